"""Every cuda/*.cu compiles with nvcc for sm_90, as NVRTC will see it (common.cuh inlined).

Runs in CI without a GPU; skips only when nvcc is absent. Each file is built for the three
activation dtypes (sampling.cu works on float32 logits only) so every #if branch is checked.
Where libnvrtc is installed (CuPy's CUDA wheels) the sources also go through NVRTC itself, which
is stricter than nvcc (no host functions, no implicit headers).
"""
from __future__ import annotations

import ctypes
import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CUDA_DIR = Path(__file__).resolve().parents[1] / "cuda"
SOURCES = sorted(p.name for p in CUDA_DIR.glob("*.cu"))
DTYPE_IDS = {"float32": 0, "float16": 1, "bfloat16": 2}
NVCC = shutil.which("nvcc")

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


def inlined_source(name: str) -> str:
    """The text the CUDA backend hands to NVRTC (minillm/ops/cuda.py:_read_source)."""
    header = (CUDA_DIR / "common.cuh").read_text().replace("#pragma once", "")
    return (CUDA_DIR / name).read_text().replace('#include "common.cuh"', header)


def compile_source(text: str, tmp_path: Path, *defines: str) -> subprocess.CompletedProcess:
    src = tmp_path / "kernel.cu"
    src.write_text(text)
    cmd = [NVCC, "-arch=sm_90", "-std=c++17", "-c", str(src), "-o", str(tmp_path / "kernel.o"), *defines]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_every_source_includes_the_common_header_once():
    assert SOURCES, "no kernel sources found"
    for name in SOURCES:
        text = (CUDA_DIR / name).read_text()
        assert text.count('#include "common.cuh"') == 1, name
        assert text.lstrip().startswith("//"), f"{name} must open with its layout / launch comment"


CASES = [(name, dtype) for name in SOURCES for dtype in DTYPE_IDS
         if name != "sampling.cu" or dtype == "float32"]


@needs_nvcc
@pytest.mark.parametrize("name,dtype", CASES)
def test_kernel_source_compiles_for_sm90(name, dtype, tmp_path):
    extra = ["-DHEAD_DIM=128", "-DGQA=2"] if name == "paged_attention.cu" else []
    result = compile_source(inlined_source(name), tmp_path, f"-DMINILLM_DTYPE={DTYPE_IDS[dtype]}", *extra)
    assert result.returncode == 0, f"{name} ({dtype}) failed to compile:\n{result.stderr}"


@needs_nvcc
@pytest.mark.parametrize("head_dim,group", [(8, 4), (64, 8), (256, 1)])
def test_attention_compiles_for_other_head_sizes(head_dim, group, tmp_path):
    result = compile_source(inlined_source("paged_attention.cu"), tmp_path, "-DMINILLM_DTYPE=2",
                            f"-DHEAD_DIM={head_dim}", f"-DGQA={group}")
    assert result.returncode == 0, result.stderr


@needs_nvcc
def test_compile_check_catches_a_syntax_error(tmp_path):
    broken = inlined_source("activation.cu").replace("return __fmul_rn(", "return __fmul_rn((", 1)
    assert compile_source(broken, tmp_path).returncode != 0


def _load_nvrtc():
    """libnvrtc (with its builtins preloaded so NVRTC finds them), or None."""
    dirs = [os.path.join(site, "nvidia", "*", "lib") for site in sys.path]
    dirs += [os.path.join(site, "nvidia", "cuda_nvrtc", "lib") for site in sys.path] + ["/usr/local/cuda/lib64"]
    for d in dirs:
        for lib in sorted(glob.glob(os.path.join(d, "libnvrtc.so.1*"))):
            try:
                for builtins in glob.glob(os.path.join(os.path.dirname(lib), "libnvrtc-builtins.so.*")):
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                return ctypes.CDLL(lib)
            except OSError:
                continue
    return None


NVRTC = _load_nvrtc()


def nvrtc_compile(text: str, options: list[str]) -> tuple[int, str]:
    prog = ctypes.c_void_p()
    assert NVRTC.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), b"kernel.cu", 0, None, None) == 0
    opts = [o.encode() for o in options]
    status = NVRTC.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    NVRTC.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    NVRTC.nvrtcGetProgramLog(prog, log)
    NVRTC.nvrtcDestroyProgram(ctypes.byref(prog))
    return status, log.value.decode(errors="replace")


@pytest.mark.skipif(NVRTC is None, reason="libnvrtc not found")
@pytest.mark.parametrize("name,dtype", CASES)
def test_kernel_source_compiles_with_nvrtc(name, dtype):
    extra = ["-DHEAD_DIM=64", "-DGQA=4"] if name == "paged_attention.cu" else []
    status, log = nvrtc_compile(inlined_source(name), ["-std=c++17", "-arch=sm_90",
                                                      f"-DMINILLM_DTYPE={DTYPE_IDS[dtype]}", *extra])
    assert status == 0, f"{name} ({dtype}) failed in NVRTC:\n{log}"
