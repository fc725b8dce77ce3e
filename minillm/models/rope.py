"""Rotary embedding tables: inverse frequencies (default, linear, llama3 scaling) and cos/sin."""
from __future__ import annotations

import math

import numpy as np


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """inv_freq: [head_dim // 2] float64, with the checkpoint's rope scaling applied."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")


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


def cos_sin_table(head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> np.ndarray:
    """cos_sin: [max_positions, head_dim] float32; cos in the first half, sin in the second."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling).astype(np.float32)
    freqs = np.arange(max_positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(freqs), np.sin(freqs)], axis=-1).astype(np.float32)
