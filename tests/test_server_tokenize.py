"""vLLM's utility endpoints: POST /tokenize, POST /detokenize, GET /version.

A real server on loopback with a chat template that renders tools too, and an API key (which
guards /v1 only, as in vLLM: these endpoints stay open). /tokenize's ids must be the engine
tokenizer's, and what a completion or chat completion feeds the engine (its usage.prompt_tokens).
"""
from __future__ import annotations

import httpx
import pytest
from test_server_helpers import CHAT_TEMPLATE, api_servers_on_one_core, get_stats, openai_error, running_server

import minillm
from minillm.config import EngineConfig
from minillm.server.app import ServerOptions
from minillm.server.limits import ServerLimits

MODEL = "stories"
KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_PROMPT_CHARS = 2000
# CHAT_TEMPLATE, plus the names of the request's tools before the conversation.
TOOLS_TEMPLATE = ("{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n{% endif %}"
                  + CHAT_TEMPLATE)
MESSAGES = [{"role": "user", "content": "Tell me a story."}]
CONTINUED = MESSAGES + [{"role": "assistant", "content": "Once upon a"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def server(stories_path):
    options = ServerOptions(chat_template=TOOLS_TEMPLATE, limits=ServerLimits(max_prompt_chars=MAX_PROMPT_CHARS))
    with running_server(stories_path, served_model_name=MODEL, api_key=KEY, options=options) as (url, engine):
        yield url, engine


def _post(url: str, path: str, body) -> httpx.Response:
    """POST body as JSON (bytes: as they are, for JSON that Python cannot encode, such as a lone surrogate)."""
    if isinstance(body, bytes):
        return httpx.post(f"{url}{path}", content=body, headers={**AUTH, "Content-Type": "application/json"},
                          timeout=30)
    return httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=30)


def _ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text[:500]
    return response.json()


@pytest.mark.parametrize("add_special_tokens", [True, False, None])
def test_tokenize_prompt_is_the_engine_tokenizers_and_the_completions(server, add_special_tokens):
    url, engine = server
    prompt = "Once upon a time, Lily saw a big dog."
    fields = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
    body = _ok(_post(url, "/tokenize", {"model": MODEL, "prompt": prompt, **fields}))
    expected = engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens is not False)
    assert body == {"count": len(expected), "max_model_len": engine.max_model_len, "tokens": expected,
                    "token_strs": None}
    completion = _ok(_post(url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                     "temperature": 0, **fields}))
    assert completion["usage"]["prompt_tokens"] == body["count"]


def test_tokenize_returns_token_strings_on_request(server):
    url, engine = server
    body = _ok(_post(url, "/tokenize", {"prompt": "Once upon a time", "return_token_strs": True}))
    assert body["token_strs"] == engine.tokenizer.convert_ids_to_tokens(body["tokens"])
    assert body["token_strs"][0] == engine.tokenizer.bos_token and len(body["token_strs"]) == body["count"]


# (tokenize fields, chat completion fields): the same rendering asked of both.
CHAT_FORMS = {
    "defaults": ({}, {}),
    "no-generation-prompt": ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
    "continue-final-message": ({"messages": CONTINUED, "add_generation_prompt": False, "continue_final_message": True},
                               {"messages": CONTINUED, "add_generation_prompt": False,
                                "continue_final_message": True}),
    "add-special-tokens": ({"add_special_tokens": True}, {"add_special_tokens": True}),
    # /tokenize renders tools always (it has no tool_choice); a chat completion does under "none".
    "tools": ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "none"}),
    "template-kwargs": ({"chat_template_kwargs": {"tools": TOOLS}}, {"chat_template_kwargs": {"tools": TOOLS}}),
}


@pytest.mark.parametrize("form", list(CHAT_FORMS))
def test_tokenize_messages_counts_what_a_chat_completion_feeds_the_engine(server, form):
    url, engine = server
    tokenize_fields, chat_fields = CHAT_FORMS[form]
    body = _ok(_post(url, "/tokenize", {"model": MODEL, "messages": MESSAGES, **tokenize_fields}))
    chat = _ok(_post(url, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 1,
                                                    "temperature": 0, **chat_fields}))
    assert body["count"] == chat["usage"]["prompt_tokens"] == len(body["tokens"])
    tok = engine.tokenizer
    text = tok.render_chat(tokenize_fields.get("messages", MESSAGES), template=TOOLS_TEMPLATE,
                           add_generation_prompt=tokenize_fields.get("add_generation_prompt", True),
                           continue_final_message=tokenize_fields.get("continue_final_message", False),
                           tools=tokenize_fields.get("tools", (tokenize_fields.get("chat_template_kwargs") or {})
                                                     .get("tools")))
    assert body["tokens"] == tok.encode(text, add_special_tokens=tokenize_fields.get("add_special_tokens", False))
    if form == "tools":
        assert "tools: get_weather" in text


def test_detokenize_round_trips(server):
    url, engine = server
    prompt = "Once upon a time, there was a little girl named Lily."
    ids = _ok(_post(url, "/tokenize", {"prompt": prompt, "add_special_tokens": False}))["tokens"]
    text = _ok(_post(url, "/detokenize", {"model": MODEL, "tokens": ids}))["prompt"]
    assert text == prompt
    assert _ok(_post(url, "/tokenize", {"prompt": text, "add_special_tokens": False}))["tokens"] == ids
    # Special tokens stay in the text, as vLLM decodes them.
    with_bos = _ok(_post(url, "/tokenize", {"prompt": prompt}))["tokens"]
    text = _ok(_post(url, "/detokenize", {"tokens": with_bos}))["prompt"]
    assert text == engine.tokenizer.decode(with_bos, skip_special_tokens=False)
    assert text.startswith(engine.tokenizer.bos_token)
    assert _ok(_post(url, "/detokenize", {"tokens": []})) == {"prompt": ""}


def test_version(server):
    url, _ = server
    response = httpx.get(f"{url}/version", timeout=10)
    assert _ok(response) == {"version": minillm.__version__}
    assert httpx.head(f"{url}/version", timeout=10).status_code == 200


def test_the_api_key_guards_v1_only_as_in_vllm(server):
    url, _ = server
    assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
    assert httpx.post(f"{url}/tokenize", json={"prompt": "Once"}, timeout=10).status_code == 200
    assert httpx.post(f"{url}/detokenize", json={"tokens": [1]}, timeout=10).status_code == 200
    assert httpx.get(f"{url}/version", timeout=10).status_code == 200


LONG = "a" * (MAX_PROMPT_CHARS + 1)
# (name, path, body, status, param)
ERRORS = [
    ("tokenize-model", "/tokenize", {"model": "gpt-4", "prompt": "Once"}, 404, "model"),
    ("tokenize-chat-model", "/tokenize", {"model": "gpt-4", "messages": MESSAGES}, 404, "model"),
    ("detokenize-model", "/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "model"),
    ("prompt-missing", "/tokenize", {"model": MODEL}, 400, "prompt"),
    ("prompt-int", "/tokenize", {"prompt": 3}, 400, "prompt"),
    ("prompt-ids", "/tokenize", {"prompt": [1, 2]}, 400, "prompt"),
    ("prompt-surrogate", "/tokenize", b'{"prompt": "a\\ud800"}', 400, "prompt"),
    ("prompt-and-messages", "/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "messages"),
    ("body-list", "/tokenize", [{"prompt": "a"}], 400, None),
    ("add-special-tokens-int", "/tokenize", {"prompt": "a", "add_special_tokens": 2}, 400, "add_special_tokens"),
    ("return-token-strs-string", "/tokenize", {"prompt": "a", "return_token_strs": "sure"}, 400, "return_token_strs"),
    ("prompt-too-long", "/tokenize", {"prompt": LONG}, 400, "prompt"),
    ("messages-empty", "/tokenize", {"messages": []}, 400, "messages"),
    ("message-content-int", "/tokenize", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("message-no-role", "/tokenize", {"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    ("image-part", "/tokenize", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages.0.content.0.type"),
    ("messages-too-long", "/tokenize", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("continue-and-generation-prompt", "/tokenize", {"messages": CONTINUED, "continue_final_message": True},
     400, "continue_final_message"),
    ("untrusted-chat-template", "/tokenize", {"messages": MESSAGES, "chat_template": "{{ messages }}"},
     400, "chat_template"),
    ("reserved-template-kwarg", "/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"messages": []}},
     400, "chat_template_kwargs"),
    ("tool-without-function", "/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]},
     400, "tools.0.function"),
    ("tokens-missing", "/detokenize", {"model": MODEL}, 400, "tokens"),
    ("tokens-out-of-vocabulary", "/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
    ("tokens-negative", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("tokens-huge", "/detokenize", {"tokens": [2**70]}, 400, "tokens"),
    ("tokens-fraction", "/detokenize", {"tokens": [1.5]}, 400, "tokens.0"),
    ("tokens-text", "/detokenize", {"tokens": "1 2"}, 400, "tokens"),
]


@pytest.mark.parametrize("path,body,status,param", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_bad_requests_are_openai_errors_naming_the_field(server, path, body, status, param):
    url, _ = server
    openai_error(_post(url, path, body), status, param)


def test_a_wrong_model_is_the_completions_404(server):
    url, _ = server
    expected = _post(url, "/v1/completions", {"model": "gpt-4", "prompt": "Once"})
    for path, body in (("/tokenize", {"model": "gpt-4", "prompt": "Once"}),
                       ("/tokenize", {"model": "gpt-4", "messages": MESSAGES}),
                       ("/detokenize", {"model": "gpt-4", "tokens": [1]})):
        response = _post(url, path, body)
        assert (response.status_code, response.json()) == (expected.status_code, expected.json())


def test_bad_requests_leave_the_engine_serving(server):
    """Tokenising happens in the API server: after every error above a completion still runs."""
    url, _ = server
    for _, path, body, _, _ in ERRORS:
        _post(url, path, body)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert _ok(_post(url, "/v1/completions", {"prompt": "Once", "max_tokens": 2}))["usage"]["completion_tokens"] == 2


@pytest.fixture(scope="module")
def two_servers(stories_path):
    """One engine core for two API servers (as --api-server-count 2 runs them), no chat template."""
    with api_servers_on_one_core(EngineConfig(model=str(stories_path), device="cpu"), 2, None, MODEL) as both:
        yield both


def test_every_api_server_tokenizes_without_the_engine_core(two_servers):
    urls, engines = two_servers
    before = get_stats(urls[0])["prompt_tokens_total"]
    prompt = "Lily and Ben went to the park."
    expected = engines[0].tokenizer.encode(prompt)
    for url in urls:
        assert _ok(_post(url, "/tokenize", {"prompt": prompt}))["tokens"] == expected
        assert _ok(_post(url, "/detokenize", {"tokens": expected}))["prompt"] == \
            engines[0].tokenizer.decode(expected, skip_special_tokens=False)
        # No template on this model: the chat form is the chat completion's 400.
        error = openai_error(_post(url, "/tokenize", {"messages": MESSAGES}), 400, "messages")
        assert error["code"] == "no_chat_template"
    assert get_stats(urls[0])["prompt_tokens_total"] == before      # nothing reached the engine core
