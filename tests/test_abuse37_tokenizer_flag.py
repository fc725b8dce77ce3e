"""vLLM's tokenizer, tokenizer_revision and tokenizer_mode: `--tokenizer DIR_OR_HUB_ID` on the engine flags and
LLM(tokenizer=...). tokenizer.json, tokenizer_config.json and the chat template come from it, config.json and
generation_config.json from the model; a hub id comes from the store at --tokenizer-revision; the engine,
every API server process and the chat template read it. A tokenizer without tokenizer.json, or with ids past
the model's embedding rows, is one line naming --tokenizer (a ValueError naming tokenizer in Python)."""
from __future__ import annotations

import json
import shutil
import sys

import httpx
import pytest
from test_abuse28_cli import started  # noqa: F401 - serve's run_server stubbed, as a fixture
from test_abuse29_cli import one_line
from test_cli import STORIES, needs_stories, run_main
from test_server_failure import _serve
from test_server_helpers import CHAT_TEMPLATE

from minillm import LLM, SamplingParams

pytestmark = needs_stories

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Once upon"}]
GREEDY = SamplingParams(max_tokens=8, temperature=0)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SMALL = ("--device", "cpu", "--max-model-len", "64", "--max-num-seqs", "4")


def model_without_tokenizer(dst):
    """stories260K's weights and configs without its tokenizer files; its generation_config.json says temperature 0.25."""
    dst.mkdir()
    for name in ("config.json", "model.safetensors"):
        (dst / name).symlink_to(STORIES / name)
    (dst / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2,
                                                            "temperature": 0.25}))
    return dst


def tokenizer_dir(dst, extra_token: bool = False):
    """stories260K's tokenizer files alone, with a chat template (and a generation_config.json that is not
    the model's, so never read); extra_token: one more token, past the model's 512 embedding rows."""
    dst.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(STORIES / name, dst / name)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    (dst / "generation_config.json").write_text(json.dumps({"temperature": 0.75}))
    if extra_token:
        data = json.loads((dst / "tokenizer.json").read_text())
        data["added_tokens"].append({"id": 512, "content": "<extra>", "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
        (dst / "tokenizer.json").write_text(json.dumps(data))
    return dst


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(a model without tokenizer files, a tokenizer directory, one whose vocabulary is too large, one without
    tokenizer.json)."""
    root = tmp_path_factory.mktemp("tokenizer_flag")
    empty = root / "no_tokenizer"
    empty.mkdir()
    (empty / "tokenizer_config.json").write_text("{}")
    return (model_without_tokenizer(root / "model"), tokenizer_dir(root / "tok"),
            tokenizer_dir(root / "big", extra_token=True), empty)


@pytest.fixture(scope="module")
def expected(llm):
    """What stories260K with its own tokenizer answers: greedy text, chat reply (the same template), token ids."""
    text = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].text
    reply = llm.chat(MESSAGES, GREEDY, use_tqdm=False, chat_template=CHAT_TEMPLATE)[0].outputs[0].text
    return {"text": text, "reply": reply, "ids": llm.get_tokenizer().encode(PROMPT)}


# ---- LLM ------------------------------------------------------------------------------------------------------


def test_llm_reads_the_tokenizer_and_its_chat_template_from_tokenizer_and_generation_config_from_the_model(
        dirs, expected):
    model, tok, _, _ = dirs
    with LLM(str(model), tokenizer=str(tok), tokenizer_mode="auto", device="cpu", max_model_len=64) as llm:
        assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].text == expected["text"]
        assert llm.chat(MESSAGES, GREEDY, use_tqdm=False)[0].outputs[0].text == expected["reply"]
        assert llm.llm_engine.sampling_defaults["temperature"] == 0.25
        assert llm.llm_engine.model_config.tokenizer == str(tok)


@pytest.mark.parametrize("which, args, words", [
    ("empty", {}, "has no tokenizer.json"),
    ("big", {}, "has token ids up to 512"),
    (None, {"tokenizer": ""}, "tokenizer is empty"),
    ("tok", {"tokenizer_revision": "v2"}, "tokenizer_revision 'v2' names a version of a hub tokenizer"),
])
def test_llm_refuses_a_tokenizer_it_cannot_use_with_a_value_error_naming_it(dirs, which, args, words):
    model, tok, big, empty = dirs
    given = {"tok": tok, "big": big, "empty": empty}
    if which is not None:
        args = {"tokenizer": str(given[which]), **args}
    with pytest.raises(ValueError, match="^tokenizer") as info:
        LLM(str(model), device="cpu", max_model_len=64, **args)
    assert words in str(info.value)


# ---- generate, and hub ids through the store -------------------------------------------------------------------


def hub_store(root, good, big):
    """A Hugging Face cache holding someorg/tok: main is the too-large tokenizer, v2 the good one."""
    repo = root / "models--someorg--tok"
    for commit, src in (("a" * 40, big), ("b" * 40, good)):
        shutil.copytree(src, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    (repo / "refs" / "v2").write_text("b" * 40)
    return root


def test_generate_reads_tokenizer_from_a_directory_and_from_the_store_at_tokenizer_revision(
        dirs, expected, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tok, big, _ = dirs
    status, out, err = run_main(capsys, "generate", str(model), "--tokenizer", str(tok), "-p", PROMPT,
                                "--max-tokens", "8", "--temperature", "0", *SMALL)
    assert (status, out) == (0, f"{PROMPT}{expected['text']}\n"), err
    store = hub_store(tmp_path / "store", tok, big)
    status, out, err = run_main(capsys, "generate", str(model), "--tokenizer", "someorg/tok", "--tokenizer-revision",
                                "v2", "--download-dir", str(store), "-p", PROMPT, "--max-tokens", "8", "--temperature",
                                "0", *SMALL)
    assert (status, out) == (0, f"{PROMPT}{expected['text']}\n"), err
    status, _, err = run_main(capsys, "generate", str(model), "--tokenizer", "someorg/tok", "--download-dir",
                              str(store), "-p", PROMPT, *SMALL)
    line = one_line(err)
    assert status == 2 and "'--tokenizer'" in line and "has token ids up to 512" in line, line


@pytest.mark.parametrize("command", ["generate", "serve", "chat"])
@pytest.mark.parametrize("which, words", [("empty", "has no tokenizer.json"), ("big", "has token ids up to 512"),
                                          ("gone", "no such directory")])
def test_a_tokenizer_without_tokenizer_json_or_too_large_is_one_line_naming_the_flag(
        dirs, capsys, monkeypatch, started, command, which, words):  # noqa: F811
    monkeypatch.setattr("sys.stdin", open("/dev/null"))
    model, _, big, empty = dirs
    given = {"big": big, "empty": empty, "gone": empty.parent / "gone"}[which]
    args = {"generate": ("-p", PROMPT), "serve": (), "chat": ("-q", "hi")}[command]
    status, _, err = run_main(capsys, command, str(model), "--tokenizer", str(given), *args, *SMALL)
    line = one_line(err)
    assert status == 2 and "Invalid value for '--tokenizer'" in line and words in line, line


@pytest.mark.parametrize("mode, status", [("hf", 0), ("mistral", 2)])
def test_tokenizer_mode_takes_auto_and_hf_and_refuses_vllms_others_naming_the_flag(dirs, capsys, started,  # noqa: F811
                                                                                    mode, status):
    model, tok, _, _ = dirs
    code, _, err = run_main(capsys, "serve", str(model), "--tokenizer", str(tok), "--tokenizer-mode", mode, *SMALL)
    assert code == status, err
    if status:
        assert "Invalid value for '--tokenizer-mode': 'mistral' is not supported" in one_line(err)
    else:
        assert started["config"].tokenizer == str(tok) and started["config"].tokenizer_mode == "hf"


# ---- serve, with two API server processes ---------------------------------------------------------------------


def test_serve_with_tokenizer_answers_completions_chat_and_tokenize_on_every_api_server(dirs, expected, tmp_path):
    model, tok, _, _ = dirs
    command = [sys.executable, "-m", "minillm.cli", "serve", str(model), "--tokenizer", str(tok),
               "--api-server-count", "2", "--max-model-len", "64", "--max-num-seqs", "4"]
    with _serve(tmp_path, command) as (_, url, log):
        for _ in range(4):      # each a new connection: the kernel spreads them over both API servers
            body = {"model": "stories", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected["text"], r.text
            body = {"model": "stories", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected["reply"], r.text
            r = httpx.post(f"{url}/tokenize", json={"model": "stories", "prompt": PROMPT}, timeout=60)
            assert r.status_code == 200 and r.json()["tokens"] == expected["ids"], r.text
        assert log.read_text().count("API server") >= 2
