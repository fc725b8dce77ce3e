"""Launcher of cuda/prefill_attention.cu: tensor-core prefill attention for fp16 / bf16 caches.

minillm/ops/cuda.py:paged_attention calls `variant()` for every prefill; when it names a block
shape (fp16 / bf16 with the cache in the same dtype, head_dim 64 or 128, GQA group up to 16, `out`
4-byte aligned) `launch()` runs it, otherwise the older kernels of paged_attention.cu run (other
dtypes, such as an FP8 cache, and other head sizes). The twin is minillm/ops/numpy.py:paged_attention.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

SOURCE = "prefill_attention.cu"
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


@dataclass(frozen=True)
class Variant:
    """Block shape of prefill_attention.cu: warps in key groups, 16 * m_tiles query rows a warp."""

    warps: int
    m_tiles: int                # 16-row MMA tiles of one warp
    key_groups: int             # warp groups that share the rows and split every K/V tile's keys
    stages: int                 # K/V tiles in shared memory
    min_blocks: int             # blocks one multiprocessor must hold (caps the registers)

    @property
    def rows(self) -> int:
        """Query rows of one block (query tokens x the GQA heads sharing a KV head)."""
        return 16 * self.m_tiles * self.warps // self.key_groups

    def smem_bytes(self, head_dim: int) -> int:
        """Dynamic shared memory of one block: Q rows plus the K and V stages, padded rows."""
        return (self.rows + 2 * self.stages * KV_TILE) * (head_dim + 8) * 2

    def defines(self) -> dict[str, int]:
        """The source's -D shape constants."""
        return {"PA_WARPS": self.warps, "PA_MT": self.m_tiles, "PA_KSPLIT": self.key_groups,
                "PA_STAGES": self.stages, "PA_MIN_BLOCKS": self.min_blocks}


# "flash-4w": 4 warps of 32 rows and two K/V stages, two blocks a multiprocessor (FlashAttention-2's
# shape: each K/V fragment feeds two MMAs). "flash-8w": the same 128 rows with 8 warps in two key
# groups (each takes half of every tile, merged at the end) and three stages, one block a
# multiprocessor: a long block keeps 8 warps, and a small grid balances block by block.
VARIANTS = {"flash-4w": Variant(warps=4, m_tiles=2, key_groups=1, stages=2, min_blocks=2),
            "flash-8w": Variant(warps=8, m_tiles=2, key_groups=2, stages=3, min_blocks=1)}
KERNELS = (AUTO, *VARIANTS, OLD_KERNEL)

_configured: set[int] = set()
_lock = threading.Lock()


def variant(kernel: str, q, k_cache, out, max_query_len: int, batch: int, num_sms: int) -> Variant | None:
    """The block shape of prefill_attention.cu that runs this prefill, or None for the older kernels.

    kernel: the flag minillm.ops.cuda.PREFILL_ATTENTION, one of KERNELS.
    """
    if kernel not in KERNELS:
        raise ValueError(f"prefill attention kernel must be one of {list(KERNELS)}, got {kernel!r}")
    if kernel == OLD_KERNEL or q.dtype.name not in ("float16", "bfloat16") or k_cache.dtype != q.dtype:
        return None
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if head_dim not in HEAD_DIMS or group > MAX_GROUP or out.data.ptr % 4:
        return None
    if kernel != AUTO:
        return VARIANTS[kernel]
    blocks = num_q_tiles(VARIANTS["flash-4w"], group, max_query_len) * num_kv_heads * batch
    return VARIANTS["flash-8w" if blocks <= AUTO_8W_BLOCKS_PER_SM * num_sms else "flash-4w"]


def num_q_tiles(v: Variant, group: int, max_query_len: int) -> int:
    """Query tiles of the longest chunk: blocks of v.rows rows hold v.rows // group tokens."""
    return max(1, -(-max_query_len // (v.rows // group)))


def grid_order(v: Variant, tiles: int, num_kv_heads: int, batch: int, num_sms: int) -> tuple[int, int]:
    """(blocks, first_wave): one block per (query tile, KV head, sequence); first_wave > 0 when the
    grid fits two blocks per multiprocessor, so the second round is handed out shortest first."""
    blocks = tiles * num_kv_heads * batch
    first_wave = num_sms if v.min_blocks >= 2 and blocks <= 2 * num_sms else 0
    return blocks, first_wave


def _configure(fn, smem: int) -> None:
    """Raise the kernel's dynamic shared-memory limit (once per compiled kernel)."""
    with _lock:
        if id(fn) in _configured:
            return
        fn.max_dynamic_shared_size_bytes = smem
        fn.preferred_shared_memory_carveout = 100      # all of L1 as shared memory: two blocks fit
        _configured.add(id(fn))


def launch(v: Variant, out, q, k_cache, v_cache, qsl, seq_lens, tables, scale: float, max_query_len: int):
    """The launch of prefill_attention.cu over the batch (arguments as minillm/ops/cuda.py:_prefill
    checked them), with the layer's caches left to bind: a minillm.ops.cuda.KernelLaunch."""
    from minillm.ops import cuda as ops

    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group, batch = num_heads // num_kv_heads, seq_lens.shape[0]
    tiles = num_q_tiles(v, group, max_query_len)
    blocks, first_wave = grid_order(v, tiles, num_kv_heads, batch, ops._num_multiprocessors())
    defines = {"HEAD_DIM": head_dim, "GQA": group, **v.defines()}
    fn = ops._kernel(SOURCE, q.dtype, "prefill_attention", **defines)
    smem = v.smem_bytes(head_dim)
    _configure(fn, smem)
    return ops.KernelLaunch(
        fn, (blocks,), (32 * v.warps,),
        [ops._ptr(out), ops._i64(out.strides[0] // out.dtype.itemsize), ops._ptr(q),
         ops._i64(ops._row_stride(q, "q")), ops.K_CACHE, ops.V_CACHE, ops._ptr(tables),
         ops._i64(tables.strides[0] // 4), ops._ptr(seq_lens), ops._ptr(qsl), ops._i32(batch),
         ops._i32(num_kv_heads), ops._i32(tiles), ops._i32(ops._log2_exact(block_size, "block_size")),
         np.float32(scale * ops.LOG2E), ops._i32(first_wave)],
        shared_mem=smem)
