"""Which part of each weight a tensor-parallel rank holds, by Hugging Face name.

    column-parallel (split the output rows):  q/k/v_proj by heads (+ their biases), gate/up_proj
    replicated KV heads (N above num_key_value_heads): k/v_proj rows of one head on N / Hk ranks each
    row-parallel (split the input columns):   o_proj by heads, down_proj; each followed by an all-reduce
    vocab-parallel (split the vocabulary):    embed_tokens and lm_head, padded to N * ceil(V / N) rows
    replicated:                               every norm (input, post-attention, final, q/k norms)

A rank's ModelConfig is the model's with its share of the heads and of the MLP width; the
vocabulary stays the model's (rank 0 samples from the gathered logits).

KV heads as vLLM's QKVParallelLinear splits them: with N <= Hk each rank holds Hk / N whole heads;
with N > Hk (a multiple of it) each rank holds one, head rank // (N / Hk), which is the head its
Hq / N query heads read, so its KV pool has one head and attention stays local to the rank.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from minillm.config import ModelConfig


def check_tensor_parallel_size(config: ModelConfig, size: int, backend: str) -> None:
    """ValueError naming tensor_parallel_size and the model's size it does not fit (vLLM's refusals)."""
    if backend != "numpy":
        raise ValueError(f"tensor_parallel_size={size} runs on the CPU backend only (device='cpu'); "
                         f"the GPU communicator (NCCL) is not built yet")
    heads, kv_heads = config.num_heads, config.num_kv_heads
    if heads % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's num_attention_heads ({heads}): "
                         f"each rank holds whole query heads")
    if size > kv_heads and size % kv_heads:
        raise ValueError(f"tensor_parallel_size {size} is above the model's num_key_value_heads ({kv_heads}) "
                         f"and must be a multiple of it: each KV head is replicated on whole ranks")
    if size < kv_heads and kv_heads % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's num_key_value_heads ({kv_heads}): "
                         f"each rank holds whole KV heads")
    if config.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's intermediate_size "
                         f"({config.intermediate_size})")


def num_kv_head_replicas(num_kv_heads: int, size: int) -> int:
    """Ranks holding each KV head: size / num_kv_heads above it, else 1 (vLLM's num_kv_head_replicas)."""
    return size // num_kv_heads if size >= num_kv_heads else 1


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """KV heads each rank holds and caches: num_kv_heads / size, at least 1."""
    return max(1, num_kv_heads // size)


def shard_model_config(config: ModelConfig, size: int) -> ModelConfig:
    """One rank's shape: its query heads, KV heads and MLP width (the KV pool is sized from it)."""
    return dataclasses.replace(config, num_heads=config.num_heads // size,
                               num_kv_heads=kv_heads_per_rank(config.num_kv_heads, size),
                               intermediate_size=config.intermediate_size // size)


def vocab_shard_size(vocab_size: int, size: int) -> int:
    """Rows of the embedding and LM head on each rank (the last rank's padded with zeros)."""
    return -(-vocab_size // size)


def shard_weights(weights: dict[str, np.ndarray], config: ModelConfig, rank: int,
                  size: int) -> dict[str, np.ndarray]:
    """Rank `rank`'s part of every weight, same names; slices are views where they can be."""
    q_rows = config.num_heads // size * config.head_dim          # this rank's q heads * Dh
    kv_rows = kv_heads_per_rank(config.num_kv_heads, size) * config.head_dim
    kv_part = rank // num_kv_head_replicas(config.num_kv_heads, size)   # ranks sharing a KV head read one part
    mlp_rows = config.intermediate_size // size
    rows = lambda w, n: w[rank * n:(rank + 1) * n]                # noqa: E731  column-parallel
    cols = lambda w, n: w[:, rank * n:(rank + 1) * n]             # noqa: E731  row-parallel
    kv = lambda w, n: w[kv_part * n:(kv_part + 1) * n]            # noqa: E731  column-parallel, maybe replicated
    split = {"q_proj": (rows, q_rows), "k_proj": (kv, kv_rows), "v_proj": (kv, kv_rows),
             "o_proj": (cols, q_rows), "gate_proj": (rows, mlp_rows), "up_proj": (rows, mlp_rows),
             "down_proj": (cols, mlp_rows)}
    out = {}
    for name, w in weights.items():
        module = name.split(".")[-2]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = _vocab_rows(w, rank, size)
        elif module in split:
            how, n = split[module]
            out[name] = how(w, n)
        else:
            out[name] = w
    return out


def _vocab_rows(w: np.ndarray, rank: int, size: int) -> np.ndarray:
    """w: [V, D] -> this rank's [ceil(V / N), D], zero rows past V."""
    n = vocab_shard_size(w.shape[0], size)
    part = w[rank * n:(rank + 1) * n]
    if part.shape[0] == n:
        return part
    padded = np.zeros((n,) + w.shape[1:], w.dtype)
    padded[:part.shape[0]] = part
    return padded
