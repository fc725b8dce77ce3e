"""use_beam_search in the combinations vLLM's server serves: a chat stream (the final beams, sent once the
search is over; it was a 400 naming stream), and prompt_logprobs or a completion's echo with logprobs (the
first step, the prompt alone, scores the prompt; each was a 400). What vLLM refuses stays a 400 naming the
field: a completions stream, with vLLM's message. (An output constraint holds every beam:
test_abuse40_beam_constrained.py.)"""
from __future__ import annotations

import json
import socket
import threading

import pytest

openai = pytest.importorskip("openai")

import core_hooks  # noqa: E402
import httpx  # noqa: E402
from test_abuse39_beam import StepPermits, engine_rows  # noqa: E402
from test_server_helpers import chat_model_dir, running_server, wait_for  # noqa: E402

from minillm import LLM  # noqa: E402
from minillm.sampling_params import BeamSearchParams  # noqa: E402

MODEL = "stories"
PERIOD = 426            # "." in stories260K's vocabulary: this module's EOS, so beams end within a few tokens
MESSAGES = [{"role": "user", "content": "hi"}]
BEAM = {"use_beam_search": True}
PERMITS = StepPermits()


@pytest.fixture(scope="module")
def model_dir(stories_path, tmp_path_factory):
    """stories260K with a chat template whose tokenizer names "." its EOS."""
    out = chat_model_dir(stories_path, tmp_path_factory.mktemp("beam40_model"))
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "."}))
    return out


def hooks(engine) -> None:
    core_hooks.install(engine)
    PERMITS.install(engine)


@pytest.fixture(scope="module")
def url(model_dir):
    with running_server(model_dir, engine_core="thread", core_hook=hooks, max_model_len=64) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(url):
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def offline(model_dir):
    with LLM(str(model_dir), device="cpu", max_model_len=64) as model:
        yield model


@pytest.fixture(autouse=True)
def steps_open():
    PERMITS.open()
    yield
    PERMITS.open()


def streamed_choices(chunks) -> tuple[dict[int, dict], list]:
    """Each choice's whole content, finish, stop_reason, token ids and logprob rows from a chat stream's
    chunks; and the usage chunks' usage."""
    got: dict[int, dict] = {}
    usages = []
    for chunk in chunks:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for c in chunk.choices:
            row = got.setdefault(c.index, {"role": None, "content": "", "finish_reason": None, "stop_reason": None,
                                           "token_ids": [], "logprobs": []})
            row["role"] = row["role"] or c.delta.role
            row["content"] += c.delta.content or ""
            row["token_ids"] += (c.model_extra or {}).get("token_ids") or []
            if c.logprobs is not None and c.logprobs.content:
                row["logprobs"] += [(r.token, r.logprob, [(t.token, t.logprob) for t in r.top_logprobs])
                                    for r in c.logprobs.content]
            if c.finish_reason is not None:
                row["finish_reason"], row["stop_reason"] = c.finish_reason, (c.model_extra or {}).get("stop_reason")
    return got, usages


@pytest.mark.parametrize("n, include_stop", [(1, False), (3, False), (2, True)])
def test_a_chat_stream_sends_the_offline_beams_of_the_rendered_prompt_as_the_whole_reply_has_them(
        client, offline, n, include_stop):
    body = dict(model=MODEL, messages=MESSAGES, n=n, max_completion_tokens=10, temperature=0, logprobs=True,
                top_logprobs=2)
    extra = {**BEAM, "length_penalty": 0.7, "include_stop_str_in_output": include_stop, "return_token_ids": True}
    whole = client.chat.completions.create(**body, extra_body=extra)
    got, usages = streamed_choices(client.chat.completions.create(
        **body, stream=True, stream_options={"include_usage": True}, extra_body=extra))
    prompt = whole.prompt_token_ids
    [output] = offline.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(
        beam_width=n, max_tokens=10, length_penalty=0.7, include_stop_str_in_output=include_stop))
    tok = offline.get_tokenizer()
    head = tok.decode(prompt)
    assert len(output.sequences) == n and sorted(got) == list(range(n))
    for beam, choice in zip(output.sequences, whole.choices):
        shown = beam.tokens[len(prompt):-1] if beam.finish_reason == "stop" else beam.tokens[len(prompt):]
        assert choice.message.content == tok.decode(prompt + shown)[len(head):]
        assert choice.finish_reason == beam.finish_reason
        row = got[choice.index]
        whole_rows = [(r.token, r.logprob, [(t.token, t.logprob) for t in r.top_logprobs])
                      for r in choice.logprobs.content]
        assert (row["role"], row["content"], row["finish_reason"], row["stop_reason"], row["token_ids"]) == \
            ("assistant", choice.message.content, choice.finish_reason, choice.model_extra["stop_reason"],
             choice.token_ids)
        # each step is batched with whatever else runs: the same floats to a few ulps
        assert [(t, [a for a, _ in top]) for t, _, top in row["logprobs"]] == \
            [(t, [a for a, _ in top]) for t, _, top in whole_rows]
        assert [v for _, v, top in row["logprobs"] for v in [v, *(b for _, b in top)]] == \
            pytest.approx([v for _, v, top in whole_rows for v in [v, *(b for _, b in top)]], abs=1e-4)
    [usage] = usages
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)


def test_a_chat_stream_of_a_search_begins_once_the_search_is_over(url):
    # One step at a time: the stream's response (its status line too) waits for the search's last step.
    PERMITS.close(1)
    got: dict = {}

    def read():
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": MESSAGES, "n": 2, "max_tokens": 3, "temperature": 0, "stream": True,
                "ignore_eos": True, "request_id": "wait-40", **BEAM}) as reply:
            got["status"] = reply.status_code
            got["events"] = [line for line in reply.iter_lines() if line.startswith("data: ")]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert wait_for(PERMITS.used_up, 60)
    # the second step is an engine request (two beams), and no byte of the answer has come
    assert wait_for(lambda: engine_rows(url, r"chatcmpl-wait-40-beam-1-[0-9a-f]{8}"), 60)
    assert "status" not in got
    PERMITS.open()
    reader.join(60)
    assert got["status"] == 200 and got["events"][-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in got["events"][:-1]]
    assert [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks] == \
        [(0, None), (1, None), (0, "length"), (1, "length")]


def test_a_hang_up_before_a_chat_stream_of_a_search_begins_aborts_the_step_in_flight(url, client):
    PERMITS.close()
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "n": 2, "stream": True,
                       "request_id": "gone-40", **BEAM}).encode()
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert wait_for(lambda: engine_rows(url, r"chatcmpl-gone-40-beam-0-[0-9a-f]{8}"), 60)
    sock.close()
    assert wait_for(lambda: not engine_rows(url, r"chatcmpl-gone-40-.*"), 60)
    PERMITS.open()
    after = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, n=2, temperature=0,
                                           extra_body=BEAM)
    assert len(after.choices) == 2 and not engine_rows(url, r"chatcmpl-gone-40-.*")


def same_prompt_logprobs(got: list, expected: list) -> bool:
    """Two answers' prompt_logprobs alike: the same tokens, ranks and texts, each logprob to a few ulps."""
    def split(rows):
        return ([None if r is None else {t: {k: v for k, v in e.items() if k != "logprob"} for t, e in r.items()}
                 for r in rows], [e["logprob"] for r in rows if r for e in r.values()])
    (got_rest, got_values), (rest, values) = split(got), split(expected)
    return got_rest == rest and got_values == pytest.approx(values, abs=1e-4)


def test_prompt_logprobs_are_the_prompts_own_and_leave_the_beams_as_they_were(client):
    body = {"model": MODEL, "prompt": ["Once upon a time", "Lily"], "n": 2, "max_tokens": 6, "temperature": 0}
    beams = client.completions.create(**body, extra_body=BEAM)
    scored = client.completions.create(**body, extra_body={**BEAM, "prompt_logprobs": 3})
    plain = client.completions.create(model=MODEL, prompt=body["prompt"], max_tokens=1,
                                      extra_body={"prompt_logprobs": 3})
    assert [c.text for c in scored.choices] == [c.text for c in beams.choices]
    for i, choice in enumerate(scored.choices):
        own = choice.model_extra["prompt_logprobs"]
        assert own is not None and same_prompt_logprobs(own, plain.choices[i // 2].model_extra["prompt_logprobs"])
        assert own[0] is None and all(len(row) >= 3 for row in own[1:])
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=4, temperature=0,
                                          extra_body={**BEAM, "prompt_logprobs": 1})
    alone = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                           extra_body={"prompt_logprobs": 1})
    assert chat.model_extra["prompt_logprobs"] is not None
    assert same_prompt_logprobs(chat.model_extra["prompt_logprobs"], alone.model_extra["prompt_logprobs"])


def test_echo_with_logprobs_shows_the_prompts_logprobs_then_the_beams(client):
    body = {"model": MODEL, "prompt": "Once upon a time", "n": 2, "max_tokens": 5, "temperature": 0, "logprobs": 2}
    beams = client.completions.create(**body, extra_body=BEAM)
    echoed = client.completions.create(**body, echo=True, extra_body=BEAM)
    plain = client.completions.create(model=MODEL, prompt=body["prompt"], max_tokens=1, logprobs=2, echo=True)
    num_prompt = len(plain.choices[0].logprobs.tokens) - 1
    for beam, choice in zip(beams.choices, echoed.choices):
        assert choice.text == body["prompt"] + beam.text
        lp = choice.logprobs
        assert lp.tokens[:num_prompt] == plain.choices[0].logprobs.tokens[:num_prompt]
        # Each request is batched with others, and a BLAS product's sums may round apart by ~1e-7.
        assert lp.token_logprobs[:num_prompt] == pytest.approx(plain.choices[0].logprobs.token_logprobs[:num_prompt],
                                                               abs=1e-4)
        assert lp.token_logprobs[num_prompt:] == pytest.approx(beam.logprobs.token_logprobs, abs=1e-4)


STREAM_MESSAGE = "Streaming is not currently supported with beam search"


@pytest.mark.parametrize("route, body, param, message", [
    ("completions", {"stream": True}, "stream", STREAM_MESSAGE),      # vLLM's refusal, its words
    ("chat", {"stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs", None),  # as without a search
])
def test_what_vllm_refuses_is_a_400_naming_the_field(client, route, body, param, message):
    extra = {**BEAM, **body.pop("extra_body", {})}
    with pytest.raises(openai.BadRequestError) as raised:
        if route == "chat":
            reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, extra_body=extra, **body)
        else:
            reply = client.completions.create(model=MODEL, prompt="Once", n=2, extra_body=extra, **body)
        list(reply) if body.get("stream") else None
    error = raised.value.body
    assert raised.value.status_code == 400 and error["param"] == param, error
    if message is not None:
        assert error["message"] == message
