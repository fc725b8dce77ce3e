"""Launcher of cuda/prefill_attention.cu: tensor-core prefill attention for fp16 / bf16 and FP8 caches.

minillm/ops/cuda.py:paged_attention calls `variant()` for every prefill; when it names a block
shape (fp16 / bf16 activations with the cache in the same dtype or in FP8 E4M3, head_dim 64 or
128, GQA group up to 16, `out` 4-byte aligned) `launch()` runs it, otherwise the older kernels of
paged_attention.cu run (float32, other head sizes). An FP8 cache takes flash-4w's shape (one key
group). The twin is minillm/ops/numpy.py:paged_attention.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import numpy as np

SOURCE = "prefill_attention.cu"
HOPPER_SOURCE = "prefill_attention_wgmma.cu"   # warpgroup MMAs, built for sm_90a
KV_TILE = 64                    # keys of one K/V tile in shared memory (PA_BN in the source)
MAX_GROUP = 16                  # query heads per KV head handled here
HEAD_DIMS = (64, 128)
OLD_KERNEL = "mma"              # the value of the kernel flag that keeps paged_prefill_mma
AUTO = "flash"                  # the flag's value that picks the block shape from the grid
# "flash" picks flash-8w while flash-4w would make at most this many blocks per multiprocessor.
# Measured on the H200 (RESULTS.md, Kernels): a 2,048-token chunk alone (256 blocks) ran at 208
# TFLOP/s with either shape, and over a 14,000-token prefix flash-4w ran at 310 against 250 for
# flash-8w, so flash-4w is the default everywhere (0); flash-8w stays selectable by name.
AUTO_8W_BLOCKS_PER_SM = 0
# Key splits (see the source's header): a grid of fewer blocks than multiprocessors splits each
# block's K/V tiles so that about SPLIT_BLOCKS_PER_SM blocks a multiprocessor run, each split at
# least MIN_SPLIT_TILES tiles of the longest context (shorter ones gain less than the reduce costs).
# A 128-token chunk over a 16,000-token prefix was 16 blocks on the H200's 132 (RESULTS.md, Long
# prompts among decoders).
SPLIT_BLOCKS_PER_SM = 2
MIN_SPLIT_TILES = 4
MAX_KV_SPLITS = 32
SPLIT_WORKSPACE_BYTES = 256 << 20     # cap on the fp32 partials of one step


@dataclass(frozen=True)
class Variant:
    """Block shape of prefill_attention.cu: warps in key groups, 16 * m_tiles query rows a warp."""

    warps: int
    m_tiles: int                # 16-row MMA tiles of one warp
    key_groups: int             # warp groups that share the rows and split every K/V tile's keys
    stages: int                 # K/V tiles in shared memory
    min_blocks: int             # blocks one multiprocessor must hold (caps the registers)
    hopper: bool = False        # prefill_attention_wgmma.cu: a producer and two MMA warpgroups

    @property
    def rows(self) -> int:
        """Query rows of one block (query tokens x the GQA heads sharing a KV head)."""
        if self.hopper:
            return 128                            # two consumer warpgroups of 64 rows
        return 16 * self.m_tiles * self.warps // self.key_groups

    def smem_bytes(self, head_dim: int, fp8: bool = False) -> int:
        """Dynamic shared memory of one block: Q rows plus the K and V stages, padded rows (FP8: one
        widened fp16 K and V tile plus the stages of bytes; Hopper: 128-byte swizzled rows of Q and
        of each stage's 128-key K and V tiles, plus 1 KB to align them)."""
        if self.hopper:
            return self.rows * head_dim * 2 + self.stages * 2 * HOPPER_KV_TILE * head_dim * 2 + 1024
        if fp8:
            return (self.rows + 2 * KV_TILE) * (head_dim + 8) * 2 + 2 * self.stages * KV_TILE * head_dim
        return (self.rows + 2 * self.stages * KV_TILE) * (head_dim + 8) * 2

    def defines(self) -> dict[str, int]:
        """The source's -D shape constants."""
        return {"PA_WARPS": self.warps, "PA_MT": self.m_tiles, "PA_KSPLIT": self.key_groups,
                "PA_STAGES": self.stages, "PA_MIN_BLOCKS": self.min_blocks}


# "flash-4w": 4 warps of 32 rows and two K/V stages, two blocks a multiprocessor (FlashAttention-2's
# shape: each K/V fragment feeds two MMAs). "flash-8w": the same 128 rows with 8 warps in two key
# groups (each takes half of every tile, merged at the end) and three stages, one block a
# multiprocessor: a long block keeps 8 warps, and a small grid balances block by block.
# "flash-wgmma" (Hopper, sm_90a; head_dim 128, a cache in q's dtype): a producer warpgroup gathers
# 128-key K/V tiles into three swizzled stages and two warpgroups of 64 query rows run S = Q K^T
# and O += P V as warpgroup MMAs, the next tile's scores and softmax beside the last tile's P V.
# On Hopper the default takes it for every grid: a small one (a short chunk over a long prefix)
# splits its keys across one wave (kv_splits).
VARIANTS = {"flash-4w": Variant(warps=4, m_tiles=2, key_groups=1, stages=2, min_blocks=2),
            "flash-8w": Variant(warps=8, m_tiles=2, key_groups=2, stages=3, min_blocks=1),
            "flash-wgmma": Variant(warps=12, m_tiles=1, key_groups=1, stages=3, min_blocks=1, hopper=True)}
HOPPER = "flash-wgmma"
HOPPER_KV_TILE = 128            # keys of one K/V tile of the Hopper kernel
HOPPER_HEAD_DIMS = (128,)
HOPPER_CAPABILITIES = ("90",)   # sm_90a code runs on compute capability 9.0 only
KERNELS = (AUTO, *VARIANTS, OLD_KERNEL)

_configured: set[int] = set()
_hopper_failed: list[str] = []      # why the Hopper kernel did not build, once it did not
_lock = threading.Lock()


def variant(kernel: str, q, k_cache, out, max_query_len: int, batch: int, num_sms: int) -> Variant | None:
    """The block shape of prefill_attention.cu that runs this prefill, or None for the older kernels.

    kernel: the flag minillm.ops.cuda.PREFILL_ATTENTION, one of KERNELS.
    """
    if kernel not in KERNELS:
        raise ValueError(f"prefill attention kernel must be one of {list(KERNELS)}, got {kernel!r}")
    fp8 = k_cache.dtype == np.uint8
    if kernel == OLD_KERNEL or q.dtype.name not in ("float16", "bfloat16") or (k_cache.dtype != q.dtype and not fp8):
        return None
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if head_dim not in HEAD_DIMS or group > MAX_GROUP or out.data.ptr % 4:
        return None
    if fp8:                                   # one key group (the source's PA_KSPLIT 1)
        return VARIANTS["flash-4w"] if kernel in (AUTO, "flash-4w", HOPPER) else None
    hopper = head_dim in HOPPER_HEAD_DIMS and _capability() in HOPPER_CAPABILITIES
    if kernel == HOPPER:                      # where it cannot run, flash-4w's shape
        return VARIANTS[HOPPER if hopper else "flash-4w"]
    if kernel != AUTO:
        return VARIANTS[kernel]
    if hopper:                                # a small grid splits its keys across the card
        return VARIANTS[HOPPER]
    blocks = num_q_tiles(VARIANTS["flash-4w"], group, max_query_len) * num_kv_heads * batch
    return VARIANTS["flash-8w" if blocks <= AUTO_8W_BLOCKS_PER_SM * num_sms else "flash-4w"]


def hopper_kernel(dtype, head_dim: int, group: int):
    """prefill_attention_wgmma built for sm_90a, or None when NVRTC cannot build it (an older toolkit):
    then the flash kernel runs, and the failure is logged once and not retried."""
    from minillm.ops import cuda as ops
    if _hopper_failed:
        return None
    try:
        return ops._kernel(HOPPER_SOURCE, dtype, "prefill_attention_wgmma", arch="90a", HEAD_DIM=head_dim, GQA=group)
    except Exception as exc:  # NVRTC without sm_90a, a driver that cannot load it: the flash kernel serves
        _hopper_failed.append(f"{type(exc).__name__}: {exc}")
        logging.getLogger("minillm").warning("prefill attention: the Hopper kernel did not build (%s); "
                                             "the flash kernel runs instead", " / ".join(_hopper_failed[0].splitlines())[:500])
        return None


def _capability() -> str:
    """The device's compute capability ("90" on Hopper; "" without CuPy)."""
    from minillm.ops import cuda as ops
    return ops._compute_capability()


def num_q_tiles(v: Variant, group: int, max_query_len: int) -> int:
    """Query tiles of the longest chunk: blocks of v.rows rows hold v.rows // group tokens."""
    return max(1, -(-max_query_len // (v.rows // group)))


def grid_order(v: Variant, tiles: int, num_kv_heads: int, batch: int, num_sms: int) -> tuple[int, int]:
    """(blocks, first_wave): one block per (query tile, KV head, sequence); first_wave > 0 when the
    grid fits two blocks per multiprocessor, so the second round is handed out shortest first."""
    blocks = tiles * num_kv_heads * batch
    first_wave = num_sms if v.min_blocks >= 2 and blocks <= 2 * num_sms else 0
    return blocks, first_wave


def kv_splits(blocks: int, max_seq_len: int, num_sms: int, num_tokens: int, num_heads: int, head_dim: int,
              hopper: bool = False) -> int:
    """Key splits of every block of a grid of `blocks` blocks whose longest context is max_seq_len
    (1: none); the partials of num_tokens rows stay within SPLIT_WORKSPACE_BYTES. The Hopper
    kernel (one block a multiprocessor) splits as far as one wave holds, in its 128-key tiles."""
    if blocks >= num_sms:
        return 1
    if hopper:
        want = num_sms // max(1, blocks)
        cap = -(-max(1, max_seq_len) // HOPPER_KV_TILE) // MIN_SPLIT_TILES
    else:
        want = -(-SPLIT_BLOCKS_PER_SM * num_sms // max(1, blocks))
        cap = -(-max(1, max_seq_len) // KV_TILE) // MIN_SPLIT_TILES
    room = SPLIT_WORKSPACE_BYTES // max(1, num_tokens * num_heads * (head_dim + 2) * 4)
    return int(max(1, min(want, cap, room, MAX_KV_SPLITS)))


def grid_kv_splits(v: Variant, num_tokens: int, num_heads: int, head_dim: int, num_kv_heads: int, batch: int,
                   max_query_len: int, max_seq_len: int, num_sms: int) -> int:
    """The key splits launch() picks for a batch of `batch` chunks (1: none)."""
    tiles = num_q_tiles(v, num_heads // num_kv_heads, max_query_len)
    blocks, _ = grid_order(v, tiles, num_kv_heads, batch, num_sms)
    return kv_splits(blocks, max_seq_len, num_sms, num_tokens, num_heads, head_dim, v.hopper)


def _configure(fn, smem: int) -> None:
    """Raise the kernel's dynamic shared-memory limit (once per compiled kernel)."""
    with _lock:
        if id(fn) in _configured:
            return
        if hasattr(fn, "kernel"):              # a RawKernel
            fn.max_dynamic_shared_size_bytes = smem
            fn.preferred_shared_memory_carveout = 100      # all of L1 as shared memory: two blocks fit
        else:                                  # a module's function (minillm.ops.cuda._kernel with arch)
            from cupy.cuda import driver
            max_smem = getattr(driver, "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES", 8)
            carveout = getattr(driver, "CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT", 9)
            driver.funcSetAttribute(fn.ptr, max_smem, smem)
            driver.funcSetAttribute(fn.ptr, carveout, 100)
        _configured.add(id(fn))


def launch(v: Variant, out, q, k_cache, qsl, seq_lens, tables, scale: float, max_query_len: int,
           max_seq_len: int, num_splits: int | None = None, row0: int = 0) -> list:
    """The launches of prefill_attention.cu over the batch (arguments as minillm/ops/cuda.py:_prefill
    checked them), with the layer's caches left to bind: minillm.ops.cuda.KernelLaunch's.

    q and out hold every token row of the step; the batch's chunks start at row row0 (a mixed
    step's decode rows come first). num_splits forces the key splits (None: kv_splits()).
    """
    from minillm.ops import cuda as ops

    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group, batch = num_heads // num_kv_heads, seq_lens.shape[0]
    tiles = num_q_tiles(v, group, max_query_len)
    sms = ops._num_multiprocessors()
    blocks, first_wave = grid_order(v, tiles, num_kv_heads, batch, sms)
    splits = num_splits or grid_kv_splits(v, num_tokens, num_heads, head_dim, num_kv_heads, batch, max_query_len,
                                          max_seq_len, sms)
    fn = hopper_kernel(q.dtype, head_dim, group) if v.hopper else None
    if v.hopper and fn is None:               # it did not build: the flash kernel, with its own splits
        v = VARIANTS["flash-4w"]
        blocks, first_wave = grid_order(v, num_q_tiles(v, group, max_query_len), num_kv_heads, batch, sms)
        splits = num_splits or grid_kv_splits(v, num_tokens, num_heads, head_dim, num_kv_heads, batch,
                                              max_query_len, max_seq_len, sms)
    fp8 = k_cache.dtype == np.uint8
    flash_defines = VARIANTS["flash-4w"].defines() if v.hopper else v.defines()
    defines = {"HEAD_DIM": head_dim, "GQA": group, **flash_defines, **({"KV_FP8": 1} if fp8 else {})}
    out_stride = ops._i64(out.strides[0] // out.dtype.itemsize)
    if splits > 1:
        cp = ops._require_cupy()
        part_o = cp.empty((num_tokens, num_heads, splits, head_dim), np.float32)
        part_ml = cp.empty((num_tokens, num_heads, splits, 2), np.float32)
        parts, keep = [ops._ptr(part_o), ops._ptr(part_ml)], (part_o, part_ml)
    else:
        parts, keep = [np.uint64(0), np.uint64(0)], ()
    if v.hopper:
        smem = v.smem_bytes(head_dim)
        _configure(fn, smem)
        launches = [ops.KernelLaunch(
            fn, (blocks, splits), (384,),
            [ops._ptr(out), out_stride, ops._ptr(q), ops._i64(ops._row_stride(q, "q")), ops.K_CACHE, ops.V_CACHE,
             ops._ptr(tables), ops._i64(tables.strides[0] // 4), ops._ptr(seq_lens), ops._ptr(qsl),
             ops._i32(batch), ops._i32(num_kv_heads), ops._i32(ops._log2_exact(block_size, "block_size")),
             np.float32(scale * ops.LOG2E), *parts, ops._i32(splits)],
            shared_mem=smem, keep=keep)]
    else:
        fn = ops._kernel(SOURCE, q.dtype, "prefill_attention", **defines)
        smem = v.smem_bytes(head_dim, fp8)
        _configure(fn, smem)
        launches = [ops.KernelLaunch(
            fn, (blocks, splits), (32 * v.warps,),
            [ops._ptr(out), out_stride, ops._ptr(q),
             ops._i64(ops._row_stride(q, "q")), ops.K_CACHE, ops.V_CACHE, ops._ptr(tables),
             ops._i64(tables.strides[0] // 4), ops._ptr(seq_lens), ops._ptr(qsl), ops._i32(batch),
             ops._i32(num_kv_heads), ops._i32(tiles), ops._i32(ops._log2_exact(block_size, "block_size")),
             np.float32(scale * ops.LOG2E), ops._i32(first_wave), *parts, ops._i32(splits), ops.KV_SCALES],
            shared_mem=smem, keep=keep)]
    if splits > 1 and num_tokens > row0:
        reduce = ops._kernel(SOURCE, q.dtype, "prefill_attention_reduce", **defines)
        launches.append(ops.KernelLaunch(
            reduce, (num_heads, num_tokens - row0), (128,),
            [ops._ptr(out), out_stride, *parts, ops._ptr(qsl), ops._i32(batch), ops._i32(row0),
             ops._i32(num_heads), ops._i32(splits)], keep=keep))
    return launches
