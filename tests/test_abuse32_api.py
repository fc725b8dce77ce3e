"""The OpenAI-compatible endpoints as a vLLM user drives them (the openai client and raw HTTP), at
their edges: each defect found there, pinned."""
from __future__ import annotations

import httpx
import pytest
from test_server_helpers import chat_template_server, running_server, sse_events, story_streams  # noqa: F401

from minillm.server.app import ServerOptions


def test_model_cards_carry_vllms_parent_and_permission(http):
    """vLLM's ModelCard has parent (null for a base model) and permission (one ModelPermission), which
    proxies and dashboards read (olla's vLLM profile); the cards had neither."""
    for card in [*http.get("/v1/models").json()["data"], http.get("/v1/models/stories").json()]:
        assert card["parent"] is None and card["max_model_len"] == 256
        [permission] = card["permission"]
        assert permission["object"] == "model_permission" and permission["id"].startswith("modelperm-")
        assert {k: permission[k] for k in ("allow_sampling", "allow_logprobs", "allow_view", "organization",
                                           "allow_create_engine", "allow_fine_tuning", "group", "is_blocking")} == \
            {"allow_sampling": True, "allow_logprobs": True, "allow_view": True, "organization": "*",
             "allow_create_engine": False, "allow_fine_tuning": False, "group": None, "is_blocking": False}


# A template that shows what it was given to render with: the reasoning effort and the thinking switch.
EFFORT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
                   "|effort={{ reasoning_effort }}|thinking={{ enable_thinking }}|")


@pytest.fixture(scope="module")
def thinking_url(stories_path):
    """A server of stories260K with EFFORT_TEMPLATE and the qwen3 reasoning parser."""
    options = ServerOptions(chat_template=EFFORT_TEMPLATE, reasoning_parser="qwen3")
    with running_server(stories_path, max_model_len=256, options=options) as (url, _):
        yield url


def rendered(url: str, **body) -> str:
    """The prompt a chat request was rendered to (its prompt_token_ids decoded)."""
    response = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Lily"}], "max_tokens": 1, "return_token_ids": True, **body})
    assert response.status_code == 200, response.text
    ids = response.json()["prompt_token_ids"]
    return httpx.post(f"{url}/detokenize", json={"tokens": ids}, timeout=10).json()["prompt"]


@pytest.mark.parametrize("body, shown", [
    ({}, "|effort=|thinking=|"),
    ({"reasoning_effort": "low"}, "|effort=low|thinking=True|"),
    ({"reasoning_effort": "none"}, "|effort=none|thinking=False|"),
    # chat_template_kwargs' enable_thinking wins over the effort's; the request's effort over the kwargs'
    ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True, "reasoning_effort": "high"}},
     "|effort=none|thinking=True|"),
])
def test_chat_reasoning_effort_reaches_the_template_as_in_vllm(thinking_url, body, shown):
    """vLLM passes a chat request's reasoning_effort (OpenAI's field, which the openai client sends as
    is) to the template, and enable_thinking = effort != "none" where chat_template_kwargs does not say;
    the field was logged as unknown and dropped, so "none" left a thinking model thinking."""
    assert rendered(thinking_url, **body).endswith(shown)


def test_chat_reasoning_effort_none_leaves_no_reasoning_to_split_off(thinking_url):
    """With reasoning_effort "none" the qwen3 parser takes the reply as the answer, as with
    enable_thinking false (the template closed the thinking block): the reply went to reasoning."""
    body = {"messages": [{"role": "user", "content": "Lily"}], "max_tokens": 4, "temperature": 0}
    thinking = httpx.post(f"{thinking_url}/v1/chat/completions", json=body, timeout=60).json()
    assert thinking["choices"][0]["message"]["content"] is None
    reply = httpx.post(f"{thinking_url}/v1/chat/completions", json={**body, "reasoning_effort": "none"},
                       timeout=60).json()["choices"][0]["message"]
    assert reply["content"] and reply.get("reasoning") is None


@pytest.mark.parametrize("value", ["extreme", 3, ""])
def test_chat_reasoning_effort_outside_vllms_values_is_a_400_naming_it(http, healthy_stream, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "reasoning_effort": value}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "reasoning_effort"


def test_responses_reasoning_effort_reaches_the_template_as_in_vllm(thinking_url):
    """vLLM renders a Responses request with reasoning.effort as the template's reasoning_effort; it
    was only echoed back."""
    response = httpx.post(f"{thinking_url}/v1/responses", timeout=60, json={
        "input": "Lily", "reasoning": {"effort": "none"}, "max_output_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    [message] = response.json()["output"]
    chat = httpx.post(f"{thinking_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Lily"}], "max_tokens": 4, "temperature": 0,
        "reasoning_effort": "none"}).json()
    assert message["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert response.json()["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]


def responses_reply(http, **body) -> dict:
    response = http.post("/v1/responses", json={"input": "Once upon a time", "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_responses_takes_vllms_sampling_extensions(http):
    """vLLM's ResponsesRequest takes logit_bias, ignore_eos, skip_special_tokens and
    include_stop_str_in_output; each was logged as unknown and dropped, so a reply that was to end at
    once (</s> biased up) ran on, and one told to go on past </s> stopped."""
    eos = {"2": 100}
    stopped = responses_reply(http, logit_bias=eos, max_output_tokens=4)
    assert stopped["status"] == "completed" and stopped["usage"]["output_tokens"] == 1
    on = responses_reply(http, logit_bias=eos, ignore_eos=True, skip_special_tokens=False, max_output_tokens=3)
    assert on["status"] == "incomplete" and on["output"][0]["content"][0]["text"] == "</s></s></s>"
    plain = responses_reply(http, max_output_tokens=8)["output"][0]["content"][0]["text"]
    stop = plain.split()[1]
    kept = responses_reply(http, max_output_tokens=8, stop=[stop], include_stop_str_in_output=True)
    assert kept["output"][0]["content"][0]["text"].endswith(stop)


def test_responses_prompt_template_is_a_400_naming_it(http, healthy_stream):
    """OpenAI's stored prompt templates are refused, as vLLM refuses them: the request was answered
    without the template it named."""
    response = http.post("/v1/responses", json={"input": "hi", "prompt": {"id": "pmpt_1", "version": "2"}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert responses_reply(http, prompt=None, max_output_tokens=1)["status"] == "incomplete"


@pytest.mark.parametrize("side", ["left", "right", None])
def test_truncation_side_says_which_end_truncate_prompt_tokens_keeps(http, side):
    """vLLM's truncation_side: "right" keeps the prompt's first truncate_prompt_tokens tokens, "left"
    (and no side) its last; "right" was logged as unknown and the last tokens kept."""
    ids = http.post("/tokenize", json={"prompt": "Once upon a time there was"}).json()["tokens"]
    body = {"prompt": "Once upon a time there was", "max_tokens": 1, "truncate_prompt_tokens": 3,
            "return_token_ids": True, "truncation_side": side}
    kept = http.post("/v1/completions", json=body).json()["choices"][0]["prompt_token_ids"]
    assert kept == (ids[:3] if side == "right" else ids[-3:])
    messages = [{"role": "user", "content": "Once upon a time there was"}]
    chat_ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    chat = {"messages": messages, "max_tokens": 1, "truncate_prompt_tokens": 4, "return_token_ids": True,
            "truncation_side": side}
    kept = http.post("/v1/chat/completions", json=chat).json()["prompt_token_ids"]
    assert kept == (chat_ids[:4] if side == "right" else chat_ids[-4:])


def test_truncation_side_outside_left_and_right_is_a_400_naming_it(http, healthy_stream):
    body = {"prompt": "Once", "max_tokens": 1, "truncate_prompt_tokens": 1, "truncation_side": "middle"}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "truncation_side"


# vLLM's fields that change what comes back, which this server does not implement: (field, a value set).
# (repetition_detection is served: tests/test_abuse39_repetition.py)
UNSERVED = [("logprob_token_ids", [5, 6]), ("thinking_token_budget", 16), ("watermarking", True)]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("name, value", UNSERVED)
def test_vllm_fields_this_server_does_not_serve_are_refused_by_name(http, healthy_stream, path, name, value):
    """Each was logged as unknown and the request answered as if it had not been sent (logprobs of other
    tokens, thinking unbounded, no watermark)."""
    body = {"prompt": "Once", "messages": [{"role": "user", "content": "Once"}], "max_tokens": 1, "logprobs": None}
    response = http.post(path, json={**body, name: value})
    assert response.status_code == 400 and response.json()["error"]["param"] == name


@pytest.mark.parametrize("name, value", [("logprob_token_ids", None), ("thinking_token_budget", -1),
                                         ("thinking_token_budget", None), ("repetition_detection", None),
                                         ("watermarking", False)])
def test_vllm_fields_at_their_neutral_values_pass(http, name, value):
    body = {"prompt": "Once", "max_tokens": 1, name: value}
    assert http.post("/v1/completions", json=body).status_code == 200


def test_chat_return_prompt_text_gives_the_rendered_prompt(http):
    """vLLM's return_prompt_text: the response's prompt_text is the prompt the template rendered (on a
    stream, in each choice's first chunk, beside prompt_token_ids); it was logged as unknown."""
    messages = [{"role": "user", "content": "Once upon"}]
    body = {"messages": messages, "max_tokens": 2, "return_prompt_text": True, "return_token_ids": True}
    reply = http.post("/v1/chat/completions", json=body).json()
    text = reply["prompt_text"]
    assert text == "<s>user: Once upon\nassistant:"      # the tests' CHAT_TEMPLATE, BOS as text
    assert http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"] == \
        reply["prompt_token_ids"]
    # not asked: null, as vLLM's whole response (its model_dump) has every field
    assert http.post("/v1/chat/completions", json={**body, "return_prompt_text": False}).json()["prompt_text"] is None
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True, "n": 2}) as response:
        events = sse_events(response.iter_lines())
    openers = [e for e in events if e["choices"] and "role" in e["choices"][0]["delta"]]
    assert len(openers) == 2 and all(e["prompt_text"] == text for e in openers)
    assert not any("prompt_text" in e for e in events if e not in openers)


@pytest.mark.parametrize("status", ["incomplete", "in_progress", "completed"])
def test_responses_continues_a_partial_assistant_message(http, status):
    """vLLM continues the last input item when it is an assistant message left incomplete or in
    progress (an output fed back to go on with it), as chat's continue_final_message does; it opened
    a new assistant turn after it. A completed message is answered by a new turn, as before."""
    partial = {"type": "message", "role": "assistant", "status": status,
               "content": [{"type": "output_text", "text": "Once upon a"}]}
    reply = responses_reply(http, input=[{"role": "user", "content": "Lily"}, partial], max_output_tokens=3)
    continued = status != "completed"
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Lily"}, {"role": "assistant", "content": "Once upon a"}],
        "max_tokens": 3, "temperature": 0, "continue_final_message": continued,
        "add_generation_prompt": not continued}).json()
    assert reply["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert reply["output"][-1]["content"][0]["text"] == chat["choices"][0]["message"]["content"]


def test_responses_keeps_a_reasoning_item_that_ends_the_input(http):
    """A reasoning item goes with the assistant turn after it; one that ends the input (no turn after
    it) was dropped without a word. vLLM renders it as an assistant message of that reasoning."""
    reasoning = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "She likes cats"}]}
    reply = responses_reply(http, input=[{"role": "user", "content": "Lily"}, reasoning], max_output_tokens=1)
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Lily"},
                     {"role": "assistant", "content": "", "reasoning": "She likes cats"}],
        "max_tokens": 1}).json()
    assert reply["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]


def test_hidden_reasoning_leaks_through_no_logprobs_or_token_ids(thinking_url):
    """include_reasoning false drops the reasoning a --reasoning-parser splits off; its tokens still came
    back as logprobs and token_ids (the reasoning's text token by token). vLLM leaves both out then."""
    body = {"messages": [{"role": "user", "content": "Lily"}], "max_tokens": 4, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "return_token_ids": True}
    shown = httpx.post(f"{thinking_url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert shown["message"]["reasoning"] and shown["logprobs"]["content"] and shown["token_ids"]
    hidden = httpx.post(f"{thinking_url}/v1/chat/completions", json={**body, "include_reasoning": False},
                        timeout=60).json()["choices"][0]
    assert hidden["message"]["reasoning"] is None and hidden["logprobs"] is None and hidden["token_ids"] is None
    with httpx.stream("POST", f"{thinking_url}/v1/chat/completions", timeout=60,
                      json={**body, "include_reasoning": False, "stream": True}) as response:
        choices = [c for e in sse_events(response.iter_lines()) for c in e["choices"]]
    assert choices[-1]["finish_reason"] == "length"
    assert all(c["logprobs"] is None and c.get("token_ids") is None for c in choices)


def same_prompt_logprobs(a: list, b: list) -> bool:
    """Whether two prompt_logprobs lists hold the same tokens, ranks and texts, and logprobs equal to
    float noise (NumPy's products differ in the last bits with what else shares the batch)."""
    def without_logprobs(entries):
        return [None if e is None else {t: {k: x for k, x in v.items() if k != "logprob"} for t, v in e.items()}
                for e in entries]

    def logprobs(entries):
        return [v["logprob"] for e in entries if e is not None for v in e.values()]
    return without_logprobs(a) == without_logprobs(b) and logprobs(a) == pytest.approx(logprobs(b), abs=1e-4)


def test_chat_echo_scores_the_prompt_as_in_vllm(http):
    """vLLM scores the prompt of a chat request with echo (prompt_logprobs = top_logprobs, 0 when not
    given), so the response carries prompt_logprobs as with prompt_logprobs sent; it carried none."""
    messages = [{"role": "user", "content": "Lily"}, {"role": "assistant", "content": "Once upon"}]
    body = {"messages": messages, "max_tokens": 1, "temperature": 0, "add_generation_prompt": False,
            "continue_final_message": True, "echo": True}
    echoed = http.post("/v1/chat/completions", json=body).json()
    explicit = http.post("/v1/chat/completions", json={**body, "echo": False, "prompt_logprobs": 0}).json()
    assert same_prompt_logprobs(echoed["prompt_logprobs"], explicit["prompt_logprobs"])
    assert len(echoed["prompt_logprobs"]) == echoed["usage"]["prompt_tokens"]
    top2 = http.post("/v1/chat/completions", json={**body, "logprobs": True, "top_logprobs": 2}).json()
    assert same_prompt_logprobs(top2["prompt_logprobs"], http.post("/v1/chat/completions", json={
        **body, "echo": False, "logprobs": True, "top_logprobs": 2, "prompt_logprobs": 2}).json()["prompt_logprobs"])
    assert http.post("/v1/chat/completions", json={**body, "echo": False}).json()["prompt_logprobs"] is None
