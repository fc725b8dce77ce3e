"""use_beam_search on the OpenAI routes, through the openai client (extra_body), as vLLM's server takes
it: the choices are LLM.beam_search's beams for the same prompt and parameters, the search's steps are
engine requests beside the others (a stream in flight is unchanged, a hang-up aborts the step in
flight), and what beam search cannot honour is a 400 naming the field. Each was a 400 naming
use_beam_search (the server had no beam search). And `minillm bench throughput --n N
--use-beam-search`, as vLLM's bench has it."""
from __future__ import annotations

import json
import logging
import re
import socket
import threading

import pytest

openai = pytest.importorskip("openai")

import core_hooks  # noqa: E402
import httpx  # noqa: E402
from test_server_helpers import (  # noqa: E402
    call_utility, chat_model_dir, get_stats, running_router, running_server, wait_for,
)
from test_cli import STORIES, needs_stories, run_main  # noqa: E402

from minillm import LLM  # noqa: E402
from minillm.benchmarks.throughput import floor_seconds  # noqa: E402
from minillm.benchmarks.workload import QWEN3_0_6B, Workload, random_workload, roofline_seconds  # noqa: E402
from minillm.sampling_params import BeamSearchParams  # noqa: E402

MODEL = "stories"
PERIOD = 426            # "." in stories260K's vocabulary: this module's EOS, so beams end within a few tokens
PROMPTS = ["Once upon a time", "Lily and Tom"]
MESSAGES = [{"role": "user", "content": "hi"}]
BEAM = {"use_beam_search": True}


class StepPermits:
    """A core_hook: the engine runs a step only on a permit (it takes commands, adds and aborts,
    meanwhile); open() lets every step run."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.permits: int | None = None      # None: open
        self.given = threading.Condition(self.lock)

    def install(self, engine) -> None:
        real_step = engine.step

        def step():
            with self.lock:
                if self.permits is not None:
                    if self.permits == 0:
                        self.given.wait(0.01)
                        return []
                    self.permits -= 1
            return real_step()

        engine.step = step

    def close(self, permits: int = 0) -> None:
        """From now on only `permits` more steps run."""
        with self.lock:
            self.permits = permits

    def open(self) -> None:
        with self.lock:
            self.permits = None
            self.given.notify_all()

    def used_up(self) -> bool:
        with self.lock:
            return self.permits == 0


PERMITS = StepPermits()


@pytest.fixture(scope="module")
def model_dir(stories_path, tmp_path_factory):
    """stories260K with a chat template whose tokenizer names "." its EOS."""
    out = chat_model_dir(stories_path, tmp_path_factory.mktemp("beam_model"))
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "."}))
    return out


def hooks(engine) -> None:
    """core_hooks' failure switches, and PERMITS."""
    core_hooks.install(engine)
    PERMITS.install(engine)


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(model_dir, engine_core="thread", core_hook=hooks, max_model_len=64) as running:
        yield running


@pytest.fixture(scope="module")
def url(server):
    return server[0]


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


def after_prompt(tok, prompt: list[int], token_ids: list[int]) -> str:
    """The text token_ids add after prompt."""
    head = tok.decode(prompt)
    return tok.decode(prompt + token_ids)[len(head):]


def expected_choice(tok, beam, num_prompt_tokens: int, include_stop: bool) -> dict:
    """What a choice of the server's answer holds for an offline beam."""
    generated = beam.tokens[num_prompt_tokens:]
    shown = generated[:-1] if beam.finish_reason == "stop" else generated
    return {"text": after_prompt(tok, beam.tokens[:num_prompt_tokens], shown),
            "token_ids": generated if include_stop else shown, "finish_reason": beam.finish_reason,
            "stop_reason": PERIOD if beam.finish_reason == "stop" else None}


@pytest.mark.parametrize("include_stop", [False, True])
def test_completion_choices_are_the_offline_beams_of_each_prompt(client, offline, include_stop):
    params = BeamSearchParams(beam_width=3, max_tokens=12, length_penalty=0.8, include_stop_str_in_output=include_stop)
    beams = offline.beam_search(PROMPTS, params)
    reply = client.completions.create(
        model=MODEL, prompt=PROMPTS, n=3, max_tokens=12, temperature=0, logprobs=2,
        extra_body={**BEAM, "length_penalty": 0.8, "include_stop_str_in_output": include_stop,
                    "return_token_ids": True})
    tok = offline.get_tokenizer()
    assert [c.index for c in reply.choices] == list(range(6))
    finishes = set()
    for pi, output in enumerate(beams):
        assert len(output.sequences) == 3
        for bi, beam in enumerate(output.sequences):
            choice = reply.choices[pi * 3 + bi]
            num_prompt = len(choice.prompt_token_ids)
            assert choice.prompt_token_ids == beam.tokens[:num_prompt]
            got = {"text": choice.text, "token_ids": choice.token_ids, "finish_reason": choice.finish_reason,
                   "stop_reason": choice.stop_reason}
            assert got == expected_choice(tok, beam, num_prompt, include_stop)
            # each token's logprob (and 2 alternatives) from its step; with the EOS shown they add up to the score's
            assert len(choice.logprobs.token_logprobs) == len(choice.token_ids)
            assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
            if include_stop or beam.finish_reason == "length":
                assert sum(choice.logprobs.token_logprobs) == pytest.approx(beam.cum_logprob, abs=1e-4)
            finishes.add(beam.finish_reason)
    assert finishes == {"stop", "length"}
    assert reply.usage.completion_tokens == sum(len(c.token_ids) for c in reply.choices)
    assert reply.usage.prompt_tokens == sum(len(reply.choices[pi * 3].prompt_token_ids) for pi in range(2))


def test_chat_choices_are_the_offline_beams_of_the_rendered_prompt(client, offline):
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=2, max_completion_tokens=8, temperature=0, logprobs=True, top_logprobs=2,
        extra_body={**BEAM, "length_penalty": 1.5, "return_token_ids": True})
    prompt = reply.prompt_token_ids
    [output] = offline.beam_search({"prompt_token_ids": prompt},
                                   BeamSearchParams(beam_width=2, max_tokens=8, length_penalty=1.5))
    tok = offline.get_tokenizer()
    got = [{"text": c.message.content, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
            "stop_reason": c.model_extra["stop_reason"]} for c in reply.choices]
    assert got == [expected_choice(tok, beam, len(prompt), False) for beam in output.sequences]
    assert [c.message.role for c in reply.choices] == ["assistant"] * 2
    rows = reply.choices[0].logprobs.content
    assert len(rows) == len(reply.choices[0].token_ids) and all(len(row.top_logprobs) == 2 for row in rows)


def test_width_one_without_a_period_is_greedy(client):
    # One beam whose candidates are its step's two likeliest tokens: the likeliest goes on each step.
    body = {"model": MODEL, "prompt": "The cat", "max_tokens": 6, "temperature": 0}
    greedy = client.completions.create(**body, extra_body={"stop_token_ids": [PERIOD]}).choices[0]
    beam = client.completions.create(**body, extra_body=BEAM).choices[0]
    assert greedy.finish_reason == "length" and (beam.text, beam.finish_reason) == (greedy.text, "length")


def engine_rows(url: str, pattern: str) -> list[str]:
    """The ids of /v1/stats' request rows that match pattern."""
    return [row["request_id"] for row in get_stats(url)["requests"] if re.fullmatch(pattern, row["request_id"])]


def test_steps_run_beside_a_stream_in_flight_which_is_unchanged(url, client, offline):
    story = {"model": MODEL, "prompt": "The dog", "max_tokens": 40, "temperature": 0}
    solo = client.completions.create(**story, extra_body={"ignore_eos": True}).choices[0].text
    got: dict = {}

    def read_stream():
        chunks = client.completions.create(**story, stream=True, extra_body={"ignore_eos": True,
                                                                              "request_id": "plain-39"})
        got["stream"] = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)

    def search():
        got["beam"] = client.completions.create(model=MODEL, prompt=PROMPTS[0], n=2, max_tokens=10, temperature=0,
                                                extra_body={**BEAM, "request_id": "beam-39"})

    PERMITS.close(3)                       # the stream is prefilled and takes a token or two, then waits
    reader = threading.Thread(target=read_stream, daemon=True)
    reader.start()
    assert wait_for(PERMITS.used_up, 60)
    assert engine_rows(url, r"cmpl-plain-39-0-[0-9a-f]{8}")
    searcher = threading.Thread(target=search, daemon=True)
    searcher.start()
    # the search's first step is an engine request beside the stream's (and /v1/stats answers meanwhile)
    assert wait_for(lambda: engine_rows(url, r"cmpl-beam-39-beam-0-[0-9a-f]{8}"), 60)
    assert engine_rows(url, r"cmpl-plain-39-0-[0-9a-f]{8}")
    PERMITS.open()
    reader.join(60)
    searcher.join(60)
    assert got["stream"] == solo
    [output] = offline.beam_search(PROMPTS[0], BeamSearchParams(beam_width=2, max_tokens=10))
    tok = offline.get_tokenizer()
    num_prompt = len(tok.encode(PROMPTS[0]))
    assert [c.text for c in got["beam"].choices] == [expected_choice(tok, b, num_prompt, False)["text"]
                                                     for b in output.sequences]


def test_a_hang_up_aborts_the_step_in_flight(url, client):
    PERMITS.close()
    body = json.dumps({"model": MODEL, "prompt": "Once", "max_tokens": 8, "n": 2, "use_beam_search": True,
                       "request_id": "gone-39"}).encode()
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert wait_for(lambda: engine_rows(url, r"cmpl-gone-39-beam-0-[0-9a-f]{8}"), 60)
    sock.close()
    # aborted without a step (none runs while closed): its row goes, no other takes its place
    assert wait_for(lambda: not engine_rows(url, r"cmpl-gone-39-.*"), 60)
    PERMITS.open()
    after = client.completions.create(model=MODEL, prompt="Once", max_tokens=3, n=2, temperature=0, extra_body=BEAM)
    assert len(after.choices) == 2
    assert not engine_rows(url, r"cmpl-gone-39-.*")


def test_a_failed_step_fails_the_search_as_it_fails_a_plain_request(server, offline):
    url, engine = server
    ids = offline.get_tokenizer().encode("Once upon")
    answers = []
    for extra in ({}, {**BEAM, "n": 3}):
        call_utility(engine, "fail_next_step_for", [ids])      # the search's first step: the prompt alone
        answers.append(httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 4,
                                                                 **extra}, timeout=60))
    plain, beam = answers
    assert plain.status_code >= 500 and (beam.status_code, beam.json()) == (plain.status_code, plain.json())
    assert httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 4, **BEAM},
                      timeout=60).status_code == 200


def test_a_step_aborted_in_the_engine_ends_the_search_with_one_aborted_choice(server):
    url, engine = server
    PERMITS.close()
    search = threading.Thread(target=lambda: got.update(reply=httpx.post(
        f"{url}/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 4, "n": 2, **BEAM,
                                       "request_id": "cut-39"}, timeout=60)), daemon=True)
    got: dict = {}
    search.start()
    rows = wait_for(lambda: engine_rows(url, r"cmpl-cut-39-beam-0-[0-9a-f]{8}"), 60)
    engine.abort(rows[0])            # as an operator's abort would end it, not the client
    PERMITS.open()
    search.join(60)
    reply = got["reply"]
    assert reply.status_code == 200, reply.text
    [choice] = reply.json()["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("", "abort")
    assert reply.json()["usage"]["completion_tokens"] == 0


def test_ignored_sampling_fields_are_logged_and_change_nothing(client, caplog, monkeypatch):
    from minillm.server import app
    monkeypatch.setattr(app.logger, "propagate", True)     # a server served earlier in this process stops it
    body = {"model": MODEL, "prompt": PROMPTS[1], "n": 2, "max_tokens": 6, "temperature": 0}
    plain = client.completions.create(**body, extra_body=BEAM)
    with caplog.at_level(logging.WARNING, logger="minillm.server"):
        ignored = client.completions.create(**body, stop=["park"], seed=5, top_p=0.5,
                                            extra_body={**BEAM, "min_tokens": 2, "skip_special_tokens": True})
    assert [c.text for c in ignored.choices] == [c.text for c in plain.choices]
    warned = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert warned and all(name in warned[-1] for name in ("top_p", "seed", "stop", "min_tokens"))
    assert "skip_special_tokens" not in warned[-1]      # at its default


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("route, body, param", [
    ("completions", {"stream": True}, "stream"),
    ("completions", {"n": 11}, "n"),                           # 2 * 11 log-probabilities a step > max_logprobs 20
    ("chat", {"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ("completions", {"extra_body": {"kv_transfer_params": {"do_remote_decode": True}}}, "kv_transfer_params"),
    ("chat", {"max_completion_tokens": 100}, "max_completion_tokens"),       # past max_model_len 64
])
def test_what_beam_search_cannot_honour_is_a_400_naming_the_field(client, route, body, param):
    extra = {**BEAM, **body.pop("extra_body", {})}
    with pytest.raises(openai.BadRequestError) as raised:
        if route == "chat":
            client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, extra_body=extra, **body)
        else:
            client.completions.create(model=MODEL, prompt="Once", **{"n": 2, **body}, extra_body=extra)
    assert raised.value.status_code == 400 and raised.value.body["param"] == param, raised.value.body


# ---- minillm bench throughput --use-beam-search (vLLM's) ------------------------------------------------

BENCH = ("bench", "throughput", "--model", str(STORIES), "--device", "cpu")


@needs_stories
def test_bench_throughput_use_beam_search_runs_llm_beam_search_with_n_beams(capsys, tmp_path, monkeypatch):
    # --n and --use-beam-search were 'unrecognized arguments'.
    calls = []
    real = LLM.beam_search

    def beam_search(self, prompts, params, *args, **kwargs):
        calls.append((len(prompts), params))
        return real(self, prompts, params, *args, **kwargs)

    monkeypatch.setattr(LLM, "beam_search", beam_search)
    out_file = tmp_path / "throughput.json"
    status, out, err = run_main(capsys, *BENCH, "--num-prompts", "3", "--input-len", "4", "--output-len", "3",
                                "--n", "2", "--use-beam-search", "--output-json", str(out_file))
    assert status == 0, err
    assert calls == [(3, BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))]
    assert "workload: 3 requests, 12 prompt tokens, 18 output tokens" in out and "2 beams (LLM.beam_search)" in out
    figures = json.loads(out_file.read_text())
    assert figures["output_tokens"] == 18 and figures["total_num_tokens"] == 12 + 18


@needs_stories
def test_bench_throughput_n_generates_n_completions_a_request(capsys):
    status, out, err = run_main(capsys, *BENCH, "--num-prompts", "2", "--input-len", "4", "--output-len", "3",
                                "--n", "3")
    assert status == 0, err
    assert "workload: 2 requests, 8 prompt tokens, 18 output tokens" in out and "3 completions a request" in out


@needs_stories
@pytest.mark.parametrize("options, needle", [
    (("--input-len", "4", "--output-len", "3", "--n", "11"), "--n with --use-beam-search: beam_width must be"),
    (("--input-len", "4", "--output-len", "3", "--n", "3", "--max-logprobs", "4"), "past --max-logprobs 4"),
    (("--max-output-len", "5",), "not nano-vllm's workload"),
    (("--input-len", "4", "--output-len", "3", "--random-range-ratio", "0.5"), "not --random-range-ratio"),
])
def test_bench_throughput_use_beam_search_refuses_what_it_cannot_run(capsys, options, needle):
    status, out, err = run_main(capsys, *BENCH, "--use-beam-search", *options)
    assert status == 2 and needle in err, err


def test_the_bench_floor_prefills_each_prompt_once_and_decodes_n_sequences():
    w = random_workload(4, 16, 8)
    config, bw, mm = QWEN3_0_6B, 3e12, 8e14
    assert floor_seconds(w, 1, config, bw, mm) == pytest.approx(roofline_seconds(w, config, bw, mm))
    fanned = Workload(w.prompts * 3, w.max_tokens * 3)
    prefill = roofline_seconds(Workload(w.prompts, [0] * 4), config, bw, mm)
    assert floor_seconds(w, 3, config, bw, mm) == pytest.approx(roofline_seconds(fanned, config, bw, mm) - 2 * prefill)
    assert roofline_seconds(w, config, bw, mm) < floor_seconds(w, 3, config, bw, mm) < roofline_seconds(fanned, config,
                                                                                                        bw, mm)


# ---- the P/D router ----------------------------------------------------------------------------------

def test_the_router_sends_a_beam_search_whole_to_a_decode_server(stories_path):
    # Its steps are requests of their own, which no lease of one prompt carries: through the prefill server
    # (kv_transfer_params, a 400 there) the router answered a 502 naming the KV transfer.
    from minillm.router import RouterConfig, decode_only_reason
    for path in ("/v1/completions", "/v1/chat/completions"):
        for value in (True, "true", 1):      # as a server reads the boolean
            assert decode_only_reason(path, {"prompt": "Once", "use_beam_search": value}) == "beam search"
        for value in (False, "false", None, "maybe"):     # no search (or the server's 400): the lease path
            assert decode_only_reason(path, {"prompt": "Once", "use_beam_search": value}) is None
    body = {"model": MODEL, "prompt": "Once upon", "n": 1, "max_tokens": 5, "temperature": 0, **BEAM}
    with running_server(stories_path, engine_core="thread",
                        kv_transfer_config={"kv_role": "kv_producer", "kv_lease_s": 60}) as (prefill, _), \
            running_server(stories_path, engine_core="thread", kv_transfer_config={"kv_role": "kv_consumer"}) \
            as (decode, _), running_router(RouterConfig((prefill,), (decode,))) as router:
        routed = httpx.post(f"{router}/v1/completions", json=body, timeout=60)
        assert routed.status_code == 200, routed.text
        direct = httpx.post(f"{decode}/v1/completions", json=body, timeout=60).json()
        assert [c["text"] for c in routed.json()["choices"]] == [c["text"] for c in direct["choices"]]
