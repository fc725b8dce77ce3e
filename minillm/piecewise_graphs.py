"""Piecewise CUDA graphs for prefill and mixed steps: everything but attention, captured.

A step that mixes decodes with a prefill chunk cannot replay a decode graph, and launched kernel by
kernel from Python its host time (hundreds of launches for a 28-layer model) exceeds the GPU time
of a few thousand tokens. Attention is the one op whose launch depends on the batch's layout (its
grid follows the longest chunk and the number of sequences), so it runs eagerly, and the work
between two attention calls (output projection, norms, MLP, the next layer's QKV projection, q/k
norm, rotary and KV append) replays as one captured graph: L + 1 graph launches and L attention
launches a step, for each padded token count (vLLM's piecewise CUDA graphs).

Per token count t the captured pieces read the static inputs ids, positions, slot_mapping [t]
(rows past the step's tokens: token 0 at position 0, no KV write), write each layer's q into one
static buffer, read attention's output from another, and leave the final hidden states in a third;
all three are shared by every t (one step runs at a time). Intermediates come from the decode
graphs' private pool.
"""
from __future__ import annotations

from types import ModuleType

import numpy as np

from minillm.attention import AttentionMetadata
from minillm.cuda_graphs import HostInputs, end_capture


def piecewise_token_sizes(max_num_tokens: int) -> list[int]:
    """Padded token counts: 16..128 doubling, steps of 64 to 512 and of 128 to 1024 (the mixed steps
    of serving, a few hundred decodes and a prompt chunk, where padding rows cost GEMM time), of 256
    to 4096, of 512 to 8192, of 1024 beyond, capped at (and always including) max_num_tokens."""
    sizes = [16, 32, 64] + list(range(128, 513, 64)) + list(range(640, 1025, 128))
    sizes += list(range(1280, 4097, 256)) + list(range(4608, 8193, 512))
    sizes += list(range(9216, max_num_tokens + 1024, 1024))
    return sorted({min(s, max_num_tokens) for s in sizes})


class _Split:
    """The capture hooks DecoderModel.forward calls where attention would run."""

    def __init__(self, stream, q, o, hidden):
        self.stream, self.q, self.o, self.hidden = stream, q, o, hidden
        self.pieces: list = []

    def attention(self, layer: int):
        """End the piece before layer's attention, start the next; attention's output buffer."""
        self.pieces.append(end_capture(self.stream))
        self.stream.begin_capture()
        return self.o


class PiecewiseGraphs:
    """Captured pieces of the forward pass for each padded token count."""

    def __init__(self, model, ops: ModuleType, kv_pool, max_num_tokens: int, stream, pool):
        import cupy as cp

        self.cp, self.model, self.ops, self.kv_pool, self.stream, self.pool = cp, model, ops, kv_pool, stream, pool
        self.sizes = piecewise_token_sizes(max_num_tokens)
        t = self.max_tokens = self.sizes[-1]
        c = model.config
        # packed: [ids (t) | positions (t) | slot_mapping (t)]
        host = np.zeros(3 * t, np.int32)
        host[2 * t:] = -1
        self.inputs = HostInputs(cp, host)
        with stream:
            self.device = cp.asarray(host)
            self.ids, self.positions, self.slot_mapping = self.device[:t], self.device[t:2 * t], self.device[2 * t:]
            dtype = model.embed.dtype
            self.q = cp.empty((t, c.num_heads, c.head_dim), dtype)          # [t, Hq, Dh] each layer's q
            self.o = cp.empty((t, c.num_heads, c.head_dim), dtype)          # [t, Hq, Dh] attention's output
            self.hidden = cp.empty((t, c.hidden_size), dtype)               # [t, D] the final hidden states
        self.chains: dict[int, list] = {}                                   # t -> L + 1 graphs
        self.num_runs = 0                # steps replayed (the tests read it)
        self._capture_all()

    def static_bytes(self) -> int:
        """Device bytes of the shared static buffers."""
        return int(self.device.nbytes + self.q.nbytes + self.o.nbytes + self.hidden.nbytes)

    def _warmup_meta(self, t: int) -> AttentionMetadata:
        """t one-token sequences at position 0 reading block 0 (nothing is written: slots are -1)."""
        cp = self.cp
        return AttentionMetadata(cp.arange(t + 1, dtype=cp.int32), cp.ones(t, cp.int32),
                                 cp.zeros((t, 1), cp.int32), self.slot_mapping[:t], 1, 1, False)

    def _capture_all(self) -> None:
        cp, model = self.cp, self.model
        with cp.cuda.using_allocator(self.pool.malloc), self.stream:
            for t in reversed(self.sizes):          # largest first: smaller ones reuse its memory
                meta = self._warmup_meta(t)
                model.forward(self.ids[:t], self.positions[:t], meta, self.kv_pool)   # compiles, sizes
                self.stream.synchronize()
                split = _Split(self.stream, self.q[:t], self.o[:t], self.hidden[:t])
                self.stream.begin_capture()
                model.forward(self.ids[:t], self.positions[:t], meta, self.kv_pool, split=split)
                split.pieces.append(end_capture(self.stream))
                self.chains[t] = split.pieces
        self.stream.synchronize()

    def release(self) -> None:
        """Drop the graphs (the pool is the decode graphs', which free it)."""
        self.chains.clear()

    def can_run(self, num_tokens: int) -> bool:
        """True when a captured chain holds this many tokens."""
        return num_tokens <= self.max_tokens

    def run(self, ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray, meta: AttentionMetadata,
            before_launch=None):
        """The step's hidden states [T, D] (a view valid until the next run): ids, positions,
        slot_mapping [T] on the host; meta: the step's attention metadata on the device.

        before_launch(ids_buffer) may fill device-side inputs once the host inputs are copied in.
        """
        n = len(ids)
        t = next(s for s in self.sizes if s >= n)
        m, h = self.max_tokens, self.inputs.host
        h[:n], h[n:t] = ids, 0
        h[m:m + n], h[m + n:m + t] = positions, 0
        h[2 * m:2 * m + n], h[2 * m + n:2 * m + t] = slot_mapping, -1
        self.inputs.upload(self.device, 3 * m, self.stream)
        if before_launch is not None:
            before_launch(self.ids)
        pieces, model, pool = self.chains[t], self.model, self.kv_pool
        # Every layer's attention has the same shapes: checked and packed once, run per layer at
        # the layer's cache and scale addresses (what DecoderModel.attention passes).
        plan = self.ops.attention_plan(self.q[:t], pool[0, 0], pool[0, 1], meta, model.scale, model.kv_scales[0],
                                       out=self.o[:t])
        k0, layer_bytes, v_offset = pool.data.ptr, pool.strides[0], pool.strides[1]
        s0, scale_bytes = model.kv_scales.data.ptr, model.kv_scales.strides[0]
        for layer, piece in enumerate(pieces[:-1]):
            piece.launch(self.stream)
            k = k0 + layer * layer_bytes
            plan.run_at(k, k + v_offset, s0 + layer * scale_bytes)
        pieces[-1].launch(self.stream)
        self.num_runs += 1
        return self.hidden[:n]
