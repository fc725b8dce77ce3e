"""FP8 E4M3 KV storage: the quantisation rule both backends keep, in its NumPy form.

A cache element is one uint8 byte holding E4M3 bits (ml_dtypes.float8_e4m3fn: 4 exponent bits,
3 mantissa bits, no infinities, largest finite 448). With a per-tensor scale s (a layer's k_scale or
v_scale), x is stored as e4m3(clip(x / s, -448, 448)), rounded to nearest even, and read back as
float(bits) * s. The clip saturates instead of overflowing to NaN, as the GPU's `cvt.satfinite`
does, so finite inputs (and infinities) never store a NaN.
"""
from __future__ import annotations

import functools

import numpy as np

FP8_E4M3_MAX = 448.0
STORAGE_NAME = "fp8_e4m3"             # what the stats call an FP8 cache


@functools.cache
def e4m3() -> np.dtype:
    """ml_dtypes' float8_e4m3fn, imported on first use: loading ml_dtypes costs most of a second."""
    import ml_dtypes
    return np.dtype(ml_dtypes.float8_e4m3fn)


def encode_e4m3(x: np.ndarray, scale) -> np.ndarray:
    """x: any float array -> uint8 E4M3 bits of x / scale (fp32 division), saturated to +-448."""
    with np.errstate(over="ignore"):          # an overflow to inf saturates like any large value
        scaled = x.astype(np.float32) / np.float32(scale)
    return np.clip(scaled, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(e4m3()).view(np.uint8)


def decode_e4m3(bits: np.ndarray, scale) -> np.ndarray:
    """uint8 E4M3 bits -> float32 values times scale."""
    return bits.view(e4m3()).astype(np.float32) * np.float32(scale)


def scales_from_absmax(absmax: np.ndarray) -> np.ndarray:
    """Per-tensor scales that map the largest magnitude to 448; 1.0 where it is 0 or not finite."""
    absmax = np.asarray(absmax, np.float32)
    ok = np.isfinite(absmax) & (absmax > 0)
    return np.where(ok, absmax / np.float32(FP8_E4M3_MAX), np.float32(1.0)).astype(np.float32)


def kv_cache_storage(kv_cache_dtype: str, dtype: str) -> str:
    """The name of what the pool stores: 'fp8_e4m3', or the model dtype for 'auto'."""
    return STORAGE_NAME if kv_cache_dtype in ("fp8", "fp8_e4m3") else str(dtype)
