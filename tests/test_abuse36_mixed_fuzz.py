"""A seeded mix of what a busy public endpoint gets, sent to one `minillm serve` at once.

Completions, chat (with tools), Responses and Messages requests, streamed or not, draw n>1,
logprobs, echo, prompt_logprobs, stop strings and ids, min_tokens, penalties, logit_bias, seeds,
greedy and sampled decoding, structured outputs, max_tokens 1, ignore_eos and token ids from one
seeded generator; some clients leave mid-stream and some requests are invalid. The server runs
ngram speculation, async scheduling, prefix caching, 4 sequences a step and a pool of 20 KV blocks.

Each reply is checked on its own (the SDKs' types, usage against the tokens returned, the finish
reason against the text and max_tokens, structured outputs valid, logit_bias +-100 obeyed); greedy
and seeded requests are sent again alone and must match; an invalid request is an OpenAI-style 4xx
naming its field. After the run: /health 200, the pool empty, and /metrics' finished requests
equal to the choices the clients saw end plus those whose clients left.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_server_helpers import CHAT_TEMPLATE, started_url, stop_server

openai_types = pytest.importorskip("openai.types")
anthropic_types = pytest.importorskip("anthropic.types")
from openai.types import chat as openai_chat  # noqa: E402
from openai.types import responses as openai_responses  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL = "stories"
SEED = 9
NUM_CASES = 100
CONCURRENCY = 16
SERVE_ARGS = ["--max-num-seqs", "4", "--num-gpu-blocks-override", "20", "--block-size", "16",
              "--enable-prefix-caching", "--async-scheduling", "--speculative-config",
              '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}']
PROMPTS = ["Once upon a time", "Lily and Tom went to the park", "The little dog", "One day, a girl named Sue",
           "He was very happy because", "Tim had a big red ball. He", "The sun was"]
STOPS = [" the", ".", "ball", "\n", "was", " a", "Tim"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                   "required": ["city"], "additionalProperties": False}}}]
CHOICES = ["yes", "no", "maybe so"]
REGEX = "[a-z]{2,6}( [a-z]{2,6}){0,3}"
ONE = [{"role": "user", "content": "a"}]
INVALID = [   # (route, body, status, the param the error names)
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "logprobs": 1000}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "a", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [-5]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 3, "min_tokens": 5}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "a", "structured_outputs": {"regex": "("}}, 400, "structured_outputs.regex"),
    ("/v1/completions", {"prompt": "a", "model": "nope"}, 404, "model"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 1000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "prompt_logprobs": 2, "stream": True}, 400, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": ONE, "top_logprobs": 3}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": ONE, "tools": TOOLS,
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": ONE, "n": -2}, 400, "n"),
    ("/v1/responses", {"input": "a", "max_output_tokens": -3}, 400, "max_output_tokens"),
    ("/v1/messages", {"messages": ONE}, 400, None),    # Anthropic's errors name no field
]

# ---------------------------------------------------------------------------------------------
# The cases.


def draw_sampling(rng: random.Random, body: dict, chat: bool) -> None:
    """Sampling fields any OpenAI route takes, drawn into body."""
    body["temperature"] = 0 if rng.random() < 0.5 else rng.choice([0.7, 1.0, 1.3])
    if body["temperature"] and rng.random() < 0.5:
        body["seed"] = rng.randrange(1000)
    if rng.random() < 0.3:
        body["top_p"] = rng.choice([0.5, 0.9])
    if rng.random() < 0.2:
        body["top_k"] = rng.choice([1, 5, 40])
    if rng.random() < 0.25:
        body[rng.choice(["presence_penalty", "frequency_penalty"])] = rng.choice([-1.0, 0.5, 1.5])
    if rng.random() < 0.15:
        body["repetition_penalty"] = rng.choice([0.8, 1.2])
    if rng.random() < 0.2:
        body["logit_bias"] = {str(rng.randrange(3, 512)): rng.choice([-100, 5, 100]) for _ in range(rng.randint(1, 3))}
    if rng.random() < 0.25:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
        body["include_stop_str_in_output"] = rng.random() < 0.5
    if rng.random() < 0.15:
        body["stop_token_ids"] = rng.sample(range(3, 512), 3)
    if rng.random() < 0.2:
        body["ignore_eos"] = True
    if rng.random() < 0.25:
        body["n"] = rng.choice([2, 3])
    max_tokens = rng.choice([1, 1, 2, 5, 10, 20, 40, 60])
    body["max_completion_tokens" if chat and rng.random() < 0.5 else "max_tokens"] = max_tokens
    if rng.random() < 0.2:
        body["min_tokens"] = rng.randint(0, max_tokens)
    draw = rng.random()
    if draw < 0.06:
        body["structured_outputs"] = {"choice": CHOICES}
    elif draw < 0.12:
        body["structured_outputs"] = {"regex": REGEX}
    elif draw < 0.18 and chat:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    elif draw < 0.18:
        body["structured_outputs"] = {"json": SCHEMA}
    if rng.random() < 0.5:
        body["return_token_ids"] = True


def draw_completion(rng: random.Random) -> dict:
    """A /v1/completions body."""
    body = {"prompt": rng.sample(PROMPTS, 2) if rng.random() < 0.1 else rng.choice(PROMPTS)}
    draw_sampling(rng, body, chat=False)
    if rng.random() < 0.35:
        body["logprobs"] = rng.choice([0, 1, 3])
    if rng.random() < 0.15:
        body["echo"] = True
    if rng.random() < 0.15:
        body["prompt_logprobs"] = rng.choice([0, 2])
    return body


def draw_chat(rng: random.Random) -> dict:
    """A /v1/chat/completions body, some with tools."""
    messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
    if rng.random() < 0.3:
        messages = [{"role": "system", "content": "Tell a story."}, *messages,
                    {"role": "assistant", "content": "Ok."}, {"role": "user", "content": rng.choice(PROMPTS)}]
    body = {"messages": messages}
    draw_sampling(rng, body, chat=True)
    if rng.random() < 0.35:
        body["logprobs"] = True
        if rng.random() < 0.7:
            body["top_logprobs"] = rng.choice([0, 1, 4])
    if rng.random() < 0.15 and not {"response_format", "structured_outputs", "stop", "min_tokens"} & set(body):
        body.pop("max_completion_tokens", None)
        body.update(tools=TOOLS, max_tokens=60, tool_choice=rng.choice(
            ["required", {"type": "function", "function": {"name": "get_weather"}}, "none"]))
    return body


def draw_responses(rng: random.Random) -> dict:
    """A /v1/responses body."""
    body = {"input": rng.choice(PROMPTS), "max_output_tokens": rng.choice([1, 5, 20, 40])}
    if rng.random() < 0.5:
        body["temperature"] = 0
    if rng.random() < 0.2:
        body.update(text={"format": {"type": "json_schema", "name": "p", "schema": SCHEMA}}, max_output_tokens=80)
    if rng.random() < 0.2:
        body.update(top_logprobs=2, include=["message.output_text.logprobs"])
    return body


def draw_messages(rng: random.Random) -> dict:
    """A /v1/messages body."""
    body = {"max_tokens": rng.choice([1, 5, 20, 40]), "messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}
    if rng.random() < 0.5:
        body["temperature"] = 0
    if rng.random() < 0.3:
        body["stop_sequences"] = rng.sample(STOPS, 1)
    if rng.random() < 0.2:
        body["system"] = "Tell a story."
    return body


def draw_case(rng: random.Random, index: int) -> dict:
    """One case: {index, route, body} and, where drawn, the error it must get or when its client leaves."""
    draw = rng.random()
    if draw < 0.07:
        route, body, status, param = rng.choice(INVALID)
        return {"index": index, "route": route, "body": {"model": MODEL, **body}, "invalid": (status, param)}
    route, drawer = next(item for limit, *item in [(0.45, "/v1/completions", draw_completion),
                                                   (0.78, "/v1/chat/completions", draw_chat),
                                                   (0.89, "/v1/responses", draw_responses),
                                                   (1.0, "/v1/messages", draw_messages)] if draw < limit)
    case = {"index": index, "route": route, "body": {"model": MODEL, **drawer(rng)}}
    if rng.random() < 0.4:
        case["body"]["stream"] = True
        if case["body"].get("prompt_logprobs"):
            case["body"]["prompt_logprobs"] = 0
        if route in ("/v1/completions", "/v1/chat/completions") and rng.random() < 0.6:
            case["body"]["stream_options"] = {"include_usage": True}
        if rng.random() < 0.2:
            case["leave_after"] = rng.randint(1, 4)
    return case


# ---------------------------------------------------------------------------------------------
# Checks of one reply. Each returns what must repeat when the request is sent again alone.


def max_tokens_of(body: dict) -> int:
    """The request's token limit, under any route's name for it."""
    return next(body[k] for k in ("max_tokens", "max_completion_tokens", "max_output_tokens") if k in body)


def check_text(body: dict, text: str, finish: str, num_tokens: int | None, problems: list) -> None:
    """A choice's text and token count against max_tokens, min_tokens, ignore_eos, stops and structure."""
    structured = body.get("structured_outputs") or body.get("response_format") or {}
    stops, limit = body.get("stop") or [], max_tokens_of(body)
    if num_tokens is not None:
        if num_tokens > limit or (finish == "length" and num_tokens != limit):
            problems.append(f"{num_tokens} tokens, max_tokens {limit}, finish {finish}")
        if not structured and num_tokens < body.get("min_tokens", 0):
            problems.append(f"{num_tokens} tokens < min_tokens {body['min_tokens']}")
        if (body.get("ignore_eos") and not (stops or body.get("stop_token_ids") or structured)
                and num_tokens != limit):
            problems.append(f"ignore_eos but {num_tokens} tokens of {limit}")
    if not body.get("min_tokens"):      # within min_tokens a stop string does not stop (vLLM's)
        for stop in stops:
            kept = text[:-len(stop)] if body.get("include_stop_str_in_output") and text.endswith(stop) else text
            if stop in kept:
                problems.append(f"stop {stop!r} in {text!r}")
    if finish != "stop" or stops or body.get("stop_token_ids"):
        return
    if "choice" in structured and text not in CHOICES:
        problems.append(f"not a choice: {text!r}")
    if "regex" in structured and not re.fullmatch(REGEX, text):
        problems.append(f"regex not matched: {text!r}")
    if "json" in structured or structured.get("type") == "json_schema":
        check_json(text, problems)


def check_json(text: str, problems: list) -> None:
    """text is an object of SCHEMA."""
    try:
        value = json.loads(text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int) and isinstance(value["name"], str)
    except (ValueError, AssertionError):
        problems.append(f"not JSON of the schema: {text!r}")


def check_token_ids(body: dict, choices: list[dict], problems: list) -> None:
    """Greedy choices of one prompt alike; logit_bias of +-100 obeyed where no grammar overrides it."""
    n = body.get("n", 1)
    if body.get("temperature") == 0:
        for start in range(0, len(choices), n):
            if len({c["text"] for c in choices[start:start + n]}) > 1:
                problems.append(f"greedy choices differ: {[c['text'] for c in choices[start:start + n]]}")
    if not body.get("logit_bias") or body.get("structured_outputs") or body.get("response_format") or body.get("tools"):
        return
    up = {int(t) for t, v in body["logit_bias"].items() if v == 100}
    down = {int(t) for t, v in body["logit_bias"].items() if v == -100}
    for choice in choices:
        ids = choice["token_ids"] or []
        sampled = ids[:-1] if choice["finish_reason"] == "stop" else ids
        if (up and not set(sampled) <= up) or down & set(ids):
            problems.append(f"logit_bias {body['logit_bias']} but tokens {ids}")


def completion_choices(body: dict, data: dict, problems: list) -> tuple[list[dict], dict | None]:
    """The choices of a completion, whole or streamed, validated by the openai SDK's types; and its usage."""
    if "events" not in data:
        if not body.get("echo"):    # the SDK's type takes no null first logprob, which echo sends as vLLM does
            openai_types.Completion.model_validate(data)
        return [{"index": c["index"], "text": c["text"], "finish_reason": c["finish_reason"],
                 "token_ids": c.get("token_ids"), "prompt_logprobs": c.get("prompt_logprobs"),
                 "logprobs": list(zip(c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]))
                 if c.get("logprobs") else None} for c in data["choices"]], data["usage"]
    choices: dict[int, dict] = {}
    usage = None
    for event in data["events"]:
        if not body.get("echo"):
            openai_types.Completion.model_validate({**event, "choices": [
                {**c, "finish_reason": c["finish_reason"] or "stop"} for c in event["choices"]]})
        usage = event.get("usage") or usage
        for c in event["choices"]:
            choice = choices.setdefault(c["index"], {"index": c["index"], "text": "", "finish_reason": None,
                                                     "token_ids": None, "logprobs": None, "prompt_logprobs": None})
            choice["text"] += c["text"]
            if c["finish_reason"]:
                if choice["finish_reason"]:
                    problems.append(f"choice {c['index']} finished twice")
                choice["finish_reason"] = c["finish_reason"]
            if c.get("token_ids") is not None:
                choice["token_ids"] = (choice["token_ids"] or []) + c["token_ids"]
            if c.get("logprobs"):
                choice["logprobs"] = (choice["logprobs"] or []) + list(
                    zip(c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]))
    return sorted(choices.values(), key=lambda c: c["index"]), usage


def check_completion(body: dict, data: dict, prompt_lens: list[int], problems: list) -> list:
    """A /v1/completions reply."""
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    n = body.get("n", 1)
    choices, usage = completion_choices(body, data, problems)
    if [c["index"] for c in choices] != list(range(n * len(prompts))):
        problems.append(f"choices {[c['index'] for c in choices]}")
    total = 0
    for choice in choices:
        prompt = prompts[choice["index"] // n]
        text = choice["text"]
        if body.get("echo"):
            if not text.startswith(prompt):
                problems.append(f"echo: {text!r} does not start with {prompt!r}")
            text = text[len(prompt):]
        num_tokens = len(choice["token_ids"]) if choice["token_ids"] is not None else None
        if choice["logprobs"] is not None:
            num_logprobs = len(choice["logprobs"]) - (prompt_lens[choice["index"] // n] if body.get("echo") else 0)
            if num_tokens is not None and num_logprobs != num_tokens:
                problems.append(f"{num_logprobs} logprobs, {num_tokens} token ids")
            num_tokens = num_logprobs
            if (not body.get("echo") and not body.get("stop_token_ids")
                    and (choice["finish_reason"] == "length" or not body.get("stop"))
                    and "".join(t for t, _ in choice["logprobs"]) != text):
                problems.append(f"logprobs' tokens {choice['logprobs']} are not the text {text!r}")
        if body.get("prompt_logprobs") is not None and "events" not in data and choice["prompt_logprobs"] is None:
            problems.append("no prompt_logprobs")
        if choice["finish_reason"] not in ("stop", "length"):
            problems.append(f"finish_reason {choice['finish_reason']}")
        check_text(body, text, choice["finish_reason"], num_tokens, problems)
        total = None if num_tokens is None or total is None else total + num_tokens
    check_usage(body, usage, total, sum(prompt_lens), problems)
    check_token_ids(body, choices, problems)
    return [(c["text"], c["finish_reason"], c["token_ids"], c["logprobs"], c["prompt_logprobs"]) for c in choices]


def check_usage(body: dict, usage: dict | None, num_tokens: int | None, num_prompt_tokens: int | None,
                problems: list) -> None:
    """usage there when asked for, its counts those of the choices."""
    if usage is None:
        if not body.get("stream") or body.get("stream_options", {}).get("include_usage"):
            problems.append("no usage")
        return
    if num_tokens is not None and usage["completion_tokens"] != num_tokens:
        problems.append(f"usage completion_tokens {usage['completion_tokens']}, choices' tokens {num_tokens}")
    if num_prompt_tokens is not None and usage["prompt_tokens"] != num_prompt_tokens:
        problems.append(f"usage prompt_tokens {usage['prompt_tokens']}, prompt {num_prompt_tokens}")


def chat_choices(data: dict, problems: list) -> tuple[list[dict], dict | None]:
    """The choices of a chat reply, whole or streamed, validated by the openai SDK's types; and its usage."""
    if "events" not in data:
        openai_chat.ChatCompletion.model_validate(data)
        return [{"index": c["index"], "text": c["message"]["content"] or "", "finish_reason": c["finish_reason"],
                 "logprobs": (c["logprobs"] or {}).get("content"), "token_ids": c.get("token_ids"),
                 "tools": [t["function"]["arguments"] for t in c["message"].get("tool_calls") or []]}
                for c in data["choices"]], data["usage"]
    choices: dict[int, dict] = {}
    usage = None
    for event in data["events"]:
        openai_chat.ChatCompletionChunk.model_validate(event)
        usage = event.get("usage") or usage
        for c in event["choices"]:
            choice = choices.setdefault(c["index"], {"index": c["index"], "text": "", "finish_reason": None,
                                                     "logprobs": None, "token_ids": None, "tools": {}})
            choice["text"] += c["delta"].get("content") or ""
            for call in c["delta"].get("tool_calls") or []:
                arguments = (call.get("function") or {}).get("arguments") or ""
                choice["tools"][call["index"]] = choice["tools"].get(call["index"], "") + arguments
            if c["finish_reason"]:
                if choice["finish_reason"]:
                    problems.append(f"choice {c['index']} finished twice")
                choice["finish_reason"] = c["finish_reason"]
            if (c.get("logprobs") or {}).get("content") is not None:
                choice["logprobs"] = (choice["logprobs"] or []) + c["logprobs"]["content"]
            if c.get("token_ids") is not None:
                choice["token_ids"] = (choice["token_ids"] or []) + c["token_ids"]
    for choice in choices.values():
        choice["tools"] = [choice["tools"][k] for k in sorted(choice["tools"])]
    return sorted(choices.values(), key=lambda c: c["index"]), usage


def check_chat(body: dict, data: dict, problems: list) -> list:
    """A /v1/chat/completions reply."""
    choices, usage = chat_choices(data, problems)
    if [c["index"] for c in choices] != list(range(body.get("n", 1))):
        problems.append(f"choices {[c['index'] for c in choices]}")
    total = 0
    for choice in choices:
        num_tokens = len(choice["token_ids"]) if choice["token_ids"] is not None else None
        if body.get("logprobs"):
            entries = choice["logprobs"] or []
            if num_tokens is not None and len(entries) != num_tokens:
                problems.append(f"{len(entries)} logprobs, {num_tokens} token ids")
            num_tokens = len(entries)
            if any(len(e["top_logprobs"]) != body.get("top_logprobs", 0) for e in entries):
                problems.append(f"top_logprobs not {body.get('top_logprobs', 0)} each")
        if "tools" in body and body["tool_choice"] != "none":
            check_tool_calls(body, choice, problems)
        else:
            if choice["finish_reason"] not in ("stop", "length"):
                problems.append(f"finish_reason {choice['finish_reason']}")
            check_text(body, choice["text"], choice["finish_reason"], num_tokens, problems)
        total = None if num_tokens is None or total is None else total + num_tokens
    check_usage(body, usage, total, None, problems)
    check_token_ids(body, choices, problems)
    return [(c["text"], c["finish_reason"], c["tools"], c["token_ids"],
             [(e["token"], e["logprob"]) for e in c["logprobs"] or []]) for c in choices]


def check_tool_calls(body: dict, choice: dict, problems: list) -> None:
    """A choice forced to call the tool: a call with the tool's arguments unless cut by max_tokens."""
    named = isinstance(body["tool_choice"], dict)
    if choice["finish_reason"] not in (("stop", "length") if named else ("tool_calls", "length")):
        problems.append(f"tool_choice {body['tool_choice']}: finish_reason {choice['finish_reason']}")
    if choice["finish_reason"] == "length":
        return
    if not choice["tools"]:
        problems.append(f"no tool call; content {choice['text']!r}")
    for arguments in choice["tools"]:
        try:
            assert set(json.loads(arguments)) == {"city"}
        except (ValueError, AssertionError):
            problems.append(f"tool arguments {arguments!r}")


RESPONSE_EVENT = TypeAdapter(openai_responses.ResponseStreamEvent)
MESSAGE_EVENT = TypeAdapter(anthropic_types.RawMessageStreamEvent)


def check_responses(body: dict, data: dict, problems: list) -> list:
    """A /v1/responses reply."""
    deltas = None
    if "events" in data:
        for event in data["events"]:
            RESPONSE_EVENT.validate_python(event)
        if [e["sequence_number"] for e in data["events"]] != list(range(len(data["events"]))):
            problems.append("sequence numbers not 0, 1, ...")
        final = [e for e in data["events"] if e["type"] in ("response.completed", "response.incomplete")]
        if len(final) != 1:
            problems.append(f"{len(final)} final events")
            return []
        deltas = "".join(e["delta"] for e in data["events"] if e["type"] == "response.output_text.delta")
        data = final[0]["response"]
    openai_responses.Response.model_validate(data)
    parts = [p for o in data["output"] if o["type"] == "message" for p in o["content"] if p["type"] == "output_text"]
    text = "".join(p["text"] for p in parts)
    if deltas is not None and deltas != text:
        problems.append(f"deltas {deltas!r}, text {text!r}")
    num_tokens, status = data["usage"]["output_tokens"], data["status"]
    if num_tokens > body["max_output_tokens"] or (status == "incomplete") != (num_tokens == body["max_output_tokens"]
                                                                             and status != "completed"):
        problems.append(f"{status} with {num_tokens} tokens of {body['max_output_tokens']}")
    if body.get("top_logprobs") and sum(len(p.get("logprobs") or []) for p in parts) != num_tokens:
        problems.append(f"logprobs not one per output token ({num_tokens})")
    if "text" in body and status == "completed":
        check_json(text, problems)
    return [(text, status)]


def check_messages(body: dict, data: dict, problems: list) -> list:
    """A /v1/messages reply."""
    if "events" in data:
        events = [e for e in data["events"] if e["type"] != "ping"]
        for event in events:
            MESSAGE_EVENT.validate_python(event)
        deltas = [e for e in events if e["type"] == "message_delta"]
        if len(deltas) != 1 or events[-1]["type"] != "message_stop":
            problems.append(f"{len(deltas)} message_delta events, last {events[-1]['type']}")
            return []
        text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
        stop_reason, num_tokens = deltas[0]["delta"]["stop_reason"], deltas[0]["usage"]["output_tokens"]
    else:
        anthropic_types.Message.model_validate(data)
        text = "".join(c["text"] for c in data["content"] if c["type"] == "text")
        stop_reason, num_tokens = data["stop_reason"], data["usage"]["output_tokens"]
    if num_tokens > body["max_tokens"] or (stop_reason == "max_tokens") != (num_tokens == body["max_tokens"]
                                                                            and stop_reason != "stop_sequence"
                                                                            and stop_reason != "end_turn"):
        problems.append(f"{stop_reason} with {num_tokens} tokens of {body['max_tokens']}")
    if any(stop in text for stop in body.get("stop_sequences", [])):
        problems.append(f"a stop sequence in {text!r}")
    return [(text, stop_reason)]


# ---------------------------------------------------------------------------------------------
# Sending.


async def send(client: httpx.AsyncClient, case: dict) -> tuple[int, dict]:
    """The status and JSON of the reply ({"events": [...]} for a 200 stream; "left" where the client left,
    "no_done" where the stream ended without [DONE], as Responses and Messages streams end)."""
    body = case["body"]
    if not body.get("stream"):
        response = await client.post(case["route"], json=body)
        return response.status_code, response.json()
    events = []
    async with client.stream("POST", case["route"], json=body) as response:
        if response.status_code != 200:
            return response.status_code, json.loads(await response.aread())
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            if line[5:].strip() == "[DONE]":
                return 200, {"events": events}
            events.append(json.loads(line[5:]))
            if len(events) == case.get("leave_after"):
                return 200, {"events": events, "left": True}
    return 200, {"events": events, "no_done": True}


async def prompt_lengths(client: httpx.AsyncClient, body: dict) -> list[int]:
    """Each prompt's token count, from /tokenize."""
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    return [(await client.post("/tokenize", json={"model": MODEL, "prompt": p})).json()["count"] for p in prompts]


async def run_case(client: httpx.AsyncClient, case: dict) -> dict:
    """Send a case and check its reply: {"problems": [...], "seen": what must repeat, "left": bool}."""
    status, data = await send(client, case)
    problems: list[str] = []
    route, body = case["route"], case["body"]
    if "invalid" in case:
        want_status, param = case["invalid"]
        error = data.get("error") if isinstance(data, dict) else None
        if status != want_status or not isinstance(error, dict) or (
                route != "/v1/messages" and (error.get("param") != param or error.get("type") is None)):
            problems.append(f"wanted {want_status} naming {param}, got {status} {data}")
        return {"problems": problems, "seen": None, "left": False}
    if status != 200:
        return {"problems": [f"{status} {data}"], "seen": None, "left": False}
    if data.get("left"):
        return {"problems": [], "seen": None, "left": True}
    if data.get("no_done") and route in ("/v1/completions", "/v1/chat/completions"):
        problems.append("stream ended without [DONE]")
    if route == "/v1/completions":
        seen = check_completion(body, data, await prompt_lengths(client, body), problems)
    elif route == "/v1/chat/completions":
        seen = check_chat(body, data, problems)
    elif route == "/v1/responses":
        seen = check_responses(body, data, problems)
    else:
        seen = check_messages(body, data, problems)
    return {"problems": problems, "seen": seen, "left": False}


def repeatable(case: dict) -> bool:
    """A request whose reply the batch must not change: greedy or seeded, answered whole."""
    return "invalid" not in case and "leave_after" not in case and (
        case["body"].get("temperature") == 0 or "seed" in case["body"])


def same(a, b) -> bool:
    """Two replies alike: equal, but for log-probabilities within 1e-4."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-4
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def finished_counts(cases: list[dict], results: dict) -> tuple[int, int]:
    """The choices the clients saw end, and those of streams their clients left."""
    def num_choices(case):
        body = case["body"]
        return body.get("n", 1) * (len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1)
    seen = sum(len(results[c["index"]]["seen"] or ()) for c in cases)
    left = sum(num_choices(c) for c in cases if results[c["index"]]["left"])
    return seen, left


async def idle_stats(client: httpx.AsyncClient) -> dict:
    """/v1/stats once nothing runs or waits and the pool is empty (the last reading after 60 s)."""
    for _ in range(600):
        stats = (await client.get("/v1/stats")).json()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_num_used_blocks"] == 0:
            break
        await asyncio.sleep(0.1)
    return stats


async def request_success(client: httpx.AsyncClient) -> dict[str, float]:
    """/metrics' minillm:request_success_total by finished_reason."""
    text = (await client.get("/metrics")).text
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^minillm:request_success_total\{finished_reason="(\w+)"[^}]*\} (\S+)$', text, re.M)}


async def fuzz(url: str, cases: list[dict]) -> list[str]:
    """Send the cases CONCURRENCY at a time, then the repeatable ones alone; every problem found."""
    problems = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        limit = asyncio.Semaphore(CONCURRENCY)

        async def limited(case):
            async with limit:
                return await run_case(client, case)
        results = dict(zip((c["index"] for c in cases), await asyncio.gather(*(limited(c) for c in cases))))
        stats = await idle_stats(client)
        if stats["num_running"] or stats["num_waiting"] or stats["kv_num_used_blocks"]:
            problems.append(f"not idle after the run: {stats}")
        counts = await request_success(client)
        seen, left = finished_counts(cases, results)
        if counts.get("error") or counts.get("abort", 0) > left or sum(counts.values()) != seen + left:
            problems.append(f"request_success {counts}: clients saw {seen} choices end and left {left}")
        for case in cases:
            result = results[case["index"]]
            if repeatable(case) and result["seen"] is not None:
                alone = await run_case(client, case)
                if not same(alone["seen"], result["seen"]):
                    result["problems"].append(f"in the batch {result['seen']}, alone {alone['seen']}")
            problems += [f"case {case['index']} {case['route']} {json.dumps(case['body'])}: {p}"
                         for p in result["problems"]]
        if (await client.get("/health")).status_code != 200:
            problems.append("/health not 200 after the run")
    return problems


@pytest.fixture(scope="module")
def served(stories_path, tmp_path_factory):
    """The base URL of `minillm serve` of stories260K on the CPU with SERVE_ARGS."""
    log = tmp_path_factory.mktemp("mixed_fuzz") / "serve.log"
    command = [sys.executable, "-m", "minillm.cli", "serve", str(stories_path), "--device", "cpu", "--port", "0",
               "--served-model-name", MODEL, "--chat-template", CHAT_TEMPLATE, "--max-model-len", "256",
               "--timeout-graceful-shutdown", "1", "--disable-uvicorn-access-log", *SERVE_ARGS]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        yield started_url(proc, log, timeout=120)
    finally:
        stop_server(proc)


def test_mixed_requests_keep_every_invariant(served):
    """NUM_CASES seeded requests at once: every reply sound, greedy and seeded ones as alone, metrics true."""
    rng = random.Random(SEED)
    cases = [draw_case(rng, i) for i in range(NUM_CASES)]
    assert sum("leave_after" in c for c in cases) and sum("invalid" in c for c in cases)
    problems = asyncio.run(fuzz(served, cases))
    assert not problems, "\n".join(problems[:20])
