"""ModelRunner: the only engine part that touches device memory.

It owns the weights and the KV pool (allocated once), turns a SchedulerOutput into input ids,
positions and attention metadata, runs the model and the sampler, and returns a StepOutput.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from types import ModuleType

import numpy as np

from minillm.attention import AttentionMetadata
from minillm.config import EngineConfig, ModelConfig
from minillm.models.decoder import DecoderModel
from minillm.sampler import Sampler
from minillm.scheduler import SchedulerOutput, StepOutput
from minillm.sequence import PLACEHOLDER
from minillm.stats import MemoryStats

DEFAULT_CPU_KV_BYTES = 1 << 30


def kv_bytes_per_block(mc: ModelConfig, block_size: int, itemsize: int) -> int:
    """Bytes one block takes across all layers, K and V."""
    return mc.kv_bytes_per_token * block_size * itemsize


class ModelRunner:
    """Weights, KV pool and the forward pass for one backend."""

    def __init__(self, model_config: ModelConfig, config: EngineConfig, ops: ModuleType,
                 weights: dict[str, np.ndarray], dtype, max_model_len: int):
        self.model_config, self.config, self.ops, self.dtype = model_config, config, ops, dtype
        self.block_size = config.block_size
        self.model = DecoderModel(model_config, weights, ops, dtype, max_model_len)
        self.weights_bytes = sum(int(getattr(a, "nbytes", 0)) for a in self._device_arrays())
        self.num_blocks = self._decide_num_blocks(max_model_len)
        mc = model_config
        # kv_pool: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_pool = ops.xp.zeros((mc.num_layers, 2, self.num_blocks, self.block_size,
                                     mc.num_kv_heads, mc.head_dim), dtype=ops.xp.dtype(dtype))
        self.sampler = Sampler(ops, list(mc.eos_token_id))
        self.stream = None
        self.graphs = None
        self.profile = False             # when set, time forward and sampling with CUDA events
        self.timings: Counter[str] = Counter()   # seconds per phase, summed over steps
        self._last_sampled = None        # (ids on the device, seq_id -> row) of the last async step
        if ops.name == "cuda":
            import cupy
            self.stream = cupy.cuda.Stream(non_blocking=True)
            if not config.enforce_eager:
                from minillm.cuda_graphs import DecodeGraphs
                self.graphs = DecodeGraphs(self.model, ops, self.kv_pool, config.max_num_seqs,
                                           max_model_len, self.block_size, self.stream)

    def _device_arrays(self):
        m = self.model
        yield from (m.embed, m.lm_head, m.final_norm)
        for lw in m.layers:
            yield from (a for a in vars(lw).values() if a is not None)

    def _decide_num_blocks(self, max_model_len: int) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = kv_bytes_per_block(self.model_config, self.block_size, self.ops.xp.dtype(self.dtype).itemsize)
        if self.ops.name == "numpy":
            budget = cfg.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES
            enough = cfg.max_num_seqs * ((max_model_len + self.block_size - 1) // self.block_size)
            return max(1, min(budget // per_block, enough))
        activations = self._profile_activation_bytes(max_model_len)
        # Decode graphs keep their own logits [max_num_seqs, V] fp32 and a batch's activations.
        graphs = 0 if cfg.enforce_eager else 2 * cfg.max_num_seqs * self.model_config.vocab_size * 4
        free, total = self.ops.device_memory_info()
        budget = int(total * cfg.gpu_memory_utilization) - (total - free) - activations - graphs
        if budget < per_block:
            raise ValueError(f"no device memory left for the KV pool: {free / 2**30:.1f} GiB free of "
                             f"{total / 2**30:.1f} GiB, a forward pass needs {activations / 2**30:.1f} GiB; "
                             f"lower max_num_batched_tokens or raise gpu_memory_utilization")
        return budget // per_block

    def _profile_activation_bytes(self, max_model_len: int) -> int:
        """Run one forward pass at max_num_batched_tokens (and logits and sampling for max_num_seqs
        rows) on dummy inputs and return the device memory it took, measured on CuPy's pool."""
        cp, mc, cfg, bs = self.ops.xp, self.model_config, self.config, self.block_size
        num_tokens = min(cfg.max_num_batched_tokens, max_model_len * cfg.max_num_seqs)
        seq_len = min(num_tokens, max_model_len)
        lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        blocks = -(-seq_len // bs)
        # One sequence's worth of blocks that every dummy sequence reads; nothing is written.
        scratch = cp.zeros((mc.num_layers, 2, blocks, bs, mc.num_kv_heads, mc.head_dim), dtype=cp.dtype(self.dtype))
        a = self.ops.asarray
        meta = AttentionMetadata(a(np.cumsum([0] + lens).astype(np.int32)), a(np.asarray(lens, np.int32)),
                                 a(np.tile(np.arange(blocks, dtype=np.int32), (len(lens), 1))),
                                 a(np.full(num_tokens, -1, np.int32)), max(lens), max(lens), False)
        positions = np.concatenate([np.arange(n, dtype=np.int32) for n in lens])
        pool = cp.get_default_memory_pool()
        cp.cuda.Device().synchronize()
        before = pool.total_bytes()
        hidden = self.model.forward(a(np.zeros(num_tokens, np.int32)), a(positions), meta, scratch)
        rows = min(cfg.max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[:rows])
        ones = a(np.ones(rows, np.float32))
        self.ops.log_softmax(logits)
        self.ops.sample(logits, ones, a(np.zeros(rows, np.int32)), ones * 0.9, ones * 0.0, ones * 0.5)
        cp.cuda.Device().synchronize()
        peak = pool.total_bytes() - before
        del hidden, logits, scratch
        pool.free_all_blocks()
        return peak + (256 << 20)                # cuBLAS workspace and rounding

    def prepare_inputs(self, out: SchedulerOutput):
        """Host-side input ids [T], positions [T] and attention metadata for the step."""
        if all(n == 1 for n in out.num_new_tokens):
            return self._prepare_decode(out)
        bs = self.block_size
        ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
        for seq, n in zip(out.seqs, out.num_new_tokens):
            start = seq.num_computed_tokens
            pos = np.arange(start, start + n)
            table = np.asarray(seq.block_table, dtype=np.int64)
            ids.append(np.asarray(seq.token_ids[start:start + n], dtype=np.int32))
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
        meta = AttentionMetadata(
            query_start_loc=np.asarray(qsl, np.int32), seq_lens=np.asarray(seq_lens, np.int32),
            block_tables=self._block_tables(out), slot_mapping=np.concatenate(slots).astype(np.int32),
            max_query_len=max(out.num_new_tokens), max_seq_len=max(seq_lens), is_decode_only=False)
        return np.concatenate(ids), np.concatenate(positions).astype(np.int32), meta

    def _prepare_decode(self, out: SchedulerOutput):
        """The common step, one token per sequence, in plain Python loops (cheaper than numpy here)."""
        bs = self.block_size
        positions = [s.num_computed_tokens for s in out.seqs]
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(out.seqs, positions)]
        ids = np.fromiter((s.token_ids[p] for s, p in zip(out.seqs, positions)), np.int32, len(positions))
        pos = np.asarray(positions, np.int32)
        meta = AttentionMetadata(
            query_start_loc=np.arange(len(positions) + 1, dtype=np.int32), seq_lens=pos + 1,
            block_tables=self._block_tables(out), slot_mapping=np.asarray(slots, np.int32),
            max_query_len=1, max_seq_len=int(pos.max()) + 1, is_decode_only=True)
        return ids, pos, meta

    @staticmethod
    def _block_tables(out: SchedulerOutput) -> np.ndarray:
        """block_tables: [B, max_blocks] int32, padded with 0."""
        tables = np.zeros((len(out.seqs), max(len(s.block_table) for s in out.seqs)), dtype=np.int32)
        for b, seq in enumerate(out.seqs):
            tables[b, :len(seq.block_table)] = seq.block_table
        return tables

    def _to_device(self, meta: AttentionMetadata) -> AttentionMetadata:
        if self.ops.name == "numpy":
            return meta
        a = self.ops.asarray
        return AttentionMetadata(a(meta.query_start_loc), a(meta.seq_lens), a(meta.block_tables),
                                 a(meta.slot_mapping), meta.max_query_len, meta.max_seq_len,
                                 meta.is_decode_only)

    def launch(self, out: SchedulerOutput) -> "PendingStep":
        """Queue one forward pass and the sampling of every sequence whose known tokens are all
        computed; on the GPU nothing waits here, so the host can go on while the step runs."""
        t0 = time.perf_counter()
        ids, positions, meta = self.prepare_inputs(out)
        rows = [b for b, (s, n) in enumerate(zip(out.seqs, out.num_new_tokens))
                if s.num_computed_tokens + n == s.num_tokens]
        patch = self._placeholder_patch(ids, out)
        t1 = time.perf_counter()
        self.timings["prepare"] += t1 - t0
        seqs = [out.seqs[b] for b in rows]
        with self.stream if self.stream is not None else contextlib.nullcontext():
            events = self._events() if self.profile else None
            logits = self._forward(ids, positions, meta, rows, patch)
            if events:
                events[1].record()
            self.timings["forward_host"] += time.perf_counter() - t1
            if logits is None:
                return PendingStep(self, [], tokens=[])
            if any(s.params.logprobs is not None for s in seqs) or self.ops.name == "numpy":
                tokens, logprobs = self.sampler(logits, seqs)   # waits for the device
                if events:
                    events[2].record()
                self._last_sampled = (self.ops.asarray(np.asarray(tokens, np.int32)),
                                      {s.seq_id: r for r, s in enumerate(seqs)})
                return PendingStep(self, seqs, tokens=tokens, logprobs=logprobs, events=events)
            ids_dev = self.sampler.sample_no_sync(logits, seqs)   # [len(seqs)] int32 on the device
            if events:
                events[2].record()
            self._last_sampled = (ids_dev, {s.seq_id: r for r, s in enumerate(seqs)})
            return PendingStep(self, seqs, ids_dev=ids_dev, events=events)

    def _placeholder_patch(self, ids: np.ndarray, out: SchedulerOutput):
        """(dst token rows, src rows of the last sampled ids) for inputs still on the device, or None."""
        holes = np.flatnonzero(ids == PLACEHOLDER)
        if len(holes) == 0:
            return None
        if self._last_sampled is None:
            raise RuntimeError("a placeholder token has no sampled value to come from")
        last_ids, last_rows = self._last_sampled
        starts = np.cumsum([0] + list(out.num_new_tokens))
        owner = np.searchsorted(starts, holes, side="right") - 1      # batch row of each hole
        src = [last_rows[out.seqs[b].seq_id] for b in owner]
        ids[holes] = 0
        return holes.astype(np.int32), np.asarray(src, np.int32), last_ids

    def _apply_patch(self, ids_dev, patch) -> None:
        if patch is not None:
            dst, src, last_ids = patch
            ids_dev[self.ops.asarray(dst)] = last_ids[self.ops.asarray(src)]

    def _events(self):
        """Three CUDA events, the first recorded now (profiling only)."""
        if self.ops.name != "cuda":
            return None
        events = [self.ops.xp.cuda.Event() for _ in range(3)]
        events[0].record()
        return events

    def _forward(self, ids, positions, meta: AttentionMetadata, rows: list[int], patch=None):
        """Logits [len(rows), V] of the sampling rows (None when no row samples)."""
        if meta.is_decode_only and self.graphs is not None and self.graphs.can_run(len(ids)):
            logits = self.graphs.run(ids, meta, lambda ids_dev: self._apply_patch(ids_dev, patch))
            if len(rows) < len(ids):
                logits = logits[self.ops.asarray(np.asarray(rows, np.int32))] if rows else None
            return logits
        ids_dev = self.ops.asarray(ids)
        self._apply_patch(ids_dev, patch)
        hidden = self.model.forward(ids_dev, self.ops.asarray(positions), self._to_device(meta), self.kv_pool)
        if not rows:
            return None
        last = self.ops.asarray(meta.query_start_loc[np.asarray(rows) + 1] - 1)
        return self.model.compute_logits(hidden[last])           # [len(rows), V]

    def memory_stats(self) -> MemoryStats:
        """Weights, KV pool and everything else, in bytes."""
        kv = int(self.kv_pool.nbytes)
        if self.ops.name == "numpy":
            total = _process_rss_bytes()
        else:
            free, device_total = self.ops.device_memory_info()
            total = device_total - free
        other = max(total - self.weights_bytes - kv, 0)
        return MemoryStats(self.weights_bytes, kv, other, max(total, self.weights_bytes + kv))


def _process_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class PendingStep:
    """A launched step: its sampling sequences and, once wait() returns, their tokens."""

    def __init__(self, runner: ModelRunner, seqs, tokens=None, logprobs=None, ids_dev=None, events=None):
        self.runner, self.seqs, self.events = runner, seqs, events
        self.tokens, self.logprobs = tokens, logprobs
        self._host = self._done = None
        if ids_dev is not None:          # start the copy back now; wait() only waits for this step
            import cupy
            import cupyx
            self._host = cupyx.empty_pinned(ids_dev.shape, dtype=np.int32)
            ids_dev.get(out=self._host, blocking=False)
            self._done = cupy.cuda.Event()
            self._done.record()

    def wait(self) -> StepOutput:
        """The step's tokens (blocks until the device has produced them)."""
        t0 = time.perf_counter()
        if self.tokens is None:
            self._done.synchronize()
            self.tokens = self._host.tolist()
        timings = self.runner.timings
        if self.events:
            self.events[2].synchronize()
            elapsed = self.runner.ops.xp.cuda.get_elapsed_time
            timings["forward_gpu"] += elapsed(self.events[0], self.events[1]) / 1e3
            timings["sample_gpu"] += elapsed(self.events[1], self.events[2]) / 1e3
        timings["wait"] += time.perf_counter() - t0
        lps = self.logprobs or [None] * len(self.seqs)
        return StepOutput(sampled={s.seq_id: t for s, t in zip(self.seqs, self.tokens)},
                          logprobs={s.seq_id: lp for s, lp in zip(self.seqs, lps) if lp is not None})
