"""The NumPy linear() on a decode batch's few rows."""
import numpy as np
import pytest

from minillm.ops import numpy as npops


@pytest.mark.parametrize("num_rows", [0, 1, 3, 8, 128, 129, 300])
def test_linear_of_few_rows_equals_the_product_of_many(num_rows):
    """linear() computes up to FEW_ROWS rows as (w @ x.T).T (faster in OpenBLAS for a decode batch):
    the same values as x @ w.T, with the bias, out and out_dtype alike."""
    rng = np.random.default_rng(num_rows)
    x = rng.standard_normal((num_rows, 96)).astype(np.float32)
    w = rng.standard_normal((200, 96)).astype(np.float32)
    bias = rng.standard_normal(200).astype(np.float32)
    ref = x.astype(np.float64) @ w.T.astype(np.float64) + bias
    y = npops.linear(x, w, bias)
    assert y.shape == (num_rows, 200) and y.dtype == np.float32 and y.flags.c_contiguous
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    # another operand order is another BLAS kernel, summing in another order: float32 rounding apart
    np.testing.assert_allclose(y, x @ w.T + bias, rtol=1e-5, atol=1e-5)
    out = np.full((num_rows, 200), np.nan, np.float16)
    assert npops.linear(x, w, out=out) is out
    np.testing.assert_allclose(out, (x @ w.T).astype(np.float16), rtol=1e-3, atol=1e-3)
    assert npops.linear(x.astype(np.float16), w, out_dtype=np.float32).dtype == np.float32


def test_a_tied_head_shares_the_embeddings_memory():
    """prepare_linear_weight() returns a packed float32 weight as it is: a tied lm_head is the
    embedding's array (it was a second copy, 0.58 GiB of Qwen3-0.6B's 2.2 GiB in float32)."""
    embed = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)
    head = npops.prepare_linear_weight(embed, np.float32)
    assert np.shares_memory(head, embed) and head.dtype == np.float32 and head.flags.c_contiguous
    # a bf16 checkpoint's float32 tensor is a view of the uint32 array it was widened in: its whole buffer
    widened = (np.zeros((64, 16), np.uint32) << 16).view(np.float32)
    assert np.shares_memory(npops.prepare_linear_weight(widened, np.float32), widened)


@pytest.mark.parametrize("view", ["rows", "columns", "float16"])
def test_a_weight_that_is_part_of_a_larger_array_or_another_dtype_is_copied(view):
    """A tensor-parallel rank's slice is packed into its own array, so the whole tensor can go."""
    full = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    w = {"rows": full[16:32], "columns": full[:, 4:8], "float16": full.astype(np.float16)}[view]
    got = npops.prepare_linear_weight(w, np.float32)
    assert not np.shares_memory(got, full) and got.flags.c_contiguous and got.dtype == np.float32
    np.testing.assert_array_equal(got, w.astype(np.float32))
