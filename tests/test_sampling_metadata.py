"""The sampler's packed per-row inputs: the views equal the per-field arrays, one upload a step at
most, none when nothing changed, every change caught, and the host slots never overwritten under a
copy still queued."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from minillm.device import CpuDevice
from minillm.ops import numpy as npops
from minillm.sampler import Sampler
from minillm.sampling_metadata import NUM_STATIC, SamplingInputBuffer, banned_entries, penalty_entries
from minillm.sampling_params import SamplingParams
from minillm.sequence import Sequence

from test_bad_words import TOKENIZER

VOCAB = 64
EOS = [0]


def make_seq(params: SamplingParams, seed: int, prompt=(1, 2, 3)) -> Sequence:
    seq = Sequence("r", 0, list(prompt), params, 0.0, np.random.default_rng(seed), 1000)
    seq.num_output_placeholders = 1          # the token being sampled, as at launch
    return seq


def mixed_batch() -> list[Sequence]:
    """Greedy and sampled rows with every per-row parameter the kernels read set somewhere."""
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=11, logit_bias={3: 2.5, 60: -1.0}),
        SamplingParams(temperature=1.3, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.3,
                       frequency_penalty=0.2, seed=12, logit_bias={4: 1.5, 9: -100.0}),
        SamplingParams(temperature=0.0, logprobs=3, min_tokens=5, stop_token_ids=[7, 9]),
        SamplingParams(temperature=1.0, top_k=-1, logprobs=0, seed=13),
        SamplingParams(temperature=0.6, top_p=0.95, frequency_penalty=0.5, min_tokens=2, seed=14),
    ]
    seqs = [make_seq(p, 100 + i, prompt=(1 + i, 2, 3)) for i, p in enumerate(params)]
    seqs[2].output_counts = {4: 2, 5: 1}
    seqs[5].output_counts = {6: 3}
    return seqs


def field(seqs, f) -> np.ndarray:
    return np.array([f(s.params) for s in seqs], np.float32)


def test_views_equal_the_per_field_arrays():
    seqs = mixed_batch()
    twins = [np.random.default_rng(100 + i) for i in range(len(seqs))]
    buf = SamplingInputBuffer(npops, CpuDevice(), 8, EOS)
    meta = buf.prepare(seqs, VOCAB)
    np.testing.assert_array_equal(meta.temperature, field(seqs, lambda p: p.temperature))
    assert meta.top_k.dtype == np.int32
    np.testing.assert_array_equal(meta.top_k, [max(s.params.top_k, 0) for s in seqs])
    np.testing.assert_array_equal(meta.top_p, field(seqs, lambda p: p.top_p))
    np.testing.assert_array_equal(meta.min_p, field(seqs, lambda p: p.min_p))
    np.testing.assert_array_equal(meta.repetition_penalty, field(seqs, lambda p: p.repetition_penalty))
    np.testing.assert_array_equal(meta.presence_penalty, field(seqs, lambda p: p.presence_penalty))
    np.testing.assert_array_equal(meta.frequency_penalty, field(seqs, lambda p: p.frequency_penalty))
    want_u = np.array([0.0 if s.params.is_greedy else r.random() for s, r in zip(seqs, twins)], np.float32)
    np.testing.assert_array_equal(meta.uniforms, want_u)
    assert meta.logprob_rows == [3, 4] and meta.logprob_rows_device.tolist() == [3, 4]
    rows, tokens, counts, in_prompt = (np.array(a, np.int32) for a in penalty_entries(seqs, [2, 5]))
    for got, want in zip(meta.penalty_entries, (rows, tokens, counts, in_prompt)):
        np.testing.assert_array_equal(got, want)
    assert sorted(zip(meta.banned[0].tolist(), meta.banned[1].tolist())) == [(3, 0), (3, 7), (3, 9), (5, 0)]
    assert meta.logit_bias[0].tolist() == [1, 1, 2, 2] and meta.logit_bias[2].tolist() == [2.5, -1.0, 1.5, -100.0]
    assert meta.copied == (0, buf.entries_offset + 4 * len(rows) + 2 * 4 + 3 * 4)   # one copy: everything


def test_no_upload_when_nothing_changed_and_all_rows_greedy():
    seqs = [make_seq(SamplingParams(temperature=0.0), i) for i in range(5)]
    buf = SamplingInputBuffer(npops, CpuDevice(), 8, EOS)
    first = buf.prepare(seqs, VOCAB)
    assert first.copied == (0, buf.uniforms_offset + 5) and buf.num_uploads == 1
    again = buf.prepare(list(seqs), VOCAB)                  # a new list of the same rows
    assert again.copied is None and buf.num_uploads == 1
    np.testing.assert_array_equal(again.temperature, np.zeros(5, np.float32))
    np.testing.assert_array_equal(again.uniforms, np.zeros(5, np.float32))


def test_unchanged_sampled_rows_upload_only_their_uniforms():
    seqs = [make_seq(SamplingParams(temperature=0.8, seed=i), i) for i in range(3)]
    twins = [np.random.default_rng(i) for i in range(3)]
    buf = SamplingInputBuffer(npops, CpuDevice(), 4, EOS)
    buf.prepare(seqs, VOCAB)
    [t.random() for t in twins]
    for _ in range(3):
        meta = buf.prepare(seqs, VOCAB)
        u = buf.uniforms_offset
        assert meta.copied == (u, u + 3)
        np.testing.assert_array_equal(meta.uniforms, np.array([t.random() for t in twins], np.float32))
        np.testing.assert_array_equal(meta.temperature, np.full(3, 0.8, np.float32))


CHANGES = {
    "temperature": dict(temperature=0.5),
    "top_k": dict(top_k=7),
    "top_p": dict(top_p=0.5),
    "min_p": dict(min_p=0.1),
    "seed": dict(seed=99),
    "repetition_penalty": dict(repetition_penalty=1.5),
    "presence_penalty": dict(presence_penalty=0.4),
    "frequency_penalty": dict(frequency_penalty=0.4),
    "logprobs": dict(logprobs=2),
    "min_tokens": dict(min_tokens=3),
    "allowed_token_ids": dict(allowed_token_ids=[9, 3, 9]),
}


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_a_changed_field_of_one_row_uploads_the_static_words(name):
    seqs = [make_seq(SamplingParams(temperature=0.0), i) for i in range(4)]
    buf = SamplingInputBuffer(npops, CpuDevice(), 4, EOS)
    buf.prepare(seqs, VOCAB)
    assert buf.prepare(seqs, VOCAB).copied is None
    seqs[2].params = dataclasses.replace(seqs[2].params, **CHANGES[name])
    meta = buf.prepare(seqs, VOCAB)
    assert meta.copied is not None and meta.copied[0] == 0
    if name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty"):
        want = getattr(seqs[2].params, name)
        assert getattr(meta, name)[2] == np.float32(want)
    again = buf.prepare(seqs, VOCAB).copied                  # clean again: only per-step sections
    u, e = buf.uniforms_offset, buf.entries_offset
    # per step: the uniforms, the prompt tokens' repetition entries, an EOS ban, the allowed ids and their row
    want = {"temperature": (u, u + 4), "repetition_penalty": (e, e + 12), "min_tokens": (e, e + 2),
            "allowed_token_ids": (e, e + 5)}.get(name)
    assert again == want


@pytest.mark.parametrize("change", ["replace", "reorder", "drop", "add"])
def test_a_changed_row_uploads_the_static_words(change):
    seqs = [make_seq(SamplingParams(temperature=0.0, top_k=i + 1), i) for i in range(4)]
    buf = SamplingInputBuffer(npops, CpuDevice(), 8, EOS)
    buf.prepare(seqs, VOCAB)
    if change == "replace":       # another sequence with equal parameters values but its own object
        seqs[1] = make_seq(SamplingParams(temperature=0.0, top_k=2), 1)
    elif change == "reorder":
        seqs[0], seqs[3] = seqs[3], seqs[0]
    elif change == "drop":
        seqs.pop(1)
    else:
        seqs.append(make_seq(SamplingParams(temperature=0.0, top_k=9), 9))
    meta = buf.prepare(seqs, VOCAB)
    assert meta.copied is not None and meta.copied[0] == 0
    np.testing.assert_array_equal(meta.top_k, [s.params.top_k for s in seqs])


def test_logit_bias_is_added_before_the_penalties_and_uploaded_every_step():
    seqs = mixed_batch()
    buf = SamplingInputBuffer(npops, CpuDevice(), 8, EOS)
    for _ in range(2):
        meta = buf.prepare(seqs, VOCAB)
        rows, tokens, bias = meta.logit_bias
        assert list(zip(rows.tolist(), tokens.tolist(), bias.tolist())) == [(1, 3, 2.5), (1, 60, -1.0),
                                                                            (2, 4, 1.5), (2, 9, -100.0)]
        assert meta.copied is not None and meta.copied[1] == buf.entries_offset + len(meta.penalty_entries[0]) * 4 \
            + len(meta.banned[0]) * 2 + 4 * 3
    # the order: logits + bias, then the repetition penalty divides the positive ones
    logits = np.ones((len(seqs), VOCAB), np.float32)
    Sampler(npops, EOS, CpuDevice()).apply_metadata_penalties(logits, meta)
    assert logits[1, 3] == 3.5 and logits[1, 60] == 0.0 and logits[0, 3] == 1.0
    row2_token4 = (1.0 + 1.5) / 1.2 - 2 * 0.2 - 0.3          # output count 2: frequency x2, presence once
    assert logits[2, 4] == pytest.approx(row2_token4, rel=1e-6)


def test_allowed_ids_mask_first_and_bad_words_join_the_bans():
    allowed = SamplingParams(temperature=0.0, allowed_token_ids=[40, 9, 3, 9], logit_bias={9: 2.0, 11: 5.0})
    worded = SamplingParams(temperature=0.8, seed=3, bad_words=["ab", "c"], min_tokens=4, stop_token_ids=[6])
    worded.update_from_tokenizer(TOKENIZER, VOCAB)         # ((7, 8), (9, 8), (5,), (6,))
    seqs = [make_seq(p, i) for i, p in enumerate([SamplingParams(temperature=0.0), allowed, worded])]
    seqs[2].token_ids.append(9)                            # its last output starts " ab"
    meta = SamplingInputBuffer(npops, CpuDevice(), 4, EOS).prepare(seqs, VOCAB)
    assert [a.tolist() for a in meta.allowed] == [[1, 1, 1], [3, 9, 40], [1]]
    # min_tokens' EOS and stop token, then the bad words' bans: 8 completes " ab", 5 and 6 are words
    assert list(zip(*(a.tolist() for a in meta.banned))) == [(2, 0), (2, 6), (2, 8), (2, 5), (2, 6)]
    logits = np.ones((3, VOCAB), np.float32)
    Sampler(npops, EOS, CpuDevice()).apply_metadata_penalties(logits, meta)
    assert np.flatnonzero(np.isfinite(logits[1])).tolist() == [3, 9, 40]
    assert logits[1, 9] == 3.0 and logits[1, 3] == 1.0     # the bias of an allowed token counts, not 11's
    assert np.flatnonzero(np.isinf(logits[2])).tolist() == [0, 5, 6, 8]
    assert np.all(logits[0] == 1.0)


def test_allowed_ids_and_bad_words_equal_the_per_field_path_over_steps():
    rng = np.random.default_rng(6)
    params = [SamplingParams(temperature=1.0, seed=21, allowed_token_ids=list(range(10, 30)), presence_penalty=0.5),
              SamplingParams(temperature=0.0, bad_words=["ab", "dog"], min_tokens=3),
              SamplingParams(temperature=0.9, seed=22, bad_words=["ab"], allowed_token_ids=[7, 8, 9, 5, 1])]
    for p in params:
        p.update_from_tokenizer(TOKENIZER, VOCAB)
    seqs = mixed_batch()[:3] + [make_seq(p, 200 + i) for i, p in enumerate(params)]
    twins = [np.random.default_rng(100 + i) for i in range(3)] + [np.random.default_rng(200 + i) for i in range(3)]
    sampler = Sampler(npops, EOS, CpuDevice(), max_num_seqs=4)
    for _ in range(12):
        logits = (rng.standard_normal((len(seqs), VOCAB)) * 2).astype(np.float32)
        out = sampler.sample_no_sync(logits.copy(), seqs)
        np.testing.assert_array_equal(out.token_ids, reference_sample(logits.copy(), seqs, twins)[0])
        for s, t in zip(seqs, out.token_ids.tolist()):
            s.output_counts[t] = s.output_counts.get(t, 0) + 1
            s.token_ids.append(t)
    outputs = [s.output_token_ids for s in seqs[3:]]
    assert set(outputs[0]) <= set(range(10, 30)) and set(outputs[2]) <= {7, 8, 9, 5, 1}
    for ids in outputs[1:]:
        pairs = set(zip(ids, ids[1:]))
        assert not pairs & {(7, 8), (9, 8), (10, 11)}
    assert {7, 9} & set(outputs[2][:-1])                   # a word was started: its ban was in force


def test_penalties_upload_their_entries_every_step():
    seq = make_seq(SamplingParams(temperature=0.0, presence_penalty=0.5), 1)
    buf = SamplingInputBuffer(npops, CpuDevice(), 4, EOS)
    buf.prepare([seq], VOCAB)
    seq.output_counts = {8: 1}
    meta = buf.prepare([seq], VOCAB)
    e = buf.entries_offset
    assert meta.copied == (e, e + 4)                         # one entry: row, token, count, in prompt
    assert [a.tolist() for a in meta.penalty_entries] == [[0], [8], [1], [0]]


def test_growth_past_the_capacity_keeps_every_field():
    buf = SamplingInputBuffer(npops, CpuDevice(), 2, EOS)
    seqs = [make_seq(SamplingParams(temperature=0.1 * i, top_k=i, repetition_penalty=1.1), i,
                     prompt=range(i * 3000, i * 3000 + 3000)) for i in range(5)]
    meta = buf.prepare(seqs, 20000)
    assert buf.cap >= 5 and buf.entry_cap >= 4 * 15000
    np.testing.assert_array_equal(meta.top_k, [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(meta.temperature, field(seqs, lambda p: p.temperature))
    assert meta.penalty_entries[0].size == 15000
    assert meta.copied[0] == 0


def reference_sample(logits: np.ndarray, seqs, twins) -> tuple[np.ndarray, np.ndarray | None]:
    """The sampler before packing: one array per field, uploaded one by one."""
    sampler = Sampler(npops, EOS)
    rows = [b for b, s in enumerate(seqs) if s.params.logprobs is not None]
    logprobs = npops.log_softmax(logits[rows]) if rows else None
    sampler.apply_penalties_and_bans(logits, seqs)
    uniforms = np.array([0.0 if s.params.is_greedy else t.random() for s, t in zip(seqs, twins)], np.float32)
    ids = npops.sample(logits, field(seqs, lambda p: p.temperature),
                       np.array([max(s.params.top_k, 0) for s in seqs], np.int32), field(seqs, lambda p: p.top_p),
                       field(seqs, lambda p: p.min_p), uniforms)
    return ids, logprobs


def test_sampler_equals_the_per_field_path_over_steps():
    rng = np.random.default_rng(5)
    seqs = mixed_batch()
    twins = [np.random.default_rng(100 + i) for i in range(len(seqs))]
    sampler = Sampler(npops, EOS, CpuDevice(), max_num_seqs=4)
    for step in range(6):
        if step == 3:                                        # a row leaves, a new one joins
            seqs = seqs[1:] + [make_seq(SamplingParams(temperature=0.9, presence_penalty=0.2, seed=7), 77)]
            twins = twins[1:] + [np.random.default_rng(77)]
        logits = (rng.standard_normal((len(seqs), VOCAB)) * 2).astype(np.float32)
        out = sampler.sample_no_sync(logits.copy(), seqs)
        want_ids, want_lp = reference_sample(logits.copy(), seqs, twins)
        np.testing.assert_array_equal(out.token_ids, want_ids)
        if want_lp is None:
            assert out.logprobs is None
        else:
            np.testing.assert_array_equal(out.logprobs, want_lp)
        for s, t in zip(seqs, out.token_ids.tolist()):        # the step's token joins the outputs
            s.output_counts[t] = s.output_counts.get(t, 0) + 1
            s.token_ids.append(t)


# ---- the host slots under copies that run later -----------------------------------------------

class QueuedEvent:
    def __init__(self, device, index):
        self.device, self.index = device, index

    @property
    def done(self) -> bool:
        return self.device.num_run > self.index

    def synchronize(self) -> None:
        self.device.run_until(self.index)


class QueuedDevice(CpuDevice):
    """A device whose copies run only when an event is waited for, reading the host words then."""

    def __init__(self):
        self.queue, self.num_run, self.num_waits, self.delivered = [], 0, 0, []

    def copy_to_device_async(self, dst, src):
        self.queue.append((dst, src))
        return QueuedEvent(self, len(self.queue) - 1)

    def run_until(self, index: int) -> None:
        self.num_waits += 1
        while self.num_run <= index:
            dst, src = self.queue[self.num_run]
            dst[...] = src
            self.delivered.append(dst.copy())
            self.num_run += 1


def test_a_host_slot_is_reused_only_after_its_copy_ran():
    device = QueuedDevice()
    seqs = [make_seq(SamplingParams(temperature=1.0, seed=i), i) for i in range(3)]
    twins = [np.random.default_rng(i) for i in range(3)]
    buf = SamplingInputBuffer(npops, device, 4, EOS)
    want = []
    for _ in range(4):
        buf.prepare(seqs, VOCAB)                          # one step in flight: copies still queued
        want.append(np.array([t.random() for t in twins], np.float32))
    assert device.num_waits == 2                          # steps 3 and 4 waited for the copies of 1 and 2
    device.run_until(len(device.queue) - 1)
    u = buf.uniforms_offset
    for step, (delivered, uniforms) in enumerate(zip(device.delivered, want)):
        got = delivered.view(np.float32)
        got = got[u:u + 3] if step == 0 else got[:3]      # the first copy starts at the static words
        np.testing.assert_array_equal(got, uniforms, err_msg=f"step {step}")


def test_static_words_are_of_the_batch_they_were_packed_for():
    seqs = mixed_batch()
    buf = SamplingInputBuffer(npops, CpuDevice(), 8, EOS)
    meta = buf.prepare(seqs, VOCAB)
    top_k = meta.top_k.copy()
    buf.prepare(seqs[:2], VOCAB)                          # another batch packs into the other slot
    meta = buf.prepare(seqs, VOCAB)                       # and back: the words are packed again
    assert meta.copied[0] == 0
    np.testing.assert_array_equal(meta.top_k, top_k)
    assert NUM_STATIC == 8
    assert banned_entries(seqs, [3], EOS, VOCAB)[0] == [3, 3, 3]
