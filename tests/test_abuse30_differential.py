"""Differential: seeded random requests through LLM.generate and POST /v1/completions agree.

The same sampling fields go both ways (vLLM's mapping: the body's seed is SamplingParams.seed, the
n completions of a request seeded seed + index by the engine on both sides); the choices must carry
the same token ids, text, finish and stop reasons, logprobs (within a tolerance that float noise of
another batch shape stays under) and usage.
"""
from __future__ import annotations

import math
import random

import httpx
import pytest

from minillm import LLM, SamplingParams
from test_server_helpers import running_server, sse_events

NUM_REQUESTS = 40
MAX_MODEL_LEN = 128
LOGPROB_TOLERANCE = 1e-4      # float noise of another batch is ~1e-6; a wrong token's logprob is off by > 0.01
CLAMPED = -9999.0
EOS = 2             # how the server writes -inf (JSON has no infinity)


@pytest.fixture(scope="module")
def words(tok) -> list[str]:
    """Whole words of stories260K's vocabulary (its "▁word" pieces)."""
    return sorted(piece[1:] for piece in tok.get_vocab() if piece.startswith("▁") and piece[1:].isalpha())


@pytest.fixture(scope="module")
def model(stories_path):
    """One LLM on the CPU, with the server's context."""
    with LLM(str(stories_path), device="cpu", max_model_len=MAX_MODEL_LEN) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(stories_path):
    """(url, engine) of one server on the same model and context."""
    with running_server(stories_path, served_model_name="stories", max_model_len=MAX_MODEL_LEN) as running:
        yield running


def random_body(rng: random.Random, words: list[str], tok) -> dict:
    """A /v1/completions body of random prompts (one or two; text or token ids) and sampling fields,
    deterministic given rng."""
    vocab_size = tok.vocab_size
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 8))) for _ in range(rng.choice([1, 1, 1, 2]))]
    if rng.random() < 0.2:
        prompts = [tok.encode(p) for p in prompts]
    body: dict = {"prompt": prompts if len(prompts) > 1 else prompts[0],
                  "max_tokens": rng.choice([rng.randint(1, 40), rng.randint(60, 100)])}
    if rng.random() < 0.35:
        body["temperature"] = 0.0
    else:
        body["temperature"] = round(rng.uniform(0.2, 1.6), 3)
        body["seed"] = rng.randint(0, 2**31)
    if rng.random() < 0.4:
        body["top_k"] = rng.choice([1, 2, 5, 20, 100, -1])
    if rng.random() < 0.4:
        body["top_p"] = round(rng.uniform(0.3, 1.0), 3)
    if rng.random() < 0.3:
        body["min_p"] = round(rng.uniform(0.0, 0.3), 3)
    if rng.random() < 0.3:
        body["presence_penalty"] = round(rng.uniform(-1.0, 2.0), 3)
    if rng.random() < 0.3:
        body["frequency_penalty"] = round(rng.uniform(-1.0, 2.0), 3)
    if rng.random() < 0.3:
        body["repetition_penalty"] = round(rng.uniform(0.8, 1.8), 3)
    if rng.random() < 0.4:
        body["stop"] = rng.sample([" the", "ed", ".", " was", "He", "!", "a"], rng.randint(1, 3))
        body["include_stop_str_in_output"] = rng.random() < 0.3
    if rng.random() < 0.3:
        body["stop_token_ids"] = rng.sample(range(259, 330), rng.randint(1, 3))     # the commonest merges
    if rng.random() < 0.3:
        body["min_tokens"] = rng.randint(0, body["max_tokens"])
    if rng.random() < 0.5:
        body["logprobs"] = rng.randint(0, 5)
    body["n"] = rng.choice([1, 1, 2, 3])
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    if rng.random() < 0.15:
        body["bad_words"] = rng.sample(words, 2)
    if rng.random() < 0.1:
        body["allowed_token_ids"] = rng.sample(range(vocab_size), 20)
    if rng.random() < 0.15:
        body["skip_special_tokens"] = False
    if rng.random() < 0.2:
        body["prompt_logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.3:
        body["logit_bias"] = {str(rng.randrange(vocab_size)): round(rng.uniform(-100, 100), 2)
                              for _ in range(rng.randint(1, 3))}
        if rng.random() < 0.5:
            body["logit_bias"][str(EOS)] = round(rng.uniform(30, 40), 2)  # EOS soon (raw logprob -29) past min_tokens
    return body


def prompts_of(body: dict) -> list:
    """The body's prompts as LLM.generate takes them."""
    prompt = body["prompt"]
    prompts = prompt if isinstance(prompt, list) and not isinstance(prompt[0], int) else [prompt]
    return [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]


def to_params(body: dict) -> SamplingParams:
    """The body's SamplingParams, field for field as vLLM maps them."""
    fields = {k: v for k, v in body.items() if k != "prompt"}
    bias = fields.pop("logit_bias", None)
    if bias is not None:
        fields["logit_bias"] = {int(k): v for k, v in bias.items()}
    return SamplingParams(**fields)


@pytest.fixture(scope="module")
def cases(words, tok, model, server):
    """[(body, the LLM's RequestOutputs (one a prompt), the server's response body, its streamed
    response joined)] for NUM_REQUESTS random requests."""
    rng = random.Random(30)
    bodies = [random_body(rng, words, tok) for _ in range(NUM_REQUESTS)]
    flat = [(prompt, to_params(b)) for b in bodies for prompt in prompts_of(b)]
    flat_outputs = iter(model.generate([p for p, _ in flat], [params for _, params in flat]))
    outputs = [[next(flat_outputs) for _ in prompts_of(b)] for b in bodies]
    responses, streamed = [], []
    with httpx.Client(base_url=server[0], timeout=60) as client:
        for body in bodies:
            sent = {**body, "model": "stories", "return_token_ids": True,
                    "return_tokens_as_token_ids": "logprobs" in body}
            response = client.post("/v1/completions", json=sent)
            assert response.status_code == 200, (body, response.text)
            responses.append(response.json())
            sent.update(stream=True, stream_options={"include_usage": True})
            sent.pop("prompt_logprobs", None)     # refused with stream, as vLLM refuses it
            with client.stream("POST", "/v1/completions", json=sent) as response:
                assert response.status_code == 200, body
                streamed.append(joined_stream(sse_events(response.iter_lines())))
    return list(zip(bodies, outputs, responses, streamed))


def joined_stream(events: list[dict]) -> dict:
    """A streamed completion's chunks joined into the shape of the non-streaming response."""
    choices: dict[int, dict] = {}
    usage = None
    for event in events:
        usage = event.get("usage") or usage
        for chunk in event["choices"]:
            choice = choices.setdefault(chunk["index"], {
                "index": chunk["index"], "text": "", "token_ids": [], "prompt_token_ids": None,
                "finish_reason": None, "stop_reason": None, "logprobs": None})
            assert choice["finish_reason"] is None, ("a chunk after the finish", event)
            choice["text"] += chunk["text"]
            choice["token_ids"] += chunk.get("token_ids") or []
            choice["prompt_token_ids"] = choice["prompt_token_ids"] or chunk.get("prompt_token_ids")
            choice["finish_reason"], choice["stop_reason"] = chunk["finish_reason"], chunk["stop_reason"]
            if chunk["logprobs"] is not None:
                joined = choice["logprobs"] = choice["logprobs"] or {
                    "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                for key in joined:
                    joined[key] += chunk["logprobs"][key]
    return {"choices": list(choices.values()), "usage": usage}


def close(a: float | None, b: float | None) -> bool:
    """Logprobs equal within LOGPROB_TOLERANCE (-inf and the server's clamped -9999 alike)."""
    if a is None or b is None:
        return a is b
    a, b = max(a, CLAMPED), max(b, CLAMPED)
    return math.isclose(a, b, rel_tol=0, abs_tol=LOGPROB_TOLERANCE)


def test_the_requests_cover_the_fields(cases):
    """The draw exercises every field it is meant to (else the comparison proves less than it says)."""
    bodies = [body for body, _, _, _ in cases]
    for field in ("seed", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                  "stop", "stop_token_ids", "min_tokens", "logprobs", "ignore_eos", "logit_bias", "bad_words",
                  "allowed_token_ids", "skip_special_tokens", "prompt_logprobs"):
        assert any(field in b for b in bodies), field
    assert {b["n"] for b in bodies} == {1, 2, 3}
    assert {b.get("logprobs") for b in bodies} >= {None, 0, 5}
    assert any(b["temperature"] == 0 for b in bodies) and any(b["temperature"] > 0 for b in bodies)
    assert any(len(prompts_of(b)) == 2 for b in bodies)
    assert any(isinstance(p, dict) for b in bodies for p in prompts_of(b))
    completions = [c for _, outs, _, _ in cases for out in outs for c in out.outputs]
    assert {c.finish_reason for c in completions} >= {"stop", "length"}
    stop_reasons = {type(c.stop_reason) for c in completions if c.finish_reason == "stop"}
    assert stop_reasons == {str, int, type(None)}      # a stop string, a stop token id, EOS


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("i", range(NUM_REQUESTS))
def test_server_agrees_with_generate(cases, i, stream):
    body, outs, response, streamed = cases[i]
    if stream:
        response = streamed
    choices = sorted(response["choices"], key=lambda c: c["index"])
    pairs = [(out, comp) for out in outs for comp in out.outputs]      # choice index: prompt * n + completion
    assert len(choices) == len(pairs) == body["n"] * len(outs), body
    for choice, (out, comp) in zip(choices, pairs):
        where = (body, choice["index"])
        assert choice["prompt_token_ids"] == out.prompt_token_ids, where
        if not stream:      # vLLM's prompt_logprobs: in the JSON response's choices alone
            assert_same_prompt_logprobs(choice.get("prompt_logprobs"), out.prompt_logprobs, where)
        assert choice["token_ids"] == comp.token_ids, where
        assert choice["text"] == comp.text, where
        assert choice["finish_reason"] == comp.finish_reason, where
        assert choice["stop_reason"] == comp.stop_reason, where
        if "logprobs" not in body:
            assert choice["logprobs"] is None and comp.logprobs is None, where
            continue
        logprobs = choice["logprobs"]
        assert logprobs is not None, where
        assert logprobs["tokens"] == [f"token_id:{t}" for t in comp.token_ids], where
        assert len(comp.logprobs) == len(comp.token_ids), where
        for j, (token, row) in enumerate(zip(comp.token_ids, comp.logprobs)):
            assert close(logprobs["token_logprobs"][j], row[token]), (where, j)
            top = logprobs["top_logprobs"][j]
            expected = {f"token_id:{t}": lp for t, lp in row.items()}
            assert set(top) == set(expected), (where, j, top, expected)
            assert all(close(top[k], expected[k]) for k in top), (where, j, top, expected)
    num_prompt = sum(len(out.prompt_token_ids) for out in outs)     # once a prompt, whatever n (vLLM's count)
    num_generated = sum(len(comp.token_ids) for _, comp in pairs)
    # a whole response's usage has vLLM's details as null; a stream's usage chunk leaves them out
    details = {} if stream else {"prompt_tokens_details": None, "completion_tokens_details": None}
    assert response["usage"] == {"prompt_tokens": num_prompt, "completion_tokens": num_generated,
                                 "total_tokens": num_prompt + num_generated, **details}, body


def assert_same_prompt_logprobs(served: list | None, entries: list | None, where) -> None:
    """The server's prompt_logprobs ({token id: {logprob, rank, decoded_token}}) are LLM.generate's."""
    if entries is None:
        assert served is None, where
        return
    assert served is not None and len(served) == len(entries), where
    assert served[0] is None and entries[0] is None, where
    for j, (row, entry) in enumerate(zip(served[1:], entries[1:]), 1):
        assert {int(t) for t in row} == set(entry), (where, j, row, entry)
        for t, value in row.items():
            logprob = entry[int(t)]
            assert close(value["logprob"], logprob), (where, j, t)
            assert (value["rank"], value["decoded_token"]) == (logprob.rank, logprob.decoded_token), (where, j, t)


@pytest.mark.parametrize("prompt", ["Once upon a time", [1, 403, 416, 261]], ids=["text", "token_ids"])
def test_echoed_offsets_index_the_text_whatever_skip_special_tokens(server, prompt):
    """The echoed prompt never shows BOS, so with skip_special_tokens false too its tokens' text_offset
    index the text the choice carries (they counted "<s>" and ran back at the first generated token)."""
    body = {"model": "stories", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "echo": True, "logprobs": 1}
    with httpx.Client(base_url=server[0], timeout=60) as client:
        skipped, kept = (client.post("/v1/completions", json={**body, "skip_special_tokens": skip}).json()
                         for skip in (True, False))
    assert kept["choices"][0]["text"] == skipped["choices"][0]["text"]
    offsets = kept["choices"][0]["logprobs"]["text_offset"]
    assert offsets == skipped["choices"][0]["logprobs"]["text_offset"]
    assert offsets == sorted(offsets)
