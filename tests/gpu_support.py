"""What the GPU test modules share: CuPy (a module importing this skips without it) and whether a
CUDA GPU is there."""
from __future__ import annotations

import pytest

cupy = pytest.importorskip("cupy")
try:
    HAS_GPU = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:  # no driver
    HAS_GPU = False
