"""Structured outputs with the matchers in a grammar process (grammar_process=True, the GPU's
default) on stories260K (CPU): every constrained output valid and each one equal to what the
in-process matchers give, beside unconstrained requests that keep their alone output (async
scheduling on and off); the grammar process killed mid-generation ends only the constrained
requests in flight, and the next constrained request gets a new process; a script without a
__main__ guard; shutdown leaves no process and no shared segment."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from minillm import SamplingParams, StructuredOutputsParams
from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from test_structured_engine import CHECKS, PROMPT, assert_valid, constrained


def run(engine: LLMEngine, requests: dict[str, SamplingParams]) -> dict:
    """Add the requests and step until all are done; request id -> its CompletionOutput."""
    for request_id, params in requests.items():
        engine.add_request(request_id, PROMPT, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    return done


def new_engine(stories_path, grammar_process: bool, async_scheduling: bool = True, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(stories_path), device="cpu", grammar_process=grammar_process,
                                  async_scheduling=async_scheduling, **kwargs), log=lambda m: None)


def step_until_done(engine, max_steps: int = 2000) -> dict:
    """Step until no request is left (at most max_steps); request id -> its CompletionOutput."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    raise AssertionError(f"requests still unfinished after {max_steps} steps: {sorted(engine.requests)}")


def tokens_until(engine, counts: dict, request_id: str, num_tokens: int) -> None:
    """Step until request_id has num_tokens output tokens (counts: request id -> its tokens so far)."""
    while counts.get(request_id, 0) < num_tokens:
        counts.update({o.request_id: len(o.outputs[0].token_ids) for o in engine.step()})


def long_constrained(seed: int = 0) -> SamplingParams:
    """A constrained request that goes on for 200 tokens (lowercase words)."""
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=200, ignore_eos=True,
                          structured_outputs=StructuredOutputsParams(regex="[a-z ]+"))


def kill(process) -> None:
    """Kill a grammar process and wait for it to be gone."""
    process._proc.kill()
    process._proc.wait()


def alone(stories_path, params: SamplingParams, async_scheduling: bool = True):
    """The CompletionOutput of an unconstrained request run alone on an in-process engine."""
    engine = new_engine(stories_path, False, async_scheduling)
    try:
        return run(engine, {"alone": params})["alone"]
    finally:
        engine.shutdown()


def mixed_requests() -> dict[str, SamplingParams]:
    """Every kind of constraint at three seeds and greedy, and unconstrained greedy requests."""
    requests = {f"{kind}-{seed}": constrained(kind, seed) for kind in CHECKS for seed in (0, 1, 2, None)}
    requests.update({f"plain-{i}": SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) for i in range(4)})
    return requests


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_grammar_process_gives_what_in_process_matchers_give(stories_path, async_scheduling):
    outs = {}
    for grammar_process in (False, True):
        engine = new_engine(stories_path, grammar_process, async_scheduling)
        try:
            outs[grammar_process] = run(engine, mixed_requests())
        finally:
            engine.shutdown()
    plain = alone(stories_path, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), async_scheduling)
    for request_id, out in outs[True].items():
        assert (out.text, out.finish_reason) == (outs[False][request_id].text, outs[False][request_id].finish_reason)
        if request_id.startswith("plain"):
            assert out.token_ids == plain.token_ids
        else:
            assert_valid(request_id.split("-")[0], out, request_id)


def test_a_killed_grammar_process_ends_only_the_constrained_requests_and_the_next_gets_a_new_one(stories_path):
    engine = new_engine(stories_path, True)
    try:
        engine.add_request("c", PROMPT, long_constrained())
        tokens = {}
        tokens_until(engine, tokens, "c", 10)    # the constrained one decoding, its matcher in the grammar process
        plain = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        engine.add_request("u", PROMPT, plain)
        tokens_until(engine, tokens, "u", 5)     # and the unconstrained one beside it
        first = engine.structured_outputs._process
        kill(first)
        done = step_until_done(engine)
        assert done["c"].finish_reason == "error" and len(done["c"].token_ids) < 200
        assert done["u"].token_ids == alone(stories_path, plain).token_ids and done["u"].finish_reason == "length"
        again = run(engine, {"again": constrained("date", 3)})["again"]
        assert_valid("date", again)
        assert engine.structured_outputs._process is not first and first._proc.poll() is not None
    finally:
        engine.shutdown()


NO_MAIN_GUARD = '''
import sys
from minillm import LLM, SamplingParams, StructuredOutputsParams
llm = LLM(sys.argv[1], device="cpu", grammar_process=True)
out = llm.generate(["Once"], SamplingParams(temperature=0, max_tokens=20,
                   structured_outputs=StructuredOutputsParams(regex="[0-9]{4}")))
print("generated", repr(out[0].outputs[0].text), flush=True)
'''


def test_a_script_without_a_main_guard_starts_one_grammar_process(stories_path, tmp_path):
    # multiprocessing's spawn would run the script again in the child, which would build another engine.
    script = tmp_path / "script.py"
    script.write_text(NO_MAIN_GUARD)
    proc = subprocess.run([sys.executable, str(script), str(stories_path)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("generated") == 1
    text = proc.stdout.split("generated ", 1)[1].strip()
    assert len(text) == 6 and text[1:5].isdigit(), text


def mask_inodes() -> set[int]:
    """The inodes of the grammar mask memory this process holds open."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "minillm-grammar-masks" in os.readlink(f"/proc/self/fd/{fd}"):
                found.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except FileNotFoundError:       # the listing's own descriptor, closed since
            continue
    return found


def test_shutdown_stops_the_grammar_process_and_removes_its_shared_masks(stories_path):
    engine = new_engine(stories_path, True)
    out = run(engine, {"c": constrained("choice", 0)})["c"]
    assert_valid("choice", out)
    process = engine.structured_outputs._process
    masks = os.stat(f"/proc/self/fd/{process.spec.mask_fd}").st_ino
    assert masks in mask_inodes() and process._proc.poll() is None
    engine.shutdown()
    assert process._proc.poll() is not None and masks not in mask_inodes()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_the_openai_client_gets_valid_json_through_a_server_whose_core_holds_a_grammar_process(
        stories_path, tmp_path, stream):
    openai = pytest.importorskip("openai")
    from test_server_helpers import chat_model_dir, running_server
    from test_server_structured import MESSAGES, chat_texts
    from test_structured_output import SCHEMA
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    model = chat_model_dir(stories_path, tmp_path / "chat-model")
    with running_server(model, engine_core="process", grammar_process=True) as (url, _), \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        texts, finishes = chat_texts(client, stream, model="stories", messages=MESSAGES, max_tokens=96,
                                     temperature=1.0, n=5, seed=13, response_format=response_format)
    assert len(texts) == 5
    for text, finish in zip(texts, finishes):
        assert finish == "stop"
        assert CHECKS["json"][1](text), text


def test_a_fill_out_when_the_grammar_process_dies_allows_every_token(stories_path):
    # The fill's answer failed and the step with it: every request of the step was aborted.
    engine = new_engine(stories_path, True)
    try:
        engine.add_request("c", PROMPT, constrained("date", 0))
        while not engine.structured_outputs or not engine.structured_outputs._process or not any(
                s.structured_output.matcher is not None for s in engine.requests["c"].seqs):
            engine.step()
        process = engine.structured_outputs._process
        matcher = engine.requests["c"].seqs[0].structured_output.matcher
        os.kill(process._proc.pid, signal.SIGSTOP)         # it cannot answer what follows
        process.bitmasks[0][:1] = 0
        answer = process.fill(0, [matcher.handle], [])
        kill(process)
        assert answer.result() == 0.0 and (process.bitmasks[0][0] == -1).all()
        assert process.failed
    finally:
        engine.shutdown()


def test_a_grammar_process_that_stops_answering_ends_only_the_constrained_requests(stories_path):
    # Waiting for its answers had no bound: a stuck process held the engine thread, and every request, for ever.
    engine = new_engine(stories_path, True)
    try:
        engine.add_request("c", PROMPT, long_constrained())
        tokens = {}
        tokens_until(engine, tokens, "c", 5)
        plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        engine.add_request("u", PROMPT, plain)
        tokens_until(engine, tokens, "u", 3)
        process = engine.structured_outputs._process
        process.answer_timeout_s = 0.2
        os.kill(process._proc.pid, signal.SIGSTOP)
        done = step_until_done(engine)
        assert done["c"].finish_reason == "error" and "did not answer" in done["c"].stop_reason
        assert process._proc.wait() != 0
        assert done["u"].token_ids == alone(stories_path, plain).token_ids
        assert_valid("date", run(engine, {"again": constrained("date", 1)})["again"])
    finally:
        engine.shutdown()
