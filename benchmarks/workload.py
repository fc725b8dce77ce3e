"""The offline workloads (nano-vllm's, and vLLM's random dataset), and the roofline floor they are held against."""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

# Qwen3-0.6B's architecture (config.json of the public checkpoint).
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
    "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
}


@dataclass
class Workload:
    """Prompt token ids and output lengths, in request order."""

    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_output_tokens(self) -> int:
        """Output tokens in all (every request runs to max_tokens: ignore_eos)."""
        return sum(self.max_tokens)


def nano_vllm_workload(num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024) -> Workload:
    """random.seed(0); all prompts first, then all output lengths, as nano-vllm's bench.py draws them
    (lengths from 100 up, or from the maximum itself when that is below 100)."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(min(100, max_input_len), max_input_len))]
               for _ in range(num_seqs)]
    max_tokens = [random.randint(min(100, max_output_len), max_output_len) for _ in range(num_seqs)]
    return Workload(prompts, max_tokens)


def random_length_range(length: int, range_ratio: float, least: int = 0) -> tuple[int, int]:
    """The lengths vLLM's random dataset draws around LENGTH: [floor(length * (1 - r)), ceil(length * (1 + r))],
    the low end raised to LEAST (vLLM's outputs are at least 1 token)."""
    return max(least, math.floor(length * (1 - range_ratio))), max(least, math.ceil(length * (1 + range_ratio)))


def random_workload(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0) -> Workload:
    """vLLM's random dataset: each request's prompt and output lengths drawn uniformly from
    random_length_range (every request of input_len + output_len tokens at range_ratio 0), the
    prompts of random token ids as nano_vllm_workload's."""
    rng = random.Random(seed)
    in_lo, in_hi = random_length_range(input_len, range_ratio)
    out_lo, out_hi = random_length_range(output_len, range_ratio, least=1)
    input_lens = [rng.randint(in_lo, in_hi) for _ in range(num_prompts)]
    max_tokens = [rng.randint(out_lo, out_hi) for _ in range(num_prompts)]
    prompts = [[rng.randint(0, 10000) for _ in range(n)] for n in input_lens]
    return Workload(prompts, max_tokens)


def write_random_model_dir(out: Path, config: dict = QWEN3_0_6B) -> Path:
    """A model directory with config.json and a word-level tokenizer of the model's vocabulary."""
    from tokenizers import Tokenizer, models

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    vocab = {f"<t{i}>": i for i in range(config["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="<t0>")).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"<t{config['eos_token_id']}>"}))
    return out


def weight_bytes(c: dict, itemsize: int = 2) -> int:
    """Bytes of the weights one forward pass reads (the tied head counted once)."""
    h, i, v, layers = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h + 2 * c["head_dim"]
    head = 0 if c.get("tie_word_embeddings") else v * h
    return (v * h + head + layers * per_layer + h) * itemsize


def roofline_seconds(w: Workload, c: dict, bandwidth: float, matmul_flops: float, itemsize: int = 2,
                     kv_itemsize: int | None = None) -> float:
    """A lower bound on the run: prefill at the matrix rate, then each decode step reads all weights
    plus the K/V of every resident token at the copy bandwidth (all requests fit in the pool).
    kv_itemsize: bytes of a cache element (1 for an FP8 cache; default: the weights' itemsize)."""
    kv_bytes = itemsize if kv_itemsize is None else kv_itemsize
    kv_per_token = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * kv_bytes
    params = weight_bytes(c, itemsize) // itemsize
    prefill = 2 * params * sum(len(p) for p in w.prompts) / matmul_flops
    decode = 0.0
    for step in range(1, max(w.max_tokens) + 1):
        resident = sum(len(p) + step for p, m in zip(w.prompts, w.max_tokens) if m >= step)
        decode += (weight_bytes(c, itemsize) + resident * kv_per_token) / bandwidth
    return prefill + decode
