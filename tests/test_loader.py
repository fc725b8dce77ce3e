"""Model loading: config.json -> ModelConfig, safetensors -> numpy, model paths and downloads."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from minillm.loader import (
    bf16_bits_to_float32,
    expected_weight_shapes,
    float32_to_bf16_bits,
    list_local_models,
    load_model_config,
    load_weights,
    resolve_model_path,
)

from conftest import put_in_hf_cache
from make_fixtures import FIXTURES, TINY_DIR, TINY_MODELS

try:
    import torch
    import transformers
except ImportError:          # the light test install: checkpoints are written with safetensors.numpy
    torch = transformers = None

live = pytest.mark.skipif(torch is None, reason="needs torch and transformers (.[parity])")

STORIES = Path(os.environ.get("MINILLM_TEST_MODEL",
                              Path(__file__).resolve().parents[1].parent / "shared" / "models" / "stories260K"))
needs_stories = pytest.mark.skipif(not (STORIES / "config.json").is_file(), reason="stories260K not present")

TINY = dict(vocab_size=160, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),   # head_dim != hidden / heads
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def save_tiny(out: Path, family: str, dtype: str = "float32", **overrides):
    """A tiny random model of one family saved by transformers; returns (path, state_dict)."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    config = getattr(transformers, config_cls)(**{**TINY, "tie_word_embeddings": False, **extra, **overrides})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():   # norms start at exactly 1.0; random values test the conversions better
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    model = model.to(TORCH_DTYPES[dtype])
    model.save_pretrained(out)
    return out, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _bits(t) -> np.ndarray:
    """A torch bfloat16 tensor's bit patterns as uint16."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def save_numpy_checkpoint(out: Path, family: str = "llama", dtype=np.float32, shard_files: int = 1,
                          drop: tuple[str, ...] = (), **overrides) -> tuple[Path, dict[str, np.ndarray]]:
    """A random checkpoint written by safetensors.numpy (no torch): (path, the arrays written)."""
    from safetensors.numpy import save_file

    extra = FAMILIES[family][2]
    write_config(out, architectures=[ARCHITECTURES[family]], **{"tie_word_embeddings": False, **extra, **overrides})
    rng = np.random.default_rng(0)
    state = {name: rng.standard_normal(shape).astype(dtype)
             for name, shape in expected_weight_shapes(load_model_config(out)).items() if name not in drop}
    names = sorted(state)
    if shard_files == 1:
        save_file(state, str(out / "model.safetensors"))
        return out, state
    weight_map = {}
    for i in range(shard_files):
        file = f"model-{i + 1:05d}-of-{shard_files:05d}.safetensors"
        part = {n: state[n] for n in names[i::shard_files]}
        save_file(part, str(out / file))
        weight_map.update(dict.fromkeys(part, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out, state


def write_config(path: Path, **fields) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    base = {"architectures": ["LlamaForCausalLM"], **{k: v for k, v in TINY.items()}}
    base.update(fields)
    (path / "config.json").write_text(json.dumps({k: v for k, v in base.items() if v is not None}))
    return path


# ---- stories260K --------------------------------------------------------------------------------


@needs_stories
def test_stories_config_matches_config_json():
    raw = json.loads((STORIES / "config.json").read_text())
    c = load_model_config(STORIES)
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size) == ("llama", 512, 64, 172)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        raw["num_hidden_layers"], raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"])
    assert c.rms_norm_eps == raw["rms_norm_eps"] and c.rope_theta == raw["rope_theta"]
    assert c.max_position_embeddings == 512 and c.tie_word_embeddings is True
    assert c.rope_scaling is None and c.torch_dtype == "float32"
    assert c.bos_token_id == 1 and c.eos_token_id == (2,)
    assert not c.attention_bias and not c.qk_norm


@needs_stories
def test_stories_weights_match_safetensors():
    from safetensors.numpy import load_file

    ref = load_file(str(STORIES / "model.safetensors"))
    config = load_model_config(STORIES)
    w = load_weights(STORIES, config, "float32")
    assert set(w) == set(expected_weight_shapes(config)) == set(ref) - {"lm_head.weight"}
    for name, arr in w.items():
        assert arr.dtype == np.float32 and np.array_equal(arr, ref[name]), name
    w16 = load_weights(STORIES, config, "float16")
    assert all(w16[k].dtype == np.float16 and np.array_equal(w16[k], ref[k].astype(np.float16)) for k in w16)
    wbf = load_weights(STORIES, config, "bfloat16")
    for name, arr in wbf.items():   # the rounding itself is held against torch's below
        assert arr.dtype == np.uint16 and np.array_equal(arr, float32_to_bf16_bits(ref[name])), name


# ---- tiny transformers models -------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_checkpoints_saved_by_transformers_load(name):
    """The fixtures are transformers' own save_pretrained output (bf16): names, shapes, dtypes, features."""
    path = TINY_DIR / name
    config = load_model_config(path)
    family, overrides = TINY_MODELS[name]
    assert config.architecture == family and config.torch_dtype == "bfloat16"
    assert config.attention_bias == (family == "qwen2") and config.qk_norm == (family == "qwen3")
    assert config.head_dim == overrides.get("head_dim", config.hidden_size // config.num_heads)
    assert config.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    from minillm.loader import checkpoint_tensors
    stored = checkpoint_tensors(path)
    expected = expected_weight_shapes(config)
    assert set(stored) == set(expected) and all(stored[k].shape == expected[k] for k in expected)
    native, as_f32 = load_weights(path, config, "bfloat16"), load_weights(path, config, "float32")
    for name_, bits in native.items():
        assert bits.dtype == np.uint16 and as_f32[name_].dtype == np.float32
        assert np.array_equal(bf16_bits_to_float32(bits), as_f32[name_]), name_   # bf16 -> fp32 is exact
        assert np.array_equal(float32_to_bf16_bits(as_f32[name_]), bits), name_


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("saved", [np.float32, np.float16])
def test_numpy_checkpoints_load_exactly(tmp_path, family, saved):
    path, state = save_numpy_checkpoint(tmp_path / family, family, saved)
    config = load_model_config(path)
    assert config.architecture == family and config.torch_dtype == np.dtype(saved).name
    for dtype in ("float32", "float16"):
        loaded = load_weights(path, config, dtype)
        assert set(loaded) == set(state)
        for name, arr in state.items():
            assert loaded[name].dtype == np.dtype(dtype) and np.array_equal(loaded[name], arr.astype(dtype)), name


@live
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("saved", ["float32", "float16", "bfloat16"])
def test_tiny_models_load_exactly(tmp_path, family, saved):
    path, state = save_tiny(tmp_path / family, family, saved)
    config = load_model_config(path)
    assert config.architecture == family and config.torch_dtype == saved
    assert config.attention_bias == (family == "qwen2") and config.qk_norm == (family == "qwen3")
    assert config.head_dim == (16 if family == "qwen3" else 8) and config.num_kv_heads == 2
    expected = expected_weight_shapes(config)
    assert set(expected) == set(state)
    as_f32 = load_weights(path, config, "float32")
    native = load_weights(path, config, saved)
    for name, tensor in state.items():
        assert tuple(tensor.shape) == expected[name]
        assert as_f32[name].dtype == np.float32
        assert np.array_equal(as_f32[name], tensor.float().numpy()), name   # bf16 -> fp32 is exact
        if saved == "bfloat16":
            assert native[name].dtype == np.uint16 and np.array_equal(native[name], _bits(tensor)), name
        else:
            assert np.array_equal(native[name], tensor.numpy()), name


def test_sharded_numpy_checkpoint_loads(tmp_path):
    path, state = save_numpy_checkpoint(tmp_path / "sharded", "qwen2", shard_files=3)
    w = load_weights(path, load_model_config(path), "float32")
    assert set(w) == set(state) and all(np.array_equal(w[k], state[k]) for k in state)
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ValueError, match="shard model-00002-of-00003.safetensors"):
        load_weights(path, load_model_config(path), "float32")


@live
def test_sharded_checkpoint_loads(tmp_path):
    path, state = save_tiny(tmp_path / "sharded", "qwen2", "float32")
    for f in path.glob("*.safetensors"):
        f.unlink()
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config.from_pretrained(path))
    model.load_state_dict(state)
    model.save_pretrained(path, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 2
    w = load_weights(path, load_model_config(path), "float32")
    assert set(w) == set(state)
    assert all(np.array_equal(w[k], state[k].numpy()) for k in state)


def test_tied_embeddings_need_no_lm_head(tmp_path):
    path, state = save_numpy_checkpoint(tmp_path / "tied", "llama", tie_word_embeddings=True)
    config = load_model_config(path)
    assert config.tie_word_embeddings
    w = load_weights(path, config, "float32")
    assert "lm_head.weight" not in w and "lm_head.weight" not in expected_weight_shapes(config)
    assert np.array_equal(w["model.embed_tokens.weight"], state["model.embed_tokens.weight"])


# ---- config parsing -----------------------------------------------------------------------------


def test_config_defaults_and_normalisation(tmp_path):
    c = load_model_config(write_config(tmp_path / "a", num_key_value_heads=None, eos_token_id=[2, 7],
                                       rope_scaling={"type": "linear", "factor": 2.0}))
    assert c.num_kv_heads == 4 and c.head_dim == 8 and c.rope_theta == 10000.0
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert c.eos_token_id == (2, 7) and c.torch_dtype == "float32"


def test_rope_parameters_of_transformers_5(tmp_path):
    params = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    c = load_model_config(write_config(tmp_path / "l3", rope_parameters=params, dtype="bfloat16"))
    assert c.rope_theta == 500000.0 and c.torch_dtype == "bfloat16"
    assert c.rope_scaling == {k: v for k, v in params.items() if k != "rope_theta"}
    c = load_model_config(write_config(tmp_path / "plain", rope_parameters={"rope_theta": 1e6, "rope_type": "default"}))
    assert c.rope_theta == 1e6 and c.rope_scaling is None


@pytest.mark.parametrize("scaling,message", [
    ({"rope_type": "llama3"}, "needs a 'factor'"),                             # was a KeyError traceback
    ([1, 2], "'rope_scaling' must be an object"),
    ("yes", "'rope_scaling' must be an object"),
    ({"rope_type": "linear", "factor": "abc"}, "'rope_scaling.factor' must be a positive number"),
    ({"rope_type": "linear", "factor": 0}, "'rope_scaling.factor' must be a positive number"),   # NaN tables
    ({"rope_type": "llama3", "factor": 8, "low_freq_factor": 2, "high_freq_factor": 2},
     "high_freq_factor must be greater than low_freq_factor"),
    ({"rope_type": "dual", "factor": 4}, "rope_scaling type 'dual' is not supported"),
])
def test_bad_rope_scaling_is_named(tmp_path, scaling, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_model_config(write_config(tmp_path / "r", rope_scaling=scaling))


def test_mistral_runs_as_llama_with_its_window_read(tmp_path):
    c = load_model_config(write_config(tmp_path / "m", architectures=["MistralForCausalLM"], sliding_window=None))
    assert c.architecture == "llama" and c.sliding_window is None
    c = load_model_config(write_config(tmp_path / "m1", architectures=["MistralForCausalLM"], sliding_window=16))
    assert c.sliding_window == 16        # the engine holds max_model_len to it (tests/test_abuse29_models.py)


def test_unknown_architecture_is_named(tmp_path):
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM"):
        load_model_config(write_config(tmp_path / "gpt2", architectures=["GPT2LMHeadModel"]))


@pytest.mark.parametrize("field, value", [("hidden_size", None), ("num_attention_heads", 0),
                                          ("num_key_value_heads", 3), ("hidden_act", "gelu")])
def test_bad_config_field_is_named(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        load_model_config(write_config(tmp_path / "bad", **{field: value}))


# ---- errors ---------------------------------------------------------------------------------------


def test_missing_config_json_names_the_path(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path}.*config.json"):
        load_model_config(tmp_path)
    with pytest.raises(ValueError, match=f"{tmp_path}.*config.json"):
        resolve_model_path(str(tmp_path))


def test_missing_tensor_is_named(tmp_path):
    path, _ = save_numpy_checkpoint(tmp_path / "missing", "llama", drop=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        load_weights(path, load_model_config(path), "float32")


def test_untied_without_lm_head_is_an_error(tmp_path):
    path, _ = save_numpy_checkpoint(tmp_path / "nohead", "llama", drop=("lm_head.weight",))
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        load_weights(path, load_model_config(path), "float32")


def test_wrong_shape_names_tensor_and_shapes(tmp_path):
    path, _ = save_numpy_checkpoint(tmp_path / "shape", "qwen3")
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 40
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight in model\.safetensors has "
                                         r"shape \[48, 32\], expected \[40, 32\]"):
        load_weights(path, load_model_config(path), "float32")


def test_no_weights_and_bad_dtype(tmp_path):
    path = write_config(tmp_path / "empty")
    with pytest.raises(ValueError, match="safetensors"):
        load_weights(path, load_model_config(path), "float32")
    with pytest.raises(ValueError, match="dtype"):
        load_weights(path, load_model_config(path), "int8")


def test_offline_repo_id_says_it_could_not_fetch(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match=r"no such directory: someorg/tiny-model; as a Hugging Face repo id "
                                           r"it could not be fetched"):
        resolve_model_path("someorg/tiny-model", download_dir=str(tmp_path))


def test_a_missing_path_is_no_such_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shared").mkdir()
    model = save_numpy_checkpoint(tmp_path / "real" / "models" / "tiny", "llama")[0]
    (tmp_path / "elsewhere").symlink_to(tmp_path / "real")      # shared folders are often links
    for missing in (str(tmp_path / "does" / "not" / "exist"), "./tiny", "shared/tiny", "a/b/c"):
        # shared/ exists here, so shared/tiny is a mistyped path, never a hub id to fetch
        with pytest.raises(FileNotFoundError, match=f"no such directory: {missing}") as info:
            resolve_model_path(missing)
        if missing.endswith("tiny"):
            assert "did you mean ./elsewhere/models/tiny or ./real/models/tiny?" in str(info.value)
    with pytest.raises(FileNotFoundError, match="not a Hugging Face repo id"):
        resolve_model_path("not a repo id")
    with pytest.raises(ValueError, match="is a file"):
        resolve_model_path(str(model / "config.json"))


# ---- the model store: the Hugging Face cache -------------------------------------------------------


def test_hub_ids_come_from_the_hugging_face_cache(tmp_path, monkeypatch):
    """HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub: what other tools downloaded is used."""
    from minillm.model_store import hf_hub_cache

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hf_hub_cache() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    assert hf_hub_cache() == tmp_path / "hf-home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    assert hf_hub_cache() == tmp_path / "hub-cache"

    tiny = save_numpy_checkpoint(tmp_path / "src", "llama")[0]
    snapshot = put_in_hf_cache(tmp_path / "hub-cache", "someorg/tiny-llama", tiny)
    monkeypatch.chdir(tmp_path)      # the working directory plays no part
    assert resolve_model_path("someorg/tiny-llama") == snapshot
    assert load_model_config(resolve_model_path("someorg/tiny-llama")).architecture == "llama"
    other = put_in_hf_cache(tmp_path / "elsewhere", "someorg/tiny-llama", tiny)
    assert resolve_model_path("someorg/tiny-llama", download_dir=str(tmp_path / "elsewhere")) == other


def test_a_revision_picks_its_snapshot_of_a_hub_model(tmp_path, monkeypatch):
    """vLLM's revision: a branch or tag (a ref in the cache) or a commit names the snapshot; a local
    directory has none to pick."""
    import shutil
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tiny = save_numpy_checkpoint(tmp_path / "src", "llama")[0]
    store = tmp_path / "hub"
    main = put_in_hf_cache(store, "someorg/tiny-llama", tiny, revision="0123abcd")
    tagged = shutil.copytree(main, main.parent / "fedc9876", symlinks=True)
    (main.parents[1] / "refs" / "v2").write_text("fedc9876")
    for revision, want in ((None, main), ("main", main), ("0123abcd", main), ("v2", tagged), ("fedc9876", tagged)):
        assert resolve_model_path("someorg/tiny-llama", str(store), revision) == want, revision
    with pytest.raises(RuntimeError, match="could not be fetched at revision 'nope'"):
        resolve_model_path("someorg/tiny-llama", str(store), "nope")
    with pytest.raises(ValueError, match="revision 'main' names a version of a hub model; .* is a local directory"):
        resolve_model_path(str(tiny), revision="main")


def test_the_store_is_listed_with_what_minillm_cannot_run(tmp_path):
    cache = tmp_path / "hub"
    tiny = save_numpy_checkpoint(tmp_path / "src", "qwen2")[0]
    (tiny / "tokenizer.json").write_text("{}")      # minillm runs no snapshot without one (list looks for it)
    put_in_hf_cache(cache, "someorg/tiny-qwen", tiny)
    put_in_hf_cache(cache, "other/half", write_config(tmp_path / "half"))   # config, no weights
    gguf = tmp_path / "gguf"
    gguf.mkdir()
    (gguf / "model.Q4_K_M.gguf").write_bytes(b"GGUF")
    put_in_hf_cache(cache, "someone/a-gguf", gguf)
    (cache / "datasets--x--y").mkdir()                                        # not a model repo
    listed = {m.repo_id: m for m in list_local_models(str(cache))}
    assert sorted(listed) == ["other/half", "someone/a-gguf", "someorg/tiny-qwen"]
    assert listed["someorg/tiny-qwen"].note == ""
    assert listed["someorg/tiny-qwen"].size_bytes == sum(f.stat().st_size for f in tiny.iterdir())
    assert listed["other/half"].note == "no safetensors weights"
    assert listed["someone/a-gguf"].note == "no config.json"
    assert list_local_models(str(tmp_path / "nowhere")) == []


# ---- bf16 conversion ---------------------------------------------------------------------------------


def test_bf16_rounding_matches_torch_fixture():
    ref = np.load(FIXTURES / "bf16_rounding.npz")       # torch's rounding (tests/make_fixtures.py)
    assert np.array_equal(float32_to_bf16_bits(ref["x"]), ref["bits"])
    nan = float32_to_bf16_bits(np.array([np.nan, -np.nan], dtype=np.float32))
    assert np.isnan(bf16_bits_to_float32(nan)).all()
    # bf16 -> fp32 is exact: widening back and rounding again gives the same bits
    assert np.array_equal(float32_to_bf16_bits(bf16_bits_to_float32(ref["bits"])), ref["bits"])


@live
def test_bf16_rounding_matches_torch():
    from make_fixtures import bf16_rounding_inputs, torch_bf16_bits

    x = bf16_rounding_inputs()
    ref = torch_bf16_bits(x)
    assert np.array_equal(float32_to_bf16_bits(x), ref)
    assert np.array_equal(bf16_bits_to_float32(ref), torch.from_numpy(x).to(torch.bfloat16).float().numpy())


def test_checkpoint_dtype_read_from_tensors_when_config_has_none(tmp_path):
    path = tmp_path / "nodtype"
    path.mkdir()
    for f in (TINY_DIR / "qwen2-bias").iterdir():      # saved by transformers in bf16
        (path / f.name).symlink_to(f)
    (path / "config.json").unlink()
    cfg = json.loads((TINY_DIR / "qwen2-bias" / "config.json").read_text())
    cfg.pop("dtype", None), cfg.pop("torch_dtype", None)
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(path).torch_dtype == "bfloat16"


@pytest.mark.parametrize("name, hint", [
    ("model.Q4_K_M.gguf", "GGUF files (llama.cpp, Ollama) are not read: give a Hugging Face model directory"),
    ("model.safetensors", "give the directory that holds it"),
    ("notes.txt", None)])
def test_a_file_given_as_the_model_says_what_to_give_instead(tmp_path, name, hint):
    path = tmp_path / name
    path.write_bytes(b"GGUF" if name.endswith(".gguf") else b"{}")
    with pytest.raises(ValueError) as caught:
        resolve_model_path(str(path))
    message = str(caught.value)
    assert message.startswith(f"{path} is a file, not a model directory")
    if hint is None:
        assert message == f"{path} is a file, not a model directory"
    else:
        assert hint in message and (hint != "give the directory that holds it" or str(tmp_path) in message)
