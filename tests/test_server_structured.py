"""Structured outputs through the server and the official openai client: response_format on chat,
vLLM's structured_outputs in both endpoints' bodies, streamed and not; bad constraints are 400s
naming the field while a healthy stream finishes unchanged; the figures in /v1/stats and /metrics."""
from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")

from test_server_helpers import HealthyStreams, chat_model_dir, get_stats, running_server  # noqa: E402
from test_structured_engine import CHECKS  # noqa: E402
from test_structured_output import SCHEMA  # noqa: E402

PROMPT = "Once upon a time"
MODEL = "stories"
MAX_TOKENS = 96
NUM_SEEDS = 5
MESSAGES = [{"role": "user", "content": "Tell me about a cat."}]


@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat-model"))
    with running_server(model, served_model_name=MODEL) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def structured_outputs_body(kind: str) -> dict:
    return {"structured_outputs": dict(CHECKS[kind][0])}


def completion_texts(client, stream: bool, **args) -> tuple[list[str], list[str]]:
    """(texts, finish reasons) of a completions call's n choices, in index order."""
    if not stream:
        out = client.completions.create(**args)
        return [c.text for c in out.choices], [c.finish_reason for c in out.choices]
    texts, finishes = {}, {}
    for chunk in client.completions.create(stream=True, **args):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    return [texts[i] for i in sorted(texts)], [finishes[i] for i in sorted(texts)]


def chat_texts(client, stream: bool, **args) -> tuple[list[str], list[str]]:
    """(texts, finish reasons) of a chat call's n choices, in index order."""
    if not stream:
        out = client.chat.completions.create(**args)
        return [c.message.content for c in out.choices], [c.finish_reason for c in out.choices]
    texts, finishes = {}, {}
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    return [texts[i] for i in sorted(texts)], [finishes[i] for i in sorted(texts)]


def assert_all_valid(kind: str, texts: list[str], finishes: list[str]) -> None:
    assert len(texts) == NUM_SEEDS
    for text, finish in zip(texts, finishes):
        assert finish == "stop", (kind, finish, text)
        assert CHECKS[kind][1](text), (kind, text)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("kind", list(CHECKS))
def test_completions_with_structured_outputs(client, kind, stream):
    texts, finishes = completion_texts(client, stream, model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                       temperature=1.0, n=NUM_SEEDS, seed=11,
                                       extra_body=structured_outputs_body(kind))
    assert_all_valid(kind, texts, finishes)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("kind", list(CHECKS))
def test_chat_with_structured_outputs(client, kind, stream):
    texts, finishes = chat_texts(client, stream, model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                 temperature=1.0, n=NUM_SEEDS, seed=12, extra_body=structured_outputs_body(kind))
    assert_all_valid(kind, texts, finishes)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_chat_with_response_format_json_schema(client, stream):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    texts, finishes = chat_texts(client, stream, model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                 temperature=1.0, n=NUM_SEEDS, seed=13, response_format=response_format)
    assert_all_valid("json", texts, finishes)
    same, _ = completion_texts(client, stream, model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0,
                               n=NUM_SEEDS, seed=13, extra_body={"response_format": response_format})
    assert_all_valid("json", same, ["stop"] * NUM_SEEDS)            # completions take it too, as vLLM's do


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_chat_with_response_format_json_object(client, stream):
    # stories260K writes its story into the first key and never closes it: the object is still
    # open at max_tokens, so only its opening is checked (and a closed one must parse).
    texts, finishes = chat_texts(client, stream, model=MODEL, messages=MESSAGES, max_tokens=24,
                                 temperature=1.0, n=NUM_SEEDS, seed=14, response_format={"type": "json_object"})
    for text, finish in zip(texts, finishes):
        assert text.startswith('{"'), text
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
    plain, _ = chat_texts(client, stream, model=MODEL, messages=MESSAGES, max_tokens=24, temperature=1.0,
                          n=NUM_SEEDS, seed=14)
    assert not any(text.startswith("{") for text in plain)


def test_response_format_text_is_no_constraint(client):
    args = dict(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0)
    plain = client.chat.completions.create(**args).choices[0].message.content
    assert client.chat.completions.create(response_format={"type": "text"}, **args).choices[0].message.content == plain


# ----------------------------------------------------------------------------- bad input

BAD = [   # (endpoint, body fields, param)
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ("chat", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("chat", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format"),
    ("completions", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("completions", {"structured_outputs": {"json": {"type": "strin"}}}, "structured_outputs.json"),
    ("chat", {"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ("completions", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ("chat", {"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex"),
    ("completions", {"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ("chat", {"structured_outputs": {"grammar": "start: 'a' | "}}, "structured_outputs.grammar"),
    ("completions", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("completions", {"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs"),
    ("chat", {"structured_outputs": {"choice": ["a"], "grammar": "start: \"a\""}}, "structured_outputs"),
    ("chat", {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ("completions", {"guided_json": SCHEMA}, "guided_json"),
    ("completions", {"structured_outputs": {"regex": "a\ud800"}}, "structured_outputs"),     # not Unicode
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"\udfff": 1}}}},
     "response_format"),
    ("chat", {"response_format": "json"}, "response_format"),
    ("completions", {"structured_outputs": {"x" * 5000: 1}}, "structured_outputs"),
    ("chat", {"response_format": {"type": "y" * 5000}}, "response_format.type"),
]


def post(url: str, endpoint: str, fields: dict) -> httpx.Response:
    """POST the body as ASCII JSON (a lone surrogate travels as its \\u escape, as JSON allows)."""
    body = {"model": MODEL, "max_tokens": 8, **fields}
    if endpoint == "chat":
        path, body = "chat/completions", {"messages": MESSAGES, **body}
    else:
        path, body = "completions", {"prompt": PROMPT, **body}
    return httpx.post(f"{url}/v1/{path}", content=json.dumps(body), timeout=60,
                      headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("endpoint,fields,param", BAD)
def test_bad_constraint_is_a_400_naming_the_field(server, endpoint, fields, param):
    response = post(server[0], endpoint, fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(param) or param in error["message"]
    assert len(error["message"]) < 1000                  # a long input is not echoed back whole


def test_the_openai_client_sees_the_400s(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"type": "strin"}}})
    assert info.value.status_code == 400 and info.value.param == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, stream=True,
                                  extra_body={"structured_outputs": {"regex": "a(b"}})
    assert info.value.param == "structured_outputs.regex"


def test_a_healthy_stream_finishes_unchanged_through_the_bad_requests(server):
    healthy = HealthyStreams(server[0], {"model": MODEL, "prompt": PROMPT, "max_tokens": 480, "temperature": 0,
                                         "ignore_eos": True})
    with healthy.in_flight(fresh=True):
        for endpoint, fields, param in BAD:
            response = post(server[0], endpoint, fields)
            assert response.status_code == 400 and response.json()["error"]["param"] == param
    healthy.check()


def test_stats_and_metrics_show_the_grammar_work(server, client):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                              extra_body=structured_outputs_body("date"))
    stats = get_stats(server[0])
    assert stats["num_grammars_compiled"] >= 1 and stats["grammar_compile_time_s"] > 0
    assert stats["num_grammar_fill_steps"] >= 1 and stats["grammar_fill_time_s"] > 0
    metrics = httpx.get(f"{server[0]}/metrics", timeout=10).text
    samples = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("minillm:structured_output")}
    assert samples["minillm:structured_output_compile_seconds_count"] >= 1
    assert samples["minillm:structured_output_compile_seconds_sum"] > 0
    assert samples["minillm:structured_output_bitmask_fill_seconds_count"] >= 1
    assert samples["minillm:structured_output_bitmask_fill_seconds_sum"] > 0
