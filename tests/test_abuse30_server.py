"""`minillm serve` as real clients use it: Anthropic's Messages API, /metrics against vLLM's names.

A real server on loopback with a chat template; each test runs with a healthy greedy stream in
flight, and every such stream must end with the text of the same request made alone.
"""
from __future__ import annotations

import json

from test_server_helpers import wait_for
from test_server_helpers import chat_template_server, story_streams  # noqa: F401 (the server and healthy fixtures)

MODEL = "stories"


def test_a_final_assistant_message_is_continued_as_anthropic_prefills(http, healthy_stream):
    # Anthropic's Messages API continues a final assistant message (a prefill): the reply goes on from
    # its text. The conversation was rendered with a new assistant turn after it instead, so the
    # prefill was a finished message the reply ignored.
    messages = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a"}]
    continued = {"model": MODEL, "messages": messages, "add_generation_prompt": False,
                 "continue_final_message": True}
    prompt_ids = http.post("/tokenize", json=continued).json()["tokens"]
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": messages}
    assert http.post("/v1/messages/count_tokens", json=body).json() == {"input_tokens": len(prompt_ids)}
    chat = http.post("/v1/chat/completions", json={**continued, "max_tokens": 4, "temperature": 0}).json()
    reply = http.post("/v1/messages", json=body).json()
    assert reply["content"] == [{"type": "text", "text": chat["choices"][0]["message"]["content"]}], reply
    usage = reply["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(prompt_ids), usage


NAME_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"],
               "additionalProperties": False}


def test_messages_output_config_format_holds_the_reply_to_its_json_schema(http, healthy_stream):
    # Anthropic's structured outputs (output_config.format, what the SDK's messages.parse sends) were
    # logged as an unknown field and ignored: the reply was free text that the client failed to parse.
    body = {"model": MODEL, "max_tokens": 40, "temperature": 0, "messages": [{"role": "user", "content": "Name?"}],
            "output_config": {"format": {"type": "json_schema", "schema": NAME_SCHEMA}}}
    reply = http.post("/v1/messages", json=body).json()
    [block] = reply["content"]
    assert block["type"] == "text" and set(json.loads(block["text"])) == {"name"}, reply
    assert reply["stop_reason"] == "end_turn", reply
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as response:
        deltas = [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]
    text = "".join(e["delta"]["text"] for e in deltas if e["type"] == "content_block_delta")
    assert text == block["text"]


def test_messages_output_config_errors_name_its_fields(http, healthy_stream):
    def error(output_config) -> dict:
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                "output_config": output_config}
        response = http.post("/v1/messages", json=body)
        assert response.status_code == 400, response.text
        return response.json()["error"]

    assert error({"format": {"type": "xml", "schema": {}}})["param"] == "output_config.format.type"
    assert error({"format": {"type": "json_schema"}})["param"] == "output_config.format.schema"
    assert error({"format": "json"})["param"] == "output_config.format"
    assert error([1])["param"] == "output_config"
    bad_schema = error({"format": {"type": "json_schema", "schema": {"type": "bogus"}}})
    assert bad_schema["param"] == "output_config.format.schema", bad_schema
    assert "response_format" not in bad_schema["message"] and "bogus" in bad_schema["message"], bad_schema


def _scrape(http) -> dict[str, float]:
    """/metrics as {series with labels: value} (the model_name label dropped)."""
    values = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            name, _, labels = series.partition("{")
            kept = [label for label in labels.rstrip("}").split(",") if label and not label.startswith("model_name=")]
            values[name + ("{" + ",".join(kept) + "}" if kept else "")] = float(value)
    return values


def _idle(http) -> dict[str, float]:
    """A scrape once no request runs or waits (the healthy stream of an earlier test has ended)."""
    idle = wait_for(lambda: (lambda m: m if m["minillm:num_requests_running"] == 0
                             and m["minillm:num_requests_waiting"] == 0 else None)(_scrape(http)), 60)
    assert idle, "the server never went idle"
    return idle


PHASES = ("queue_time", "prefill_time", "decode_time", "inference_time", "time_per_output_token")


def test_metrics_have_vllms_request_phase_histograms(http):
    # vLLM's request_queue_time_seconds, request_prefill_time_seconds, request_decode_time_seconds,
    # request_inference_time_seconds and request_time_per_output_token_seconds were missing.
    before = _idle(http)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "ignore_eos": True}
    http.post("/v1/completions", json=body).raise_for_status()
    after = _scrape(http)
    e2e = after["minillm:e2e_request_latency_seconds_sum"] - before["minillm:e2e_request_latency_seconds_sum"]
    for phase in PHASES:
        name = f"minillm:request_{phase}_seconds"
        assert after[f"{name}_count"] - before.get(f"{name}_count", 0) == 1, name
        seconds = after[f"{name}_sum"] - before.get(f"{name}_sum", 0)
        assert 0 <= seconds <= e2e, (name, seconds, e2e)
    assert after['minillm:request_decode_time_seconds_bucket{le="+Inf"}'] >= 1


def test_metrics_count_each_of_n_completions_as_a_request_as_vllm_does(http):
    # One request with n=3 added 3 to request_success_total and 3 prompts to prompt_tokens_total, but 1
    # to each histogram (and all 3 completions' tokens to one request_generation_tokens value), so the
    # counters and the histograms disagreed on what a request is; vLLM counts each of n as one.
    before = _idle(http)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "n": 3, "ignore_eos": True}
    http.post("/v1/completions", json=body).raise_for_status()
    after = _scrape(http)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0)

    assert grew('minillm:request_success_total{finished_reason="length"}') == 3
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_prompt_tokens",
                 "request_generation_tokens", "request_decode_time_seconds"):
        assert grew(f"minillm:{name}_count") == 3, name
    assert grew("minillm:request_generation_tokens_sum") == grew("minillm:generation_tokens_total") == 12
    assert grew('minillm:request_generation_tokens_bucket{le="5.0"}') == 3
    assert grew("minillm:request_prompt_tokens_sum") == grew("minillm:prompt_tokens_total")
    assert grew("minillm:inter_token_latency_seconds_count") == 3 * 3     # 3 gaps in each of 3 completions


def test_messages_pass_chat_template_kwargs_to_the_template_as_vllm_does(http, healthy_stream):
    # vLLM's /v1/messages takes chat_template_kwargs; here they were logged as an unknown field and
    # dropped, so a client could not switch a template's options (and a reserved name went unnoticed).
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    response = http.post("/v1/messages", json={**body, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "chat_template_kwargs"
    response = http.post("/v1/messages", json={**body, "chat_template_kwargs": {"enable_thinking": False},
                                               "thinking": {"type": "enabled", "budget_tokens": 1}})
    assert response.status_code == 200, response.text
