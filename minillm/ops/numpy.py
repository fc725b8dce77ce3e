"""NumPy backend: the reference for every CUDA kernel, and the CPU backend.

Every function here has a twin of the same name and signature in minillm/ops/cuda.py.
Activations are [T, ...] with T the number of tokens in the step; the KV cache of one layer is
k_cache / v_cache: [num_blocks, block_size, num_kv_heads, head_dim], in the activations' dtype or
uint8 holding FP8 E4M3 bits (minillm/fp8.py); an FP8 cache comes with kv_scales [2] float32
(k_scale, v_scale): appends quantise with them, attention dequantises.
"""
from __future__ import annotations

import numpy as np

from minillm.attention import AttentionMetadata
from minillm.fp8 import decode_e4m3, encode_e4m3, scales_from_absmax

xp = np
name = "numpy"


def asarray(a, dtype=None) -> np.ndarray:
    """Host array -> backend array (a copy-free view where possible)."""
    return np.ascontiguousarray(np.asarray(a, dtype=dtype))


def asarray_async(a) -> np.ndarray:
    """Host array -> backend array without waiting for queued work (nothing is queued on the CPU)."""
    return np.ascontiguousarray(a)


def to_numpy(a) -> np.ndarray:
    """Backend array -> host numpy array."""
    return np.asarray(a)


def synchronize() -> None:
    """Wait for queued device work (nothing to wait for on the CPU)."""


def prepare_linear_weight(w: np.ndarray, dtype) -> np.ndarray:
    """w: [N, K] (Hugging Face layout) -> the layout linear() takes: w itself where it already is
    and holds its whole buffer (a tied lm_head shares the embedding's memory), else a packed copy
    (a tensor-parallel rank's slice does not keep the whole checkpoint tensor alive)."""
    w = np.asarray(w)
    if w.dtype == np.dtype(dtype) and w.flags.c_contiguous and w.nbytes == _buffer_of(w).nbytes:
        return w
    return np.ascontiguousarray(w.astype(dtype))


def _buffer_of(a: np.ndarray) -> np.ndarray:
    """The array that owns a's memory (a itself when it is no view)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


FEW_ROWS = 128      # linear() computes up to this many rows as (w @ x.T).T


def linear(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None, out: np.ndarray | None = None,
           out_dtype=None) -> np.ndarray:
    """x: [T, K] @ w[N, K].T (+ bias[N]) -> [T, N] in x's dtype (or out_dtype), accumulated in fp32
    (written into out [T, N] when given)."""
    x32, w32 = x.astype(np.float32, copy=False), w.astype(np.float32, copy=False)
    if x.shape[0] <= FEW_ROWS:
        # The same sums as x @ w.T, which OpenBLAS runs 1.3-1.7x slower for 2-32 rows (a decode batch)
        y = np.ascontiguousarray(np.matmul(w32, x32.T).T)
    else:
        y = np.matmul(x32, w32.T)
    if bias is not None:
        y += bias.astype(np.float32, copy=False)
    y = y.astype(out_dtype or x.dtype, copy=False)
    if out is None:
        return y
    out[...] = y
    return out


def embedding(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """ids: [T] int32, table: [V, D] -> [T, D]."""
    return table[ids]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x: [T, D], weight: [D] -> [T, D]: x / rms(x) * weight, computed in fp32."""
    x32 = x.astype(np.float32, copy=False)
    inv = 1.0 / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight.astype(np.float32) * (x32 * inv).astype(x.dtype)).astype(x.dtype)


def embedding_rms_norm(ids: np.ndarray, table: np.ndarray, weight: np.ndarray, eps: float):
    """embedding then rms_norm: returns (rms_norm(h), h) with h = table[ids] [T, D] (one launch on the GPU)."""
    h = embedding(ids, table)
    return rms_norm(h, weight, eps), h


def add_rms_norm(x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float):
    """Fused residual add then RMSNorm: s = x + residual; returns (rms_norm(s), s), both [T, D]."""
    s = (x.astype(np.float32) + residual.astype(np.float32)).astype(x.dtype)
    return rms_norm(s, weight, eps), s


def rotary(q: np.ndarray, k: np.ndarray, positions: np.ndarray, cos_sin: np.ndarray):
    """Neox-style rotary on q: [T, Hq, Dh] and k: [T, Hk, Dh] at positions [T].

    cos_sin: [max_pos, Dh] float32, cos in the first Dh/2 columns, sin in the last Dh/2.
    Returns the rotated (q, k).
    """
    half = q.shape[-1] // 2
    cs = cos_sin[positions]                       # [T, Dh]
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]

    def rot(x):
        x32 = x.astype(np.float32)
        x1, x2 = x32[..., :half], x32[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)

    return rot(q), rot(k)


def is_fp8_cache(cache) -> bool:
    """True for a cache of FP8 E4M3 bits (uint8)."""
    return cache.dtype == np.uint8


def _fp8_scales(kv_scales) -> tuple[np.float32, np.float32]:
    if kv_scales is None:
        raise ValueError("an FP8 (uint8) KV cache needs kv_scales [2] float32 (k_scale, v_scale)")
    k_scale, v_scale = np.asarray(kv_scales, np.float32).reshape(2)
    return k_scale, v_scale


def kv_append(k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
              slot_mapping: np.ndarray, kv_scales: np.ndarray | None = None) -> None:
    """Write k, v: [T, Hk, Dh] into the caches at slot_mapping [T] (-1: skip), in place.

    An FP8 cache stores e4m3(k / k_scale) and e4m3(v / v_scale), saturated (minillm/fp8.py)."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    if is_fp8_cache(k_cache):
        k_scale, v_scale = _fp8_scales(kv_scales)
        k_cache[blocks, offsets] = encode_e4m3(k[keep], k_scale)
        v_cache[blocks, offsets] = encode_e4m3(v[keep], v_scale)
        return
    k_cache[blocks, offsets] = k[keep]
    v_cache[blocks, offsets] = v[keep]


def calculate_kv_scales(k: np.ndarray, v: np.ndarray, kv_scales: np.ndarray) -> None:
    """vLLM's calculate_kv_scales, in place: kv_scales [2] = (max|k|, max|v|) / 448 over k, v:
    [T, Hk, Dh] (NaN elements skipped; 1.0 where the maximum is 0 or infinite)."""
    absmax = [np.nanmax(np.abs(x.astype(np.float32)), initial=0.0) for x in (k, v)]
    kv_scales[...] = scales_from_absmax(absmax)


def qk_norm_rotary_kv_append(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_norm, k_norm, eps: float,
                             positions: np.ndarray, cos_sin: np.ndarray, k_cache: np.ndarray,
                             v_cache: np.ndarray, slot_mapping: np.ndarray,
                             kv_scales: np.ndarray | None = None) -> np.ndarray:
    """Per-head RMSNorm of q and k (when q_norm / k_norm [Dh] are given: Qwen3), rotary on both,
    and the KV append of the rotated k and v; returns the rotated q [T, Hq, Dh].

    The composition of rms_norm, rotary and kv_append, which the CUDA backend fuses into one launch."""
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = rotary(q, k, positions, cos_sin)
    kv_append(k, v, k_cache, v_cache, slot_mapping, kv_scales)
    return q


def decode_attention_append(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_norm, k_norm, eps: float,
                            positions: np.ndarray, cos_sin: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                            slot_mapping: np.ndarray, meta: AttentionMetadata, scale: float,
                            kv_scales: np.ndarray | None = None) -> np.ndarray:
    """A layer's attention in a decode-only step from the raw q [B, Hq, Dh], k, v [B, Hk, Dh]:
    qk_norm_rotary_kv_append, then paged_attention of the rotated q -> [B, Hq, Dh].

    The composition the CUDA backend runs as one launch (paged_decode_append)."""
    q = qk_norm_rotary_kv_append(q, k, v, q_norm, k_norm, eps, positions, cos_sin, k_cache, v_cache,
                                 slot_mapping, kv_scales)
    return paged_attention(q, k_cache, v_cache, meta, scale, kv_scales)


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    meta: AttentionMetadata, scale: float, kv_scales: np.ndarray | None = None) -> np.ndarray:
    """Causal attention of ragged query chunks over their paged history (which includes them).

    q: [T, Hq, Dh]; returns [T, Hq, Dh]. Query row i of sequence b sits at position
    seq_lens[b] - q_len_b + i and attends to positions 0..that position. GQA: query head h reads
    KV head h // (Hq // Hk). Sequences of equal query and context lengths are computed together
    (a batch of one engine step often holds many of them), as many at once as ATTENTION_KV_BYTES
    holds, each chunk in query tiles of at most ATTENTION_SCORE_BYTES of scores. An FP8 cache is
    read as float(bits) * k_scale (v_scale) from kv_scales.
    """
    fp8 = is_fp8_cache(k_cache)
    k_scale, v_scale = _fp8_scales(kv_scales) if fp8 else (None, None)
    num_kv_heads, head_dim = k_cache.shape[2:]
    out = np.empty_like(q)
    qsl = np.asarray(meta.query_start_loc)
    q_lens, ctxs = qsl[1:] - qsl[:-1], np.asarray(meta.seq_lens)
    shapes: dict[tuple[int, int], list[int]] = {}
    for b in range(len(ctxs)):
        if q_lens[b]:
            shapes.setdefault((int(q_lens[b]), int(ctxs[b])), []).append(b)
    for (q_len, ctx), rows in shapes.items():
        # K and V of one sequence in float32 (an FP8 cache's decoding holds two such copies a moment)
        per_seq = 2 * ctx * num_kv_heads * head_dim * 4 * (2 if fp8 else 1)
        step = max(1, ATTENTION_KV_BYTES // per_seq)
        for i in range(0, len(rows), step):
            keys, vals = _gather_kv(k_cache, v_cache, meta.block_tables, np.asarray(rows[i:i + step]), ctx,
                                    k_scale, v_scale)
            token_rows = qsl[rows[i:i + step]][:, None] + np.arange(q_len)              # [G, q_len]
            _chunk_attention(q, keys, vals, token_rows, scale, out)
    return out


# Scratch of paged_attention on the host. A chunk's scores in one piece take
# Hq * q_len * ctx * 4 bytes: gigabytes a layer for a long prompt's chunk over a long context.
ATTENTION_SCORE_BYTES = 32 << 20      # float32 scores of one query tile [G, Hk, tile * group, <= ctx]
ATTENTION_KV_BYTES = 64 << 20         # K and V gathered for the sequences computed together


def _gather_kv(k_cache, v_cache, block_tables, rows: np.ndarray, ctx: int, k_scale, v_scale):
    """K and V of the sequences `rows` read from their blocks: two [G, ctx, Hk, Dh] float32."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    g = len(rows)
    blocks = block_tables[rows, : (ctx + block_size - 1) // block_size]               # [G, nblk]
    keys = k_cache[blocks].reshape(g, -1, num_kv_heads, head_dim)[:, :ctx]             # [G, ctx, Hk, Dh]
    vals = v_cache[blocks].reshape(g, -1, num_kv_heads, head_dim)[:, :ctx]
    if k_scale is not None:
        return decode_e4m3(keys, k_scale), decode_e4m3(vals, v_scale)
    return keys.astype(np.float32, copy=False), vals.astype(np.float32, copy=False)


def _chunk_attention(q: np.ndarray, keys: np.ndarray, vals: np.ndarray, token_rows: np.ndarray, scale: float,
                     out: np.ndarray) -> None:
    """Causal attention of G chunks, rows token_rows [G, q_len] of q [T, Hq, Dh], over the last
    q_len of their ctx keys and values, keys / vals: [G, ctx, Hk, Dh] float32; into the same rows of out.

    Computed in query tiles: a tile's rows are exactly those of the chunk in one piece (softmax over
    the whole row in fp32); the keys past a tile's last position, masked for all its rows, are left out."""
    g, q_len = token_rows.shape
    num_heads, head_dim = q.shape[1:]
    ctx, num_kv_heads = keys.shape[1:3]
    group = num_heads // num_kv_heads
    keys_t = keys.transpose(0, 2, 3, 1)                                                # [G, Hk, Dh, ctx]
    vals_t = vals.transpose(0, 2, 1, 3)                                                # [G, Hk, ctx, Dh]
    tile = max(1, ATTENTION_SCORE_BYTES // (g * num_heads * ctx * 4))
    for t0 in range(0, q_len, tile):
        t1 = min(q_len, t0 + tile)
        rows = token_rows[:, t0:t1]
        # Query row (i, j) is query token i of KV head k's j-th query head: [G, Hk, tile * group, Dh].
        qb = q[rows].reshape(g, t1 - t0, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
        qb = qb.reshape(g, num_kv_heads, (t1 - t0) * group, head_dim).astype(np.float32, copy=False)
        num_keys = ctx - q_len + t1                          # positions 0..the tile's last one
        scores = qb @ keys_t[..., :num_keys]                                            # [G, Hk, tile*r, n]
        scores *= scale
        q_pos = np.repeat(ctx - q_len + np.arange(t0, t1), group)
        np.copyto(scores, -np.inf, where=np.arange(num_keys)[None, :] > q_pos[:, None])
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        o = scores @ vals_t[:, :, :num_keys]                                            # [G, Hk, tile*r, Dh]
        o = o.reshape(g, num_kv_heads, t1 - t0, group, head_dim).transpose(0, 2, 1, 3, 4)
        out[rows] = o.reshape(g, t1 - t0, num_heads, head_dim)


def silu_and_mul(x: np.ndarray) -> np.ndarray:
    """x: [T, 2I] = [gate | up] -> silu(gate) * up: [T, I]."""
    half = x.shape[-1] // 2
    g = x[:, :half].astype(np.float32)
    u = x[:, half:].astype(np.float32)
    return (g / (1.0 + np.exp(-g)) * u).astype(x.dtype)


def apply_penalties(logits: np.ndarray, rows: np.ndarray, token_ids: np.ndarray,
                    output_counts: np.ndarray, in_prompt: np.ndarray, repetition: np.ndarray,
                    presence: np.ndarray, frequency: np.ndarray) -> None:
    """Penalise seen tokens in place, as vLLM defines it.

    logits: [B, V] float32. One entry per distinct (row, token) seen: rows, token_ids,
    output_counts (times generated so far) and in_prompt (0/1), all [N]. repetition, presence,
    frequency: [B]. Repetition divides positive logits (multiplies negative ones) of every seen
    token; presence subtracts once and frequency per occurrence, for generated tokens only.
    """
    if len(rows) == 0:
        return
    vals = logits[rows, token_ids]
    rep = repetition[rows]
    seen = (output_counts > 0) | (in_prompt > 0)
    with np.errstate(over="ignore"):       # a penalty near 0 or 3.4e38 overflows to +-inf, as in float32 on the GPU
        vals = np.where(seen, np.where(vals > 0, vals / rep, vals * rep), vals)
    counts = output_counts.astype(np.float32)
    vals = vals - frequency[rows] * counts - presence[rows] * (counts > 0)
    logits[rows, token_ids] = vals


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """logits: [B, V] -> log-probabilities [B, V] in float32."""
    x = logits.astype(np.float32)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def sample(logits: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
           min_p: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Pick one token per row; returns ids [B] int32.

    logits: [B, V] float32; temperature, top_p, min_p, uniforms: [B] float32; top_k: [B] int32.
    temperature 0 is the argmax. Otherwise weights e = exp(logit / T - max / T); min_p keeps
    tokens with e >= min_p (p >= min_p * p_max). Without top-k and top-p the kept tokens are walked
    in id order (no sort needed, the fast path on the GPU); with either, tokens are ordered by
    descending logit (ties by id), the top_k first are kept (0: all) and then the smallest prefix
    whose mass reaches top_p of the mass top-k and min-p kept (vLLM renormalises before top-p).
    The pick is the first kept token, in that order, whose cumulative weight exceeds uniforms[b]
    times the kept weight.
    """
    batch, vocab = logits.shape
    out = np.empty(batch, dtype=np.int32)
    for b in range(batch):
        row = logits[b].astype(np.float32)
        top = row.max()
        if temperature[b] <= 0.0 or top == -np.inf or _is_infinite_over(top, temperature[b]):
            out[b] = int(np.argmax(row))      # greedy, every token masked (id 0), or an infinite weight
        elif not 0 < top_k[b] < vocab and top_p[b] >= 1.0:
            out[b] = _sample_in_id_order(row, temperature[b], min_p[b], uniforms[b])
        else:
            out[b] = _sample_sorted(row, temperature[b], top_k[b], top_p[b], min_p[b], uniforms[b])
    return out


def _is_infinite_over(top: np.float32, temperature) -> bool:
    """Whether the row's largest logit over the temperature is +inf (a logit_bias of inf, or one
    that a small temperature scales past float32): the tokens there outweigh all others without
    bound and exp(x - max) is NaN for them, so the first of them is taken, as the CUDA kernel's
    NaN weights fall back to its argmax."""
    with np.errstate(over="ignore"):
        return bool(np.float32(top) / np.float32(temperature) == np.inf)


def _over_temperature(x: np.ndarray, temperature) -> np.ndarray:
    """x / temperature in float32: a finite logit far below the largest (a penalty's, a bias's) over a
    small temperature is -inf, as on the GPU, without a RuntimeWarning out of the step (the largest
    over it is finite here: _is_infinite_over took the other rows)."""
    with np.errstate(over="ignore"):
        return x / np.float32(temperature)


def _sample_in_id_order(row: np.ndarray, temperature, min_p, u) -> int:
    x = _over_temperature(row, temperature)
    e = np.exp(x - x.max())
    w = np.where(e >= min_p, e, np.float32(0.0)) if min_p > 0.0 else e
    idx = _first_past_share(w, float(u))
    return idx if w[idx] > 0 else int(np.argmax(row))


_PICK_CHUNK = 1024


def _first_past_share(w: np.ndarray, u: float) -> int:
    """w: [V] weights >= 0 -> the first index whose cumulative weight exceeds u times the total, summed
    in float64 (a float32 running sum never reached a token weighing under half an ulp of the sum
    before it: past 65,536 likely tokens of 200,000, the 0.7 % of the tail's mass was never drawn).
    Chunk sums find the chunk and a cumulative sum of that chunk alone the token: a float32 cumsum
    of Qwen3's 151,936 took 1.3 ms, this 0.16 ms."""
    n = len(w)
    full = n - n % _PICK_CHUNK
    sums = np.add.reduce(w[:full].reshape(-1, _PICK_CHUNK), axis=1, dtype=np.float64)   # [V // chunk]
    if full < n:
        sums = np.append(sums, w[full:].sum(dtype=np.float64))
    cum = np.cumsum(sums)
    target = u * cum[-1]
    c = min(int(np.searchsorted(cum, target, side="right")), len(cum) - 1)
    start = c * _PICK_CHUNK
    local = np.cumsum(w[start:start + _PICK_CHUNK], dtype=np.float64) + (cum[c - 1] if c else 0.0)
    return start + min(int(np.searchsorted(local, target, side="right")), len(local) - 1)


def _sample_sorted(row: np.ndarray, temperature, top_k, top_p, min_p, u) -> int:
    if np.isnan(row).any():
        order = np.lexsort((np.arange(len(row)), -row))   # descending logit, then id
    elif 0 < top_k < len(row):
        order = _top_k_order(row, int(top_k))             # past top_k nothing is kept: no need to sort it
    else:
        return _sample_nucleus(row, temperature, top_p, min_p, u)
    vocab = len(order)
    x = _over_temperature(row[order], temperature)
    p = np.exp(x - x[0]).astype(np.float64)              # float64 sums, as _sample_nucleus's
    p /= p.sum()
    keep = np.ones(vocab, dtype=bool)
    if 0 < top_k < vocab:
        keep[top_k:] = False
    if min_p > 0.0:
        keep &= p >= min_p * p[0]
    if top_p < 1.0:
        before = np.cumsum(p) - p                          # mass strictly before each token
        keep &= before < top_p * p[keep].sum()             # of what top-k and min-p kept (a prefix)
    keep[0] = True
    p = np.where(keep, p, 0.0)
    cdf = np.cumsum(p)
    idx = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), vocab - 1)
    return int(order[idx]) if keep[idx] else int(order[0])


def _sample_nucleus(row: np.ndarray, temperature, top_p, min_p, u) -> int:
    """_sample_sorted's rule without top-k, sorting only the tokens that can be in the nucleus (a sort
    of the whole vocabulary took 55 ms a row of Qwen3's 151,936): the likeliest tokens, 8 times more
    each round, until their weight reaches top_p of the kept weight (or min_p keeps no more). Sums
    are in float64: a nucleus of thousands of tokens summed in float32 drifted by more than a
    token's share."""
    vocab = len(row)
    x = _over_temperature(row, temperature)
    e = np.exp(x - x.max())                                # [V] weights; the likeliest token's is 1
    kept = e >= np.float32(min_p) if min_p > 0.0 else None  # p >= min_p * p_max
    num_kept = vocab if kept is None else int(np.count_nonzero(kept))
    bound = float(np.float32(top_p)) * float((e if kept is None else e[kept]).sum(dtype=np.float64))
    k = min(num_kept, 256)
    while True:
        order = _top_k_order(row, k) if k < vocab else np.lexsort((np.arange(vocab), -row))
        w = e[order].astype(np.float64)
        cum = np.cumsum(w)
        if k == num_kept or cum[-1] >= bound:             # the next token's mass before it reaches the bound
            break
        k = min(num_kept, 8 * k)
    keep = cum - w < bound                                 # of what min-p kept (a prefix)
    keep[0] = True
    cdf = np.cumsum(np.where(keep, w, 0.0))
    idx = min(int(np.searchsorted(cdf, float(u) * cdf[-1], side="right")), len(order) - 1)
    return int(order[idx]) if keep[idx] else int(order[0])


def _top_k_order(row: np.ndarray, k: int) -> np.ndarray:
    """The first k ids of row in descending logit, then id order (a sort of the whole vocabulary
    took 18 ms a row of Qwen3's 151,936; a partition and a sort of k take a few)."""
    kth = row[np.argpartition(row, len(row) - k)[len(row) - k]]      # the k-th largest logit
    above = np.flatnonzero(row > kth)
    ties = np.flatnonzero(row == kth)[: k - len(above)]              # the lowest ids of the k-th logit
    ids = np.concatenate([above, ties])
    return ids[np.lexsort((ids, -row[ids]))]


def apply_token_bitmask(logits: np.ndarray, bitmask: np.ndarray, rows: np.ndarray) -> None:
    """Structured outputs: set the logits of forbidden tokens to -inf, in place, in the listed rows.

    logits: [B, V] float32; bitmask: [N, W] int32 with W >= ceil(V / 32), bit j of word w is token
    32 w + j (1: allowed, 0: forbidden); rows: [N] int32, the logits row each mask row applies to
    (mask i to logits row rows[i], rows distinct). Entries outside [0, B) are skipped (-1 pads a
    fixed-size rows array). Rows not listed are left untouched.
    """
    batch, vocab = logits.shape
    num_words = (vocab + 31) // 32
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[0] != rows.shape[0] \
            or bitmask.shape[1] < num_words:
        raise ValueError(f"bitmask must be int32 [{rows.shape[0]} (one per row), >= {num_words}], got "
                         f"{bitmask.dtype} {bitmask.shape}")
    keep = (rows >= 0) & (rows < batch)
    rows = rows[keep]
    if rows.size == 0 or vocab == 0:
        return
    words = np.ascontiguousarray(bitmask[keep, :num_words], dtype="<i4")       # [N, ceil(V/32)]
    # little-endian bytes, least significant bit first: bit j of word w lands at column 32 w + j
    allowed = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)  # [N, V]
    logits[rows] = np.where(allowed, logits[rows], np.float32(-np.inf))
