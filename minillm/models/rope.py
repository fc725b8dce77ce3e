"""Rotary embedding tables as transformers computes them: inverse frequencies (default, linear,
dynamic, yarn, longrope and llama3 scaling), an attention factor on cos/sin (yarn, longrope)."""
from __future__ import annotations

import math

import numpy as np


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """inv_freq: [head_dim // 2] float64, with the checkpoint's rope scaling applied.

    scaling is the loader's (minillm/loader.py): original_max_position_embeddings and a yarn or
    longrope factor filled in. "dynamic" rescales only past max_position_embeddings, which
    max_model_len never exceeds, so its table is the default one; longrope's short factors are
    the ones used up to original_max_position_embeddings, which the loader holds the model to."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    kind = (scaling or {}).get("rope_type", "default")
    if kind in ("default", "dynamic"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    if kind == "yarn":
        return _yarn_scaled(inv_freq, head_dim, theta, scaling)
    if kind == "longrope":
        return inv_freq / np.asarray(scaling["short_factor"], np.float64)
    raise ValueError(f"rope_scaling type {kind!r} is not supported "
                     f"(supported: default, linear, dynamic, yarn, longrope, llama3)")


def _llama3_scaled(inv_freq: np.ndarray, s: dict) -> np.ndarray:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, a smooth ramp between."""
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return np.where(is_medium, smoothed, scaled)


def _yarn_scaled(inv_freq: np.ndarray, head_dim: int, theta: float, s: dict) -> np.ndarray:
    """YaRN: frequencies past beta_fast rotations over the original context kept, those under
    beta_slow divided by `factor`, a linear ramp between (transformers' _compute_yarn_parameters)."""
    factor, old_ctx = float(s["factor"]), float(s["original_max_position_embeddings"])

    def correction_dim(num_rotations: float) -> float:
        return head_dim * math.log(old_ctx / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001                 # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp                  # 1: extrapolate (the original frequency), 0: interpolate
    return inv_freq / factor * (1.0 - keep) + inv_freq * keep


def _mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: dict | None) -> float:
    """The factor transformers multiplies cos and sin by (so q.k by its square): 1 but for yarn and longrope."""
    s = scaling or {}
    kind = s.get("rope_type", "default")
    if kind not in ("yarn", "longrope"):
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])
    if kind == "yarn":
        if s.get("mscale") and s.get("mscale_all_dim"):
            return _mscale(factor, float(s["mscale"])) / _mscale(factor, float(s["mscale_all_dim"]))
        return _mscale(factor)
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(float(s["original_max_position_embeddings"])))


def cos_sin_table(head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> np.ndarray:
    """cos_sin: [max_positions, head_dim] float32; cos in the first half, sin in the second, both
    times the scaling's attention factor."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling).astype(np.float32)
    freqs = np.arange(max_positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    table = np.concatenate([np.cos(freqs), np.sin(freqs)], axis=-1)
    scale = attention_factor(scaling)
    return (table * np.float32(scale) if scale != 1.0 else table).astype(np.float32)
