"""Fan-out and size limits, short error quotes, per-response times, ignored fields, chat templates.

A real server on loopback with the default limits; each test runs with a healthy greedy stream in
flight, and every such stream must end with the text of the same request made alone.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

from test_server_helpers import CHAT_TEMPLATE, HealthyStreams, get_stats, running_server, wait_for  # noqa: E402

from minillm.config import EngineConfig  # noqa: E402
from minillm.engine import LLMEngine  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402
from minillm.server.app import ServerOptions  # noqa: E402
from minillm.server.limits import ServerLimits  # noqa: E402
from minillm.tokenizer import Tokenizer, chat_template_from_arg  # noqa: E402

MODEL = "stories"
REPO = Path(__file__).resolve().parents[1]
LIMITS = ServerLimits()
# stories260K has no chat template of its own: the server is given one (what --chat-template does).
OPTIONS = ServerOptions(chat_template=CHAT_TEMPLATE, trust_request_chat_template=True, limits=LIMITS)
MESSAGES = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def server(stories_path):
    with running_server(stories_path, served_model_name=MODEL, options=OPTIONS) as (url, engine):
        started = time.time()
        yield url, engine, started


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def healthy(server):
    streams = HealthyStreams(server[0], {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400})
    yield streams
    streams.check()
    stats = wait_for(lambda: (s := get_stats(server[0]))["num_running"] == 0 and s)
    assert stats and stats["kv_num_used_blocks"] == 0 and server[1].is_healthy


def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, **fields}


def _error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert error["param"] == param, error
    assert len(error["message"]) < 400, "an error must quote a short prefix of what was sent, not all of it"
    return error


# The fan-out that was accepted before: each is now a 400 naming the field.
FAN_OUT = [
    ("n-1000", "/v1/completions", _completion(n=1000), "n"),
    ("chat-n-1000", "/v1/chat/completions", {"messages": MESSAGES, "n": 1000, "max_tokens": 4}, "n"),
    ("2000-prompts", "/v1/completions", _completion(prompt=["Once upon a time"] * 2000), "prompt"),
    ("n-times-prompts", "/v1/completions", _completion(prompt=["Once"] * 3, n=100), "n"),
    ("10000-stop-strings", "/v1/completions", _completion(stop=[f"stop{i}" for i in range(10_000)]), "stop"),
    ("long-stop-string", "/v1/completions", _completion(stop=["x" * 10_000]), "stop"),
    ("100000-stop-token-ids", "/v1/completions", _completion(stop_token_ids=list(range(3, 403)) * 250),
     "stop_token_ids"),
    ("prompt-over-char-limit", "/v1/completions", _completion(prompt="a" * (LIMITS.max_prompt_chars + 1)),
     "prompt"),
    ("prompts-over-char-limit", "/v1/completions",
     _completion(prompt=["a" * (LIMITS.max_prompt_chars // 2 + 1)] * 2), "prompt"),
    ("messages-over-char-limit", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a" * (LIMITS.max_prompt_chars + 1)}]}, "messages"),
]


@pytest.mark.parametrize("path,body,param", [c[1:] for c in FAN_OUT], ids=[c[0] for c in FAN_OUT])
def test_fan_out_and_size_limits_are_400s_naming_the_field(http, healthy_stream, path, body, param):
    _error(http.post(path, json=body), 400, param)


def test_limits_sit_just_above_what_they_allow(http, healthy_stream):
    at_limit = _completion(stop=[f"s{i}" for i in range(LIMITS.max_stop_strings)],
                           stop_token_ids=[3] * LIMITS.max_stop_token_ids, n=2, max_tokens=2)
    assert http.post("/v1/completions", json=at_limit).status_code == 200
    over = {**at_limit, "stop": at_limit["stop"] + ["one more"]}
    _error(http.post("/v1/completions", json=over), 400, "stop")


def test_errors_quote_a_short_prefix_of_the_value(http, healthy_stream):
    huge_model = "m" * 1_000_000
    error = _error(http.post("/v1/completions", json=_completion(model=huge_model)), 404, "model")
    assert "mmmm" in error["message"] and "1000000" in error["message"]   # a prefix, and how long it was
    error = _error(http.post("/v1/completions", json=_completion(seed=10**300)), 400, "seed")
    assert "bits" in error["message"]
    error = _error(http.post("/v1/completions", json=_completion(prompt=[5] * 10 + [10**6] * 5000)), 400, "prompt")
    assert "5000 items" in error["message"]


# The bodies that used to end the engine loop for good (defect 1 of the hardening issue): a top_k past
# the vocabulary is now the whole vocabulary (vLLM's reading), the stop token ids still a 400.
KILLERS = [
    (_completion(top_k=100000000000000000000), 200),
    (_completion(top_k=2**31), 200),
    (_completion(min_tokens=2, stop_token_ids=[100000]), 400),
    (_completion(min_tokens=2, stop_token_ids=[2**40]), 400),
]


def test_requests_that_killed_the_engine_leave_it_serving(http, healthy_stream, server):
    for body, status in KILLERS:
        for stream in (False, True):
            response = http.post("/v1/completions", json={**body, "stream": stream})
            assert response.status_code == status, response.text
            if status == 400:
                assert response.json()["error"]["param"] == "stop_token_ids"
    assert http.get("/health").status_code == 200 and server[1].is_healthy
    after = http.post("/v1/completions", json=_completion(max_tokens=3, ignore_eos=True)).json()
    assert after["usage"]["completion_tokens"] == 3


def test_the_engine_itself_refuses_ids_outside_the_vocabulary(stories_path):
    engine = LLMEngine(EngineConfig(model=str(stories_path), device="cpu", num_kv_blocks=16), log=lambda _: None)
    vocab = engine.model_config.vocab_size
    for params, field in ((SamplingParams(min_tokens=2, stop_token_ids=[vocab]), "stop_token_ids"),
                          (SamplingParams(logit_bias={vocab: 1.0}), "logit_bias"),
                          (SamplingParams(allowed_token_ids=[vocab]), "allowed_token_ids")):
        with pytest.raises(ValueError, match=f"^{field} "):
            engine.add_request("r", "Once", params)
    assert not engine.has_unfinished_requests()
    engine.add_request("ok", "Once", SamplingParams(top_k=vocab, stop_token_ids=[vocab - 1], max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()


def test_created_is_the_time_of_each_response(server, client, healthy):
    _, _, started = server
    # Let the clock pass the second the server started in, so a start-time stamp cannot pass for a fresh one.
    assert wait_for(lambda: int(time.time()) > int(started), timeout=5)
    with healthy.in_flight():
        before = int(time.time())
        stamps = [client.completions.create(model=MODEL, prompt="Once", max_tokens=2).created,
                  client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).created,
                  client.models.list().data[0].created, client.models.retrieve(MODEL).created]
        stamps += [c.created for c in client.completions.create(model=MODEL, prompt="Once", max_tokens=2,
                                                                stream=True)]
        stamps += [c.created for c in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                                                     stream=True)]
        after = int(time.time())
    assert all(before <= stamp <= after for stamp in stamps), (started, before, stamps)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_unknown_fields_are_accepted_and_logged_by_name(client, healthy_stream):
    logger, records = logging.getLogger("minillm.server"), _Records()
    logger.addHandler(records)
    try:
        out = client.completions.create(model=MODEL, prompt="Once", max_tokens=2,
                                        extra_body={"frobnicate": True, "guided_quux": {"a": 1}})
        chat = client.chat.completions.create(model=MODEL, max_tokens=2, extra_body={"vibe": "calm"},
                                              messages=[{"role": "user", "content": "hi", "mood": "sunny"}])
    finally:
        logger.removeHandler(records)
    assert out.usage.completion_tokens == 2 and chat.usage.completion_tokens == 2
    ignored = [m for m in records.messages if "ignored" in m]
    assert len(ignored) == 2
    assert "'frobnicate'" in ignored[0] and "'guided_quux'" in ignored[0]
    assert "'vibe'" in ignored[1] and "'messages.0.mood'" in ignored[1]


def test_functions_are_refused_and_any_role_is_taken(client, healthy_stream):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                       functions=[{"name": "get_weather", "parameters": {"type": "object"}}])
    assert refused.value.body["param"] == "functions"
    for role in ("system", "user", "assistant", "tool", "developer", "wizard"):   # custom roles too, as vLLM
        out = client.chat.completions.create(model=MODEL, messages=[{"role": role, "content": "hi"}], max_tokens=1)
        assert out.usage.completion_tokens == 1


def _prompt_tokens(tok: Tokenizer, template: str, messages: list[dict], **kwargs) -> int:
    return len(tok.encode(tok.render_chat(messages, template=template, **kwargs), add_special_tokens=False))


def test_server_chat_template_serves_a_model_without_one(client, tok, healthy_stream):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert out.usage.prompt_tokens == _prompt_tokens(tok, CHAT_TEMPLATE, MESSAGES)
    prompt = tok.render_chat(MESSAGES, template=CHAT_TEMPLATE).removeprefix("<s>")
    same = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert out.choices[0].message.content == same.choices[0].text


def test_request_chat_template_and_kwargs_are_honoured(client, tok, healthy_stream):
    template = ("{{ bos_token }}{% for m in messages %}### {{ m['role'] | upper }} ({{ persona }}):\n"
                "{{ m['content'] }}\n{% endfor %}### ASSISTANT:")
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                         extra_body={"chat_template": template,
                                                     "chat_template_kwargs": {"persona": "a friendly old sailor"}})
    expected = _prompt_tokens(tok, template, MESSAGES, persona="a friendly old sailor")
    assert out.usage.prompt_tokens == expected != _prompt_tokens(tok, CHAT_TEMPLATE, MESSAGES)
    rendered = tok.render_chat(MESSAGES, template=template, persona="a friendly old sailor").removeprefix("<s>")
    same = client.completions.create(model=MODEL, prompt=rendered, max_tokens=8, temperature=0)
    assert out.choices[0].message.content == same.choices[0].text


@pytest.mark.parametrize("extra,param", [
    ({"chat_template": "{% for %}"}, "chat_template"),
    ({"chat_template": "{{ raise_exception('no system role here') }}"}, "chat_template"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"chat_template": ""}, "chat_template"),
    # A render must not hold a preprocessing thread for hours or build gigabytes.
    ({"chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"},
     "chat_template"),
    ({"chat_template": "{{ 'a' * 100000000 }}"}, "chat_template"),
    ({"chat_template": "{{ 10 ** 100000000 }}"}, "chat_template"),
], ids=["does-not-compile", "raises", "kwargs-messages", "kwargs-add-generation-prompt", "empty", "loops",
        "repeats", "power"])
def test_bad_request_templates_are_400s(client, healthy_stream, extra, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body=extra)
    assert refused.value.body["param"] == param


def test_long_prompt_is_tokenised_and_answered_while_the_loop_serves(http, healthy_stream):
    # Near the character limit: it is tokenised (off the event loop) and then found too long for the context.
    body = json.dumps(_completion(prompt="Once upon a time " * (LIMITS.max_prompt_chars // 20))).encode()
    error = _error(http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"}),
                   400, "prompt")
    assert error["code"] == "context_length_exceeded"


def test_chat_template_flag_takes_a_file_or_the_template(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(CHAT_TEMPLATE, encoding="utf-8")
    assert chat_template_from_arg(str(path)) == CHAT_TEMPLATE
    assert chat_template_from_arg(CHAT_TEMPLATE) == CHAT_TEMPLATE
    assert chat_template_from_arg("{{ 'a' }}\\n{{ 'é' }}") == "{{ 'a' }}\\n{{ 'é' }}"   # no escapes read, as vLLM
    with pytest.raises(ValueError, match="looks like a file path"):
        chat_template_from_arg(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="'/dev/null' is not a regular file"):   # it exists: not "no such file"
        chat_template_from_arg("/dev/null")


def test_serve_refuses_a_chat_template_that_does_not_compile(stories_path):
    result = subprocess.run([sys.executable, "-m", "minillm.cli", "serve", str(stories_path), "--device", "cpu",
                             "--port", "0", "--chat-template", "{% for %}"],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1
    assert "--chat-template does not compile" in result.stderr
