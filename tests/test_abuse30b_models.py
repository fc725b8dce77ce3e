"""Model directories broken in the ways downloads, hand edits and half-finished exports break them:
a shard that is a folder, safetensors offsets that run backwards or past the file, one tensor in two
shards, a chat template that does not compile, a config whose sizes do not agree, a vocabulary
smaller than the tokenizer's ids. Each is refused once at load with a message naming the file, the
field or the tensor, or loads as transformers loads it."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from test_abuse29_cli import EMBED, model_with_header
from test_abuse30_models import stories_copy
from test_chat import STORIES, needs_stories

from minillm.loader import checkpoint_tensors, load_model_config

pytestmark = needs_stories
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def shard(path: Path) -> dict[str, str]:
    """Split path's model.safetensors into two shards and an index; the index's weight_map."""
    from safetensors.numpy import load_file, save_file
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for file, part in zip(SHARDS, (names[:len(names) // 2], names[len(names) // 2:])):
        save_file({n: tensors[n] for n in part}, path / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    write_index(path, weight_map)
    return weight_map


def write_index(path: Path, weight_map: dict[str, str]) -> None:
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def generate(capsys, path: Path) -> tuple[int, str, str]:
    """`minillm generate PATH --device cpu -p hi`: (exit status, stdout, stderr on one line)."""
    from minillm.cli import main
    try:
        status = main(["generate", str(path), "--device", "cpu", "-p", "hi", "--max-tokens", "3"])
    except SystemExit as exc:
        status = exc.code
    out, err = capsys.readouterr()
    return status, out, " ".join(err.split())


# ---- safetensors shards and headers -------------------------------------------------------------------


def test_a_shard_the_index_names_that_is_a_directory_is_named_as_a_directory(tmp_path, capsys):
    """The index's shard was a folder of that name: "shard ... is missing from ...", which it is not."""
    path = stories_copy(tmp_path)
    shard(path)
    (path / SHARDS[1]).unlink()
    (path / SHARDS[1]).mkdir()
    with pytest.raises(ValueError, match=f"{SHARDS[1]} named in model.safetensors.index.json is a directory, "
                                         f"not safetensors weights"):
        checkpoint_tensors(path)
    status, out, err = generate(capsys, path)
    assert (status, out) == (1, "") and "is a directory, not safetensors weights" in err and "missing" not in err


def test_a_shard_the_index_names_that_is_a_link_to_nothing_says_where_it_leads(tmp_path):
    path = stories_copy(tmp_path)
    shard(path)
    (path / SHARDS[1]).unlink()
    (path / SHARDS[1]).symlink_to("../../blobs/abc")
    with pytest.raises(ValueError, match=f"{SHARDS[1]} named in model.safetensors.index.json cannot be read: it is "
                                         f"a symbolic link to ../../blobs/abc, which does not exist"):
        checkpoint_tensors(path)


@pytest.mark.parametrize("offsets, message", [
    ([10, 5], "tensor model.embed_tokens.weight has data_offsets [10, 5]: its end comes before its start"),
    ([0, 99_999_999], "tensor model.embed_tokens.weight has data_offsets [0, 99999999], past the end of "
                      "its data (1040128 bytes; a truncated download?)"),
], ids=["backwards", "past-the-end"])
def test_data_offsets_backwards_or_past_the_end_are_named_precisely(tmp_path, capsys, offsets, message):
    """[10, 5] was "its header has no dtype, shape and data_offsets", which it has."""
    path = model_with_header(STORIES, tmp_path / "m", lambda h: h[EMBED].update(data_offsets=offsets))
    with pytest.raises(ValueError) as raised:
        checkpoint_tensors(path)
    assert f"model.safetensors is not a safetensors file ({message})" in str(raised.value)
    status, out, err = generate(capsys, path)
    assert (status, out) == (1, "") and message in err


def test_overlapping_data_offsets_name_both_tensors(tmp_path):
    """The norm's bytes inside the embedding's: the error named the embedding alone, though it is
    the norm's offsets that are wrong."""
    path = model_with_header(STORIES, tmp_path / "m",
                             lambda h: h["model.norm.weight"].update(data_offsets=[0, 256]))
    with pytest.raises(ValueError, match=r"model.safetensors is not a safetensors file \(tensor "
                                         r"model.embed_tokens.weight's data_offsets overlap another tensor: model.embed_tokens.weight "
                                         r"at \[0, 131072\], model.norm.weight at \[0, 256\]\)"):
        checkpoint_tensors(path)


def test_one_tensor_in_two_shards_is_logged_with_both_files_and_the_copy_used(tmp_path, caplog):
    """A tensor saved in both shards loaded without a word (the later shard's copy, as transformers
    and vLLM take it)."""
    from safetensors.numpy import load_file, save_file
    path = stories_copy(tmp_path)
    weight_map = shard(path)
    name = next(n for n, f in weight_map.items() if f == SHARDS[1])
    first = load_file(path / SHARDS[0])
    first[name] = load_file(path / SHARDS[1])[name] * 0
    save_file(first, path / SHARDS[0], metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="minillm"):
        tensors = checkpoint_tensors(path, log_conflicts=True)
    assert tensors[name].file.name == SHARDS[1]
    assert f"tensor {name} is in both {SHARDS[0]} and {SHARDS[1]}; the copy in {SHARDS[1]} is used" in caplog.text


def test_an_index_that_names_the_wrong_shard_for_a_tensor_is_logged_once(tmp_path, caplog):
    path = stories_copy(tmp_path, torch_dtype=None)      # the dtype read from the weights: two reads
    weight_map = shard(path)
    moved = [n for n, f in weight_map.items() if f == SHARDS[0]][:3]
    write_index(path, {**weight_map, **dict.fromkeys(moved, SHARDS[1])})
    with caplog.at_level(logging.WARNING, logger="minillm"):
        tensors = checkpoint_tensors(path, log_conflicts=True)
    assert tensors[moved[0]].file.name == SHARDS[0]
    warning = (f"model.safetensors.index.json names {SHARDS[1]} for tensor {moved[0]} (and 2 more), but it is in "
               f"{SHARDS[0]}; loaded from there")
    assert warning in caplog.text
    caplog.clear()
    from minillm import LLM, SamplingParams
    with caplog.at_level(logging.WARNING, logger="minillm"):
        out = LLM(str(path), device="cpu").generate(["Once"], SamplingParams(temperature=0, max_tokens=3))
    assert out[0].outputs[0].text and caplog.text.count(warning) == 1


def test_a_consistent_sharded_checkpoint_logs_nothing(tmp_path, caplog):
    path = stories_copy(tmp_path)
    shard(path)
    with caplog.at_level(logging.WARNING, logger="minillm"):
        checkpoint_tensors(path, log_conflicts=True)
    assert caplog.text == ""


# ---- config.json ------------------------------------------------------------------------------------


def test_a_llama_hidden_size_that_is_not_a_multiple_of_its_heads_is_refused_as_transformers_refuses_it(tmp_path):
    """It was a shape error about q_proj ([60, 64] expected): transformers' LlamaConfig refuses the config."""
    path = stories_copy(tmp_path, num_attention_heads=6, num_key_value_heads=3, head_dim=None)
    with pytest.raises(ValueError, match=r"config.json hidden_size 64 is not a multiple of num_attention_heads 6"):
        load_model_config(path)


# ---- chat templates -----------------------------------------------------------------------------------

BROKEN_TEMPLATE = "{% for m in messages %}\n{{ m['content'] }}\n{% endfor %\n"
GOOD_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def with_tokenizer_config(path: Path, **changes) -> Path:
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, **changes}))
    return path


def test_a_chat_template_that_does_not_compile_is_logged_at_load_naming_its_file_and_line(tmp_path, caplog):
    """It loaded without a word and failed every chat request, naming neither file nor line. As vLLM
    (whose start-up render of the template logs "Chat template warmup failed" and serves on), the
    load logs it and completions work; chat requests fail with the same words."""
    from minillm import LLM, SamplingParams
    path = with_tokenizer_config(stories_copy(tmp_path), chat_template=BROKEN_TEMPLATE)
    where = f"TemplateSyntaxError at line 3 of {path / 'tokenizer_config.json'} field 'chat_template': expected token"
    with caplog.at_level(logging.WARNING, logger="minillm"):
        llm = LLM(str(path), device="cpu")
    assert caplog.text.count(where) == 1 and "chat requests will fail, completions work" in caplog.text
    assert llm.generate(["Once"], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].text
    with pytest.raises(ValueError, match=f"does not compile: {where}"):
        llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3))


def test_a_chat_template_file_that_does_not_compile_is_named_with_its_line(tmp_path, caplog):
    from minillm.tokenizer import Tokenizer
    path = stories_copy(tmp_path)
    (path / "chat_template.jinja").write_text(BROKEN_TEMPLATE)
    with caplog.at_level(logging.WARNING, logger="minillm"):
        Tokenizer.from_pretrained(path)
    assert f"TemplateSyntaxError at line 3 of {path / 'chat_template.jinja'}: expected token" in caplog.text


def test_a_named_template_that_does_not_compile_is_named_and_the_others_work(tmp_path, caplog):
    from minillm.tokenizer import Tokenizer
    path = with_tokenizer_config(stories_copy(tmp_path), chat_template=[
        {"name": "default", "template": GOOD_TEMPLATE}, {"name": "tool_use", "template": BROKEN_TEMPLATE}])
    with caplog.at_level(logging.WARNING, logger="minillm"):
        tok = Tokenizer.from_pretrained(path)
    assert (f"at line 3 of {path / 'tokenizer_config.json'} field 'chat_template', the template named 'tool_use'"
            in caplog.text) and "chat requests with it fail" in caplog.text
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, tokenize=False) == "user: hi\n"
    with pytest.raises(ValueError, match="the template named 'tool_use': expected token"):
        tok.apply_chat_template(messages, tokenize=False, tools=[{"type": "function", "function": {"name": "f"}}])


def test_templates_that_compile_log_nothing(tmp_path, caplog):
    from minillm.tokenizer import Tokenizer
    path = with_tokenizer_config(stories_copy(tmp_path), chat_template=GOOD_TEMPLATE)
    with caplog.at_level(logging.WARNING, logger="minillm"):
        Tokenizer.from_pretrained(path)
    assert caplog.text == ""


@pytest.mark.parametrize("template", [5, {"default": GOOD_TEMPLATE}, True])
def test_a_chat_template_of_the_wrong_type_is_refused_at_load_naming_the_field(tmp_path, template):
    """A number failed each chat request ("does not compile: TypeError ..."); a JSON object was
    read as named templates, which transformers writes as a list."""
    from minillm.tokenizer import Tokenizer
    path = with_tokenizer_config(stories_copy(tmp_path), chat_template=template)
    with pytest.raises(ValueError, match=f"{path / 'tokenizer_config.json'} field 'chat_template' must be a "
                                         f"template \\(a string\\) or a list of"):
        Tokenizer.from_pretrained(path)


# ---- the model's vocabulary against the tokenizer's ---------------------------------------------------


def test_a_vocab_size_smaller_than_the_tokenizers_ids_is_refused_at_load_naming_the_field(tmp_path, capsys):
    """vocab_size 256 with an embedding of 256 rows beside stories' 512-token tokenizer loaded, and the
    first prompt holding an id past 255 failed inside the engine: "IndexError: index 403 is out of
    bounds for axis 0 with size 256"."""
    from safetensors.numpy import load_file, save_file
    path = stories_copy(tmp_path, vocab_size=256)
    tensors = load_file(path / "model.safetensors")
    tensors[EMBED] = tensors[EMBED][:256].copy()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    message = (f"{path / 'config.json'} field 'vocab_size' is 256, but {path / 'tokenizer.json'} has token ids up "
               f"to 511")
    from minillm.tokenizer import Tokenizer
    with pytest.raises(ValueError, match=message):
        Tokenizer.from_pretrained(path)
    status, out, err = generate(capsys, path)
    assert (status, out) == (1, "") and message in err and "IndexError" not in err


def test_a_vocab_size_larger_than_the_tokenizers_ids_loads_as_padded_vocabularies_do(tmp_path):
    """Qwen2.5's 151936 rows for 151665 tokens: rows past the tokenizer are padding, never a refusal."""
    from minillm.tokenizer import Tokenizer
    assert len(Tokenizer.from_pretrained(stories_copy(tmp_path, vocab_size=600))) == 512


@pytest.mark.parametrize("field, value, message", [
    ("tie_word_embeddings", "false", "'tie_word_embeddings' must be true or false, got 'false'"),
    ("tie_word_embeddings", None, "'tie_word_embeddings' must be true or false, got None"),
    ("bos_token_id", "1", "'bos_token_id' must be a token id or null, got '1'"),
    ("torch_dtype", 5, "'torch_dtype' must be a dtype name such as 'bfloat16', got 5"),
], ids=["tie-string", "tie-null", "bos-string", "dtype-number"])
def test_config_fields_of_the_wrong_type_are_refused_as_transformers_refuses_them(tmp_path, field, value, message):
    """A tie_word_embeddings of "false" was read as true (a non-empty string), null as false (then "missing
    tensor lm_head.weight"); a bos_token_id of "1" was dropped, a torch_dtype of 5 ignored. transformers'
    config classes refuse each (5 fails its model build)."""
    path = stories_copy(tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=f"config.json field {message}"):
        load_model_config(path)
