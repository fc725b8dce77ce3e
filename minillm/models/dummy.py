"""Random weights in a checkpoint's shape, for benchmarks that need no download."""
from __future__ import annotations

import numpy as np

from minillm.config import ModelConfig
from minillm.loader import expected_weight_shapes, float32_to_bf16_bits


def dummy_weights(config: ModelConfig, dtype: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor the decoder reads, random (norm weights 1), in the loader's dtype convention."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            w = np.ones(shape, np.float32)
        else:
            w = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        out[name] = float32_to_bf16_bits(w) if dtype == "bfloat16" else w.astype(dtype)
    return out
