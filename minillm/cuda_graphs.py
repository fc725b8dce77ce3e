"""CUDA graphs for decode and verification steps: one captured forward pass per padded batch size.

A decode step of a small model is tens of kernels a layer; launched one by one from Python the
host time exceeds the GPU time. Each graph is captured once over static input buffers and
replayed with one copy of the packed host inputs. Intermediates come from a private memory pool
that outlives the graphs, so replays never write over memory someone else was given.

DecodeGraphs run one token per sequence (the decode kernel). VerifyGraphs run up to query_len
tokens per sequence through the prefill attention path: a speculative step verifies
[last token] + k drafts per sequence, and its launches would otherwise cost more host time than
the drafts save. Both kinds share one memory pool (only one graph runs at a time, on one stream).
"""
from __future__ import annotations

from types import ModuleType

import numpy as np

from minillm.attention import AttentionMetadata


class HostInputs:
    """A graph's packed int32 inputs in two page-locked host copies, filled and copied up in turn.

    A copy from pageable memory is first copied by the host into the driver's staging memory (and
    CUDA allows it to wait for the stream there). From page-locked memory the copy is only queued;
    the host fills the other copy meanwhile, after the upload that last read it is done."""

    def __init__(self, cp, initial: np.ndarray):
        import cupyx

        self._copies = [cupyx.empty_pinned(initial.shape, np.int32) for _ in range(2)]
        for copy in self._copies:
            copy[...] = initial
        self._events = [cp.cuda.Event(block=False, disable_timing=True) for _ in range(2)]
        self._next = 0

    @property
    def host(self) -> np.ndarray:
        """The copy the next upload sends (once the upload that last read it is done)."""
        event = self._events[self._next]
        if not event.done:
            event.synchronize()
        return self._copies[self._next]

    def upload(self, device, num_words: int, stream) -> None:
        """Queue device[:num_words] = host[:num_words] on stream; the next fill takes the other copy."""
        i = self._next
        device[:num_words].set(self._copies[i][:num_words], stream=stream)
        self._events[i].record(stream)
        self._next = 1 - i


def end_capture(stream):
    """End the stream's capture and upload the executable graph at once.

    A graph not uploaded is uploaded by its first launch: in serving, that cost would land on
    the first step at each new batch size."""
    graph = stream.end_capture()
    graph.upload(stream)
    return graph


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, capped at max_num_seqs."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, max_num_seqs + 16, 16))
    capped = sorted({min(s, max_num_seqs) for s in sizes})
    return capped


# A verification graph holds logits [batch x query_len, V] fp32: its batch is capped so that
# batch x query_len stays within this many tokens (speculation pays at small batches only).
VERIFY_GRAPH_MAX_TOKENS = 512


def verify_graph_batch_sizes(max_num_seqs: int, query_len: int) -> list[int]:
    """graph_batch_sizes with batch x query_len <= VERIFY_GRAPH_MAX_TOKENS (batch 1 always)."""
    return [s for s in graph_batch_sizes(max_num_seqs) if s == 1 or s * query_len <= VERIFY_GRAPH_MAX_TOKENS]


class _CapturedForwards:
    """Forward passes captured once per size over static buffers, from one private memory pool."""

    sizes: list[int]

    def _capture_all(self) -> None:
        cp = self.cp
        with cp.cuda.using_allocator(self.pool.malloc), self.stream:
            for b in reversed(self.sizes):          # largest first: smaller ones reuse its memory
                self._forward(b)                     # warm-up: compiles kernels, sizes workspaces
                self.stream.synchronize()
                self.stream.begin_capture()
                logits = self._forward(b)
                graph = end_capture(self.stream)
                self.graphs[b] = (graph, logits)
        self.stream.synchronize()

    def _forward(self, b: int):
        raise NotImplementedError

    def release(self) -> None:
        """Drop the graphs and return their private pool's memory (the device must be idle)."""
        self.graphs.clear()
        self.pool.free_all_blocks()


def longest_first(seq_lens: np.ndarray) -> np.ndarray:
    """Row indices [B] int32 by decreasing context (ties in row order)."""
    return np.argsort(-np.asarray(seq_lens, np.int64), kind="stable").astype(np.int32)


class DecodeGraphs(_CapturedForwards):
    """Captured decode forward passes (ids -> logits) for each padded batch size."""

    def __init__(self, model, ops: ModuleType, kv_pool, max_num_seqs: int, max_model_len: int,
                 block_size: int, stream):
        import cupy as cp

        self.cp, self.model, self.ops, self.kv_pool, self.stream = cp, model, ops, kv_pool, stream
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        g = self.sizes[-1]
        self.capacity = g
        # packed: [ids (g) | positions (g) | slot_mapping (g) | attention's rows: seq_lens (g)
        #          | query_start_loc (g + 1), padded to 16 bytes | block_tables (g * max_blocks)]. ids,
        # positions and slot_mapping are in the batch's order; attention's rows longest context first
        # (see run), each naming its token row in query_start_loc.
        self._tables_at = -(-(5 * g + 1) // 4) * 4
        host = self._initial_host()
        self.inputs = HostInputs(cp, host)
        with stream:                     # on the stream the graphs run on: ordered before the capture
            self.device = cp.asarray(host)
            d = self.device
            self.ids, self.positions, self.slot_mapping = d[0:g], d[g:2 * g], d[2 * g:3 * g]
            self.seq_lens, self.query_start_loc = d[3 * g:4 * g], d[4 * g:5 * g + 1]
            self.block_tables = d[self._tables_at:].reshape(g, self.max_blocks)
        self.pool = cp.cuda.MemoryPool()
        self.graphs: dict[int, tuple[object, object]] = {}
        self._capture_all()

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(self.query_start_loc[:b + 1], self.seq_lens[:b], self.block_tables[:b],
                                 self.slot_mapping[:b], 1, self.max_model_len, True)

    def _forward(self, b: int):
        hidden = self.model.forward(self.ids[:b], self.positions[:b], self._meta(b), self.kv_pool)
        return self.model.compute_logits(hidden)

    def _initial_host(self) -> np.ndarray:
        """Every row past the real batch: token 0 at position 0, no KV write, one key of block 0."""
        g = self.capacity
        host = np.zeros(self._tables_at + g * self.max_blocks, np.int32)
        host[2 * g:3 * g] = -1
        host[3 * g:4 * g] = 1
        host[4 * g:5 * g + 1] = np.arange(g + 1)
        return host

    def can_run(self, batch_size: int) -> bool:
        """True when a captured graph covers this decode batch."""
        return batch_size <= self.capacity

    def run(self, ids: np.ndarray, meta: AttentionMetadata, before_launch=None):
        """Replay the smallest graph that fits; returns logits [B, V] (a view valid until the next run).

        before_launch(ids_buffer) may fill device-side inputs once the host inputs are copied in.
        """
        b = len(ids)
        size = next(s for s in self.sizes if s >= b)
        g, h = self.capacity, self.inputs.host
        seq_lens = np.asarray(meta.seq_lens)
        h[0:b], h[g:g + b], h[2 * g:2 * g + b] = ids, seq_lens - 1, meta.slot_mapping
        h[b:g], h[g + b:2 * g], h[2 * g + b:3 * g] = 0, 0, -1
        # Attention's blocks start in row order: the longest contexts first, so that the last wave
        # holds short blocks, not a long one that leaves the other multiprocessors idle.
        order = longest_first(seq_lens)
        h[3 * g:3 * g + b], h[3 * g + b:4 * g] = seq_lens[order], 1
        h[4 * g:4 * g + b], h[4 * g + b:5 * g + 1] = order, np.arange(b, g + 1)
        tables = h[self._tables_at:].reshape(g, self.max_blocks)
        width = meta.block_tables.shape[1]
        tables[:b, :width] = np.asarray(meta.block_tables)[order]
        tables[:b, width:] = 0
        self.inputs.upload(self.device, self._tables_at + size * self.max_blocks, self.stream)   # the rows it reads
        if before_launch is not None:
            before_launch(self.ids)
        graph, logits = self.graphs[size]
        graph.launch(self.stream)
        return logits[:b]


class VerifyGraphs(_CapturedForwards):
    """Captured forward passes of ragged steps with at most query_len tokens per sequence.

    Made for speculative decoding (query_len = 1 + num_speculative_tokens), they run any step
    that fits: the sequences' chunks packed from row 0 as the eager path packs them, rows past the
    step's tokens padded (no KV write), sequences past its batch given no tokens. Logits come back
    for every token row; the caller picks the rows it samples.
    """

    def __init__(self, model, ops: ModuleType, kv_pool, max_num_seqs: int, max_model_len: int,
                 block_size: int, stream, query_len: int, pool=None):
        import cupy as cp

        self.cp, self.model, self.ops, self.kv_pool, self.stream = cp, model, ops, kv_pool, stream
        self.query_len = query_len
        self.sizes = verify_graph_batch_sizes(max_num_seqs, query_len)
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        g = self.capacity = self.sizes[-1]
        t = self.max_tokens = g * query_len
        # packed: [ids (t) | positions (t) | slot_mapping (t) | seq_lens (g) | query_start_loc (g + 1)
        #          | block_tables (g * max_blocks)]
        self._offsets = np.cumsum([0, t, t, t, g, g + 1])            # start of each region
        host = self._initial_host()
        self.inputs = HostInputs(cp, host)
        o = self._offsets
        with stream:
            self.device = cp.asarray(host)
            d = self.device
            self.ids, self.positions, self.slot_mapping = d[o[0]:o[1]], d[o[1]:o[2]], d[o[2]:o[3]]
            self.seq_lens, self.query_start_loc = d[o[3]:o[4]], d[o[4]:o[5]]
            self.block_tables = d[o[5]:].reshape(g, self.max_blocks)
        self.pool = pool if pool is not None else cp.cuda.MemoryPool()
        self.graphs: dict[int, tuple[object, object]] = {}
        self.num_runs = 0                # replays so far (the stats and tests read it)
        self._capture_all()

    def _initial_host(self) -> np.ndarray:
        """Capture inputs: every sequence query_len tokens at positions 0.., no KV write, block 0."""
        o, q = self._offsets, self.query_len
        h = np.zeros(int(o[-1]) + self.capacity * self.max_blocks, np.int32)
        h[o[1]:o[2]] = np.tile(np.arange(q, dtype=np.int32), self.capacity)
        h[o[2]:o[3]] = -1
        h[o[3]:o[4]] = q
        h[o[4]:o[5]] = np.arange(0, (self.capacity + 1) * q, q, dtype=np.int32)
        return h

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(self.query_start_loc[:b + 1], self.seq_lens[:b], self.block_tables[:b],
                                 self.slot_mapping[:b * self.query_len], self.query_len, self.max_model_len,
                                 False, prefill_kv_splits=1)

    def _forward(self, b: int):
        t = b * self.query_len
        hidden = self.model.forward(self.ids[:t], self.positions[:t], self._meta(b), self.kv_pool)
        return self.model.compute_logits(hidden)                     # [b * query_len, V]

    def can_run(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """True when a captured graph covers this step (host metadata)."""
        return (len(meta.seq_lens) <= self.capacity and meta.max_query_len <= self.query_len
                and num_tokens <= self.max_tokens)

    def run(self, ids: np.ndarray, positions: np.ndarray, meta: AttentionMetadata, before_launch=None):
        """Replay the smallest graph that holds the batch; returns logits [T, V] of the T token
        rows (a view valid until the next run). meta holds host arrays.

        before_launch(ids_buffer) may fill device-side inputs once the host inputs are copied in.
        """
        b, t = len(meta.seq_lens), len(ids)
        size = next(s for s in self.sizes if s >= b)
        o, h, g = self._offsets, self.inputs.host, self.capacity
        h[o[0]:o[0] + t], h[o[0] + t:o[1]] = ids, 0
        h[o[1]:o[1] + t], h[o[1] + t:o[2]] = positions, 0
        h[o[2]:o[2] + t], h[o[2] + t:o[3]] = meta.slot_mapping, -1
        h[o[3]:o[3] + b], h[o[3] + b:o[4]] = meta.seq_lens, 1
        h[o[4]:o[4] + b + 1], h[o[4] + b + 1:o[5]] = meta.query_start_loc, t
        tables = h[o[5]:].reshape(g, self.max_blocks)
        width = meta.block_tables.shape[1]
        tables[:b, :width] = meta.block_tables
        tables[:b, width:] = 0
        tables[b:size] = 0
        self.inputs.upload(self.device, int(o[5]) + size * self.max_blocks, self.stream)   # the rows it reads
        if before_launch is not None:
            before_launch(self.ids)
        graph, logits = self.graphs[size]
        graph.launch(self.stream)
        self.num_runs += 1
        return logits[:t]
