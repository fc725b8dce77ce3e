"""Checkpoints as users bring them: config.json spellings of every rope type, GQA ratios, saved
dtypes and shardings run as transformers runs them; a checkpoint whose tensors, files or
quantization minillm cannot run is refused at load naming the tensor, file or field.

The config and file checks need no torch; with torch and transformers installed (`.[parity]`) tiny
random models of each variant are saved by transformers and minillm's prompt logits and greedy
continuation are compared with transformers' own.
"""
import logging
import re

import numpy as np
import pytest

from minillm.loader import load_model_config, load_weights

from make_fixtures import prompt_ids, write_tokenizer
from test_abuse29_models import build_model, config_of, edit_json, hf_prompt_logits_and_greedy, live, shard
from test_loader import save_numpy_checkpoint
from test_model_parity import minillm_greedy, minillm_prompt_logits, rel_err

try:
    import torch
except ImportError:          # the light test install: config and file checks only
    torch = None

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


# ---- rope: a top-level original_max_position_embeddings ------------------------------------------

@pytest.mark.parametrize("scaling", [LLAMA3, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}])
def test_a_top_level_original_max_position_embeddings_wins_as_in_transformers(tmp_path, scaling):
    # transformers' standardize_rope_params gives a config's own original_max_position_embeddings
    # (Phi-3's spelling, kept by any config class) priority over the one in rope_scaling for llama3,
    # yarn and longrope; minillm read only rope_scaling's, and its rotary table differed from
    # transformers' at every position (prompt logits 90% off).
    c = config_of(tmp_path, rope_scaling=scaling, original_max_position_embeddings=64)
    assert c.rope_scaling["original_max_position_embeddings"] == 64


def test_a_top_level_original_max_position_embeddings_leaves_other_rope_types_alone(tmp_path):
    c = config_of(tmp_path / "a", rope_scaling={"rope_type": "linear", "factor": 2.0}, original_max_position_embeddings=64)
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    c = config_of(tmp_path / "b", rope_scaling=LLAMA3, original_max_position_embeddings=None)
    assert c.rope_scaling["original_max_position_embeddings"] == 32


@pytest.mark.parametrize("arch, fields", [("llama", dict(head_dim=15)), ("mistral", dict(hidden_size=60)),
                                          ("qwen3", dict(head_dim=15))])
def test_an_odd_head_dim_is_refused_at_load_as_transformers_refuses_it(tmp_path, arch, fields):
    # Rotary embeddings turn pairs of a head's values: an odd head loaded, and every step then
    # failed with "operands could not be broadcast together with shapes (3,4,8) (3,1,9)".
    with pytest.raises(ValueError, match=r"head_dim 15( \(hidden_size / num_attention_heads\))? is odd"):
        config_of(tmp_path, arch, **fields)


# ---- tensors the config has no place for ----------------------------------------------------------

@pytest.mark.parametrize("family, extra, message", [
    # a checkpoint of more layers than config.json's num_hidden_layers: the extra layer was dropped
    ("llama", {"model.layers.2.mlp.up_proj.weight": (64, 32)},
     r"tensor model\.layers\.2\.mlp\.up_proj\.weight .*num_hidden_layers 2"),
    # Qwen3's q/k norms in a checkpoint that config.json calls Qwen2: the norms were dropped
    ("qwen2", {"model.layers.0.self_attn.q_norm.weight": (8,), "model.layers.0.self_attn.k_norm.weight": (8,)},
     r"tensor model\.layers\.0\.self_attn\.k_norm\.weight \(and 1 more\) in model\.safetensors, which "
     r"Qwen2ForCausalLM has no place for"),
    ("llama", {"model.vision_tower.proj.weight": (4, 4)}, r"tensor model\.vision_tower\.proj\.weight"),
])
def test_a_tensor_the_model_has_no_place_for_is_refused_naming_it(tmp_path, family, extra, message):
    # Such tensors were read past without a word (vLLM refuses them: "There is no module or
    # parameter named ..."), and the model ran as another one than the checkpoint's.
    from safetensors.numpy import load_file, save_file
    path, _ = save_numpy_checkpoint(tmp_path / "m", family)
    tensors = load_file(path / "model.safetensors")
    tensors.update({name: np.ones(shape, np.float32) for name, shape in extra.items()})
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        load_weights(path, load_model_config(path), "float32")


def test_rotary_caches_and_unused_biases_are_passed_over_as_transformers_and_vllm_do(tmp_path, caplog):
    from safetensors.numpy import load_file, save_file
    path, state = save_numpy_checkpoint(tmp_path / "m", "llama")
    tensors = load_file(path / "model.safetensors")
    tensors.update({"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32),
                    "model.layers.0.self_attn.o_proj.bias": np.ones(32, np.float32)})
    save_file(tensors, str(path / "model.safetensors"))
    with caplog.at_level(logging.WARNING, logger="minillm"):
        weights = load_weights(path, load_model_config(path), "float32")
    assert set(weights) == set(state)
    assert "model.layers.0.self_attn.o_proj.bias" in caplog.text and "inv_freq" not in caplog.text


@pytest.mark.parametrize("other", ["consolidated.safetensors", "adapter_model.safetensors"])
def test_other_safetensors_files_beside_model_safetensors_are_not_read(tmp_path, other, caplog):
    # transformers reads model.safetensors alone when there is no index; Mistral's repos ship their
    # own format beside it (consolidated.safetensors), a LoRA adapter lands beside it too. Their
    # tensors were read as shards of the model's ("tensor model.norm.weight is in both ...").
    from safetensors.numpy import save_file
    path, state = save_numpy_checkpoint(tmp_path / "m", "llama")
    save_file({"layers.0.attention.wq.weight": np.ones((4, 4), np.float32),
               "model.norm.weight": np.zeros(32, np.float32)}, str(path / other))
    with caplog.at_level(logging.WARNING, logger="minillm"):
        weights = load_weights(path, load_model_config(path), "float32")
    assert np.array_equal(weights["model.norm.weight"], state["model.norm.weight"]) and caplog.text == ""


@pytest.mark.parametrize("family, tied", [("qwen3", True), ("llama", False)])
def test_a_checkpoint_saved_without_the_model_prefix_loads_as_transformers_loads_it(tmp_path, family, tied):
    # Tensors saved from the base model ("embed_tokens.weight", "layers.0. ...", as Qwen3-Embedding's
    # are): transformers adds its base_model_prefix "model." and loads them; minillm said "missing
    # tensor model.embed_tokens.weight".
    from safetensors.numpy import load_file, save_file
    path, state = save_numpy_checkpoint(tmp_path / "m", family, tie_word_embeddings=tied,
                                        drop=("lm_head.weight",) if tied else ())
    tensors = load_file(path / "model.safetensors")
    save_file({name.removeprefix("model."): value for name, value in tensors.items()}, str(path / "model.safetensors"))
    weights = load_weights(path, load_model_config(path), "float32")
    assert set(weights) == set(state) and all(np.array_equal(weights[n], state[n]) for n in state)


# ---- checkpoints minillm does not run --------------------------------------------------------------

@pytest.mark.parametrize("quantization, message", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "quant_method 'fp8'"),
    ({"load_in_4bit": True}, "quantization_config"),
])
def test_a_quantized_checkpoint_is_refused_naming_its_quantization(tmp_path, quantization, message):
    # A GPTQ checkpoint was "missing tensor model.layers.0.self_attn.q_proj.weight" (its qweight is
    # there), a bitsandbytes config over unquantized weights ran unquantized.
    with pytest.raises(ValueError, match=re.escape(message) + ".*unquantized"):
        config_of(tmp_path, quantization_config=quantization)


def test_a_null_quantization_config_is_none(tmp_path):
    assert config_of(tmp_path, quantization_config=None)


@pytest.mark.parametrize("files", [["pytorch_model.bin"],
                                   ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
                                    "pytorch_model.bin.index.json"]])
def test_pytorch_bin_weights_are_named_with_what_to_do(tmp_path, files):
    # "model directory ... has no *.safetensors weights" said nothing of the weights it does hold.
    path, _ = save_numpy_checkpoint(tmp_path / "m", "llama")
    (path / "model.safetensors").unlink()
    for name in files:
        (path / name).write_bytes(b"{}")
    with pytest.raises(ValueError, match=re.escape(f"has PyTorch weights ({files[0]}") + ".*safetensors"):
        load_weights(path, load_model_config(path), "float32")


# ---- against transformers, live --------------------------------------------------------------------

def old_rope(scaling, theta=None):
    """A config.json edit to transformers 4's spelling: rope_scaling (and a top-level rope_theta)."""
    def edit(cfg):
        cfg.pop("rope_parameters", None)
        cfg["rope_scaling"] = scaling
        if theta is not None:
            cfg["rope_theta"] = theta
    return edit


def top_level_original(scaling, original):
    def edit(cfg):
        old_rope(scaling)(cfg)
        cfg["original_max_position_embeddings"] = original
    return edit


def without_model_prefix(path):
    """Save the tensors under the base model's names, as AutoModel's save_pretrained does."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(path / "model.safetensors")
    save_file({name.removeprefix("model."): value for name, value in tensors.items()}, path / "model.safetensors",
              metadata={"format": "pt"})


LONG = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [4.0] * 8}
LIVE = {   # name: (arch, config fields, saved weights' dtype, a config.json edit, a folder edit)
    "llama-gqa-4": ("llama", dict(num_attention_heads=8, num_key_value_heads=2), "float32", None, None),
    "llama-mqa": ("llama", dict(num_attention_heads=8, num_key_value_heads=1), "float32", None, None),
    "mistral-mqa-no-window": ("mistral", dict(num_key_value_heads=1, sliding_window=None), "float32", None, None),
    "qwen3-gqa-4-untied-head-dim-8": ("qwen3", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8),
                                      "float32", None, None),
    "qwen3-mqa-tied-head-dim-32": ("qwen3", dict(num_key_value_heads=1, head_dim=32, tie_word_embeddings=True),
                                   "float32", None, None),
    "qwen2-head-dim-32-tied-gqa-4": ("qwen2", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                                                   tie_word_embeddings=True), "float32", None, None),
    "mistral-theta-1e6-head-dim-128": ("mistral", dict(rope_theta=1e6, head_dim=128, sliding_window=None),
                                       "float32", None, None),
    "llama-max-positions-32-eps-1e-5": ("llama", dict(max_position_embeddings=32, rms_norm_eps=1e-5), "float32",
                                        None, None),
    "llama31-old-spelling": ("llama", {}, "float32", old_rope(LLAMA3, 500000.0), None),
    "qwen25-yarn-old-type-key": ("qwen2", {}, "float32", old_rope(
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 1e6), None),
    "dynamic-old-type-key": ("llama", {}, "float32", old_rope({"type": "dynamic", "factor": 2.0}), None),
    "qwen3-llama3-rope-parameters": ("qwen3", dict(rope_parameters={**LLAMA3, "rope_theta": 1e6}), "float32", None, None),
    "qwen3-longrope-rope-parameters": ("qwen3", dict(head_dim=16, rope_parameters={**LONG, "rope_theta": 1e4}),
                                       "float32", None, None),
    "mistral-yarn-rope-parameters": ("mistral", dict(sliding_window=None, rope_parameters={
        "rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6, "original_max_position_embeddings": 128}),
                                     "float32", None, None),
    "llama3-top-level-original-max": ("llama", {}, "float32", top_level_original(LLAMA3, 64), None),
    "yarn-top-level-original-max": ("llama", {}, "float32", top_level_original(
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 32), None),
    "mistral-bf16-sharded": ("mistral", dict(sliding_window=None), "bfloat16", None, shard),
    "qwen2-fp16-tied": ("qwen2", dict(tie_word_embeddings=True), "float16", None, None),
    "qwen3-tied-without-model-prefix": ("qwen3", dict(head_dim=16, tie_word_embeddings=True), "float32", None,
                                        without_model_prefix),
    "llama-without-model-prefix": ("llama", {}, "float32", None, without_model_prefix),
    "llama-dtype-says-bf16-over-fp32-weights": ("llama", {}, "float32", lambda c: c.update(dtype="bfloat16"), None),
}


@live
@pytest.mark.parametrize("name", list(LIVE))
def test_variant_matches_transformers(tmp_path, name):
    arch, fields, dtype, config_edit, folder_edit = LIVE[name]
    path = tmp_path / name
    build_model(arch, dtype, **{"vocab_size": 300, "max_position_embeddings": 128, **fields}).save_pretrained(path)
    write_tokenizer(path)
    if config_edit:
        edit_json(path / "config.json", config_edit)
    if folder_edit:
        folder_edit(path)
    ids = prompt_ids(load_model_config(path).vocab_size)[:30]
    ref, greedy = hf_prompt_logits_and_greedy(path, ids, 9, 12)
    assert rel_err(minillm_prompt_logits(path, ids), ref) < 1e-4
    assert minillm_greedy(path, ids[:9], 12) == greedy
