"""Build the tiny random models of the parity tests and what transformers computes on them.

    pip install -e ".[parity]" && python3 tests/make_fixtures.py

writes tests/fixtures/tiny/<name>/: config.json and model.safetensors as transformers saves them,
a character-level tokenizer, and reference.npz with transformers' float32 logits at every position
of a prompt and its 24-token greedy continuation; and tests/fixtures/bf16_rounding.npz, torch's
float32 -> bfloat16 rounding of values that cover every rounding case. The default test run checks minillm against
these files without torch; with torch installed the same tests also run live.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TINY_DIR = FIXTURES / "tiny"

# Small enough that all five models and their references stay a few hundred KB on disk.
TINY_BASE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
TINY_MODELS = {
    "llama-gqa-untied": ("llama", {}),
    "llama-tied-llama3-rope": ("llama", dict(tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}, rope_theta=500000.0)),
    "llama-mha": ("llama", dict(num_key_value_heads=4)),
    "qwen2-bias": ("qwen2", dict(num_key_value_heads=1)),
    "qwen3-qk-norm": ("qwen3", dict(head_dim=16, tie_word_embeddings=True)),   # head_dim != hidden / heads
}
PROMPT_LEN = 38          # BOS + 37 random ids: logits compared at every position
GREEDY_PROMPT_LEN = 9
GREEDY_TOKENS = 24
SPECIALS = ["<unk>", "<s>", "</s>"]


def prompt_ids(vocab_size: int) -> list[int]:
    """The prompt every tiny model is checked on: BOS, then random ids past the specials."""
    return [1] + [int(t) for t in np.random.default_rng(1).integers(3, vocab_size, size=PROMPT_LEN - 1)]


def build_tokenizer():
    """A character-level tokenizer (printable ASCII) with <s>/</s>: enough to load and decode."""
    from tokenizers import Tokenizer, decoders, models, processors

    chars = [chr(c) for c in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.add_special_tokens(SPECIALS)
    return tok


def write_tokenizer(out_dir: Path) -> None:
    """tokenizer.json and tokenizer_config.json of the character-level tokenizer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>"}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")


def build_model(arch: str, dtype: str = "float32", **overrides):
    """A tiny random transformers model of one family, with weights wide enough that logits differ."""
    import torch
    import transformers

    torch.manual_seed(0)
    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                             "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    model = model_cls(config_cls(**{**TINY_BASE, **overrides})).eval()
    with torch.no_grad():                     # random init is tiny; widen it so logits differ
        for p in model.parameters():
            p.normal_(0.0, 0.2 if p.dim() > 1 else 1.0)
    return model.to(getattr(torch, dtype))


def transformers_reference(model_dir: Path) -> dict[str, np.ndarray]:
    """transformers' float32 prompt logits and greedy continuation for the model saved in model_dir."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids = prompt_ids(model.config.vocab_size)
    prompt = ids[:GREEDY_PROMPT_LEN]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].numpy()
        greedy = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=GREEDY_TOKENS,
                                min_new_tokens=GREEDY_TOKENS, pad_token_id=0)[0, len(prompt):].tolist()
    return {"prompt_ids": np.array(ids, np.int32), "prompt_logits": logits.astype(np.float32),
            "greedy_prompt_ids": np.array(prompt, np.int32), "greedy_ids": np.array(greedy, np.int32)}


def save_tiny_model(out_dir: Path, arch: str, dtype: str = "float32", **overrides) -> Path:
    """Save a tiny random model of one family with the character-level tokenizer."""
    build_model(arch, dtype, **overrides).save_pretrained(out_dir, safe_serialization=True)
    write_tokenizer(out_dir)
    return out_dir


def bf16_rounding_inputs() -> np.ndarray:
    """float32 values over the whole exponent range plus the edge cases of rounding to bf16."""
    rng = np.random.default_rng(0)
    return np.concatenate([
        rng.standard_normal(4096).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 4096),
        np.array([0.0, -0.0, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-40, -1e-45, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8]),
    ]).astype(np.float32)


def torch_bf16_bits(x: np.ndarray) -> np.ndarray:
    """torch's float32 -> bfloat16 rounding, as uint16 bit patterns."""
    import torch
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def main() -> int:
    """Write every fixture (bf16 weights: half the bytes, and bf16 -> fp32 is exact for both sides)."""
    import torch
    import transformers

    for name, (arch, overrides) in TINY_MODELS.items():
        out = TINY_DIR / name
        for old in out.glob("*"):
            old.unlink()
        save_tiny_model(out, arch, "bfloat16", **overrides)
        (out / "generation_config.json").unlink(missing_ok=True)   # nothing in it the tests read
        np.savez(out / "reference.npz", **transformers_reference(out))
        print(f"{name}: {sum(f.stat().st_size for f in out.iterdir()) / 1024:.0f} KiB", file=sys.stderr)
    x = bf16_rounding_inputs()
    np.savez(FIXTURES / "bf16_rounding.npz", x=x, bits=torch_bf16_bits(x))
    meta = {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0],
            "models": {name: {"architecture": arch, **TINY_BASE, **overrides}
                       for name, (arch, overrides) in TINY_MODELS.items()}}
    (TINY_DIR / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
