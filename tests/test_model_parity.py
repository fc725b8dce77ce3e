"""Parity with Hugging Face transformers: prompt logits at every position and greedy continuations."""
import json

import numpy as np
import pytest

from minillm import LLM, SamplingParams
from minillm.attention import AttentionMetadata
from minillm.loader import load_model_config, load_weights
from minillm.models.decoder import DecoderModel
from minillm.ops import get_ops

from conftest import save_tiny_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = {
    "llama-gqa-untied": ("llama", {}),
    "llama-tied-llama3-rope": ("llama", dict(tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}, rope_theta=500000.0)),
    "llama-mha": ("llama", dict(num_key_value_heads=4)),
    "qwen2-bias": ("qwen2", dict(num_key_value_heads=1)),
    "qwen3-qk-norm": ("qwen3", dict(head_dim=32, tie_word_embeddings=True)),
}


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
    return model.compute_logits(hidden)


def hf_logits(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy(), model


def rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_models_match_transformers(tmp_path, name, stories_path):
    arch, overrides = TINY[name]
    path = save_tiny_model(tmp_path / name, arch, **overrides)
    ids = [1] + list(np.random.default_rng(1).integers(3, 512, size=37))
    ref, hf_model = hf_logits(path, ids)
    ours = minillm_prompt_logits(path, ids)
    assert rel_err(ours, ref) < 1e-4
    # greedy continuation token for token
    prompt = ids[:9]
    with torch.no_grad():
        gen = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24,
                                min_new_tokens=24, pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(str(path), device="cpu", num_kv_blocks=64, block_size=4)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == gen


def test_stories_prompt_logits_match_reference(stories_path):
    ref = json.loads((stories_path / "reference.json").read_text())
    ours = minillm_prompt_logits(stories_path, ref["prompt_ids"])
    assert rel_err(ours, np.array(ref["prompt_logits_fp32"], np.float32)) < 1e-4
    assert ours.argmax(-1).tolist() == ref["prompt_argmax"]


def test_stories_prompt_logits_match_transformers(stories_path):
    ids = [1] + list(np.random.default_rng(2).integers(3, 512, size=60))
    ref, _ = hf_logits(stories_path, ids)
    assert rel_err(minillm_prompt_logits(stories_path, ids), ref) < 1e-4


def test_stories_golden_200_greedy_tokens(stories_path):
    ref = json.loads((stories_path / "reference.json").read_text())
    llm = LLM(str(stories_path), device="cpu")
    out = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))[0]
    assert [1] + out.outputs[0].token_ids == ref["greedy_from_bos_200_ids"]
    assert out.outputs[0].text == ref["greedy_from_bos_200_text"]
