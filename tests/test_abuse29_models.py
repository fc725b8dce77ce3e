"""config.json variants of real checkpoints: minillm runs them as transformers does, or refuses them
naming the field.

The config checks need no torch; with torch and transformers installed (`.[parity]`) tiny random
models of each variant are saved by transformers and minillm's prompt logits and greedy
continuation are compared with transformers' own.
"""
import json
import re

import pytest

from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.loader import load_model_config, load_weights

from make_fixtures import prompt_ids, write_tokenizer
from test_model_parity import minillm_greedy, minillm_prompt_logits, rel_err

try:
    import torch
    import transformers
except ImportError:          # the light test install: config checks only
    torch = transformers = None

live = pytest.mark.skipif(torch is None, reason="the live comparison needs torch and transformers (.[parity])")

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}


def config_of(tmp_path, arch="llama", drop=(), **fields):
    """load_model_config of a config.json of BASE with fields set and the keys in drop left out."""
    cfg = {"architectures": [ARCHITECTURES[arch]], **BASE, **fields}
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k not in drop}))
    return load_model_config(tmp_path)


# ---- refused, naming the field (transformers runs each of these differently) ---------------------

LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}


@pytest.mark.parametrize("arch, fields, drop, message", [
    ("llama", dict(hidden_act="gelu"), (), "hidden_act 'gelu'"),
    ("llama", dict(hidden_act="gelu_pytorch_tanh"), (), "hidden_act 'gelu_pytorch_tanh'"),
    ("qwen2", dict(hidden_act="relu"), (), "hidden_act 'relu'"),
    ("llama", dict(attention_bias=True), (), "attention_bias=true"),
    ("llama", dict(mlp_bias=True), (), "mlp_bias=true"),
    ("qwen3", dict(attention_bias=True), (), "attention_bias=true"),
    ("qwen3", dict(layer_types=["sliding_attention", "full_attention"]), (), "layer_types"),
    ("qwen2", dict(layer_types=["full_attention"]), (), "layer_types"),
    ("mistral", dict(sliding_window="16"), (), "'sliding_window' must be a positive integer"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers="1"), (), "max_window_layers"),
    ("llama", dict(partial_rotary_factor=0.5, rope_scaling={"rope_type": "linear", "factor": 2.0}), (),
     "partial_rotary_factor 0.5"),
    ("llama", dict(rope_parameters={**LONGROPE, "original_max_position_embeddings": 64}), (),
     "original_max_position_embeddings 64 < max_position_embeddings 256"),
    ("llama", dict(rope_scaling={**LONGROPE, "short_factor": [1.0] * 4}), (), "rope_scaling.short_factor"),
    ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}), (),
     "needs a 'low_freq_factor'"),
    ("llama", dict(rope_scaling={"rope_type": "su", "factor": 2.0}), (), "(longrope) needs a 'short_factor'"),
    ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": -1}), (),
     "rope_scaling.beta_fast"),
])
def test_unsupported_variants_are_refused_by_name(tmp_path, arch, fields, drop, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        config_of(tmp_path, arch, drop, **fields)


# ---- sliding windows: read, and the context held to them --------------------------------------------

@pytest.mark.parametrize("arch, fields, drop, window", [
    ("mistral", dict(sliding_window=16), (), 16),
    # transformers' MistralConfig windows 4096 positions when the field is left out (of 131072)
    ("mistral", {}, ("sliding_window", "max_position_embeddings"), 4096),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1), (), 16),
    ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0), (), 16),
    ("qwen3", dict(use_sliding_window=True, sliding_window=16, layer_types=["full_attention", "sliding_attention"]),
     (), 16),
    ("mistral", dict(sliding_window=256), (), None),            # as long as the context: no window
])
def test_a_sliding_window_is_read(tmp_path, arch, fields, drop, window):
    assert config_of(tmp_path, arch, drop, **fields).sliding_window == window


def test_the_context_is_held_to_the_window(tmp_path):
    # A window below the model's context was refused, so a model such as Mistral-7B-v0.1 (window
    # 4096 of 32768 positions) did not load at all; full-context attention is the model's own up to
    # the window, so the context is capped there, and a longer max_model_len is refused by name.
    config_of(tmp_path, "mistral", sliding_window=16)
    write_tokenizer(tmp_path)
    lines = []
    engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", load_format="dummy"), log=lines.append)
    assert engine.max_model_len == 16 and any("sliding_window" in line for line in lines)
    engine.shutdown()
    with pytest.raises(ValueError, match=r"max_model_len 64 exceeds the model's sliding_window 16"):
        LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", load_format="dummy", max_model_len=64))
    engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", load_format="dummy", max_model_len=12))
    assert engine.max_model_len == 12
    engine.shutdown()


# ---- read as transformers reads them ---------------------------------------------------------------

def test_rope_fields_are_read_as_transformers_reads_them(tmp_path):
    # a theta inside rope_parameters wins over a top-level one
    c = config_of(tmp_path / "a", rope_theta=5000, rope_parameters={"rope_type": "default", "rope_theta": 7000.0})
    assert c.rope_theta == 7000.0 and c.rope_scaling is None
    # a non-empty rope_scaling replaces rope_parameters whole, its theta too
    c = config_of(tmp_path / "b", rope_scaling={"type": "linear", "factor": 2.0},
                  rope_parameters={"rope_type": "default", "rope_theta": 7000.0})
    assert c.rope_theta == 10000.0 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    # llama3 and yarn without original_max_position_embeddings take max_position_embeddings;
    # a yarn factor of null is the ratio of the two
    c = config_of(tmp_path / "c", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0})
    assert c.rope_scaling["original_max_position_embeddings"] == 256
    c = config_of(tmp_path / "d", rope_scaling={"rope_type": "yarn", "factor": None,
                                                "original_max_position_embeddings": 64})
    assert c.rope_scaling["factor"] == 4.0
    # partial_rotary_factor is not read by transformers' default rotary
    assert config_of(tmp_path / "e", partial_rotary_factor=0.5).rope_scaling is None


def test_architecture_defaults_and_ignored_fields(tmp_path):
    # transformers' Qwen3Config gives head_dim 128 when config.json has none
    assert config_of(tmp_path / "q3", "qwen3", drop=("head_dim",)).head_dim == 128
    # Mistral's and Qwen3's MLPs and Mistral's attention take no bias whatever the config says
    assert config_of(tmp_path / "m", "mistral", sliding_window=None, attention_bias=True, mlp_bias=True)
    assert config_of(tmp_path / "q", "qwen3", mlp_bias=True)
    # no layer from max_window_layers on: no window
    assert config_of(tmp_path / "w", "qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=2)
    # a window as long as the context changes nothing
    assert config_of(tmp_path / "b", "mistral", sliding_window=256)
    assert config_of(tmp_path / "s", hidden_act="swish")                 # ACT2FN's other name for SiLU
    assert config_of(tmp_path / "d", dtype="bfloat16", torch_dtype="float16").torch_dtype == "bfloat16"


# ---- against transformers, live --------------------------------------------------------------------

def build_model(arch, dtype="float32", **fields):
    """A tiny random transformers model, its weights widened so logits differ."""
    torch.manual_seed(0)
    name = ARCHITECTURES[arch].replace("ForCausalLM", "")
    config = getattr(transformers, name + "Config")(**{**BASE, **fields})
    model = getattr(transformers, ARCHITECTURES[arch])(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2 if p.dim() > 1 else 1.0)
    return model.to(getattr(torch, dtype))


def edit_json(path, fn):
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def edit_tensors(path, fn):
    """Rewrite model.safetensors after fn(tensors) changed its name -> tensor dict."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def shard(path):
    """Split model.safetensors into two shards and a model.safetensors.index.json."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[:len(names) // 2], names[len(names) // 2:])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, path / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def distinct_head(tensors):
    tensors["lm_head.weight"] = torch.randn((128, 64), generator=torch.Generator().manual_seed(1))


def head_only(tensors):
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")


def old_rope_fields(cfg):
    cfg.pop("rope_parameters")
    cfg.update(rope_theta=5000, rope_scaling=None)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LIVE = {   # name: (arch, config fields, saved weights' dtype, a config.json edit, a tensors edit, a folder edit)
    "linear-old-type-key": ("llama", {}, "float32",
                            lambda c: c.update(rope_scaling={"type": "linear", "factor": 2.0}), None, None),
    "dynamic": ("llama", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "float32", None, None, None),
    "yarn": ("llama", dict(rope_scaling=YARN), "float32", None, None, None),
    "yarn-no-original-max": ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "float32",
                             None, None, None),
    "yarn-qwen2-attention-factor-betas": ("qwen2", dict(rope_scaling={**YARN, "attention_factor": 0.8, "beta_fast": 16,
                                                                      "beta_slow": 2}), "float32", None, None, None),
    "yarn-qwen3-mscale": ("qwen3", dict(rope_scaling={**YARN, "mscale": 0.7, "mscale_all_dim": 0.5, "truncate": False}),
                          "float32", None, None, None),
    "longrope": ("llama", dict(rope_scaling={**LONGROPE, "short_factor": [1.0 + 0.2 * i for i in range(8)],
                                             "factor": 4.0, "original_max_position_embeddings": 256}),
                 "float32", None, None, None),
    "llama3-no-original-max": ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0}),
                               "float32", lambda c: c["rope_parameters"].pop("original_max_position_embeddings"),
                               None, None),
    "theta-int-rope-scaling-null": ("llama", {}, "float32", old_rope_fields, None, None),
    "theta-top-level-and-in-parameters": ("llama", {}, "float32", lambda c: c.update(rope_theta=5000), None, None),
    "partial-rotary-default": ("qwen2", {}, "float32", lambda c: c.update(partial_rotary_factor=0.5), None, None),
    "llama-head-dim-32": ("llama", dict(head_dim=32), "float32", None, None, None),
    "mistral-head-dim-32-window-256": ("mistral", dict(head_dim=32, sliding_window=256), "float32", None, None, None),
    # prompt logits over the window's 16 positions, greedy 9 + 6: within it, where full attention is the window's
    "mistral-window-16": ("mistral", dict(sliding_window=16), "float32", None, None, None),
    "mistral-bias-fields-ignored": ("mistral", dict(sliding_window=None), "float32",
                                    lambda c: c.update(attention_bias=True, mlp_bias=True), None, None),
    "qwen2-window-no-layer": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2),
                              "float32", None, None, None),
    "qwen3-head-dim-128-left-out": ("qwen3", dict(head_dim=128), "float32", lambda c: c.pop("head_dim"), None, None),
    "swish": ("llama", {}, "float32", lambda c: c.update(hidden_act="swish"), None, None),
    "eps-1e-2": ("qwen3", dict(rms_norm_eps=1e-2), "float32", None, None, None),
    "tied-with-distinct-head": ("llama", dict(tie_word_embeddings=True), "float32", None, distinct_head, None),
    "tied-head-only": ("qwen2", dict(tie_word_embeddings=True), "float32", None, head_only, None),
    "extra-inv-freq": ("llama", {}, "float32", None,
                       lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}), None),
    "sharded-bf16": ("qwen3", {}, "bfloat16", None, None, shard),
    "float16-torch-dtype-key": ("llama", {}, "float16", lambda c: c.update(torch_dtype=c.pop("dtype")), None, None),
    "vocab-past-tokenizer-eos-list": ("llama", dict(vocab_size=160, eos_token_id=[2, 3]), "float32", None, None, None),
}


def hf_prompt_logits_and_greedy(path, ids, prompt_len, num_tokens):
    """transformers' float32 logits at every position of ids, and a plain greedy continuation of
    its first prompt_len ids (argmax of each step, no EOS handling, as minillm's ignore_eos)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].numpy()
        seq = list(ids[:prompt_len])
        for _ in range(num_tokens):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return logits, seq[prompt_len:]


@live
@pytest.mark.parametrize("name", list(LIVE))
def test_variant_matches_transformers(tmp_path, name):
    arch, fields, dtype, config_edit, tensors_edit, folder_edit = LIVE[name]
    path = tmp_path / name
    build_model(arch, dtype, **fields).save_pretrained(path)
    write_tokenizer(path)
    if config_edit:
        edit_json(path / "config.json", config_edit)
    if tensors_edit:
        edit_tensors(path, tensors_edit)
    if folder_edit:
        folder_edit(path)
    config = load_model_config(path)
    ids = prompt_ids(config.vocab_size)[:config.sliding_window]      # a window: the positions it covers
    num_tokens = 12 if config.sliding_window is None else config.sliding_window - 10
    ref, greedy = hf_prompt_logits_and_greedy(path, ids, 9, num_tokens)
    assert rel_err(minillm_prompt_logits(path, ids), ref) < 1e-4
    assert minillm_greedy(path, ids[:9], num_tokens) == greedy


@live
def test_tied_head_equal_to_the_embedding_is_not_loaded_twice(tmp_path):
    build_model("llama", tie_word_embeddings=True).save_pretrained(tmp_path)
    edit_tensors(tmp_path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    assert "lm_head.weight" not in load_weights(tmp_path, load_model_config(tmp_path), "float32")
