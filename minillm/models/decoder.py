"""One decoder for the Llama, Qwen2 and Qwen3 families, written over the ops interface.

Per layer: RMSNorm (fused with the residual add) -> fused QKV projection (+bias for Qwen2)
-> per-head q/k RMSNorm (Qwen3), rotary and KV append by slot mapping (one op) -> paged attention
-> output projection -> RMSNorm -> fused gate/up projection -> SiLU-and-mul -> down projection.
An FP8 KV pool (uint8) is written and read with the model's per-layer kv_scales.

Tensor parallelism (minillm/parallel/): given a communicator, the weights and the config are one
rank's shard (its heads, its MLP columns, its vocabulary rows), and the decoder adds the
collectives: an all-reduce after the embedding, the output projection and the down projection,
and an all-gather of the logits. Without one (a single rank) nothing of this runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np

from minillm.attention import AttentionMetadata
from minillm.config import ModelConfig
from minillm.models.rope import cos_sin_table


@dataclass
class LayerWeights:
    """One layer's device arrays (linear weights in the backend's layout)."""

    input_norm: object      # [D]
    qkv: object             # [(Hq + 2 Hk) Dh, D]
    qkv_bias: object | None  # [(Hq + 2 Hk) Dh]
    q_norm: object | None   # [Dh]
    k_norm: object | None   # [Dh]
    o: object               # [D, Hq Dh]
    post_norm: object       # [D]
    gate_up: object         # [2 I, D]
    down: object            # [D, I]


class DecoderModel:
    """Weights on the backend and the forward pass; no scheduling state."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], ops: ModuleType, dtype,
                 max_positions: int | None = None, comm=None):
        self.config, self.ops, self.dtype = config, ops, dtype
        self.comm = comm                                             # Communicator, or None on one rank
        lin = lambda w: ops.prepare_linear_weight(w, dtype)          # noqa: E731
        vec = lambda w: ops.asarray(w, dtype)                        # noqa: E731
        self.embed = vec(weights["model.embed_tokens.weight"])       # [V, D]
        # A tied checkpoint's own lm_head.weight, when it differs from the embedding, is the head
        # (transformers 5 leaves such a pair untied); the loader drops one equal to it.
        head = weights.get("lm_head.weight")
        if head is None:
            head = weights["model.embed_tokens.weight"]
        self.lm_head = lin(head)                                     # [V, D] ([V / N, D] on a rank)
        # A rank's vocabulary rows start here; its embedding holds ceil(V / N) of them.
        self.vocab_start = comm.rank * self.embed.shape[0] if comm is not None else 0
        self.final_norm = vec(weights["model.norm.weight"])
        self.layers = [self._layer(weights, i, lin, vec) for i in range(config.num_layers)]
        self.cos_sin = None                                          # [max_positions, Dh]: build_rotary()
        # [L, 2] float32: each layer's (k_scale, v_scale) of an FP8 KV pool, read by the kernels from
        # device memory so a calibration after the decode graphs were captured reaches them.
        self.kv_scales = ops.asarray(np.ones((config.num_layers, 2), np.float32))
        self.scale = config.head_dim ** -0.5
        if max_positions is not None:
            self.build_rotary(max_positions)

    def build_rotary(self, max_positions: int) -> None:
        """The rotary cos/sin table for positions [0, max_positions)."""
        c = self.config
        self.cos_sin = self.ops.asarray(cos_sin_table(c.head_dim, max_positions, c.rope_theta, c.rope_scaling),
                                        np.float32)

    def _layer(self, w: dict, i: int, lin, vec) -> LayerWeights:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qkv = np.concatenate([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]])
        bias = None
        if self.config.attention_bias:
            bias = vec(np.concatenate([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]]))
        gate_up = np.concatenate([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
        return LayerWeights(
            input_norm=vec(w[p + "input_layernorm.weight"]), qkv=lin(qkv), qkv_bias=bias,
            q_norm=vec(w[a + "q_norm.weight"]) if self.config.qk_norm else None,
            k_norm=vec(w[a + "k_norm.weight"]) if self.config.qk_norm else None,
            o=lin(w[a + "o_proj.weight"]), post_norm=vec(w[p + "post_attention_layernorm.weight"]),
            gate_up=lin(gate_up), down=lin(w[p + "mlp.down_proj.weight"]))

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_pool, calculate_kv_scales: bool = False,
                split=None):
        """input_ids, positions: [T]; kv_pool: [L, 2, num_blocks, block_size, Hk, Dh] -> hidden [T, D].

        calculate_kv_scales: set each layer's kv_scales from this pass's keys and values before
        they are appended (vLLM's calculate_kv_scales; the runner asks once, on the first prefill).
        split: a piecewise capture (minillm/piecewise_graphs.py) that leaves attention out: q goes
        to split.q, split.attention(layer) ends one captured piece and gives the buffer attention
        will write, and the final norm writes split.hidden."""
        ops, c = self.ops, self.config
        eps = c.rms_norm_eps
        num_tokens = input_ids.shape[0]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        if self.comm is None:                                        # the lookup and layer 0's norm: one launch
            x, residual = ops.embedding_rms_norm(input_ids, self.embed, self.layers[0].input_norm, eps)
        else:
            residual = self._parallel_embedding(input_ids)
            x = ops.rms_norm(residual, self.layers[0].input_norm, eps)
        for i, lw in enumerate(self.layers):
            if i:
                x, residual = ops.add_rms_norm(h, residual, lw.input_norm, eps)
            qkv = ops.linear(x, lw.qkv, lw.qkv_bias)                  # [T, (Hq + 2 Hk) Dh]
            q = qkv[:, :q_size].reshape(num_tokens, c.num_heads, c.head_dim)
            k = qkv[:, q_size:q_size + kv_size].reshape(num_tokens, c.num_kv_heads, c.head_dim)
            v = qkv[:, q_size + kv_size:].reshape(num_tokens, c.num_kv_heads, c.head_dim)
            k_cache, v_cache = kv_pool[i, 0], kv_pool[i, 1]          # [num_blocks, bs, Hk, Dh]
            scales = self.kv_scales[i]                               # [2]: k_scale, v_scale
            if split is None and meta.is_decode_only and not calculate_kv_scales:
                # q/k norm per head, rotary, append and attention: one launch on the GPU
                o = ops.decode_attention_append(q, k, v, lw.q_norm, lw.k_norm, eps, positions, self.cos_sin,
                                                k_cache, v_cache, meta.slot_mapping, meta, self.scale, scales)
            else:
                if calculate_kv_scales:
                    q = self._calibrate_and_append(q, k, v, lw, positions, k_cache, v_cache, meta, scales)
                else:                                                # q/k norm per head, rotary, append
                    into = {} if split is None else {"out": split.q}   # the CPU ops take no out=
                    q = ops.qk_norm_rotary_kv_append(q, k, v, lw.q_norm, lw.k_norm, eps, positions, self.cos_sin,
                                                     k_cache, v_cache, meta.slot_mapping, scales, **into)
                o = self.attention(i, q, meta, kv_pool) if split is None else split.attention(i)   # [T, Hq, Dh]
            h = ops.linear(o.reshape(num_tokens, q_size), lw.o)       # [T, D]
            if self.comm is not None:                                # each rank summed over its heads only
                h = self.comm.all_reduce(h)
            x, residual = ops.add_rms_norm(h, residual, lw.post_norm, eps)
            h = ops.linear(ops.silu_and_mul(ops.linear(x, lw.gate_up)), lw.down)
            if self.comm is not None:                                # each rank summed over its MLP columns
                h = self.comm.all_reduce(h)
        into = {} if split is None else {"out": (split.hidden, None)}
        out, _ = ops.add_rms_norm(h, residual, self.final_norm, eps, **into)
        return out

    def attention(self, layer: int, q, meta: AttentionMetadata, kv_pool):
        """Layer `layer`'s paged attention of q [T, Hq, Dh] over its KV cache -> [T, Hq, Dh]."""
        return self.ops.paged_attention(q, kv_pool[layer, 0], kv_pool[layer, 1], meta, self.scale,
                                        self.kv_scales[layer])

    def _all_kv_heads(self, x):
        """This rank's x [T, Hk / N, Dh] -> [T, Hk, Dh], every rank's KV heads (tensor parallelism;
        [T, N, Dh] when N > Hk ranks replicate them: the same maxima)."""
        return self.comm.all_gather(x.reshape(len(x), -1)).reshape(len(x), -1, x.shape[-1])

    def _calibrate_and_append(self, q, k, v, lw: LayerWeights, positions, k_cache, v_cache,
                              meta: AttentionMetadata, scales):
        """The unfused q/k norm and rotary, the layer's scales from the rotated k and v, then the append."""
        ops, eps = self.ops, self.config.rms_norm_eps
        if lw.q_norm is not None:
            q, k = ops.rms_norm(q, lw.q_norm, eps), ops.rms_norm(k, lw.k_norm, eps)
        q, k = ops.rotary(q, k, positions, self.cos_sin)
        if self.comm is None:
            ops.calculate_kv_scales(k, v, scales)
        else:                        # one scale a layer over every rank's KV heads, as on one device
            ops.calculate_kv_scales(self._all_kv_heads(k), self._all_kv_heads(v), scales)
        ops.kv_append(k, v, k_cache, v_cache, meta.slot_mapping, scales)
        return q

    def _parallel_embedding(self, input_ids):
        """input_ids: [T] -> [T, D]: each rank looks up the ids in its vocabulary rows, zeros elsewhere."""
        xp = self.ops.xp
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.embed.shape[0])          # [T] bool
        h = self.ops.embedding(xp.where(mine, local, 0).astype(np.int32), self.embed)
        return self.comm.all_reduce(h * mine[:, None].astype(h.dtype))

    def compute_logits(self, hidden, out=None):
        """hidden: [B, D] -> logits [B, V] in float32 (the head's product written into out
        [B, lm_head rows] when given)."""
        logits = self.ops.linear(hidden, self.lm_head, out=out, out_dtype=np.float32)   # [B, V] ([B, V / N] on a rank)
        if self.comm is None:
            return logits
        logits = self.comm.all_gather(logits)                        # [B, N ceil(V / N)]
        vocab = self.config.vocab_size
        return logits if logits.shape[1] == vocab else self.ops.xp.ascontiguousarray(logits[:, :vocab])
