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
    np.testing.assert_allclose(y, x @ w.T + bias, rtol=1e-6, atol=1e-6)
    out = np.full((num_rows, 200), np.nan, np.float16)
    assert npops.linear(x, w, out=out) is out
    np.testing.assert_allclose(out, (x @ w.T).astype(np.float16), rtol=1e-3, atol=1e-3)
    assert npops.linear(x.astype(np.float16), w, out_dtype=np.float32).dtype == np.float32
