"""Four differences from vLLM: the options an unknown flag's error names, the escapes of an inline
--chat-template, the keys of whole chat and text completions, and the usage a stream carries."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
from test_abuse29b_cli import one_line
from test_abuse34_reasoning_structured import thinking_model
from test_abuse35_api_leftovers import (
    BIAS, CHAT_CHOICE_KEYS, CHAT_KEYS, COMPLETION_CHOICE_KEYS, COMPLETION_KEYS, post, stream_events,
)
from test_cli import REPO, STORIES, needs_stories, run_main
from test_server_helpers import chat_model_dir, running_server, started_url, stop_server

from minillm.benchmarks.cli_args import close_option_names
from minillm.server.app import ServerOptions
from minillm.tokenizer import chat_template_from_arg, compile_chat_template, read_chat_template

# ---- an unknown flag names only the options close to it ---------------------------------------------------------

@pytest.mark.parametrize("command", [("serve", str(STORIES)), ("generate", str(STORIES), "-p", "x"),
                                     ("chat", str(STORIES)), ("monitor",), ("bench", "throughput"),
                                     ("bench", "serving")])
def test_an_unknown_flag_with_nothing_close_is_named_alone(capsys, command):
    # `serve --bogus` said "(Possible options: --host)": click's cutoff counted the two dashes as a match.
    status, _, err = run_main(capsys, *command, "--bogus")
    line = one_line(err)
    assert status == 2
    assert "--bogus" in line and "ossible options" not in line and "--host" not in line, line


@pytest.mark.parametrize("typed, options, close", [
    ("--bogus", ["--host", "--port", "--model"], []),
    ("--verbose", ["--kv-role", "--seed"], []),
    ("--temp", ["--system", "--temperature", "-tp"], ["--temperature"]),   # neither --system nor -tp
    ("--dtpye", ["--dtype", "--device"], ["--dtype"]),
    ("--max_tokenz", ["--max-tokens", "--min-tokens"], ["--max-tokens", "--min-tokens"]),
    ("--model-name", ["--served-model-name", "--model"], ["--served-model-name"]),
    ("-tpp", ["-tp", "-pp", "--tp-size"], ["-tp", "-pp"]),      # a short one among the short ones
])
def test_close_option_names_compares_the_names_without_their_dashes(typed, options, close):
    assert close_option_names(typed, options) == close


def test_a_mistyped_flag_still_names_the_one_meant(capsys):
    status, _, err = run_main(capsys, "serve", str(STORIES), "--dtpye", "float32")
    assert status == 2 and "No such option: --dtpye (Possible options: --dtype)" in one_line(err)


# ---- an inline --chat-template is taken as given ----------------------------------------------------------------

# A backslash and an n, then two backslashes: current vLLM (load_chat_template, is_literal) reads no escapes
# in an inline template; minillm read them as Python's unicode_escape does (a line break, and one backslash).
INLINE = r"{% for m in messages %}{{ m['content'] }}\n{% endfor %}a\\b"
RENDERED = "hi" + "\\n" + "a\\\\b"


def test_an_inline_template_keeps_its_backslashes():
    assert chat_template_from_arg(INLINE) == INLINE
    assert read_chat_template(INLINE) == INLINE          # chat's reader, as serve's
    assert compile_chat_template(INLINE).render(messages=[{"role": "user", "content": "hi"}]) == RENDERED


def test_escapes_in_a_jinja_string_literal_are_jinjas():
    # What a template means by "\n" it writes inside a string: Jinja reads that escape itself.
    template = chat_template_from_arg("{% for m in messages %}{{ m['content'] + '\\n' }}{% endfor %}")
    assert compile_chat_template(template).render(messages=[{"role": "user", "content": "hi"}]) == "hi\n"


@needs_stories
def test_serve_renders_an_inline_template_as_given(tmp_path):
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "minillm.cli", "serve", str(STORIES), "--device", "cpu",
                                   "--host", "127.0.0.1", "--port", "0", "--chat-template", INLINE],
                                  cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out,
                                  stderr=subprocess.STDOUT)
    try:
        url = started_url(server, log, timeout=120)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                "return_prompt_text": True}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["prompt_text"] == RENDERED
    finally:
        stop_server(server, timeout=10)


# ---- the keys of whole chat and text completions, and of a stream's usage ------------------------------------------

# The keys of vLLM's whole replies are test_abuse35_api_leftovers' lists: prompt_text (return_prompt_text),
# ec_transfer_params, metrics and a choice's routed_experts were left out. vLLM's UsageInfo, in its fields' order:
USAGE_KEYS = ["prompt_tokens", "total_tokens", "completion_tokens"]
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def url(stories_path, tmp_path_factory):
    """A server of stories260K with a chat template, on the CPU."""
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    with running_server(model, max_model_len=256) as running:
        yield running[0]


def test_a_chat_completion_carries_vllms_later_keys(url):
    body = post(url, "/v1/chat/completions", CHAT)
    assert list(body) == CHAT_KEYS and list(body["choices"][0]) == CHAT_CHOICE_KEYS
    assert [body[k] for k in ("prompt_text", "ec_transfer_params", "metrics")] == [None] * 3
    assert body["choices"][0]["routed_experts"] is None
    asked = post(url, "/v1/chat/completions", {**CHAT, "return_prompt_text": True})
    assert list(asked) == CHAT_KEYS and asked["prompt_text"].endswith("assistant:")


def test_a_completion_carries_vllms_later_keys(url):
    body = post(url, "/v1/completions", {"prompt": ["Once", "Lily"], "max_tokens": 3, "return_token_ids": True})
    assert list(body) == COMPLETION_KEYS and body["ec_transfer_params"] is None and body["metrics"] is None
    assert all(list(c) == COMPLETION_CHOICE_KEYS and c["routed_experts"] is None for c in body["choices"])
    echoed = post(url, "/v1/completions", {"prompt": "Once", "max_tokens": 0, "echo": True})
    assert list(echoed["choices"][0]) == COMPLETION_CHOICE_KEYS


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT),
                                        ("/v1/completions", {"prompt": "Once", "max_tokens": 3})])
def test_a_streams_usage_has_vllms_keys_in_its_order(url, path, body):
    # The usage chunk wrote prompt, completion, total; vLLM's UsageInfo dumps prompt, total, completion.
    *_, last = stream_events(url, path, {**body, "stream_options": {"include_usage": True}})
    assert last["choices"] == [] and list(last) == ["id", "object", "created", "model", "choices", "usage"]
    assert list(last["usage"]) == USAGE_KEYS and last["usage"]["completion_tokens"] == 3
    *chunks, last = stream_events(url, path, {**body, "stream_options": {"include_usage": True,
                                                                          "continuous_usage_stats": True}})
    # A chat chunk's continuous usage names completion_tokens_details (vLLM sets it, null without a parser).
    details = ["completion_tokens_details"] if path == "/v1/chat/completions" else []
    assert chunks and all(list(c["usage"]) == USAGE_KEYS + details for c in chunks)
    assert all(c["usage"].get("completion_tokens_details") is None for c in chunks)
    assert list(last["usage"]) == USAGE_KEYS


def test_a_chat_streams_first_chunk_names_the_prompt_fields(url):
    # vLLM sets prompt_token_ids and prompt_text on a choice's first chunk, null where not asked.
    first, second, *_ = stream_events(url, "/v1/chat/completions", CHAT)
    assert list(first)[-2:] == ["prompt_token_ids", "prompt_text"]
    assert first["prompt_token_ids"] is None and first["prompt_text"] is None
    assert "prompt_text" not in second and "prompt_token_ids" not in second
    first, *_ = stream_events(url, "/v1/chat/completions", {**CHAT, "return_prompt_text": True,
                                                             "return_token_ids": True})
    assert first["prompt_text"].endswith("assistant:") and first["prompt_token_ids"]


@pytest.fixture(scope="module")
def thinking_url(stories_path, tmp_path_factory):
    """A server of stories260K whose tokens 510 and 511 are <think> and </think>, under deepseek_r1."""
    model = thinking_model(stories_path, tmp_path_factory.mktemp("thinking"))
    options = ServerOptions(chat_template="{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}",
                            reasoning_parser="deepseek_r1")
    with running_server(model, max_model_len=256, options=options) as running:
        yield running[0]


def test_continuous_usage_counts_the_reasoning_so_far(thinking_url):
    body = {"messages": [{"role": "user", "content": "Once"}], "max_tokens": 24, "temperature": 0,
            "logit_bias": BIAS, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    *chunks, last = stream_events(thinking_url, "/v1/chat/completions", body)
    counts = [c["usage"]["completion_tokens_details"]["reasoning_tokens"] for c in chunks]
    assert counts[0] == 0 and counts == sorted(counts)
    assert counts[-1] == last["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    assert all(n <= c["usage"]["completion_tokens"] for n, c in zip(counts, chunks))
    assert json.dumps(last["usage"]).startswith('{"prompt_tokens"')
