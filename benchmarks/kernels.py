"""Kernel micro-benchmarks at the shapes of the Qwen3-0.6B workload, each beside its ceiling.

    minillm bench kernels [--json results.json]      (or python3 -m minillm.benchmarks.kernels)

First measures the card's ceilings: device-to-device copy bandwidth (bytes read + written) and
the bf16 GEMM rate of cuBLAS at 8192^3 (random data). Then times every kernel with CUDA events
after warm-up, replaying a CUDA graph of many launches so launch gaps stay out of the figure,
and prints time and achieved GB/s or TFLOP/s beside those ceilings. Model shapes: hidden 1024,
16 heads, 8 KV heads, head_dim 128, intermediate 3072, vocab 151936, block_size 16, bf16.
`--decode-only` times just the copy ceiling and decode attention with the bf16 cache and the FP8
one at batch 256 / context 1024 and batch 64 / context 4096, and prints FP8's time over bf16's.
`--decode-workload` times decode attention at the batches and contexts of nano-vllm's workload, rows
in the batch's order against longest context first (the order the decode graphs give them).
Prefill attention runs once per kernel (ops.PREFILL_ATTENTION: the old paged_prefill_mma, then
prefill_attention.cu in its two block shapes, "= flash" marking the one the default picks) on a
2048-token chunk alone and over 14,000 cached tokens, its TFLOP/s held against the GEMM rate of
the same run; then over an FP8 cache, through the old kernel and prefill_attention.cu ("flash").
Small activations stay in L2 between launches, so their GB/s can exceed the copy ceiling.
FP8 rows (kv_cache_dtype="fp8") count K/V at one byte an element. Last, the nodes of a decode
step's CUDA graph (Qwen3-0.6B shape, random weights, forward and logits as cuda_graphs.py captures
them) with each of ops.cuda's fusions switched on in turn (FUSION_STAGES), by node type.
"""
from __future__ import annotations

import ctypes
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from minillm.attention import AttentionMetadata
from minillm.benchmarks.cli_args import BenchError, BenchParser, run_main

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, BLOCK = 1024, 16, 8, 128, 3072, 151936, 16
DT = "bfloat16"


@dataclass
class Row:
    name: str
    shape: str
    time_us: float
    achieved: float
    unit: str          # "GB/s" or "TFLOP/s"
    ceiling: float     # in the same unit

    @property
    def percent(self) -> float:
        return 100.0 * self.achieved / self.ceiling if self.ceiling else float("nan")


def time_graph(cp, fn, iters: int, repeats: int = 5) -> float:
    """Median seconds per call of fn, from replays of a CUDA graph of `iters` calls."""
    stream = cp.cuda.Stream(non_blocking=True)
    pool = cp.cuda.MemoryPool()
    with stream, cp.cuda.using_allocator(pool.malloc):
        for _ in range(3):
            fn()
        stream.synchronize()
        stream.begin_capture()
        for _ in range(iters):
            fn()
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        times = []
        for _ in range(repeats):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) / 1e3 / iters)
    return statistics.median(times)


def copy_bandwidth(cp) -> float:
    """GB/s of a 2 GiB device-to-device memcpy, counting bytes read plus bytes written.

    Timed eagerly with events: inside a CUDA graph a memcpy node runs on a copy engine, which
    is slower than the kernel the driver uses for an eager device-to-device copy.
    """
    nbytes = 2 << 30
    src = cp.random.randint(0, 255, nbytes, dtype=cp.uint8)
    dst = cp.empty_like(src)
    rt = cp.cuda.runtime
    stream = cp.cuda.Stream(non_blocking=True)
    times = []
    for i in range(13):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        rt.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, rt.memcpyDeviceToDevice, stream.ptr)
        end.record(stream)
        end.synchronize()
        if i >= 3:                                     # the first copies warm up
            times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    return 2 * nbytes / statistics.median(times) / 1e9


def random_bf16(cp, ops, shape):
    """bf16 array of random values in about +-[0.008, 2) (bit patterns drawn on the device)."""
    n = int(np.prod(shape))
    mag = cp.random.randint(0x3C00, 0x4000, n, dtype=cp.int32)
    sign = cp.random.randint(0, 2, n, dtype=cp.int32) << 15
    return (mag | sign).astype(cp.uint16).view(ops.bfloat16_dtype()).reshape(shape)


def gemm_rows(cp, ops, copy_gbs: float) -> tuple[float, list[Row]]:
    n = 8192
    a, b = random_bf16(cp, ops, (n, n)), random_bf16(cp, ops, (n, n))
    out = cp.empty((n, n), dtype=a.dtype)
    t = time_graph(cp, lambda: ops.linear(a, b, out=out), iters=5)
    peak = 2 * n ** 3 / t / 1e12
    rows = [Row("gemm bf16 (ceiling)", f"{n}^3", t * 1e6, peak, "TFLOP/s", peak)]
    batch = 256
    for name, k, nn in (("qkv", HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), ("o", HEADS * HEAD_DIM, HIDDEN),
                        ("gate_up", HIDDEN, 2 * INTER), ("down", INTER, HIDDEN), ("lm_head", HIDDEN, VOCAB)):
        x, w = random_bf16(cp, ops, (batch, k)), random_bf16(cp, ops, (nn, k))
        t = time_graph(cp, lambda: ops.linear(x, w), iters=50)
        moved = 2 * (nn * k + batch * k + batch * nn)
        rows.append(Row(f"linear {name}", f"{batch}x{k}->{nn}", t * 1e6, moved / t / 1e9, "GB/s", copy_gbs))
    return peak, rows


def decode_meta(ops, rng, batch: int, ctx: int, num_blocks: int) -> AttentionMetadata:
    per_seq = ctx // BLOCK
    tables = rng.permutation(num_blocks)[:batch * per_seq].reshape(batch, per_seq).astype(np.int32)
    a = ops.asarray
    return AttentionMetadata(a(np.arange(batch + 1, dtype=np.int32)), a(np.full(batch, ctx, np.int32)),
                             a(tables), a(np.zeros(batch, np.int32)), 1, ctx, True)


def random_e4m3(cp, shape):
    """uint8 E4M3 bit patterns of magnitudes in about [2^-6, 2^6], random signs (no NaN codes)."""
    n = int(np.prod(shape))
    bits = cp.random.randint(0x08, 0x68, n, dtype=cp.int32) | (cp.random.randint(0, 2, n, dtype=cp.int32) << 7)
    return bits.astype(cp.uint8).reshape(shape)


def attention_rows(cp, ops, copy_gbs: float, gemm_peak: float, decode: bool = True) -> list[Row]:
    rng = np.random.default_rng(0)
    batch, max_ctx = 256, 4096
    num_blocks = batch * max_ctx // BLOCK
    k_cache = random_bf16(cp, ops, (num_blocks, BLOCK, KV_HEADS, HEAD_DIM))
    v_cache = random_bf16(cp, ops, (num_blocks, BLOCK, KV_HEADS, HEAD_DIM))
    k_fp8 = random_e4m3(cp, (num_blocks, BLOCK, KV_HEADS, HEAD_DIM))
    v_fp8 = random_e4m3(cp, (num_blocks, BLOCK, KV_HEADS, HEAD_DIM))
    scales = cp.asarray(np.array([0.05, 0.05], np.float32))
    q = random_bf16(cp, ops, (batch, HEADS, HEAD_DIM))
    rows = []
    for ctx in (1024, 4096) if decode else ():
        meta = decode_meta(ops, rng, batch, ctx, num_blocks)
        auto = ops.decode_num_splits(batch, KV_HEADS, ctx)
        for kv, itemsize, kc, vc, sc in (("", 2, k_cache, v_cache, None), (" fp8", 1, k_fp8, v_fp8, scales)):
            kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * itemsize
            for splits in sorted({auto, 1, 2, 4}) if not kv else [auto]:
                t = time_graph(cp, lambda: ops.paged_attention(q, kc, vc, meta, HEAD_DIM ** -0.5, sc,
                                                               num_splits=splits), iters=10)
                tag = " (auto)" if splits == auto else ""
                rows.append(Row(f"decode attention{kv} splits={splits}{tag}", f"B{batch} ctx{ctx}", t * 1e6,
                                kv_bytes / t / 1e9, "GB/s", copy_gbs))
    rows += prefill_rows(cp, ops, rng, k_fp8, v_fp8, num_blocks, gemm_peak, scales, FP8_PREFILL_KERNELS)
    return rows + prefill_rows(cp, ops, rng, k_cache, v_cache, num_blocks, gemm_peak)


PREFILL_KERNELS = ("mma", "flash-4w", "flash-8w", "flash-wgmma")   # ops.PREFILL_ATTENTION: the old kernel, the new one's shapes, Hopper's
FP8_PREFILL_KERNELS = ("mma", "flash")              # an FP8 cache: the old kernel, flash-4w's shape


def prefill_rows(cp, ops, rng, k_cache, v_cache, num_blocks: int, gemm_peak: float, kv_scales=None,
                 kernels=PREFILL_KERNELS) -> list[Row]:
    """One 2048-token causal chunk alone and over a 14,000-token cached prefix, for each kernel
    (with kv_scales, over an FP8 cache).

    FLOPs count the unmasked query-key pairs only: 4 * heads * head_dim * chunk * (prefix + (chunk + 1) / 2).
    """
    from minillm.ops import prefill_attention

    chunk, rows, a = 2048, [], ops.asarray
    qp = random_bf16(cp, ops, (chunk, HEADS, HEAD_DIM))
    default = ops.PREFILL_ATTENTION
    auto = prefill_attention.variant(prefill_attention.AUTO, qp, k_cache, qp, chunk, 1, ops._num_multiprocessors())
    kv = " fp8" if kv_scales is not None else ""
    for prefix in (0, 14000):
        ctx = prefix + chunk
        tables = rng.permutation(num_blocks)[:-(-ctx // BLOCK)][None].astype(np.int32)
        meta = AttentionMetadata(a(np.array([0, chunk], np.int32)), a(np.array([ctx], np.int32)), a(tables),
                                 a(np.zeros(chunk, np.int32)), chunk, ctx, False)
        flops = 4 * HEADS * HEAD_DIM * chunk * (prefix + (chunk + 1) / 2)
        shape = f"{chunk} over {prefix} cached" if prefix else f"chunk {chunk}"
        for kernel in kernels:
            ops.PREFILL_ATTENTION = kernel
            try:
                t = time_graph(cp, lambda: ops.paged_attention(qp, k_cache, v_cache, meta, HEAD_DIM ** -0.5,
                                                               kv_scales), iters=10 if prefix == 0 else 3)
            finally:
                ops.PREFILL_ATTENTION = default
            tag = " = flash" if prefill_attention.VARIANTS.get(kernel) is auto else ""   # the default's pick
            rows.append(Row(f"prefill attention{kv} ({kernel}{tag})", shape, t * 1e6, flops / t / 1e12, "TFLOP/s",
                            gemm_peak))
    if kv_scales is not None:
        return rows
    return rows + small_chunk_rows(cp, ops, rng, k_cache, v_cache, num_blocks, gemm_peak)


def small_chunk_rows(cp, ops, rng, k_cache, v_cache, num_blocks: int, gemm_peak: float) -> list[Row]:
    """A short chunk over a 16,000-token prefix (a long prompt's chunk beside decodes under a step
    budget): the flash kernel and, on Hopper, the warpgroup-MMA one, each with its keys split as
    launch() chooses and unsplit; the default's pick is marked."""
    from minillm.ops import prefill_attention as pa

    rows, a, prefix, sms = [], ops.asarray, 16000, ops._num_multiprocessors()
    group = HEADS // KV_HEADS
    for chunk in (128, 512):
        ctx = prefix + chunk
        qp = random_bf16(cp, ops, (chunk, HEADS, HEAD_DIM))
        tables = a(rng.permutation(num_blocks)[:-(-ctx // BLOCK)][None].astype(np.int32))
        flops = 4 * HEADS * HEAD_DIM * chunk * (prefix + (chunk + 1) / 2)
        auto = pa.variant(pa.AUTO, qp, k_cache, qp, chunk, 1, sms)
        kernels = [k for k in ("flash-4w", "flash-8w", pa.HOPPER)
                   if pa.variant(k, qp, k_cache, qp, chunk, 1, sms) is pa.VARIANTS[k]]
        default = ops.PREFILL_ATTENTION
        for kernel in kernels:
            v = pa.VARIANTS[kernel]
            chosen = pa.grid_kv_splits(v, chunk, HEADS, HEAD_DIM, KV_HEADS, 1, chunk, ctx, sms)
            for splits in sorted({1, chosen}):
                meta = AttentionMetadata(a(np.array([0, chunk], np.int32)), a(np.array([ctx], np.int32)), tables,
                                         a(np.zeros(chunk, np.int32)), chunk, ctx, False, prefill_kv_splits=splits)
                ops.PREFILL_ATTENTION = kernel
                try:
                    t = time_graph(cp, lambda: ops.paged_attention(qp, k_cache, v_cache, meta, HEAD_DIM ** -0.5),
                                   iters=10)
                finally:
                    ops.PREFILL_ATTENTION = default
                tag = " = default" if v is auto and splits == chosen else ""
                rows.append(Row(f"prefill attention ({kernel}) key splits={splits}{tag}", f"{chunk} over {prefix} cached",
                                t * 1e6, flops / t / 1e12, "TFLOP/s", gemm_peak))
    return rows


def small_kernel_rows(cp, ops, copy_gbs: float) -> list[Row]:
    batch, isz = 256, 2
    x, r = random_bf16(cp, ops, (batch, HIDDEN)), random_bf16(cp, ops, (batch, HIDDEN))
    w = random_bf16(cp, ops, (HIDDEN,))
    qkv = random_bf16(cp, ops, (batch, (HEADS + 2 * KV_HEADS) * HEAD_DIM))
    q = qkv[:, :HEADS * HEAD_DIM].reshape(batch, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].reshape(batch, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].reshape(batch, KV_HEADS, HEAD_DIM)
    pos = ops.asarray(np.arange(batch, dtype=np.int32) * 7)
    cos_sin = ops.asarray(np.random.default_rng(1).standard_normal((40960, HEAD_DIM)).astype(np.float32))
    gu = random_bf16(cp, ops, (batch, 2 * INTER))
    caches = random_bf16(cp, ops, (2, 4096, BLOCK, KV_HEADS, HEAD_DIM))
    slots = ops.asarray(np.random.default_rng(2).permutation(4096 * BLOCK)[:batch].astype(np.int32))
    ids = ops.asarray(np.random.default_rng(3).integers(0, VOCAB, batch).astype(np.int32))
    table = random_bf16(cp, ops, (VOCAB, HIDDEN))
    act = batch * HIDDEN * isz
    cases = [
        ("rms_norm", f"{batch}x{HIDDEN}", lambda: ops.rms_norm(x, w, 1e-6), 2 * act),
        ("add_rms_norm", f"{batch}x{HIDDEN}", lambda: ops.add_rms_norm(x, r, w, 1e-6), 4 * act),
        ("rotary", f"{batch}x(16+8)x128", lambda: ops.rotary(q, k, pos, cos_sin),
         2 * batch * (HEADS + KV_HEADS) * HEAD_DIM * isz + batch * HEAD_DIM * 4),
        ("silu_and_mul", f"{batch}x{2 * INTER}", lambda: ops.silu_and_mul(gu), 3 * batch * INTER * isz),
        ("kv_append", f"{batch} tokens", lambda: ops.kv_append(k, v, caches[0], caches[1], slots),
         4 * batch * KV_HEADS * HEAD_DIM * isz),
        ("embedding", f"{batch}x{HIDDEN}", lambda: ops.embedding(ids, table), 2 * act),
    ]
    rows = [Row(name, shape, (t := time_graph(cp, fn, iters=200)) * 1e6, moved / t / 1e9, "GB/s", copy_gbs)
            for name, shape, fn, moved in cases]
    return rows + fused_rows(cp, ops, copy_gbs, qkv, pos, cos_sin, slots)


def fused_rows(cp, ops, copy_gbs: float, qkv, pos, cos_sin, slots) -> list[Row]:
    """q/k norm + rotary + KV append of a decode batch: one fused launch against the separate
    kernels, into a bf16 and an FP8 cache. Bytes: q, k, v read; q and the cache rows written."""
    batch = qkv.shape[0]
    q = qkv[:, :HEADS * HEAD_DIM].reshape(batch, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].reshape(batch, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].reshape(batch, KV_HEADS, HEAD_DIM)
    w = random_bf16(cp, ops, (HEAD_DIM,))
    scales = cp.asarray(np.array([0.05, 0.05], np.float32))
    caches = {"bf16": random_bf16(cp, ops, (2, 4096, BLOCK, KV_HEADS, HEAD_DIM)),
              "fp8": random_e4m3(cp, (2, 4096, BLOCK, KV_HEADS, HEAD_DIM))}
    rows = []
    for kv, pool in caches.items():
        sc = scales if kv == "fp8" else None
        moved = batch * ((HEADS + 2 * KV_HEADS) * HEAD_DIM * 2 + HEADS * HEAD_DIM * 2 + HEAD_DIM * 4
                         + 2 * KV_HEADS * HEAD_DIM * pool.dtype.itemsize)
        fn = lambda: ops.qk_norm_rotary_kv_append(q, k, v, w, w, 1e-6, pos, cos_sin, pool[0], pool[1], slots, sc)  # noqa: E731
        for fused in (True, False):
            ops.FUSE_QK_NORM_ROTARY_KV_APPEND = fused
            try:
                t = time_graph(cp, fn, iters=200)
            finally:
                ops.FUSE_QK_NORM_ROTARY_KV_APPEND = True
            name = "qk_norm_rotary_kv_append " + ("fused" if fused else "separate (4 launches)")
            rows.append(Row(f"{name} {kv}", f"{batch}x(16+2x8)x128", t * 1e6, moved / t / 1e9, "GB/s", copy_gbs))
    return rows


# ---- the nodes of a decode step's graph ------------------------------------------------------

# CUgraphNodeType values (cuda.h) -> the names printed.
_NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "event wait",
               7: "event record", 10: "mem alloc", 11: "mem free"}


def _count_graph_nodes(graph: int) -> tuple[int, int, dict] | None:
    """(nodes, kernel nodes, {node type: count}) of a cudaGraph_t through the driver API; None
    without libcuda."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count = ctypes.c_size_t(0)
    if lib.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(count)):
        return None
    nodes = (ctypes.c_void_p * count.value)()
    if lib.cuGraphGetNodes(ctypes.c_void_p(graph), nodes, ctypes.byref(count)):
        return None
    kinds: dict[str, int] = {}
    kind = ctypes.c_int(0)
    for node in nodes:
        lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind))
        name = _NODE_TYPES.get(kind.value, f"type {kind.value}")
        kinds[name] = kinds.get(name, 0) + 1
    return int(count.value), kinds.get("kernel", 0), kinds


def _count_launches(ops, fn) -> int:
    """Kernel launches and GEMM calls of one fn() (the fallback where nodes cannot be listed)."""
    calls = [0]
    kernel, matmul = ops._kernel, ops.cublas.matmul_nt

    def counted_kernel(*args, **kwargs):
        f = kernel(*args, **kwargs)

        def launch(*a, **k):
            calls[0] += 1
            return f(*a, **k)
        return launch

    def counted_matmul(*args, **kwargs):
        calls[0] += 1
        return matmul(*args, **kwargs)

    ops._kernel, ops.cublas.matmul_nt = counted_kernel, counted_matmul
    try:
        fn()
    finally:
        ops._kernel, ops.cublas.matmul_nt = kernel, matmul
    return calls[0]


def graph_node_count(cp, ops, fn) -> dict:
    """Nodes of the graph captured from fn() (after a warm-up), or its launches counted eagerly."""
    rt = cp.cuda.runtime
    stream = cp.cuda.Stream(non_blocking=True)
    pool = cp.cuda.MemoryPool()
    with stream, cp.cuda.using_allocator(pool.malloc):
        fn()
        stream.synchronize()
        # As stream.begin_capture() does, but keeping the cudaGraph_t (CuPy's Graph drops it).
        rt.streamBeginCapture(stream.ptr, rt.streamCaptureModeRelaxed)
        try:
            fn()
        finally:
            graph = rt.streamEndCapture(stream.ptr)
        try:
            counted = _count_graph_nodes(graph)
        finally:
            rt.graphDestroy(graph)
        if counted is not None:
            return {"nodes": counted[0], "kernel_nodes": counted[1], "kinds": counted[2], "how": "cuGraphGetNodes"}
        return {"nodes": _count_launches(ops, fn), "kernel_nodes": None, "kinds": None, "how": "launches counted"}


# Fusion switches of minillm.ops.cuda, in the order they were added: a decode step's graph is
# counted with none, with each in turn, and with all of them.
FUSIONS = ("FUSE_QK_NORM_ROTARY_KV_APPEND", "FUSE_DECODE_APPEND", "FUSE_EMBEDDING_NORM")
FUSION_STAGES = {"separate": 0, "fused q/k norm + rotary + append": 1, "+ append inside decode attention": 2,
                 "+ embedding with the first norm": 3}


def decode_graph_nodes(cp, ops, batch: int = 256, ctx: int = 1024) -> dict:
    """A decode step of the Qwen3-0.6B shape (random weights): graph nodes at each stage of
    FUSION_STAGES, for a bf16 and an FP8 cache."""
    from minillm.benchmarks.kv_fp8_accuracy import random_model
    from minillm.benchmarks.workload import QWEN3_0_6B

    model = random_model(QWEN3_0_6B, ops, DT, ctx + 1)
    mc = model.config
    rng = np.random.default_rng(5)
    num_blocks = ctx // BLOCK                 # every sequence reads the same blocks: the count is the same
    a = ops.asarray
    meta = AttentionMetadata(a(np.arange(batch + 1, dtype=np.int32)), a(np.full(batch, ctx, np.int32)),
                             a(np.tile(np.arange(num_blocks, dtype=np.int32), (batch, 1))),
                             a(np.full(batch, -1, np.int32)), 1, ctx, True)
    ids = ops.asarray(rng.integers(0, mc.vocab_size, batch).astype(np.int32))
    positions = ops.asarray(np.full(batch, ctx - 1, np.int32))
    out = {}
    for kv in ("bf16", "fp8"):
        pool = cp.zeros((mc.num_layers, 2, num_blocks, BLOCK, mc.num_kv_heads, mc.head_dim),
                        cp.uint8 if kv == "fp8" else ops.bfloat16_dtype())
        step = lambda: model.compute_logits(model.forward(ids, positions, meta, pool))   # noqa: E731
        for stage, on in FUSION_STAGES.items():
            for i, name in enumerate(FUSIONS):
                setattr(ops, name, i < on)
            try:
                out[f"{kv} {stage}"] = graph_node_count(cp, ops, step)
            finally:
                for name in FUSIONS:
                    setattr(ops, name, True)
    return out


def print_graph_nodes(counts: dict, batch: int = 256) -> None:
    print(f"\ndecode step CUDA graph, Qwen3-0.6B shape (28 layers), batch {batch} (nodes, kernel nodes, "
          f"share of the separate kernels' count):")
    for kv in ("bf16", "fp8"):
        base = counts[f"{kv} separate"]["nodes"]
        for stage in FUSION_STAGES:
            c = counts[f"{kv} {stage}"]
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(c["kinds"].items())) if c["kinds"] else c["how"]
            print(f"  {kv} KV cache, {stage}: {c['nodes']} nodes ({kinds}), {c['nodes'] / base:.1%}")


def sampling_rows(cp, ops, copy_gbs: float) -> list[Row]:
    batch = 256
    rng = np.random.default_rng(4)
    logits = ops.asarray((rng.standard_normal((batch, VOCAB)) * 2.5).astype(np.float32))
    ones, zeros = cp.ones(batch, cp.float32), cp.zeros(batch, cp.float32)
    no_k, k50 = cp.zeros(batch, cp.int32), cp.full(batch, 50, cp.int32)
    t07, p09, p095, mp005 = ones * 0.7, ones * 0.9, ones * 0.95, zeros + 0.05
    uni = ops.asarray(rng.random(batch).astype(np.float32))
    moved = batch * VOCAB * 4                                     # one read of the logits
    cases = [
        ("sample greedy", lambda: ops.sample(logits, zeros, no_k, ones, zeros, uni)),
        ("sample T=1", lambda: ops.sample(logits, ones, no_k, ones, zeros, uni)),
        ("sample T=0.7 k=50 p=0.9", lambda: ops.sample(logits, t07, k50, p09, zeros, uni)),
        ("sample T=1 p=0.95 min_p=0.05", lambda: ops.sample(logits, ones, no_k, p095, mp005, uni)),
        ("log_softmax", lambda: ops.log_softmax(logits)),
    ]
    return [Row(name, f"{batch}x{VOCAB}", (t := time_graph(cp, fn, iters=10)) * 1e6,
                (3 * moved if name == "log_softmax" else moved) / t / 1e9, "GB/s", copy_gbs)
            for name, fn in cases]


def projection_rows(cp, ops, copy_gbs: float, batches=(64, 128, 256), best_of_each_at=(256,)) -> list[Row]:
    """The decode step's projections at each batch (64 / 128 / 256 by default): cuBLAS's default against the tuned
    choice (minillm/ops/gemm.py), in GB/s of weights read, each call on its own copy of the weights
    so that they come from HBM (copies overflowing L2), as in a step whose layers read their own."""
    import itertools

    from minillm.ops import gemm

    l2 = int(cp.cuda.Device().attributes.get("L2CacheSize", 50 << 20))
    rows = []
    for batch in batches:
        for name, k, nn in (("qkv", HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), ("o", HEADS * HEAD_DIM, HIDDEN),
                            ("gate_up", HIDDEN, 2 * INTER), ("down", INTER, HIDDEN)):
            wbytes = nn * k * 2
            count = max(2, min(16, -(-2 * l2 // wbytes)))
            ws = [random_bf16(cp, ops, (nn, k)) for _ in range(count)]
            x = random_bf16(cp, ops, (batch, k))
            out = cp.empty((batch, nn), dtype=x.dtype)
            result = gemm.tune(gemm.problem_of(out, x, ws[0]), x, ws[0], explicit_algos=True)
            shape = f"{batch}x{k}->{nn}"
            for tag, cand in (("default", gemm.DEFAULT), ("tuned", result.choice)):
                nxt = itertools.cycle(ws)
                t = time_graph(cp, lambda: ops.linear(x, next(nxt), out=out, candidate=cand), iters=4 * count)
                label = f"linear {name} {tag}" + (f" {cand.name}" if tag == "tuned" else "")
                rows.append(Row(label, shape, t * 1e6, wbytes / t / 1e9, "GB/s", copy_gbs))
            if batch in best_of_each_at:   # the tuner's own figures: the best of each kind of candidate
                for kind, label in (("gemm_ex", "explicit gemm_ex ids"), ("lt", "cuBLASLt"),
                                    ("lt0", "cuBLASLt, no workspace"), ("split_k", "split-K")):
                    timed = {c: v for c, v in result.seconds.items() if c.kind == kind and c.param not in (-1, 99)}
                    if timed:
                        best = min(timed, key=timed.get)
                        rows.append(Row(f"  tuner best {label}: {best.name}", shape, timed[best] * 1e6,
                                        wbytes / timed[best] / 1e9, "GB/s", copy_gbs))
            del ws
    return rows


def tail_attention_rows(cp, ops, copy_gbs: float) -> list[Row]:
    """The workload's tail: decode attention at batch 4, context 4096, with the automatic split
    count against one split (and the 16 splits of the previous 256-token minimum partition)."""
    rng = np.random.default_rng(7)
    batch, ctx = 4, 4096
    num_blocks = batch * ctx // BLOCK + 8
    k_cache = random_bf16(cp, ops, (num_blocks, BLOCK, KV_HEADS, HEAD_DIM))
    v_cache = random_bf16(cp, ops, (num_blocks, BLOCK, KV_HEADS, HEAD_DIM))
    q = random_bf16(cp, ops, (batch, HEADS, HEAD_DIM))
    meta = decode_meta(ops, rng, batch, ctx, num_blocks)
    kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2
    auto = ops.decode_num_splits(batch, KV_HEADS, ctx)
    rows = []
    for splits in sorted({auto, 1, 16, 64}):
        t = time_graph(cp, lambda: ops.paged_attention(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5,
                                                       num_splits=splits), iters=50)
        tag = " (auto)" if splits == auto else ""
        rows.append(Row(f"decode attention splits={splits}{tag}", f"B{batch} ctx{ctx}", t * 1e6,
                        kv_bytes / t / 1e9, "GB/s", copy_gbs))
    return rows


DECODE_SHAPES = ((256, 1024), (64, 4096))   # (batch, context): the workload's bulk and a long-context batch


def decode_cache_rows(cp, ops, copy_gbs: float) -> list[Row]:
    """Decode attention with the bf16 cache and the FP8 one at each of DECODE_SHAPES (automatic
    splits), K/V counted at their stored size (two bytes an element, or one)."""
    rng = np.random.default_rng(3)
    num_blocks = max(batch * ctx for batch, ctx in DECODE_SHAPES) // BLOCK
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    caches = {"bf16": (random_bf16(cp, ops, shape), random_bf16(cp, ops, shape), None, 2),
              "fp8": (random_e4m3(cp, shape), random_e4m3(cp, shape),
                      cp.asarray(np.array([0.05, 0.05], np.float32)), 1)}
    rows = []
    for batch, ctx in DECODE_SHAPES:
        meta = decode_meta(ops, rng, batch, ctx, num_blocks)
        q = random_bf16(cp, ops, (batch, HEADS, HEAD_DIM))
        splits = ops.decode_num_splits(batch, KV_HEADS, ctx)
        for kv, (kc, vc, scales, itemsize) in caches.items():
            t = time_graph(cp, lambda: ops.paged_attention(q, kc, vc, meta, HEAD_DIM ** -0.5, scales), iters=10)
            kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * itemsize
            rows.append(Row(f"decode attention {kv} splits={splits}", f"B{batch} ctx{ctx}", t * 1e6,
                            kv_bytes / t / 1e9, "GB/s", copy_gbs))
    return rows


WORKLOAD_BATCHES = (256, 192, 128, 96, 80, 64, 48, 32, 16, 8)


def workload_decode_rows(cp, ops, copy_gbs: float) -> list[Row]:
    """Decode attention (bf16) at the contexts of nano-vllm's workload when `batch` sequences are left
    (each its prompt plus the steps so far), rows in the batch's order against longest context first
    (the decode graphs' order), at the automatic split count and at one split."""
    from minillm.benchmarks.workload import nano_vllm_workload
    from minillm.cuda_graphs import longest_first
    w = nano_vllm_workload(256, 1024, 1024)
    prompt = np.array([len(p) for p in w.prompts])
    output = np.array(w.max_tokens)
    max_len = int(prompt.max() + output.max())
    num_blocks = 256 * -(-max_len // BLOCK) + 1
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = random_bf16(cp, ops, shape), random_bf16(cp, ops, shape)
    rng = np.random.default_rng(0)
    rows = []
    for batch in WORKLOAD_BATCHES:
        step = int(np.sort(output)[::-1][batch - 1]) - 1          # the step at which `batch` are left
        lens = (prompt[output > step][:batch] + step + 1).astype(np.int32)
        width = -(-int(lens.max()) // BLOCK)
        tables = (rng.permutation(num_blocks - 1)[:batch * width].reshape(batch, width) + 1).astype(np.int32)
        q = random_bf16(cp, ops, (batch, HEADS, HEAD_DIM))
        kv_bytes = 2 * int(lens.sum()) * KV_HEADS * HEAD_DIM * 2
        auto = ops.decode_num_splits(batch, KV_HEADS, 4096)
        for order_name, order in (("batch order", np.arange(batch, dtype=np.int32)), ("longest first", longest_first(lens))):
            qsl = np.append(order, batch).astype(np.int32)         # [B + 1] row b reads token row order[b]
            meta = AttentionMetadata(ops.asarray(qsl), ops.asarray(lens[order]), ops.asarray(tables[order]),
                                     ops.asarray(np.zeros(batch, np.int32)), 1, 4096, True)
            for splits in sorted({auto, 1}):
                t = time_graph(cp, lambda: ops.paged_attention(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5,
                                                               num_splits=splits), iters=20)
                tag = " (auto)" if splits == auto else ""
                rows.append(Row(f"decode, {order_name}, splits={splits}{tag}",
                                f"B{batch} ctx {lens.min()}-{lens.max()}", t * 1e6, kv_bytes / t / 1e9, "GB/s",
                                copy_gbs))
    return rows


def print_decode_ratios(rows: list[Row]) -> None:
    """FP8 time against bf16 time per shape (the FP8 cache reads half the bytes: 0.5 is its floor)."""
    times = {(r.shape, r.name.split()[2]): r.time_us for r in rows if r.name.startswith("decode attention ")}
    for batch, ctx in DECODE_SHAPES:
        shape = f"B{batch} ctx{ctx}"
        bf16, fp8 = times[(shape, "bf16")], times[(shape, "fp8")]
        print(f"{shape}: fp8 {fp8:.1f} us / bf16 {bf16:.1f} us = {fp8 / bf16:.2f} (bandwidth floor 0.50)")


def print_table(rows: list[Row]) -> None:
    print(f"{'kernel':34} {'shape':22} {'time us':>10} {'achieved':>16} {'ceiling':>16} {'%':>6}")
    for r in rows:
        print(f"{r.name:34} {r.shape:22} {r.time_us:10.1f} {r.achieved:10.1f} {r.unit:>5} "
              f"{r.ceiling:10.1f} {r.unit:>5} {r.percent:6.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = BenchParser("minillm bench kernels", __doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="Also write the rows as JSON here.")
    parser.add_argument("--no-graph-nodes", dest="graph_nodes", action="store_false",
                        help="Skip counting a decode step's graph nodes (builds a random Qwen3-0.6B-shaped model).")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--prefill-only", action="store_true",
                      help="Time only the ceilings and prefill attention (each kernel, both shapes).")
    only.add_argument("--decode-only", action="store_true",
                      help="Time only the copy ceiling and decode attention with the bf16 and the FP8 cache "
                           "at batch 256 context 1024 and batch 64 context 4096.")
    only.add_argument("--decode-workload", action="store_true",
                      help="Time only the copy ceiling and decode attention at nano-vllm's workload's batches and "
                           "contexts, rows in the batch's order against longest context first.")
    only.add_argument("--projections-only", action="store_true",
                      help="Only the copy ceiling and the decode projections at batch 1 to 256, each tuned.")
    only.add_argument("--graph-nodes-only", action="store_true",
                      help="Count only the nodes of a decode step's CUDA graph at each fusion stage.")
    args = parser.parse_args(argv)
    try:
        import cupy as cp
        if cp.cuda.runtime.getDeviceCount() == 0:
            raise RuntimeError("no CUDA device")
    except Exception as e:  # no CuPy / driver / device
        raise BenchError(f"the kernel benchmarks need CuPy and a CUDA GPU ({type(e).__name__}: {e})") from None
    from minillm.ops import cuda as ops

    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    print(f"device: {props['name'].decode()}  SMs: {props['multiProcessorCount']}  "
          f"CuPy {cp.__version__}  CUDA runtime {cp.cuda.runtime.runtimeGetVersion()}")
    if args.graph_nodes_only:
        counts = decode_graph_nodes(cp, ops)
        print_graph_nodes(counts)
        if args.json:
            args.json.write_text(json.dumps([{"name": "decode step graph nodes", "counts": counts}], indent=1))
        return 0
    copy_gbs = copy_bandwidth(cp)
    rows = [Row("copy d2d (ceiling)", "2 GiB", 2 * (2 << 30) / copy_gbs / 1e3, copy_gbs, "GB/s", copy_gbs)]
    if args.projections_only:
        batches = (1, 8, 32, 64, 128, 192, 256)
        rows += projection_rows(cp, ops, copy_gbs, batches=batches, best_of_each_at=batches)
        print_table(rows)
        if args.json:
            args.json.write_text(json.dumps([asdict(r) | {"percent": r.percent} for r in rows], indent=1))
        return 0
    if args.decode_workload:
        rows += workload_decode_rows(cp, ops, copy_gbs)
        print_table(rows)
        if args.json:
            args.json.write_text(json.dumps([asdict(r) | {"percent": r.percent} for r in rows], indent=1))
        return 0
    if args.decode_only:
        rows += decode_cache_rows(cp, ops, copy_gbs)
        print_table(rows)
        print_decode_ratios(rows)
        if args.json:
            args.json.write_text(json.dumps([asdict(r) | {"percent": r.percent} for r in rows], indent=1))
        return 0
    gemm_peak, gemm = gemm_rows(cp, ops, copy_gbs)
    rows += gemm
    rows += attention_rows(cp, ops, copy_gbs, gemm_peak, decode=not args.prefill_only)
    if not args.prefill_only:
        rows += small_kernel_rows(cp, ops, copy_gbs)
        rows += sampling_rows(cp, ops, copy_gbs)
        rows += tail_attention_rows(cp, ops, copy_gbs)
        rows += projection_rows(cp, ops, copy_gbs)
    print_table(rows)
    counts = {}
    if args.graph_nodes and not args.prefill_only:
        counts = decode_graph_nodes(cp, ops)
        print_graph_nodes(counts)
    if args.json:
        entries = [asdict(r) | {"percent": r.percent} for r in rows]
        if counts:
            entries.append({"name": "decode step graph nodes", "counts": counts})
        args.json.write_text(json.dumps(entries, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "minillm bench kernels"))
