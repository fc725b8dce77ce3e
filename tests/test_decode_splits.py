"""The decode split count: a small batch with long contexts fills the SMs; a full batch does not split."""
from __future__ import annotations

import pytest

from minillm.ops import cuda as cuda_ops

H200_SMS = 132


@pytest.mark.parametrize("batch", [1, 2, 4, 8, 16, 32])
def test_small_batches_with_long_contexts_fill_the_sms(batch):
    splits = cuda_ops.decode_num_splits(batch, 8, 4096, num_sms=H200_SMS)
    assert batch * 8 * splits >= H200_SMS
    assert 4096 / splits >= cuda_ops.DECODE_MIN_PARTITION      # no split shorter than the min partition


def test_the_tail_of_the_workload_splits_as_measured():
    # batch 4 at context 4096 on the H200: 16 splits measured fastest (28 us; 33 took 35, 64 took 51)
    assert 16 <= cuda_ops.decode_num_splits(4, 8, 4096, num_sms=H200_SMS) <= 20


def test_full_batches_and_short_contexts_do_not_split():
    assert cuda_ops.decode_num_splits(256, 8, 4096, num_sms=H200_SMS) == 1
    assert cuda_ops.decode_num_splits(2, 8, cuda_ops.DECODE_MIN_PARTITION, num_sms=H200_SMS) == 1
    assert cuda_ops.decode_num_splits(1, 1, 10 ** 6, num_sms=H200_SMS) == cuda_ops.DECODE_MAX_SPLITS


def test_the_count_follows_the_number_of_sms():
    assert cuda_ops.decode_num_splits(4, 8, 8192, num_sms=16) < cuda_ops.decode_num_splits(4, 8, 8192, num_sms=132)
