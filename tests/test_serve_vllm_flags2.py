"""vLLM's `vllm serve` flags of the second round: --chat-template-content-format,
--return-tokens-as-token-ids, --enable-prompt-tokens-details, --override-generation-config and
--enable-server-load-tracking, and the requests' spaces_between_special_tokens. The command line is
parsed in this process (the server's start stubbed); the flags' effects are seen on one engine served
by two apps, one with the flags and one without."""
from __future__ import annotations

import uuid
from types import SimpleNamespace

import httpx
import pytest
from core_hooks import install
from test_cli import STORIES, needs_stories
from test_serve_vllm_flags import logged, serve, started  # noqa: F401 (the logged and started fixtures)
from test_server_helpers import (
    call_utility, chat_model_dir, openai_error, raw_stream, running_server, sse_events, wait_for,
)

from minillm.config import EngineConfig
from minillm.generation_config import model_sampling_defaults
from minillm.server.app import ServerOptions, ServerThread, create_app

OVERRIDE = {"temperature": 0, "max_new_tokens": 24}     # greedy, and at most 24 tokens a completion
MESSAGES = [{"role": "user", "content": "Tom had a ball."}]


# ---- the command line -----------------------------------------------------------------------------

# Each flag's effect on the server options: FLAG_EFFECTS of test_serve_vllm_flags.py.


@needs_stories
def test_override_generation_config_reaches_the_engine_config(capsys, started):
    assert serve(capsys, "--override-generation-config", '{"temperature": 0.5, "max_new_tokens": 64, "top_k": null}',
                 "--generation-config", "vllm") == (0, "")
    config = started["config"]
    assert config.override_generation_config == {"temperature": 0.5, "max_new_tokens": 64, "top_k": None}
    assert config.generation_config == "vllm"


@needs_stories
def test_override_keys_that_set_no_sampling_default_are_ignored_with_a_warning(capsys, started):
    # vLLM's get_diff_sampling_param reads only its sampling keys of the object; a do_sample or
    # seed of a vLLM command line was a usage error here.
    status, err = serve(capsys, "--override-generation-config", '{"temperature": 0.5, "do_sample": true, "seed": 1}')
    assert status == 0 and started["config"].override_generation_config == {
        "temperature": 0.5, "do_sample": True, "seed": 1}
    [line] = err.strip().splitlines()
    assert line.startswith("minillm: --override-generation-config: ignoring 'do_sample', 'seed'"), line


@needs_stories
def test_without_the_flags_serve_keeps_vllms_defaults(capsys, started):
    assert serve(capsys) == (0, "")
    options = started["options"]
    assert (options.chat_template_content_format, options.return_tokens_as_token_ids,
            options.enable_prompt_tokens_details, options.enable_server_load_tracking) == ("auto", False, False, False)
    assert started["config"].override_generation_config is None


@needs_stories
@pytest.mark.parametrize("flags, message", [
    (("--chat-template-content-format", "html"), "'html' is not one of 'auto', 'string', 'openai'"),
    (("--override-generation-config", "{temperature: 1}"), "not valid JSON: Expecting property name"),
    (("--override-generation-config", "[1]"), "it must be a JSON object of generation_config.json sampling keys"),
    (("--override-generation-config", '{"temperature": -1}'), "temperature must be non-negative, got -1"),
    (("--override-generation-config", '{"max_new_tokens": 0}'), "max_new_tokens (SamplingParams' max_tokens)"),
])
def test_a_bad_value_is_a_usage_error_naming_the_flag(capsys, started, flags, message):
    status, err = serve(capsys, *flags)
    assert status == 2 and not started
    [line] = err.strip().splitlines()
    assert f"Invalid value for '{flags[0]}'" in line and message in line, line


def test_the_override_is_merged_into_the_models_defaults_or_stands_alone():
    """As vLLM's get_diff_sampling_param: over the file's values ("auto"), alone ("vllm"); null unsets."""
    tokenizer = SimpleNamespace(generation_defaults={"temperature": 0.6, "top_k": 20, "max_tokens": 64})
    override = {"temperature": 0.2, "top_k": None, "max_new_tokens": 8.0, "top_p": 0.9}

    def defaults(generation_config: str, override) -> dict:
        config = EngineConfig(model=str(STORIES), generation_config=generation_config,
                              override_generation_config=override)
        return model_sampling_defaults(config, tokenizer)

    assert defaults("auto", override) == {"temperature": 0.2, "max_tokens": 8, "top_p": 0.9}
    assert defaults("vllm", override) == {"temperature": 0.2, "max_tokens": 8, "top_p": 0.9}
    assert defaults("auto", None) == {"temperature": 0.6, "top_k": 20, "max_tokens": 64}
    # Keys that set no sampling default are ignored, as vLLM reads only its sampling keys of the object.
    assert defaults("vllm", {**override, "seed": 1, "do_sample": True}) == defaults("vllm", override)


# ---- one engine, served with the flags and without ------------------------------------------------

@pytest.fixture(scope="module")
def flagged(stories_path, tmp_path_factory):
    """(url, engine): a server with every flag of this module on, its engine started with OVERRIDE."""
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    options = ServerOptions(chat_template_content_format="openai", return_tokens_as_token_ids=True,
                            enable_prompt_tokens_details=True, enable_server_load_tracking=True, log_requests=True)
    with running_server(model, options=options, core_hook=install, max_model_len=256,
                        override_generation_config=OVERRIDE) as running:
        yield running


@pytest.fixture(scope="module")
def plain(flagged):
    """The URL of a second server over the same engine, with none of the flags."""
    server = ServerThread(create_app(flagged[1], ServerOptions(served_model_name="stories"))).start()
    yield server.url
    server.stop()


def _post(url: str, path: str, body: dict) -> dict:
    response = httpx.post(f"{url}{path}", json={"model": "stories", **body}, timeout=60)
    assert response.status_code == 200, response.text[:500]
    return response.json()


def test_content_format_openai_hands_the_template_each_message_as_a_list_of_parts(flagged, plain):
    # The tests' template writes {{ m['content'] }}: the list of parts shows as the template got it.
    parts, joined = (_post(url, "/tokenize", {"messages": MESSAGES})["tokens"] for url in (flagged[0], plain))
    assert _post(flagged[0], "/detokenize", {"tokens": parts})["prompt"].endswith(
        "user: [{'type': 'text', 'text': 'Tom had a ball.'}]\nassistant:")
    assert _post(plain, "/detokenize", {"tokens": joined})["prompt"].endswith(" user: Tom had a ball.\nassistant:")
    # A chat completion renders its messages the same way.
    chat = _post(flagged[0], "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "return_token_ids": True})
    assert chat["prompt_token_ids"] == parts


def test_logprobs_name_tokens_by_their_ids_unless_the_request_says_otherwise(flagged, plain):
    body = {"prompt": "Once upon a time", "max_tokens": 4, "logprobs": 2, "return_token_ids": True}
    [choice] = _post(flagged[0], "/v1/completions", body)["choices"]
    names = [f"token_id:{i}" for i in choice["token_ids"]]
    assert choice["logprobs"]["tokens"] == names
    assert all(len(top) >= 2 and all(key.startswith("token_id:") for key in top)
               for top in choice["logprobs"]["top_logprobs"])
    for url, fields in ((flagged[0], {"return_tokens_as_token_ids": False}), (plain, {})):
        [text_choice] = _post(url, "/v1/completions", {**body, **fields})["choices"]
        assert "".join(text_choice["logprobs"]["tokens"]) == text_choice["text"] == choice["text"]
    chat = _post(flagged[0], "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "logprobs": True,
                                                      "top_logprobs": 1, "return_token_ids": True})
    [chat_choice] = chat["choices"]
    assert [entry["token"] for entry in chat_choice["logprobs"]["content"]] == \
        [f"token_id:{i}" for i in chat_choice["token_ids"]]


def _stream_usage(url: str, path: str, body: dict) -> dict:
    response = httpx.post(f"{url}{path}", json={"model": "stories", **body, "stream": True,
                                                "stream_options": {"include_usage": True}}, timeout=60)
    assert response.status_code == 200, response.text[:500]
    return sse_events(response.text.splitlines())[-1]["usage"]


def test_usage_reports_the_prompt_tokens_served_from_the_prefix_cache(flagged, plain):
    prompt = f"{uuid.uuid4().hex} Once upon a time, there was a little girl named Lily. She loved to play outside."
    first = _post(flagged[0], "/v1/completions", {"prompt": prompt, "max_tokens": 2})["usage"]
    assert first["prompt_tokens"] > 32 and first["prompt_tokens_details"] == {"cached_tokens": 0}
    again = _post(flagged[0], "/v1/completions", {"prompt": prompt, "max_tokens": 2})["usage"]
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert 16 <= cached < again["prompt_tokens"] and cached % 16 == 0        # whole 16-token blocks
    assert _stream_usage(flagged[0], "/v1/completions", {"prompt": prompt, "max_tokens": 2})[
        "prompt_tokens_details"] == {"cached_tokens": cached}
    # Two prompts: the blocks each was served from the cache, added up as their prompt tokens are.
    both = _post(flagged[0], "/v1/completions", {"prompt": [prompt, prompt], "max_tokens": 2})["usage"]
    assert both["prompt_tokens_details"] == {"cached_tokens": 2 * cached}
    messages = [{"role": "user", "content": prompt}]
    _post(flagged[0], "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    chat = _post(flagged[0], "/v1/chat/completions", {"messages": messages, "max_tokens": 2})["usage"]
    assert chat["prompt_tokens_details"]["cached_tokens"] >= 16
    assert _stream_usage(flagged[0], "/v1/chat/completions", {"messages": messages, "max_tokens": 2})[
        "prompt_tokens_details"] == chat["prompt_tokens_details"]
    # Without the flag no details: null, as vLLM's UsageInfo dumps it.
    assert _post(plain, "/v1/completions", {"prompt": prompt, "max_tokens": 2})["usage"]["prompt_tokens_details"] is None


def test_the_overridden_generation_config_sets_what_requests_leave_unset(flagged):
    url = flagged[0]
    greedy = _post(url, "/v1/completions", {"prompt": "Lily", "max_tokens": 12, "temperature": 0})["choices"][0]["text"]
    unset = _post(url, "/v1/completions", {"prompt": "Lily", "max_tokens": 12, "n": 2})["choices"]
    assert [c["text"] for c in unset] == [greedy, greedy]                    # temperature 0 from the override
    hot = _post(url, "/v1/completions", {"prompt": "Lily", "max_tokens": 12, "n": 2, "temperature": 2, "seed": 1})
    assert len({c["text"] for c in hot["choices"]}) == 2                     # a request's own value wins
    chat = _post(url, "/v1/chat/completions", {"messages": MESSAGES, "ignore_eos": True})
    assert chat["usage"]["completion_tokens"] == 24                          # max_new_tokens: the default...
    capped = _post(url, "/v1/completions", {"prompt": "Lily", "max_tokens": 100, "ignore_eos": True})
    assert capped["usage"]["completion_tokens"] == 24                        # ...and, as in vLLM, the cap
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "Lily", "max_tokens": 1000}, timeout=60
                      ).status_code == 400                                   # past the context: still refused


def _load(url: str) -> int:
    response = httpx.get(f"{url}/load", timeout=10)
    assert response.status_code == 200 and set(response.json()) == {"server_load"}
    return response.json()["server_load"]


def test_load_counts_requests_in_flight_only_with_server_load_tracking(flagged, plain):
    url, engine = flagged
    assert _load(url) == _load(plain) == 0
    body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True, "stream": True}
    call_utility(engine, "pace_steps", 0.05)        # 24 steps: the streams stay open over a second
    try:
        socks = [raw_stream(url, body, num_chunks=2), raw_stream(plain, body, num_chunks=2)]
        assert wait_for(lambda: _load(url) == 1)
        assert _load(plain) == 0                    # its stream is in flight, as vLLM's untracked count
        for sock in socks:
            sock.close()
        assert wait_for(lambda: _load(url) == 0)
    finally:
        call_utility(engine, "pace_steps", 0)


def test_spaces_between_special_tokens_is_a_bool_taken_as_the_llm_api_takes_it(flagged, logged):
    url, engine = flagged
    body = {"prompt": "Once", "max_tokens": 3, "allowed_token_ids": [1], "ignore_eos": True,
            "skip_special_tokens": False}
    texts = [_post(url, "/v1/completions", {**body, "spaces_between_special_tokens": value})["choices"][0]["text"]
             for value in (True, False)]
    # As SamplingParams takes it: the fast tokenizer's decoder puts no spaces between special tokens.
    assert texts == [engine.tokenizer.decode([1, 1, 1], skip_special_tokens=False)] * 2 == ["<s><s><s>"] * 2
    received = [m for m in logged if m.startswith("Received request")]
    assert len(received) == 2 and "spaces_between_special_tokens=False" in received[1], received
    assert not any("ignored" in m for m in logged), logged
    chat = _post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2,
                                               "spaces_between_special_tokens": False})
    assert chat["choices"][0]["message"]["content"]
    for path, fields in (("/v1/completions", {"prompt": "Once"}), ("/v1/chat/completions", {"messages": MESSAGES})):
        for bad in ("nope", 2, [True]):      # "no" and 0 are false, as vLLM's (lax) model reads them
            response = httpx.post(f"{url}{path}", json={**fields, "spaces_between_special_tokens": bad}, timeout=60)
            error = openai_error(response, 400, "spaces_between_special_tokens")
            assert "bool" in error["message"], error
