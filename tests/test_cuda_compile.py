"""Every cuda/*.cu compiles with nvcc for sm_90, as NVRTC will see it (common.cuh inlined).

Runs in CI without a GPU; skips only when nvcc is absent. Each file is built for the three
activation dtypes (sampling.cu works on float32 logits only) so every #if branch is checked.
nvcc builds device code only (-cubin: no host compiler pass, as NVRTC sees it). The builds take
about 45 s of CPU, so they start on a thread pool as soon as the session has collected these tests
(conftest.py), niced, on the cores that the tests before them leave idle; builds still waiting when
the first test here asks run at normal priority.
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
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from minillm.ops import prefill_attention

CUDA_DIR = Path(__file__).resolve().parents[1] / "cuda"
SOURCES = sorted(p.name for p in CUDA_DIR.glob("*.cu"))
DTYPE_IDS = {"float32": 0, "float16": 1, "bfloat16": 2}
NVCC = shutil.which("nvcc")
NICE = shutil.which("nice")

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


def inlined_source(name: str) -> str:
    """The text the CUDA backend hands to NVRTC (minillm/ops/cuda.py:_read_source)."""
    header = (CUDA_DIR / "common.cuh").read_text().replace("#pragma once", "")
    return (CUDA_DIR / name).read_text().replace('#include "common.cuh"', header)


def compile_source(text: str, out_dir: Path, *defines: str, niced: bool = False) -> subprocess.CompletedProcess:
    """nvcc's device-only build of TEXT for sm_90 (the return code and its messages); niced: at the
    lowest CPU priority."""
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / "kernel.cu"
    src.write_text(text)
    arch = next((d for d in defines if d.startswith("-arch=")), "-arch=sm_90")     # a build may name sm_90a
    defines = [d for d in defines if not d.startswith("-arch=")]
    cmd = [NVCC, arch, "-std=c++17", "-cubin", str(src), "-o", str(out_dir / "kernel.cubin"), *defines]
    if niced and NICE:
        cmd = [NICE, "-n", "19", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_every_source_includes_the_common_header_once():
    assert SOURCES, "no kernel sources found"
    for name in SOURCES:
        text = (CUDA_DIR / name).read_text()
        assert text.count('#include "common.cuh"') == 1, name
        assert text.lstrip().startswith("//"), f"{name} must open with its layout / launch comment"


CASES = [(name, dtype) for name in SOURCES for dtype in DTYPE_IDS
         if name != "sampling.cu" or dtype == "float32"]
HEAD_SIZES = [(8, 4), (64, 8), (256, 1)]
# FP8 KV caches (-DKV_FP8=1): the files that read or write the cache, each dtype, and attention at
# the head sizes whose decode layout differs (16-byte loads, VEC_ELEMS-byte loads, tiny heads).
FP8_SOURCES = ("kv_append.cu", "paged_attention.cu", "rotary.cu")
FP8_CASES = [(name, dtype) for name in FP8_SOURCES for dtype in DTYPE_IDS]
FP8_HEAD_SIZES = [(128, 2), (64, 4), (128, 8), (8, 2), (64, 1)]
# prefill_attention.cu as minillm/ops/prefill_attention.py builds it: (dtype, HEAD_DIM, GQA, block
# shape); every build must keep its registers off the stack.
PREFILL_BUILDS = [("bfloat16", 128, 2, "flash-4w"), ("float16", 64, 8, "flash-4w"), ("bfloat16", 128, 3, "flash-4w"),
                  ("float16", 128, 16, "flash-4w"), ("bfloat16", 128, 2, "flash-8w"), ("float16", 64, 3, "flash-8w"),
                  ("bfloat16", 64, 1, "flash-8w"),
                  # FP8 caches (-DKV_FP8=1: byte stages widened to fp16 tiles), flash-4w's shape only
                  ("bfloat16", 128, 2, "flash-4w-fp8"), ("float16", 128, 2, "flash-4w-fp8"),
                  ("bfloat16", 64, 4, "flash-4w-fp8"), ("bfloat16", 128, 16, "flash-4w-fp8")]

# paged_decode at the benchmark's shapes (Qwen3-0.6B: head_dim 128, GQA 2; Llama-3.2-1B: 64, 4),
# bf16 and FP8 caches: (dtype, KV_FP8, HEAD_DIM, GQA). Each must fit 128 registers with no spills
# (four blocks of 128 threads a multiprocessor; more registers would drop one).
DECODE_BUILDS = [("bfloat16", 0, 128, 2), ("bfloat16", 1, 128, 2), ("float16", 1, 128, 2), ("bfloat16", 1, 64, 4),
                 ("bfloat16", 0, 64, 4), ("bfloat16", 0, 64, 1), ("float16", 0, 128, 1)]

# prefill_attention_wgmma.cu for sm_90a (warpgroup MMAs, setmaxnreg): (dtype, GQA). Its consumer
# warpgroups hold S, O and P at once (160 registers of 232): none may spill.
HOPPER_BUILDS = [("bfloat16", 2), ("float16", 2), ("bfloat16", 1), ("bfloat16", 3), ("float16", 4), ("bfloat16", 8),
                 ("bfloat16", 16)]


def nvcc_builds() -> dict[str, tuple[str, list[str]]]:
    """Every build the tests check: key -> (source text, nvcc defines)."""
    builds = {}
    for name, dtype in CASES:
        extra = ["-DHEAD_DIM=128", "-DGQA=2"] if name == "paged_attention.cu" else []
        builds[f"{name}-{dtype}"] = (inlined_source(name), [f"-DMINILLM_DTYPE={DTYPE_IDS[dtype]}", *extra])
    for head_dim, group in HEAD_SIZES:
        builds[f"attention-{head_dim}-{group}"] = (inlined_source("paged_attention.cu"), [
            "-DMINILLM_DTYPE=2", f"-DHEAD_DIM={head_dim}", f"-DGQA={group}"])
    for name, dtype in FP8_CASES:
        builds[f"fp8-{name}-{dtype}"] = (inlined_source(name), [
            f"-DMINILLM_DTYPE={DTYPE_IDS[dtype]}", "-DKV_FP8=1", "-DHEAD_DIM=64", "-DGQA=4"])
    for head_dim, group in FP8_HEAD_SIZES:
        builds[f"fp8-attention-{head_dim}-{group}"] = (inlined_source("paged_attention.cu"), [
            "-DMINILLM_DTYPE=2", "-DKV_FP8=1", f"-DHEAD_DIM={head_dim}", f"-DGQA={group}"])
    for dtype, head_dim, group, shape in PREFILL_BUILDS:
        variant, fp8 = shape.removesuffix("-fp8"), shape.endswith("-fp8")
        defines = [f"-D{k}={v}" for k, v in prefill_attention.VARIANTS[variant].defines().items()]
        defines += ["-DKV_FP8=1"] if fp8 else []
        builds[f"prefill-{dtype}-{head_dim}-{group}-{shape}"] = (inlined_source("prefill_attention.cu"), [
            f"-DMINILLM_DTYPE={DTYPE_IDS[dtype]}", f"-DHEAD_DIM={head_dim}", f"-DGQA={group}", *defines,
            "--resource-usage"])
    for dtype, fp8, head_dim, group in DECODE_BUILDS:
        builds[f"decode-{dtype}-{fp8}-{head_dim}-{group}"] = (inlined_source("paged_attention.cu"), [
            f"-DMINILLM_DTYPE={DTYPE_IDS[dtype]}", f"-DKV_FP8={fp8}", f"-DHEAD_DIM={head_dim}", f"-DGQA={group}",
            "--resource-usage"])
    for dtype, group in HOPPER_BUILDS:
        builds[f"hopper-{dtype}-{group}"] = (inlined_source("prefill_attention_wgmma.cu"), [
            "-arch=sm_90a", f"-DMINILLM_DTYPE={DTYPE_IDS[dtype]}", "-DHEAD_DIM=128", f"-DGQA={group}",
            "--resource-usage"])
    builds["sampling-usage"] = (inlined_source("sampling.cu"), ["-DMINILLM_DTYPE=0", "--resource-usage"])
    broken = inlined_source("activation.cu").replace("return __fmul_rn(", "return __fmul_rn((", 1)
    builds["syntax-error"] = (broken, [])
    return builds


class NvccBuilds:
    """Every build of nvcc_builds() on a thread pool (each nvcc is one single-threaded process).

    Niced until results() is first called: started early, the builds use only the cores that
    other tests leave idle; the ones not yet started by then run at normal priority.
    """

    def __init__(self) -> None:
        self.niced = True
        self.dir = tempfile.TemporaryDirectory(prefix="minillm-nvcc-")
        self.pool = ThreadPoolExecutor(max_workers=max(os.cpu_count() or 1, 2))
        self.futures, same = {}, {}
        for key, (text, defines) in nvcc_builds().items():
            # Two checks that ask for the same build (the FP8 attention at 64/4 in bf16) share it.
            build = (text, tuple(sorted(defines)))
            if build not in same:
                same[build] = self.pool.submit(self._build, key, text, defines)
            self.futures[key] = same[build]

    def _build(self, key: str, text: str, defines: list[str]) -> subprocess.CompletedProcess:
        return compile_source(text, Path(self.dir.name) / key, *defines, niced=self.niced)

    def results(self) -> dict[str, subprocess.CompletedProcess]:
        """Wait for every build: key -> its CompletedProcess."""
        self.niced = False
        return {key: f.result() for key, f in self.futures.items()}

    def close(self) -> None:
        """Drop the builds not started, wait for the running ones, remove the build directory."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.dir.cleanup()


_builds: NvccBuilds | None = None


def start_in_background(items: list | None = None) -> None:
    """Start the nvcc builds now, once, if one of the tests (all when None) needs them (conftest.py
    calls this with the tests the session selected here)."""
    global _builds
    needed = items is None or any("nvcc_results" in item.fixturenames for item in items)
    if NVCC is not None and _builds is None and needed:
        _builds = NvccBuilds()


def stop_background() -> None:
    """Stop and remove the builds (at the end of the session, whether or not a test here ran)."""
    global _builds
    if _builds is not None:
        _builds.close()
        _builds = None


@pytest.fixture(scope="module")
def nvcc_results() -> dict[str, subprocess.CompletedProcess]:
    """All nvcc builds (started in the background at collection, or now)."""
    start_in_background()
    try:
        yield _builds.results()
    finally:
        stop_background()


@needs_nvcc
@pytest.mark.parametrize("name,dtype", CASES)
def test_kernel_source_compiles_for_sm90(name, dtype, nvcc_results):
    result = nvcc_results[f"{name}-{dtype}"]
    assert result.returncode == 0, f"{name} ({dtype}) failed to compile:\n{result.stderr}"


@needs_nvcc
@pytest.mark.parametrize("head_dim,group", HEAD_SIZES)
def test_attention_compiles_for_other_head_sizes(head_dim, group, nvcc_results):
    result = nvcc_results[f"attention-{head_dim}-{group}"]
    assert result.returncode == 0, result.stderr


@needs_nvcc
@pytest.mark.parametrize("name,dtype", FP8_CASES)
def test_fp8_kv_cache_builds_compile(name, dtype, nvcc_results):
    result = nvcc_results[f"fp8-{name}-{dtype}"]
    assert result.returncode == 0, f"{name} ({dtype}, KV_FP8) failed to compile:\n{result.stderr}"


@needs_nvcc
@pytest.mark.parametrize("head_dim,group", FP8_HEAD_SIZES)
def test_fp8_attention_compiles_for_each_decode_layout(head_dim, group, nvcc_results):
    result = nvcc_results[f"fp8-attention-{head_dim}-{group}"]
    assert result.returncode == 0, result.stderr


@needs_nvcc
@pytest.mark.parametrize("dtype,head_dim,group,shape", PREFILL_BUILDS)
def test_prefill_attention_builds_without_spills(dtype, head_dim, group, shape, nvcc_results):
    result = nvcc_results[f"prefill-{dtype}-{head_dim}-{group}-{shape}"]
    assert result.returncode == 0, result.stderr
    for kernel in ("prefill_attention", "prefill_attention_reduce"):     # each entry function's own report
        report = function_report(result.stdout + result.stderr, kernel)
        assert "registers" in report, report                            # ptxas's resource report
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report


@needs_nvcc
@pytest.mark.parametrize("dtype,group", HOPPER_BUILDS)
def test_hopper_prefill_attention_builds_without_spills(dtype, group, nvcc_results):
    result = nvcc_results[f"hopper-{dtype}-{group}"]
    assert result.returncode == 0, result.stderr
    report = function_report(result.stdout + result.stderr, "prefill_attention_wgmma")
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report


def function_report(report: str, name: str) -> str:
    """ptxas's --resource-usage lines about entry function `name`."""
    marker = f"Compiling entry function '{name}'"
    assert marker in report, report
    return report.split(marker, 1)[1].split("Compiling entry function", 1)[0]


@needs_nvcc
@pytest.mark.parametrize("dtype,fp8,head_dim,group", DECODE_BUILDS)
@pytest.mark.parametrize("kernel", ["paged_decode", "paged_decode_append"])
def test_decode_attention_fits_128_registers_without_spills(dtype, fp8, head_dim, group, kernel, nvcc_results):
    result = nvcc_results[f"decode-{dtype}-{fp8}-{head_dim}-{group}"]
    assert result.returncode == 0, result.stderr
    report = function_report(result.stdout + result.stderr, kernel)
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report
    registers = int(report.split("Used ", 1)[1].split(" registers", 1)[0])
    assert registers <= 128, report


@needs_nvcc
def test_sample_kernel_fits_two_blocks_a_multiprocessor(nvcc_results):
    # 32 registers: two blocks of 1,024 threads share a multiprocessor. At 52 (no bound) a batch of
    # 256 temperature-only rows took 169 us on the H200 against 111 us (RESULTS.md).
    result = nvcc_results["sampling-usage"]
    assert result.returncode == 0, result.stderr
    report = function_report(result.stdout + result.stderr, "sample_kernel")
    assert int(report.split("Used ", 1)[1].split(" registers", 1)[0]) <= 32, report


@needs_nvcc
def test_compile_check_catches_a_syntax_error(nvcc_results):
    result = nvcc_results["syntax-error"]
    assert result.returncode != 0 and "error" in result.stderr


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


def nvrtc_compile(text: str, options: list[str], ptx: list | None = None) -> tuple[int, str]:
    """NVRTC's status and log for text; ptx, when given, gets the PTX of a build that succeeded."""
    prog = ctypes.c_void_p()
    assert NVRTC.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), b"kernel.cu", 0, None, None) == 0
    opts = [o.encode() for o in options]
    status = NVRTC.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    NVRTC.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    NVRTC.nvrtcGetProgramLog(prog, log)
    if ptx is not None and status == 0:
        NVRTC.nvrtcGetPTXSize(prog, ctypes.byref(size))
        code = ctypes.create_string_buffer(size.value)
        NVRTC.nvrtcGetPTX(prog, code)
        ptx.append(code.value.decode())
    NVRTC.nvrtcDestroyProgram(ctypes.byref(prog))
    return status, log.value.decode(errors="replace")


@pytest.mark.skipif(NVRTC is None, reason="libnvrtc not found")
@pytest.mark.parametrize("name,dtype", CASES)
def test_kernel_source_compiles_with_nvrtc(name, dtype):
    extra = ["-DHEAD_DIM=64", "-DGQA=4"] if name == "paged_attention.cu" else []
    status, log = nvrtc_compile(inlined_source(name), ["-std=c++17", "-arch=sm_90",
                                                      f"-DMINILLM_DTYPE={DTYPE_IDS[dtype]}", *extra])
    assert status == 0, f"{name} ({dtype}) failed in NVRTC:\n{log}"


@pytest.mark.skipif(NVRTC is None, reason="libnvrtc not found")
@pytest.mark.parametrize("name,dtype", FP8_CASES)
def test_fp8_kv_cache_builds_compile_with_nvrtc(name, dtype):
    status, log = nvrtc_compile(inlined_source(name), ["-std=c++17", "-arch=sm_90", "-DKV_FP8=1", "-DHEAD_DIM=128",
                                                      "-DGQA=2", f"-DMINILLM_DTYPE={DTYPE_IDS[dtype]}"])
    assert status == 0, f"{name} ({dtype}, KV_FP8) failed in NVRTC:\n{log}"


@pytest.mark.skipif(NVRTC is None, reason="libnvrtc not found")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_hopper_prefill_attention_compiles_with_nvrtc(dtype):
    # minillm.ops.cuda._kernel(arch="90a") has NVRTC build a cubin for sm_90a; the PTX for compute_90a
    # shows that the same text has the kernel's body there (the source guards it with the sm_90a
    # feature macro)
    options = ["-std=c++17", "-arch=compute_90a", "-DHEAD_DIM=128", "-DGQA=2", f"-DMINILLM_DTYPE={DTYPE_IDS[dtype]}"]
    ptx = []
    status, log = nvrtc_compile(inlined_source("prefill_attention_wgmma.cu"), options, ptx)
    assert status == 0, f"prefill_attention_wgmma.cu ({dtype}) failed in NVRTC:\n{log}"
    assert ".entry prefill_attention_wgmma" in ptx[0] and "wgmma.mma_async" in ptx[0]
