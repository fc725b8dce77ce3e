"""A small program for compute-sanitizer: several engines in a row on a tiny random Qwen3 in bf16,
with decode graphs, async scheduling, preemption, aborts, prefix hits and a chunked long prompt.

    compute-sanitizer --tool memcheck python3 tests/sanitize_engines.py
    compute-sanitizer --tool racecheck python3 tests/sanitize_engines.py --engines 2
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 2048,
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "attention_bias": False, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2,
}


def write_model_dir(out: Path) -> str:
    """config.json and a word-level tokenizer (the weights are dummy)."""
    from tokenizers import Tokenizer, models
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(TINY_QWEN3))
    vocab = {f"<t{i}>": i for i in range(TINY_QWEN3["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="<t0>")).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<t2>"}))
    return str(out)


def drive(engine, rng: np.random.Generator, num_requests: int = 24) -> None:
    """Decoders, a chunked long prompt, shared prefixes, aborts, and a pool small enough to preempt."""
    from minillm import SamplingParams
    prefix = rng.integers(3, 2000, 64).tolist()
    for i in range(num_requests):
        prompt = prefix + rng.integers(3, 2000, 5 + i).tolist() if i % 2 else rng.integers(3, 2000, 8 + i).tolist()
        params = SamplingParams(temperature=0.0 if i % 3 else 0.9, max_tokens=40 + i, ignore_eos=True, seed=i)
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(5):
        engine.step()
    engine.add_request("long", rng.integers(3, 2000, 700).tolist(), SamplingParams(max_tokens=8, ignore_eos=True))
    for step in range(10_000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        if step == 12:
            for i in range(0, num_requests, 5):
                engine.abort_request(f"r{i}")
    assert engine.block_manager.num_used_blocks == 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--device", default="cuda")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    args = p.parse_args(argv)
    from minillm import LLM
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model_dir(Path(tmp) / "tiny-qwen3")
        for i in range(args.engines):
            budget = (64, 256)[i % 2]
            with LLM(model, device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32", load_format="dummy", num_kv_blocks=48,
                     block_size=16, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget, max_model_len=768,
                     seed=i, enforce_eager=args.enforce_eager) as llm:
                print(f"engine {i}: started", flush=True)
                drive(llm.engine, np.random.default_rng(i), args.requests)
                print(f"engine {i}: budget {budget}, {llm.engine.scheduler.num_preemptions} preemptions, "
                      f"{llm.engine.stats().prefix_cache_hits} prefix-hit tokens", flush=True)
    print("sanitize_engines: done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
