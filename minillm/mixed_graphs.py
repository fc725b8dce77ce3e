"""Whole CUDA graphs for small mixed steps: decodes beside a few prompt chunks, attention included.

Piecewise graphs (minillm/piecewise_graphs.py) launch attention from the host between L + 1
captured pieces, because its grid follows the step's layout; for a step of a few hundred tokens
those launches take the host longer than the device takes to run the step. Here attention is
captured at a grid that holds any layout up to a size: per padded token count t, the decode
kernel over min(t, max_num_seqs) decode rows and the prefill kernel over MAX_CHUNKS chunks of up
to t tokens each, neither splitting its keys. Rows past the step's own are padding: a decode row
of context 0 returns at once, a chunk of no tokens has no query tile. A step replays one graph
after one upload of its inputs, as a decode step does.

A step fits when its tokens, decode rows and chunks fit a graph, and either its contexts are short
(UNSPLIT_CONTEXT) or the eager path would not split the keys of either kind: a short chunk over a
long context, or a few decodes over long contexts, need the splits, and go to the piecewise graphs.

Per t the graph reads, from one static int32 buffer uploaded as a prefix each step:
ids, positions, slot_mapping [t]; the chunks' query_start_loc [C + 1], seq_lens [C] and block
tables [C, max_blocks]; the decode rows' query_start_loc [D + 1], seq_lens [D] and block tables
[D, max_blocks] (C = MAX_CHUNKS, D = min(T, max_num_seqs), T the largest t). q, attention's output
and the final hidden states are the piecewise graphs' static buffers' kind, owned here.
"""
from __future__ import annotations

from types import ModuleType

import numpy as np

from minillm.attention import AttentionMetadata
from minillm.cuda_graphs import HostInputs, end_capture
from minillm.piecewise_graphs import piecewise_token_sizes

MAX_TOKENS = 1024              # the largest step captured whole (steps past it run the pieces)
MAX_CHUNKS = 4                 # prompt chunks a captured step holds beside its decode rows
# Up to this context a step runs whole even where the eager path would split keys (a few decodes,
# or a small chunk's grid): unsplit, a block streams at most 16 K/V tiles, a few microseconds a
# layer, against the host's ~1 ms of piecewise launches. Past it only a step the eager path runs
# unsplit runs whole.
UNSPLIT_CONTEXT = 1024


class _Whole:
    """The hooks DecoderModel.forward calls where attention runs: the step's fixed-grid launches."""

    def __init__(self, q, o, hidden, meta: AttentionMetadata, plans, kv_pool, kv_scales):
        self.q, self.o, self.hidden, self.meta, self.plans = q, o, hidden, meta, plans
        self.kv_pool, self.kv_scales = kv_pool, kv_scales

    def attention(self, layer: int):
        """Queue layer's attention (decode rows, then chunks) into o; return o."""
        pool, scales = self.kv_pool, self.kv_scales
        k = pool[layer, 0].data.ptr
        v = pool[layer, 1].data.ptr
        s = scales[layer].data.ptr
        for plan in self.plans:
            plan.run_at(k, v, s)
        return self.o


class MixedGraphs:
    """Captured forward passes (attention included) of mixed steps, per padded token count."""

    def __init__(self, model, ops: ModuleType, kv_pool, max_num_tokens: int, max_num_seqs: int,
                 max_model_len: int, block_size: int, stream, pool):
        import cupy as cp

        self.cp, self.model, self.ops, self.kv_pool, self.stream, self.pool = cp, model, ops, kv_pool, stream, pool
        self.sizes = [s for s in piecewise_token_sizes(max_num_tokens) if s <= MAX_TOKENS]
        t = self.max_tokens = self.sizes[-1]
        self.max_decodes = min(t, max_num_seqs)
        self.max_blocks = -(-max_model_len // block_size)
        c, d, mb = MAX_CHUNKS, self.max_decodes, self.max_blocks
        # packed: [ids t | positions t | slot_mapping t | chunk qsl c+1 | chunk seq_lens c
        #          | decode qsl d+1 | decode seq_lens d | chunk tables c*mb | decode tables d*mb]
        self._offsets = np.cumsum([0, t, t, t, c + 1, c, d + 1, d, c * mb, d * mb])
        o = self._offsets
        host = np.zeros(int(o[-1]), np.int32)
        host[o[2]:o[3]] = -1
        self.inputs = HostInputs(cp, host)
        mc = model.config
        with stream:
            self.device = cp.asarray(host)
            dev = self.device
            self.ids, self.positions, self.slot_mapping = dev[o[0]:o[1]], dev[o[1]:o[2]], dev[o[2]:o[3]]
            self.chunk_qsl, self.chunk_seq_lens = dev[o[3]:o[4]], dev[o[4]:o[5]]
            self.decode_qsl, self.decode_seq_lens = dev[o[5]:o[6]], dev[o[6]:o[7]]
            self.chunk_tables = dev[o[7]:o[8]].reshape(c, mb)
            self.decode_tables = dev[o[8]:o[9]].reshape(d, mb)
            dtype = model.embed.dtype
            self.q = cp.empty((t, mc.num_heads, mc.head_dim), dtype)        # [t, Hq, Dh] each layer's q
            self.o = cp.empty((t, mc.num_heads, mc.head_dim), dtype)        # [t, Hq, Dh] attention's output
            self.hidden = cp.empty((t, mc.hidden_size), dtype)              # [t, D] the final hidden states
        self._k_cache = kv_pool[0, 0]     # a layer's cache, for the shape checks of can_run
        self.graphs: dict[int, tuple[object, _Whole]] = {}
        self.num_runs = 0                # steps replayed (the tests read it)
        self._capture_all()

    def _decodes(self, t: int) -> int:
        """Decode rows the graph of t tokens holds (a mixed step has a chunk token besides)."""
        return min(t, self.max_decodes)

    def _hooks(self, t: int) -> _Whole:
        """The fixed-grid attention launches of the graph of t tokens, for any layer."""
        ops, model, pool, d = self.ops, self.model, self.kv_pool, self._decodes(t)
        max_len = self.max_blocks * pool.shape[3]
        decode = AttentionMetadata(self.decode_qsl[:d + 1], self.decode_seq_lens[:d], self.decode_tables[:d],
                                   self.slot_mapping[:d], 1, max_len, True)
        chunks = AttentionMetadata(self.chunk_qsl, self.chunk_seq_lens, self.chunk_tables, self.slot_mapping[:t],
                                   t, max_len, False, prefill_kv_splits=1)
        k, v, s = pool[0, 0], pool[0, 1], model.kv_scales[0]
        plans = [ops.attention_plan(self.q[:d], k, v, decode, model.scale, s, out=self.o[:d], num_splits=1),
                 ops.attention_plan(self.q[:t], k, v, chunks, model.scale, s, out=self.o[:t])]
        return _Whole(self.q[:t], self.o[:t], self.hidden[:t], chunks, plans, pool, model.kv_scales)

    def _capture_all(self) -> None:
        cp, model = self.cp, self.model
        with cp.cuda.using_allocator(self.pool.malloc), self.stream:
            for t in reversed(self.sizes):          # largest first: smaller ones reuse its memory
                hooks = self._hooks(t)
                # Every row padding (no decode context, no chunk tokens, no KV write): a warm-up.
                model.forward(self.ids[:t], self.positions[:t], hooks.meta, self.kv_pool, split=hooks)
                self.stream.synchronize()
                self.stream.begin_capture()
                model.forward(self.ids[:t], self.positions[:t], hooks.meta, self.kv_pool, split=hooks)
                self.graphs[t] = (end_capture(self.stream), hooks)
        self.stream.synchronize()

    def release(self) -> None:
        """Drop the graphs (the pool is the decode graphs', which free it)."""
        self.graphs.clear()

    def can_run(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """True when a captured graph holds this mixed step (host metadata) as the eager path
        would run it: no key splits."""
        if num_tokens > self.max_tokens or meta.is_decode_only:
            return False
        nd, batch = int(meta.num_decode_seqs), len(meta.seq_lens)
        t = next(s for s in self.sizes if s >= num_tokens)
        if nd > self._decodes(t) or batch - nd > MAX_CHUNKS or np.shape(meta.block_tables)[1] > self.max_blocks:
            return False
        if int(np.max(meta.seq_lens)) <= UNSPLIT_CONTEXT:
            return True
        hooks = self.graphs[t][1]
        return not self.ops.mixed_step_splits_keys(hooks.q, self._k_cache, hooks.o, meta)

    def run(self, ids: np.ndarray, positions: np.ndarray, meta: AttentionMetadata, before_launch=None):
        """The step's hidden states [T, D] (a view valid until the next run): ids, positions [T]
        and meta on the host, a step can_run() accepted.

        before_launch(ids_buffer) may fill device-side inputs once the host inputs are copied in.
        """
        n, nd, batch = len(ids), int(meta.num_decode_seqs), len(meta.seq_lens)
        t = next(s for s in self.sizes if s >= n)
        o, h, m, mb = self._offsets, self.inputs.host, self.max_tokens, self.max_blocks
        h[:n], h[n:t] = ids, 0
        h[m:m + n], h[m + n:m + t] = positions, 0
        h[2 * m:2 * m + n], h[2 * m + n:2 * m + t] = meta.slot_mapping, -1
        qsl, lens, tables = meta.query_start_loc, meta.seq_lens, np.asarray(meta.block_tables)
        nc, width = batch - nd, tables.shape[1]
        h[o[3]:o[3] + nc + 1], h[o[3] + nc + 1:o[4]] = qsl[nd:], n          # chunks; padding: no tokens
        h[o[4]:o[4] + nc], h[o[4] + nc:o[5]] = lens[nd:], 0
        h[o[5]:o[5] + nd + 1], h[o[5] + nd + 1:o[6]] = qsl[:nd + 1], nd      # decode rows; padding: no context
        h[o[6]:o[6] + nd], h[o[6] + nd:o[7]] = lens[:nd], 0
        h[o[7]:o[8]].reshape(MAX_CHUNKS, mb)[:nc, :width] = tables[nd:]
        h[o[8]:o[9]].reshape(self.max_decodes, mb)[:nd, :width] = tables[:nd]
        self.inputs.upload(self.device, int(o[8]) + nd * mb, self.stream)   # the rows the graph reads
        if before_launch is not None:
            before_launch(self.ids)
        graph, _ = self.graphs[t]
        graph.launch(self.stream)
        self.num_runs += 1
        return self.hidden[:n]
