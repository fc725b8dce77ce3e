"""Structured outputs after a reasoning model's thinking (vLLM's behaviour with a reasoning parser): the
output is free until </think>, the grammar holds what follows it, and a prompt that already closed the
thinking block is held from its first token. stories260K has no thinking tags, so a copy of it makes
tokens 510 and 511 the added tokens <think> and </think>; a logit bias on </think> makes the model
close its thinking after a few words of story."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from test_abuse34_parsers import model_with_added_tokens
from test_server_helpers import running_server

from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.sampling_params import SamplingParams
from minillm.server.app import ServerOptions
from minillm.structured_output import StructuredOutputsParams

THINK, END_THINK = 510, 511
SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}
BIAS = {END_THINK: 22.0}        # </think> after some words (without it the model never writes one)
TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
MODES = [(False, False), (True, False), (False, True), (True, True)]
MODE_IDS = ["sync", "async", "sync-grammar-process", "async-grammar-process"]


def thinking_model(src, dst):
    """A copy of src whose tokens 510 and 511 are the added (not special) tokens <think> and </think>."""
    return model_with_added_tokens(src, dst, {THINK: "<think>", END_THINK: "</think>"}, False)


@pytest.fixture(scope="module")
def model(stories_path, tmp_path_factory):
    return thinking_model(stories_path, tmp_path_factory.mktemp("thinking"))


def make_engine(path, **kw):
    kw.setdefault("max_model_len", 256)
    return LLMEngine(EngineConfig(model=str(path), device="cpu", **kw), log=lambda msg: None)


def run(engine, requests):
    """{request id: token ids of its one completion, finish reason} once every request is done."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (list(out.outputs[0].token_ids), out.outputs[0].finish_reason)
    return done


def reasoning_params(seed, **kw):
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=120, logit_bias=BIAS, **kw,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA, reasoning=(THINK, END_THINK)))


def split(tokenizer, ids):
    """(reasoning ids, content text) of an output: the content follows the first </think>."""
    assert END_THINK in ids, tokenizer.decode(ids)
    k = ids.index(END_THINK)
    return ids[:k], tokenizer.decode(ids[k + 1:])


@pytest.mark.parametrize("async_scheduling,grammar_process", MODES, ids=MODE_IDS)
def test_reasoning_is_free_and_the_json_after_it_validates(model, async_scheduling, grammar_process):
    engine = make_engine(model, async_scheduling=async_scheduling, grammar_process=grammar_process)
    try:
        done = run(engine, {f"r{seed}": ([1, 403], reasoning_params(seed)) for seed in range(24)})
    finally:
        engine.shutdown()
    reasoned = 0
    for rid, (ids, finish) in done.items():
        reasoning, content = split(engine.tokenizer, ids)
        assert finish == "stop", (rid, engine.tokenizer.decode(ids))
        jsonschema.validate(json.loads(content), SCHEMA)
        # the schema's grammar would allow only '{' first: story words there were sampled unconstrained
        reasoned += len(reasoning) > 2 and not engine.tokenizer.decode(reasoning).lstrip().startswith("{")
    assert reasoned >= 12


@pytest.mark.parametrize("async_scheduling,grammar_process", MODES, ids=MODE_IDS)
def test_a_prompt_that_closed_the_thinking_is_held_from_the_first_token(model, async_scheduling, grammar_process):
    engine = make_engine(model, async_scheduling=async_scheduling, grammar_process=grammar_process)
    try:
        done = run(engine, {f"p{seed}": ([1, THINK, 403, END_THINK], reasoning_params(seed)) for seed in range(6)}
                   | {f"open{seed}": ([1, END_THINK, 403, THINK], reasoning_params(seed)) for seed in range(6)})
    finally:
        engine.shutdown()
    for seed in range(6):
        ids, finish = done[f"p{seed}"]
        assert finish == "stop" and END_THINK not in ids
        jsonschema.validate(json.loads(engine.tokenizer.decode(ids)), SCHEMA)
        _, content = split(engine.tokenizer, done[f"open{seed}"][0])    # a reopened block: thinking again
        jsonschema.validate(json.loads(content), SCHEMA)


def test_without_reasoning_the_grammar_holds_the_first_token(model):
    engine = make_engine(model)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=60, logit_bias=BIAS,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    ids, finish = run(engine, {"r": ([1, 403], params)})["r"]
    assert finish == "stop" and END_THINK not in ids
    jsonschema.validate(json.loads(engine.tokenizer.decode(ids)), SCHEMA)


@pytest.mark.parametrize("async_scheduling,grammar_process", MODES, ids=MODE_IDS)
def test_preemption_in_and_after_the_reasoning_keeps_each_output(model, async_scheduling, grammar_process):
    # Seeded samples do not change when a sequence is recomputed: a pool too small for the batch
    # preempts sequences while they think and after, and each output is still the one it gives alone.
    requests = {f"s{seed}": ([1, 403, 261 + seed], reasoning_params(seed, ignore_eos=True)) for seed in range(8)}
    roomy = make_engine(model, grammar_process=grammar_process)
    try:
        alone = {rid: run(roomy, {rid: request})[rid] for rid, request in requests.items()}
    finally:
        roomy.shutdown()
    tight = make_engine(model, max_model_len=64, block_size=2, num_kv_blocks=40, max_num_batched_tokens=8,
                        max_num_seqs=6, async_scheduling=async_scheduling, grammar_process=grammar_process)
    try:
        done = run(tight, requests)
        assert tight.scheduler.num_preemptions >= 4
    finally:
        tight.shutdown()
    assert done == alone
    for ids, _ in done.values():
        jsonschema.validate(json.loads(split(tight.tokenizer, ids)[1]), SCHEMA)


def test_reasoning_ids_are_checked(model):
    with pytest.raises(ValueError, match="reasoning: must be the"):
        StructuredOutputsParams(json=SCHEMA, reasoning=(5, 5))
    engine = make_engine(model)
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA, reasoning=(THINK, 10**6)))
    with pytest.raises(ValueError, match="reasoning: token ids must be below"):
        engine.add_request("bad", [1, 403], bad)
    assert not engine.has_unfinished_requests()


# ---- through the server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(model):
    options = ServerOptions(chat_template=TEMPLATE, reasoning_parser="deepseek_r1")
    with running_server(model, max_model_len=256, options=options) as running:
        yield running


def chat_body(seed, **body):
    return {"model": "stories", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 120,
            "temperature": 1.0, "seed": seed, "logit_bias": {str(END_THINK): 19},
            "response_format": {"type": "json_schema", "json_schema": {"name": "ab", "schema": SCHEMA}}, **body}


def streamed(url, body):
    joined = {"content": "", "reasoning_content": "", "finish_reason": None}
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[len("data: "):])["choices"]:
                    for key in ("content", "reasoning_content"):
                        joined[key] += choice["delta"].get(key) or ""
                    joined["finish_reason"] = choice["finish_reason"] or joined["finish_reason"]
    return joined


def test_server_splits_the_reasoning_from_the_constrained_json_streamed_or_whole(server):
    url, _ = server
    thought = 0
    for seed in range(8):
        body = chat_body(seed)
        response = httpx.post(f"{url}/v1/chat/completions", timeout=60, json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        message = choice["message"]
        jsonschema.validate(json.loads(message["content"]), SCHEMA)
        assert "</think>" not in message["content"] and choice["finish_reason"] == "stop"
        thought += bool(message["reasoning_content"])
        assert message["reasoning"] == message["reasoning_content"]
        whole = {"content": message["content"], "reasoning_content": message["reasoning_content"] or "",
                 "finish_reason": "stop"}
        assert streamed(url, body) == whole
    assert thought >= 4


def test_server_qwen3_without_thinking_holds_the_json_from_the_first_token(model):
    options = ServerOptions(chat_template=TEMPLATE, reasoning_parser="qwen3")
    with running_server(model, max_model_len=256, options=options) as (url, _):
        response = httpx.post(f"{url}/v1/chat/completions", timeout=60, json=chat_body(
            1, chat_template_kwargs={"enable_thinking": False}))
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    jsonschema.validate(json.loads(message["content"]), SCHEMA)


def test_server_refuses_a_constraint_when_the_thinking_tags_are_not_tokens(stories_path):
    options = ServerOptions(chat_template=TEMPLATE, reasoning_parser="deepseek_r1")
    with running_server(stories_path, max_model_len=256, options=options) as (url, _):
        response = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "stories", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "response_format": {"type": "json_object"}})
        plain = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "stories", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "response_format" and "</think>" in error["message"]
    assert plain.status_code == 200
