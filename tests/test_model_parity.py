"""Parity with Hugging Face transformers: prompt logits at every position and greedy continuations.

The tiny models and transformers' outputs on them are fixtures (tests/make_fixtures.py), so the
default run needs no torch; with torch installed (`.[parity]`) the same checks also run live on
freshly built models, and the fixtures are checked against the installed transformers.
"""
import json

import numpy as np
import pytest

from minillm import LLM, SamplingParams
from minillm.attention import AttentionMetadata
from minillm.loader import load_model_config, load_weights
from minillm.models.decoder import DecoderModel
from minillm.ops import get_ops

from make_fixtures import GREEDY_PROMPT_LEN, GREEDY_TOKENS, TINY_DIR, TINY_MODELS, prompt_ids

try:
    import torch
    import transformers
except ImportError:          # the light test install: fixtures only
    torch = transformers = None

live = pytest.mark.skipif(torch is None, reason="the live comparison needs torch and transformers (.[parity])")


def minillm_prompt_logits(path, ids, block_size=4):
    """Logits at every prompt position from the NumPy decoder, through a scattered block table."""
    config = load_model_config(path)
    ops = get_ops("numpy")
    model = DecoderModel(config, load_weights(path, config, "float32"), ops, np.float32, 256)
    num_blocks = 2 * (len(ids) // block_size + 1)
    pool = np.zeros((config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim),
                    np.float32)
    table = np.random.default_rng(0).permutation(num_blocks)[: len(ids) // block_size + 1]
    pos = np.arange(len(ids))
    meta = AttentionMetadata(np.array([0, len(ids)], np.int32), np.array([len(ids)], np.int32),
                             table[None].astype(np.int32), (table[pos // block_size] * block_size
                                                            + pos % block_size).astype(np.int32),
                             len(ids), len(ids), False)
    hidden = model.forward(np.asarray(ids, np.int32), pos.astype(np.int32), meta, pool)
    return model.compute_logits(hidden)   # [len(ids), vocab]


def minillm_greedy(path, prompt, num_tokens):
    """Greedy ids from LLM.generate with a small block size, so the continuation crosses blocks."""
    llm = LLM(str(path), device="cpu", num_kv_blocks=64, block_size=4)
    out = llm.generate([list(prompt)], SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True))[0]
    return out.outputs[0].token_ids


def rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


# ---- against the fixtures (no torch) -------------------------------------------------------------

@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_tiny_models_match_transformers_fixtures(name):
    path = TINY_DIR / name
    ref = np.load(path / "reference.npz")
    ids = ref["prompt_ids"].tolist()
    assert ids == prompt_ids(load_model_config(path).vocab_size)
    assert rel_err(minillm_prompt_logits(path, ids), ref["prompt_logits"]) < 1e-4
    assert minillm_greedy(path, ref["greedy_prompt_ids"].tolist(), GREEDY_TOKENS) == ref["greedy_ids"].tolist()


def test_fixtures_cover_every_family_and_feature():
    configs = {name: load_model_config(TINY_DIR / name) for name in TINY_MODELS}
    assert {c.architecture for c in configs.values()} == {"llama", "qwen2", "qwen3"}
    assert any(c.tie_word_embeddings for c in configs.values()) and any(
        not c.tie_word_embeddings for c in configs.values())
    assert any(c.num_kv_heads == c.num_heads for c in configs.values())          # MHA
    assert any(c.num_kv_heads < c.num_heads for c in configs.values())           # GQA
    assert any(c.rope_scaling and c.rope_scaling["rope_type"] == "llama3" for c in configs.values())
    assert configs["qwen3-qk-norm"].head_dim * configs["qwen3-qk-norm"].num_heads != configs[
        "qwen3-qk-norm"].hidden_size
    assert configs["qwen2-bias"].attention_bias and configs["qwen3-qk-norm"].qk_norm


# ---- stories260K against its reference.json (no torch) -------------------------------------------

def test_stories_prompt_logits_match_reference(stories_path):
    ref = json.loads((stories_path / "reference.json").read_text())
    ours = minillm_prompt_logits(stories_path, ref["prompt_ids"])
    assert rel_err(ours, np.array(ref["prompt_logits_fp32"], np.float32)) < 1e-4
    assert ours.argmax(-1).tolist() == ref["prompt_argmax"]


def test_stories_golden_200_greedy_tokens(stories_path):
    ref = json.loads((stories_path / "reference.json").read_text())
    llm = LLM(str(stories_path), device="cpu")
    out = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))[0]
    assert [1] + out.outputs[0].token_ids == ref["greedy_from_bos_200_ids"]
    assert out.outputs[0].text == ref["greedy_from_bos_200_text"]


# ---- live, with torch and transformers installed -------------------------------------------------

def hf_logits(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy(), model


@live
@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_tiny_models_match_transformers_live(tmp_path, name):
    from make_fixtures import save_tiny_model

    arch, overrides = TINY_MODELS[name]
    path = save_tiny_model(tmp_path / name, arch, **overrides)     # float32, freshly drawn
    ids = prompt_ids(load_model_config(path).vocab_size)
    ref, hf_model = hf_logits(path, ids)
    assert rel_err(minillm_prompt_logits(path, ids), ref) < 1e-4
    prompt = ids[:GREEDY_PROMPT_LEN]
    with torch.no_grad():
        gen = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=GREEDY_TOKENS,
                                min_new_tokens=GREEDY_TOKENS, pad_token_id=0)[0, len(prompt):].tolist()
    assert minillm_greedy(path, prompt, GREEDY_TOKENS) == gen


@live
@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_fixtures_agree_with_the_installed_transformers(name):
    from make_fixtures import transformers_reference

    stored = np.load(TINY_DIR / name / "reference.npz")
    fresh = transformers_reference(TINY_DIR / name)
    assert rel_err(stored["prompt_logits"], fresh["prompt_logits"]) < 1e-5
    assert stored["greedy_ids"].tolist() == fresh["greedy_ids"].tolist()


@live
def test_stories_prompt_logits_match_transformers(stories_path):
    ids = [1] + list(np.random.default_rng(2).integers(3, 512, size=60))
    ref, _ = hf_logits(stories_path, ids)
    assert rel_err(minillm_prompt_logits(stories_path, ids), ref) < 1e-4
