"""The Python API and the CLI as careless users run them: closed stdin, broken model directories,
odd engine settings and unreadable option files."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_cli import REPO, STORIES, minillm, needs_stories


def minillm_stdin_closed(*args: str) -> subprocess.CompletedProcess:
    """Run the CLI with file descriptor 0 closed, as `minillm ... <&-` in a shell does."""
    return subprocess.run([sys.executable, "-m", "minillm.cli", *args], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=None, capture_output=True,
                          text=True, timeout=120, preexec_fn=lambda: os.close(0))


def test_a_closed_stdin_is_one_line_for_prompts_file_dash_and_for_chat():
    result = minillm_stdin_closed("generate", str(STORIES), "--device", "cpu", "--prompts-file", "-")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "minillm: error: --prompts-file -: stdin is closed; give a file, or pipe the prompts in"]
    result = minillm_stdin_closed("chat", str(STORIES), "--device", "cpu")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == ["minillm: error: chat reads your messages from stdin, which is closed"]


def model_copy(tmp_path, name: str = "model"):
    """A copy of stories260K to break one file of."""
    import shutil
    return Path(shutil.copytree(STORIES, tmp_path / name))


@needs_stories
@pytest.mark.parametrize("file, text, why", [
    ("config.json", "[1]", "config.json must hold a JSON object"),
    ("config.json", "{bad", "config.json is not valid JSON: Expecting property name"),
    ("config.json", b'{"a": "\xff"}', "config.json is not valid JSON: 'utf-8' codec can't decode"),
    ("tokenizer_config.json", "{bad", "tokenizer_config.json is not valid JSON"),
    ("tokenizer.json", "", "tokenizer.json is not a tokenizer the tokenizers library can read"),
    ("tokenizer.json", "{bad", "tokenizer.json is not a tokenizer the tokenizers library can read"),
])
def test_a_broken_file_of_the_model_directory_is_a_value_error_naming_it(tmp_path, file, text, why):
    from minillm import LLM
    path = model_copy(tmp_path)
    (path / file).write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError) as info:
        LLM(str(path), device="cpu")
    assert f"{path / file}" in str(info.value) and why in str(info.value)


@needs_stories
@pytest.mark.parametrize("field, value, why", [
    ("max_position_embeddings", "512", "'max_position_embeddings' must be a positive integer, got '512'"),
    ("num_key_value_heads", "4", "'num_key_value_heads' must be a positive integer, got '4'"),
    ("head_dim", -8, "'head_dim' must be a positive integer, got -8"),
    ("eos_token_id", "x", "'eos_token_id' must be a token id or a list of them, got 'x'"),
    ("eos_token_id", [2, None], "'eos_token_id' must be a token id or a list of them, got [2, None]"),
    ("rms_norm_eps", "1e-5", "'rms_norm_eps' must be a positive number, got '1e-5'"),
    ("rope_theta", float("nan"), "'rope_theta' must be a positive number, got nan"),
])
def test_config_fields_of_the_wrong_kind_are_value_errors_naming_the_field(tmp_path, field, value, why):
    from minillm.loader import load_model_config
    path = model_copy(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ValueError, match="config.json field") as info:
        load_model_config(path)
    assert why in str(info.value)


@needs_stories
def test_null_optional_config_fields_read_as_absent_ones(tmp_path):
    from minillm.loader import load_model_config
    path = model_copy(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    want = load_model_config(path)
    (path / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": None, "head_dim": None,
                                                  "eos_token_id": None, "max_position_embeddings": None}))
    got = load_model_config(path)
    assert (got.num_kv_heads, got.head_dim, got.eos_token_id, got.max_position_embeddings) == (8, 8, (), 2048)
    assert (want.num_kv_heads, want.head_dim, want.eos_token_id) == (4, 8, (2,))


@needs_stories
def test_a_broken_model_directory_is_one_line_in_the_cli(tmp_path):
    path = model_copy(tmp_path)
    (path / "tokenizer.json").write_text("")
    result = minillm("generate", str(path), "--device", "cpu", "-p", "Hi")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"minillm: error: {path / 'tokenizer.json'} is not a tokenizer")


def write_header(file: Path, header: bytes) -> None:
    """A safetensors file of only a header (its 8-byte length, then the bytes)."""
    file.write_bytes(len(header).to_bytes(8, "little") + header)


def sharded(path: Path, index: str) -> None:
    """path's model.safetensors as a one-shard checkpoint whose index is INDEX."""
    (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
    (path / "model.safetensors.index.json").write_text(index)


@needs_stories
@pytest.mark.parametrize("break_it, why", [
    (lambda p: write_header(p / "model.safetensors", b"{bad"), "model.safetensors is not a safetensors file (its header is not JSON"),
    (lambda p: write_header(p / "model.safetensors", b"[1]"), "model.safetensors is not a safetensors file (its header is not a JSON object)"),
    (lambda p: write_header(p / "model.safetensors", b'{"a": 5}'), "model.safetensors is not a safetensors file (its header has no dtype"),
    # an index is read where there is no model.safetensors (beside one, transformers and minillm take the file)
    (lambda p: sharded(p, "{bad"), "model.safetensors.index.json is not a safetensors index"),
    (lambda p: sharded(p, '{"weight_map": [1]}'),
     "model.safetensors.index.json is not a safetensors index: its weight_map must map tensor names to files"),
    (lambda p: sharded(p, "{}"), "model.safetensors.index.json is not a safetensors index"),
])
def test_broken_weight_files_are_value_errors_naming_the_file(tmp_path, break_it, why):
    from minillm import LLM
    path = model_copy(tmp_path)
    break_it(path)
    with pytest.raises(ValueError) as info:
        LLM(str(path), device="cpu")
    assert f"{path}/{why}" in str(info.value)


@needs_stories
def test_architectures_written_as_one_string_or_a_number_read_as_one_name(tmp_path):
    from minillm.loader import load_model_config
    path = model_copy(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": "LlamaForCausalLM"}))
    assert load_model_config(path).architecture == "llama"
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": 5}))
    with pytest.raises(ValueError, match="unsupported architecture 5; supported: LlamaForCausalLM"):
        load_model_config(path)


@needs_stories
def test_list_marks_snapshots_with_a_broken_config_or_index_and_lists_the_rest(tmp_path):
    import shutil
    store = tmp_path / "store"
    for name in ("good", "list", "index"):
        folder = store / f"models--org--{name}"
        shutil.copytree(STORIES, folder / "snapshots" / "abc")
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text("abc")
    (store / "models--org--list" / "snapshots" / "abc" / "config.json").write_text("[1]")
    sharded(store / "models--org--index" / "snapshots" / "abc", '{"weight_map": 1}')
    result = minillm("list", "--download-dir", str(store))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert set(rows) == {"org/good", "org/list", "org/index"}
    assert "cannot run" not in rows["org/good"]
    assert rows["org/list"].endswith("(minillm cannot run it: unreadable config.json)")
    assert rows["org/index"].endswith("(minillm cannot run it: incomplete download)")


@needs_stories
@pytest.mark.parametrize("setting, why", [
    ({"seed": -1}, "seed must be an integer in [0, 2**32 - 1], got -1"),
    ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes must be >= 1 (or None: sized by the engine), got 0"),
    ({"kv_cache_memory_bytes": -5}, "kv_cache_memory_bytes must be >= 1 (or None: sized by the engine), got -5"),
    ({"num_kv_blocks": 10**12}, "num_kv_blocks 1000000000000 needs 19073486.3 GiB of KV pool, more than the"),
])
def test_engine_settings_out_of_range_are_value_errors_naming_them(setting, why):
    from minillm import LLM
    with pytest.raises(ValueError) as info:
        LLM(str(STORIES), device="cpu", **setting)
    assert why in str(info.value)


@needs_stories
def test_settings_that_would_exhaust_memory_are_one_line_in_the_cli():
    # Bounded before anything is allocated (it was "out of memory: Unable to allocate ...").
    result = minillm("generate", str(STORIES), "--device", "cpu", "-p", "Hi", "--max-num-seqs", str(10**12))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == ("minillm generate: error: Invalid value for '--max-num-seqs': "
                                                      "must be in [1, 65536], got 1000000000000 (try 'minillm "
                                                      "generate --help')")


@needs_stories
def test_option_files_that_are_not_utf8_are_one_line_naming_the_option_or_file(tmp_path):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(b'{"type": "string", "description": "caf\xe9"}')
    for option in ("--json-schema", "--grammar"):
        result = minillm("generate", str(STORIES), "--device", "cpu", "-p", "Hi", option, str(latin1))
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines() == [
            f"minillm generate: error: {option}: {latin1} is not UTF-8 text: invalid continuation byte at byte 38 "
            "(try 'minillm generate --help')"]
    for command in ("chat", "serve"):
        result = minillm(command, str(STORIES), "--device", "cpu", "--chat-template", str(latin1))
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines()[-1] == (
            f"minillm: error: chat template file {latin1} is not UTF-8 text: invalid continuation byte at byte 38")


@pytest.fixture(scope="module")
def llm():
    from minillm import LLM
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"stories260K not found at {STORIES}")
    engine = LLM(str(STORIES), device="cpu", max_model_len=128)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("prompts, why", [
    (b"Once upon", "prompts must be a prompt or a list of prompts, got b'Once upon'"),
    ({"prompt": 5, "prompt_token_ids": [1, 403]}, "a prompt dict's 'prompt' must be a string, got 5"),
    ([{"prompt": ["Once"], "prompt_token_ids": [1, 403]}], "a prompt dict's 'prompt' must be a string, got ['Once']"),
])
def test_prompts_of_the_wrong_kind_are_value_errors_and_the_engine_runs_on(llm, prompts, why):
    from minillm import SamplingParams
    with pytest.raises(ValueError) as info:
        llm.generate(prompts, SamplingParams(max_tokens=2))
    assert str(info.value) == why
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate({"prompt": "Once", "prompt_token_ids": [1, 403]}, SamplingParams(temperature=0, max_tokens=3))
    assert out[0].prompt == "Once" and out[0].outputs[0].text == " upon a time"
