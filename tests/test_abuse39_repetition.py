"""repetition_detection (vLLM's): a completion whose output ends in a pattern written min_count times
stops there with finish_reason "repetition" and stop_reason "repetition_detected", offline and on the
server (vLLM's object, and its earlier three request fields); requests without it are unchanged; bad
values are a ValueError naming the field offline and a 400 with param on the server (the fields were
refused unless 0). Also: a non-streaming request that fails outside the API's errors answers with
vLLM's status and message for the exception, as a stream does (it was a 500 "internal server error: ...")."""
from __future__ import annotations

import httpx
import pytest
from test_server_helpers import CHAT_TEMPLATE, openai_error, running_server, sse_events

from minillm.repetition import RepetitionDetectionParams, ends_in_repetition
from minillm.sampling_params import SamplingParams
from minillm.server.app import ServerOptions
from minillm.server.serving_chat import ChatJob
from minillm.server.serving_completion import CompletionJob

MODEL = "stories"
# Greedy, stories260K writes ". He liked to play with his toys." three times after this prompt (11
# tokens each), and loops again later: the repeats the tests stop on.
LOOPING_PROMPT = "Tom had a red ball"
LOOPING_CHAT = [{"role": "user", "content": "The dog ran"}]    # " It is a big, shiny box." again and again
MAX_TOKENS = 96
SERVER_MAX_TOKENS = 64      # both loops stop well before it (the server's steps cost more)


def first_repeat(ids: list[int], max_size: int, min_size: int, count: int, min_tokens: int = 0) -> int | None:
    """The first output length (from min_tokens on) at which ids end in one pattern of min_size (0: 1)
    to max_size tokens written count times; worked out apart from minillm/repetition.py."""
    for n in range(max(min_tokens, 1), len(ids) + 1):
        out = ids[:n]
        for size in range(max(min_size, 1), max_size + 1):
            if size * count <= n and out[n - size * count:] == out[n - size:] * count:
                return n
    return None


def pattern_size(ids: list[int], max_size: int, count: int) -> int:
    """The shortest size whose pattern ids end in count times."""
    return next(size for size in range(1, max_size + 1) if ids[-size * count:] == ids[-size:] * count)


# ---- the check itself ----------------------------------------------------------------------------------

@pytest.mark.parametrize("ids, sizes, expected", [
    ([1, 2, 3] * 3, (3, 2, 3), True), ([1, 2, 3] * 2, (3, 2, 3), False), ([1, 2, 1, 2, 1, 2, 1, 2], (5, 2, 4), True),
    ([1, 2, 3, 1, 2, 3, 1, 2, 4], (3, 2, 3), False), ([1, 2, 3, 4, 5, 6, 5, 6, 5, 6], (3, 2, 3), True),
    ([10, 20] * 3, (5, 3, 3), False), ([7, 8, 9, 10] * 3, (5, 2, 3), True), ([5] * 4, (3, 0, 4), True),
    ([1, 2] * 3, (0, 0, 0), False), ([], (3, 2, 2), False),
])
def test_the_tail_check_finds_vllms_repeats(ids, sizes, expected):
    params = RepetitionDetectionParams(*sizes)
    assert ends_in_repetition([99, 98, *ids], len(ids), params) is expected     # the prompt's tokens never count
    assert (first_repeat(ids, *sizes) == len(ids)) is expected


def test_only_the_output_counts_not_the_prompt():
    # [1, 2] twice in the prompt and once in the output: two of three repeats are the prompt's.
    assert not ends_in_repetition([1, 2, 1, 2, 1, 2], 2, RepetitionDetectionParams(2, 0, 3))


@pytest.mark.parametrize("kwargs, message", [
    ({"max_pattern_size": -1}, "max_pattern_size must be an integer in [0, 65536]"),
    ({"max_pattern_size": 65537, "min_count": 2}, "max_pattern_size must be an integer in [0, 65536]"),
    ({"max_pattern_size": 3, "min_pattern_size": 4, "min_count": 2}, "min_pattern_size must be"),
    ({"max_pattern_size": 3, "min_pattern_size": -1, "min_count": 2}, "min_pattern_size must be"),
    ({"max_pattern_size": 3}, "min_count must be at least 2"),
    ({"max_pattern_size": 3, "min_count": 1001}, "min_count must be at most 1000"),
    ({"max_pattern_size": 2.0, "min_count": 2}, "max_pattern_size must be an integer"),
    ({"min_count": True}, "min_count must be an integer"),
])
def test_bad_values_are_a_value_error_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        RepetitionDetectionParams(**kwargs)
    with pytest.raises(ValueError, match="^repetition_detection." + message.replace("[", r"\[")):
        detection = RepetitionDetectionParams()
        vars(detection).update(kwargs)            # changed after it was made: SamplingParams checks it again
        SamplingParams(repetition_detection=detection)


def test_sampling_params_take_it_and_vllms_earlier_fields():
    assert RepetitionDetectionParams(min_count=5).min_count == 5           # max_pattern_size 0: detection off
    with pytest.raises(ValueError, match="^repetition_detection compares up to .* = 720896 tokens"):
        SamplingParams(repetition_detection=RepetitionDetectionParams(65536, 1, 11))
    with pytest.raises(ValueError, match="^repetition_detection must be a RepetitionDetectionParams"):
        SamplingParams(repetition_detection={"max_pattern_size": 3, "min_count": 2})
    flat = SamplingParams(max_repetition_pattern_size=4, repetition_min_count=3)
    assert flat.repetition_detection == RepetitionDetectionParams(4, 0, 3)
    assert SamplingParams(repetition_min_count=3, min_repetition_pattern_size=0).repetition_detection is None
    with pytest.raises(ValueError, match="^repetition_min_count must be at least 2 where max_repetition_pattern_size"):
        SamplingParams(max_repetition_pattern_size=4)
    with pytest.raises(ValueError, match="^max_repetition_pattern_size is vLLM's earlier spelling"):
        SamplingParams(max_repetition_pattern_size=4, repetition_detection=RepetitionDetectionParams(4, 0, 3))


# ---- offline -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain(llm):
    """The looping prompt's greedy output without detection (ignore_eos: the whole MAX_TOKENS)."""
    [out] = llm.generate([LOOPING_PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                         use_tqdm=False)
    assert out.outputs[0].finish_reason == "length"
    return list(out.outputs[0].token_ids)


@pytest.mark.parametrize("sizes, min_tokens", [((16, 0, 3), 0), ((16, 0, 2), 0), ((11, 11, 3), 0),
                                               ((10, 1, 3), 0), ((16, 0, 3), 34), ((16, 0, 3), 40)])
def test_generation_stops_at_the_repetition_with_its_repeats_kept(llm, plain, sizes, min_tokens):
    expected = first_repeat(plain, *sizes, min_tokens=min_tokens)
    assert expected is not None and expected < MAX_TOKENS, "the prompt no longer loops under these sizes"
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, min_tokens=min_tokens,
                            repetition_detection=RepetitionDetectionParams(*sizes))
    [out] = llm.generate([LOOPING_PROMPT], params, use_tqdm=False)
    comp = out.outputs[0]
    assert (comp.finish_reason, comp.stop_reason) == ("repetition", "repetition_detected")
    assert list(comp.token_ids) == plain[:expected]          # the same tokens, up to the repeat that stops
    size, count = pattern_size(plain[:expected], sizes[0], sizes[2]), sizes[2]
    assert list(comp.token_ids[-size * count:]) == plain[expected - size:expected] * count
    assert len(comp.token_ids) >= min_tokens


def test_a_request_without_it_is_unchanged(llm, plain):
    # Nothing stops the plain run, and a detection of no sizes changes nothing either.
    for params in (SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                  repetition_detection=RepetitionDetectionParams())):
        [out] = llm.generate([LOOPING_PROMPT], params, use_tqdm=False)
        assert list(out.outputs[0].token_ids) == plain and out.outputs[0].finish_reason == "length"


# ---- the server ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(stories_path):
    """(url, engine): stories260K with the tests' chat template."""
    with running_server(stories_path, max_model_len=256,
                        options=ServerOptions(chat_template=CHAT_TEMPLATE)) as running:
        yield running


REQUESTS = {"completions": ("/v1/completions", {"prompt": LOOPING_PROMPT}),
            "chat": ("/v1/chat/completions", {"messages": LOOPING_CHAT})}


def post(url: str, endpoint: str, body: dict) -> httpx.Response:
    path, base = REQUESTS[endpoint]
    return httpx.post(f"{url}{path}", timeout=60, json={
        "model": MODEL, **base, "temperature": 0, "max_tokens": SERVER_MAX_TOKENS, "ignore_eos": True,
        "return_token_ids": True, **body})


def choice_of(response: httpx.Response) -> tuple[dict, list[int], str]:
    """(choice, its token ids, its text) of a one-choice reply."""
    assert response.status_code == 200, response.text[:500]
    [choice] = response.json()["choices"]
    return choice, choice["token_ids"], choice["text"] if "text" in choice else choice["message"]["content"]


@pytest.mark.parametrize("form", ["object", "vllms-earlier-fields"])
@pytest.mark.parametrize("endpoint", REQUESTS)
def test_the_server_stops_at_the_repetition_with_vllms_finish_reason(server, endpoint, form):
    url = server[0]
    _, plain_ids, plain_text = choice_of(post(url, endpoint, {}))
    expected = first_repeat(plain_ids, 16, 0, 3)
    assert expected is not None and expected < SERVER_MAX_TOKENS, "the prompt no longer loops"
    body = ({"repetition_detection": {"max_pattern_size": 16, "min_count": 3}} if form == "object" else
            {"max_repetition_pattern_size": 16, "repetition_min_count": 3})
    response = post(url, endpoint, body)
    choice, ids, text = choice_of(response)
    assert (choice["finish_reason"], choice["stop_reason"]) == ("repetition", "repetition_detected")
    assert ids == plain_ids[:expected] and plain_text.startswith(text)
    assert response.json()["usage"]["completion_tokens"] == expected
    size = pattern_size(ids, 16, 3)
    assert ids[-3 * size:] == ids[-size:] * 3
    # A stream ends the same way, on the same text.
    path, base = REQUESTS[endpoint]
    with httpx.stream("POST", f"{url}{path}", timeout=60, json={
            "model": MODEL, **base, "temperature": 0, "max_tokens": SERVER_MAX_TOKENS, "ignore_eos": True, **body,
            "stream": True}) as r:
        events = sse_events(list(r.iter_lines()))
    choices = [c for e in events for c in e["choices"]]
    streamed = "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in choices)
    assert streamed == text and choices[-1]["finish_reason"] == "repetition"


@pytest.mark.parametrize("endpoint", REQUESTS)
def test_a_server_request_without_it_is_unchanged(server, endpoint):
    url = server[0]
    _, plain_ids, _ = choice_of(post(url, endpoint, {}))
    for body in ({"repetition_detection": None}, {"repetition_detection": {}},
                 {"max_repetition_pattern_size": 0, "min_repetition_pattern_size": 0, "repetition_min_count": 0},
                 {"repetition_detection": {"min_count": 3}}):
        choice, ids, _ = choice_of(post(url, endpoint, body))
        assert ids == plain_ids and choice["finish_reason"] == "length", body


@pytest.mark.parametrize("body, param", [
    ({"repetition_detection": {"max_pattern_size": 3}}, "repetition_detection.min_count"),
    ({"repetition_detection": {"max_pattern_size": 3, "min_count": 1001}}, "repetition_detection.min_count"),
    ({"repetition_detection": {"max_pattern_size": -1}}, "repetition_detection.max_pattern_size"),
    ({"repetition_detection": {"max_pattern_size": 65537, "min_count": 2}}, "repetition_detection.max_pattern_size"),
    ({"repetition_detection": {"max_pattern_size": "x"}}, "repetition_detection.max_pattern_size"),
    ({"repetition_detection": {"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}},
     "repetition_detection.min_pattern_size"),
    ({"repetition_detection": {"max_pattern_size": 65536, "min_count": 11}}, "repetition_detection"),
    ({"repetition_detection": "x"}, "repetition_detection"),
    ({"max_repetition_pattern_size": 3}, "repetition_min_count"),
    ({"max_repetition_pattern_size": "three"}, "max_repetition_pattern_size"),
    ({"min_repetition_pattern_size": 3}, "min_repetition_pattern_size"),
    ({"max_repetition_pattern_size": 3, "repetition_min_count": 1}, "repetition_min_count"),
    ({"repetition_detection": {"max_pattern_size": 3, "min_count": 2}, "repetition_min_count": 3},
     "repetition_min_count"),
])
@pytest.mark.parametrize("endpoint", REQUESTS)
def test_bad_values_are_a_400_naming_the_field(server, endpoint, body, param):
    error = openai_error(post(server[0], endpoint, body), 400, param)
    assert error["message"].startswith(param) or param in error["message"]


# ---- a non-streaming request's own failure ----------------------------------------------------------------

@pytest.mark.parametrize("failure, status, kind, message", [
    (KeyError("x"), 500, "server_error", "'x'"),
    (RuntimeError("went wrong"), 500, "server_error", "went wrong"),
    (AssertionError(), 500, "server_error", "AssertionError"),
    (ValueError("bad value"), 400, "invalid_request_error", "bad value"),
    (OverflowError("too big"), 400, "invalid_request_error", "too big"),
    (NotImplementedError("not here"), 501, "server_error", "not here"),
], ids=["KeyError", "RuntimeError", "empty-AssertionError", "ValueError", "OverflowError", "NotImplementedError"])
@pytest.mark.parametrize("endpoint", REQUESTS)
def test_a_plain_requests_own_failure_is_vllms_error_for_it(server, monkeypatch, endpoint, failure, status, kind,
                                                             message):
    job_class = CompletionJob if endpoint == "completions" else ChatJob

    def failing(self, finals):
        raise failure

    monkeypatch.setattr(job_class, "response", failing)
    error = openai_error(post(server[0], endpoint, {"max_tokens": 3}), status)
    assert error == {"message": message, "type": kind, "param": None, "code": None}
    monkeypatch.undo()
    choice, ids, _ = choice_of(post(server[0], endpoint, {"max_tokens": 3}))
    assert len(ids) == 3 and choice["finish_reason"] == "length"
