"""Generated completion and chat bodies against a real server: never a 5xx, never a dead engine, no leaks.

Each body is a plausible one (edge values included) with up to two fields, known or not, replaced by
junk of every JSON type: huge integers, NaN and infinity, lone surrogates, nested objects. A few
hundred requests, derandomized so that CI replays the same ones.
"""
from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server_helpers import chat_model_dir, get_stats, running_server, wait_for

from minillm.server.app import ServerOptions

MODEL = "stories"
NUM_EXAMPLES = 300

PLAIN = st.text(max_size=12)                                          # valid Unicode
# Text with the odd lone surrogate, as JSON's \ud800 escapes can carry.
TEXT = st.text(st.one_of(st.characters(), st.characters(categories=["Cs"])), max_size=12)
NUMBERS = st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True, allow_infinity=True))
SCALARS = st.one_of(st.booleans(), NUMBERS, TEXT)
JUNK = st.one_of(st.none(), SCALARS, st.lists(SCALARS, max_size=3), st.dictionaries(TEXT, SCALARS, max_size=2))


def sampling_fields() -> dict:
    """Values a client may well send (edges included) for the fields completions and chat share."""
    return {
        "model": st.just(MODEL),
        "n": st.integers(1, 3),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "top_k": st.integers(-1, 512),
        "min_p": st.floats(0, 1),
        "seed": st.integers(-2**63, 2**63 - 1),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.5, 2),
        "stop": st.one_of(PLAIN.filter(bool), st.lists(PLAIN.filter(bool), max_size=3)),
        "stop_token_ids": st.lists(st.integers(0, 511), max_size=4),
        "ignore_eos": st.booleans(),
        "min_tokens": st.integers(0, 3),
        "skip_special_tokens": st.booleans(),
        "include_stop_str_in_output": st.booleans(),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "user": PLAIN,
        "logit_bias": st.dictionaries(st.integers(0, 511).map(str), st.floats(-100, 100), max_size=3),
    }


def with_damage(required: dict, optional: dict) -> st.SearchStrategy:
    """A plausible body with up to two fields (known or not) replaced by junk or by values out of range."""
    names = list(required) + list(optional) + ["x_unknown", "logit_bias", "n", "top_k", "max_tokens"]
    damage = st.dictionaries(st.sampled_from(names), st.one_of(JUNK, NUMBERS), max_size=2)
    return st.builds(lambda body, bad: {**body, **bad}, st.fixed_dictionaries(required, optional=optional), damage)


def completion_bodies() -> st.SearchStrategy:
    ids = st.lists(st.integers(0, 511), min_size=1, max_size=6)
    prompt = st.one_of(PLAIN.filter(bool), ids, st.lists(PLAIN.filter(bool), min_size=1, max_size=3),
                       st.lists(ids, min_size=1, max_size=3))
    return with_damage({"prompt": prompt, "max_tokens": st.integers(1, 12)},
                       {**sampling_fields(), "logprobs": st.integers(0, 20), "echo": st.booleans()})


def chat_bodies() -> st.SearchStrategy:
    part = st.fixed_dictionaries({"type": st.just("text"), "text": PLAIN})
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
         "content": st.one_of(PLAIN, st.lists(part, max_size=2))},
        optional={"name": PLAIN, "x_extra": JUNK})
    damaged_message = st.builds(lambda m, bad: {**m, **bad}, message,
                                st.dictionaries(st.sampled_from(["role", "content", "name"]), JUNK, max_size=1))
    optional = {**sampling_fields(), "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
                "max_completion_tokens": st.integers(1, 12),
                "chat_template_kwargs": st.dictionaries(PLAIN.filter(lambda k: k not in (
                    "messages", "template", "add_generation_prompt")), st.one_of(PLAIN, st.integers()), max_size=2),
                "chat_template": st.one_of(PLAIN, st.just("{% for m in messages %}{{ m['content'] }}{% endfor %}"))}
    # max_tokens always there: a chat request without it may run to the end of the context.
    return with_damage({"messages": st.lists(st.one_of(message, damaged_message), min_size=1, max_size=3),
                        "max_tokens": st.integers(1, 12)}, optional)


REQUESTS = st.one_of(st.tuples(st.just("/v1/completions"), completion_bodies()),
                     st.tuples(st.just("/v1/chat/completions"), chat_bodies()))


@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("fuzz-model"))
    # A small pool, so that concurrent fan-out can preempt; request templates trusted, to fuzz them too.
    with running_server(model, served_model_name=MODEL, num_kv_blocks=64,
                        options=ServerOptions(trust_request_chat_template=True)) as (url, engine):
        yield url, engine


def _send(client: httpx.Client, path: str, body: dict) -> int:
    content = json.dumps(body).encode()    # NaN, Infinity and \ud800 escapes go out as Python writes them
    with client.stream("POST", path, content=content, headers={"Content-Type": "application/json"}) as response:
        raw = response.read()
    assert response.status_code < 500, (path, body, raw[:500])
    if response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream"):
        text = raw.decode()
        assert '"error"' not in text and text.rstrip().endswith("data: [DONE]"), (path, body, text[-500:])
    elif response.status_code == 200:
        assert response.json()["choices"], (path, body)
    else:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    return response.status_code


def test_generated_requests_never_get_a_5xx_nor_leak(server):
    url, engine = server
    statuses: Counter = Counter()

    with httpx.Client(base_url=url, timeout=60) as client:
        @settings(max_examples=NUM_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(REQUESTS)
        def one_request(request):
            statuses[_send(client, *request)] += 1

        one_request()

    assert sum(statuses.values()) >= NUM_EXAMPLES
    assert statuses[200] >= 20 and statuses[400] >= 50, statuses   # both sides of validation were exercised
    assert httpx.get(f"{url}/health").status_code == 200 and engine.is_healthy
    stats = wait_for(lambda: (s := get_stats(url))["num_running"] == 0 and s)
    assert stats and stats["num_waiting"] == 0 and stats["kv_num_used_blocks"] == 0
    assert stats["kv_num_free_blocks"] + stats["kv_num_cached_blocks"] == stats["kv_num_blocks"]
