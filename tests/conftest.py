"""Shared fixtures: the stories260K model path and tiny Hugging Face models built on the fly."""
import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STORIES = Path(os.environ.get("MINILLM_TEST_MODEL", REPO.parent / "shared" / "models" / "stories260K"))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="session")
def stories_path() -> Path:
    """The trained stories260K model directory (golden-text tests skip without it)."""
    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260K not found at {STORIES}; set MINILLM_TEST_MODEL")
    return STORIES


def save_tiny_model(out_dir: Path, arch: str, dtype: str = "float32", **overrides) -> Path:
    """Build a tiny random HF model of the given family, save it with stories260K's tokenizer."""
    import torch
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    common.update(overrides)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    config = cls[0](**common)
    model = cls[1](config).eval()
    with torch.no_grad():                     # random init is tiny; widen it so logits differ
        for p in model.parameters():
            p.normal_(0.0, 0.2 if p.dim() > 1 else 1.0)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (STORIES / name).exists():
            shutil.copy(STORIES / name, out_dir / name)
    return out_dir


@pytest.fixture(scope="session")
def eos_model_path(stories_path, tmp_path_factory) -> Path:
    """stories260K with a second EOS id: its stories end on token 1, which then stops generation."""
    out = tmp_path_factory.mktemp("stories_eos")
    for f in stories_path.iterdir():
        if f.name != "generation_config.json":
            (out / f.name).symlink_to(f)
    (out / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": [2, 1]}')
    return out
