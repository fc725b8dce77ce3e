"""Model directories and model options as vLLM users bring them: a rope scaling that stretches the
context, a checkpoint without its output head, vLLM's dotted form of a flag minillm refuses."""
from __future__ import annotations

import json
import re

import pytest
from test_abuse29b_cli import one_line
from test_abuse37_model_files import stories_copy
from test_cli import run_main

from minillm import LLM
from minillm.loader import load_model_config, load_weights

LINEAR = {"rope_type": "linear", "factor": 2.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}


@pytest.fixture(autouse=True)
def no_long_max_model_len(monkeypatch):
    for name in ("MINILLM_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("scaling, length, source", [
    (LINEAR, 1024, "length 1024 (max_position_embeddings 512 x its linear rope_scaling factor 2)"),
    (YARN, 1024, "length 1024 (its yarn rope_scaling original_max_position_embeddings 256 x factor 4)"),
    # vLLM derives yarn's length from original_max_position_embeddings, even below max_position_embeddings
    ({**YARN, "factor": 2.0, "original_max_position_embeddings": 128}, 256,
     "length 256 (its yarn rope_scaling original_max_position_embeddings 128 x factor 2)"),
    # dynamic's table past max_position_embeddings is another one: its length stays (vLLM's is 1024)
    ({"rope_type": "dynamic", "factor": 2.0}, 512, "max_position_embeddings 512"),
])
def test_a_rope_scaling_stretches_the_models_length_as_vllm_derives_it(stories_path, tmp_path, scaling, length,
                                                                      source):
    """vLLM's max_model_len of a linear (or yarn) model is max_position_embeddings (or yarn's
    original_max_position_embeddings) times the factor; minillm held every model to
    max_position_embeddings, refusing --max-model-len 131072 for a Qwen2.5 with YaRN factor 4."""
    folder = stories_copy(stories_path, tmp_path / "m", rope_scaling=scaling)
    with LLM(str(folder), device="cpu", num_kv_blocks=80) as llm:
        assert llm.llm_engine.max_model_len == length
    with pytest.raises(ValueError, match=re.escape(f"max_model_len {length + 1} exceeds the model's {source}")):
        LLM(str(folder), device="cpu", max_model_len=length + 1, num_kv_blocks=80)


def test_a_prompt_past_max_position_embeddings_runs_within_the_stretched_length(stories_path, tmp_path, capsys):
    folder = stories_copy(stories_path, tmp_path / "m", rope_scaling=LINEAR)
    status, out, err = run_main(capsys, "generate", str(folder), "--device", "cpu", "--max-model-len", "1k",
                                "--num-kv-blocks", "80", "-p", " ".join(["a"] * 700), "--max-tokens", "3",
                                "--ignore-eos", "--json")
    assert status == 0, err
    record = json.loads(out)
    assert len(record["prompt_token_ids"]) > 512 and len(record["outputs"][0]["token_ids"]) == 3
    status, _, err = run_main(capsys, "generate", str(folder), "--device", "cpu", "--max-model-len", "1025",
                              "-p", "Once")
    assert status == 2 and "'--max-model-len': 1025 exceeds the model's length 1024" in one_line(err), err


@pytest.mark.parametrize("tied", [None, False])
def test_a_missing_output_head_names_tie_word_embeddings(stories_path, tmp_path, tied):
    """transformers reads an absent tie_word_embeddings as false and fills the head at random; vLLM
    refuses the checkpoint. The error named the tensor only, not the field that asks for it."""
    folder = stories_copy(stories_path, tmp_path / "m", tie_word_embeddings=tied)
    if tied is None:        # left out of config.json, as a tied checkpoint saved by hand may leave it
        cfg = json.loads((folder / "config.json").read_text())
        del cfg["tie_word_embeddings"]
        (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"missing tensor lm_head\.weight \(config\.json's tie_word_embeddings "
                                         r"is false or absent, which reads as false: .* says true\)"):
        load_weights(folder, load_model_config(folder), "float32")


@pytest.mark.parametrize("flag", ["--hf-overrides.max_position_embeddings", "--hf_overrides.rope_scaling.factor"])
def test_the_dotted_form_of_a_refused_vllm_flag_says_why(stories_path, capsys, flag):
    """vLLM takes --hf-overrides.KEY VALUE as --hf-overrides '{"KEY": VALUE}'; the dotted form got a
    bare 'No such option' where --hf-overrides says what minillm does instead."""
    status, _, err = run_main(capsys, "generate", str(stories_path), "-p", "hi", flag, "4")
    assert status == 2 and f"No such option: {flag}: minillm reads config.json as it is" in err, err


@pytest.mark.parametrize("files, said", [
    (["tiny.Q4_K_M.gguf", "tiny.Q8_0.gguf"], "; it holds GGUF files (tiny.Q4_K_M.gguf and 1 more), which minillm "
                                             "does not read: give a Hugging Face model directory"),
    (["params.json", "consolidated.safetensors"], "; it holds params.json, Mistral's own format (vLLM's "
                                                  "--config-format mistral), which minillm does not read"),
    (["model.safetensors"], ""),
])
def test_a_directory_without_config_json_says_what_it_holds_instead(tmp_path, files, said):
    """A folder of GGUF files (a llama.cpp or Ollama download) or of Mistral's own format was only
    'has no config.json'."""
    folder = tmp_path / "m"
    folder.mkdir()
    for name in files:
        (folder / name).write_bytes(b"{}")
    with pytest.raises(ValueError, match=re.escape(f"model directory {folder} has no config.json{said}") +
                       ("$" if not said else "")):
        LLM(str(folder), device="cpu")


def test_a_models_folder_of_a_hugging_face_cache_names_its_hub_id(tmp_path, monkeypatch):
    folder = tmp_path / "hub" / "models--org--tiny"
    (folder / "snapshots" / "abc").mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    with pytest.raises(ValueError, match=re.escape(f"it is a model's folder in a Hugging Face cache: give the hub id "
                                                   f"org/tiny, and {tmp_path / 'hub'} as the download directory")):
        LLM(str(folder), device="cpu")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match=r"it is a model's folder in a Hugging Face cache: give the hub id org/tiny$"):
        LLM(str(folder), device="cpu")


MISTRAL_NAMES = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
                 "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
                 "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
                 "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
                 "post_attention_layernorm": "ffn_norm", "model.layers.": "layers."}


def mistral_name(name: str) -> str:
    for hf, own in MISTRAL_NAMES.items():
        name = name.replace(hf, own)
    return name


@pytest.mark.parametrize("rename, file, shown", [
    (mistral_name, "consolidated.safetensors", "layers.0.attention.wk.weight"),
    (lambda name: "language_model." + name, "model.safetensors", "language_model.model.embed_tokens.weight"),
])
def test_a_checkpoint_in_another_layout_names_a_tensor_it_holds(stories_path, tmp_path, rename, file, shown):
    """Mistral's own consolidated.safetensors, or a multimodal model's language_model. names, under a Hugging
    Face config.json: the error named only the first tensor the model missed (model.embed_tokens.weight)."""
    from safetensors.numpy import load_file, save_file
    folder = stories_copy(stories_path, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    save_file({rename(k): v for k, v in load_file(stories_path / "model.safetensors").items()}, folder / file)
    with pytest.raises(ValueError, match=r"is missing tensor model\.embed_tokens\.weight \(and \d+ more\) and holds " +
                       re.escape(f"tensors LlamaForCausalLM has no place for, such as {shown} in {file}: its tensors "
                                 f"are not named as Hugging Face's LlamaForCausalLM names them")):
        load_weights(folder, load_model_config(folder), "float32")


@pytest.mark.parametrize("file", ["chat_template.jinja", "additional_chat_templates/tool_use.jinja"])
def test_a_template_file_that_is_not_utf8_is_named(stories_path, tmp_path, file):
    """transformers' save_pretrained writes these beside tokenizer_config.json; one that was not UTF-8
    failed with the decoder's message alone ("'utf-8' codec can't decode byte 0xff ..."), naming no file."""
    from minillm.tokenizer import Tokenizer
    folder = stories_copy(stories_path, tmp_path / "m")
    (folder / file).parent.mkdir(exist_ok=True)
    (folder / file).write_bytes(b"\xff{{ messages }}")
    with pytest.raises(ValueError, match=re.escape(f"chat template file {folder / file} is not UTF-8 text: invalid "
                                                   f"start byte at byte 0")):
        Tokenizer.from_pretrained(folder)


def test_a_tensor_the_index_places_in_a_shard_that_lacks_it_names_both(stories_path, tmp_path):
    """A shard of another version of the checkpoint (or one cut short) beside its index: the error named
    the missing tensor alone, not the shard the index says holds it."""
    from safetensors.numpy import load_file, save_file
    folder = stories_copy(stories_path, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    tensors = load_file(stories_path / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:20], "model-00002-of-00002.safetensors": names[20:]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part if n != names[5]}, folder / file)
    weight_map = {n: file for file, part in shards.items() for n in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(ValueError, match=re.escape(f"is missing tensor {names[5]} (model.safetensors.index.json "
                                                   f"places it in model-00001-of-00002.safetensors, which does not "
                                                   f"hold it)")):
        load_weights(folder, load_model_config(folder), "float32")
