"""Backends with one set of op functions: `numpy` (reference and CPU) and `cuda` (CuPy kernels)."""
from __future__ import annotations

import importlib
from types import ModuleType


def get_ops(backend: str) -> ModuleType:
    """Return the op module for 'numpy' or 'cuda'."""
    if backend not in ("numpy", "cuda"):
        raise ValueError(f"unknown ops backend {backend!r}; expected 'numpy' or 'cuda'")
    return importlib.import_module(f"minillm.ops.{backend}")
