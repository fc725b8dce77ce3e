"""The engine core apart from the API server: token ids detokenised on the other side give the same
outputs as the engine's own text path; the core process frees what a stop string ends, dies
visibly, never outlives the server, and is the only process that touches CUDA."""
from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq
from test_server_helpers import wait_for

from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.engine_core import messages as m
from minillm.engine_core.core import FULL_RESOLUTION, SAMPLING_FIELDS, CoreSpec, EngineCore, EngineCoreProc, _connect
from minillm.engine_core.output_processor import OutputProcessor
from minillm.sampling_params import SamplingParams
from minillm.server.async_llm import AsyncLLM
from minillm.server.errors import EngineDeadError

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben", "One day, a cat"]


def _alone_text(engine: LLMEngine, prompt: str, params: SamplingParams) -> str:
    """The text the engine makes for one request alone."""
    engine.add_request("probe", prompt, params)
    last = None
    while engine.has_unfinished_requests():
        last = engine.step() or last
    return last[0].outputs[0].text


def _requests(engine: LLMEngine) -> dict[str, tuple[str, SamplingParams]]:
    """Requests that exercise every rule of the output side at once."""
    text = _alone_text(engine, PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    # A stop string that the 12th (last) token completes: in the split the core has already ended
    # the sequence by length when the stop string is found, and it must still count as "stop".
    tail = next(text[-k:] for k in range(3, len(text)) if text.find(text[-k:]) == len(text) - k)
    stop_token = engine.tokenizer.encode(PROMPTS[1] + " was", add_special_tokens=False)[-1]
    return {
        "stop-string": (PROMPTS[0], SamplingParams(temperature=0, max_tokens=60, stop=["Lily"], ignore_eos=True)),
        "stop-string-kept": (PROMPTS[0], SamplingParams(temperature=0, max_tokens=60, stop=["Lily", "park"],
                                                        include_stop_str_in_output=True, ignore_eos=True)),
        "n-2-sampled-logprobs": (PROMPTS[2], SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=40,
                                                            stop=[" the", "."], logprobs=3)),
        "stop-token": (PROMPTS[1], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_token])),
        "stop-at-length": (PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, stop=[tail], ignore_eos=True)),
        "plain": (PROMPTS[3], SamplingParams(temperature=0, max_tokens=30)),
    }


def _run_engine(engine: LLMEngine, requests: dict) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def _run_split(core: EngineCore, requests: dict, stop_delay: int) -> tuple[dict, OutputProcessor]:
    """The core and the API server's output processor in one process; stops found by the processor
    reach the core `stop_delay` steps later, as they might across a busy socket."""
    tokenizer = core.engine.tokenizer
    processor = OutputProcessor(tokenizer)
    for rid, (prompt, params) in requests.items():
        ids = tokenizer.encode(prompt, add_special_tokens=True)
        fields = {name: getattr(params, name) for name in SAMPLING_FIELDS}
        assert core.add_request(m.AddRequest(rid, ids, fields, time.time())) is None
        processor.add(rid, prompt, ids, params, time.time(), handle=rid)
    finals, in_transit = {}, deque()
    while core.engine.has_unfinished_requests() or in_transit:
        if core.engine.has_unfinished_requests():
            done = processor.process(core.step(), time.time())
            in_transit.append(done.stops)
            for handle, out in done.outputs:
                assert handle == out.request_id
                if out.finished:
                    assert out.request_id not in finals, "a request finished twice"
                    finals[out.request_id] = out
        if len(in_transit) > stop_delay or not core.engine.has_unfinished_requests():
            for rid, index, stop in in_transit.popleft():
                core.engine.stop_sequence(rid, index, stop)
    return finals, processor


def _view(out) -> list[tuple]:
    return [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.cumulative_logprob, c.logprobs)
            for c in out.outputs]


@pytest.fixture(scope="module")
def config(stories_path):
    return EngineConfig(model=str(stories_path), device="cpu")


@pytest.fixture(scope="module")
def reference(config):
    engine = LLMEngine(config, log=lambda _: None)
    requests = _requests(engine)
    before = Counter(engine.metrics.finished)
    finals = _run_engine(engine, requests)
    return requests, finals, Counter(engine.metrics.finished) - before


@pytest.mark.parametrize("stop_delay", [0, 1, 3])
def test_token_outputs_detokenised_apart_match_the_engine(config, reference, stop_delay):
    requests, expected, expected_finishes = reference
    assert expected["stop-string"].outputs[0].stop_reason == "Lily"
    assert expected["stop-at-length"].outputs[0].finish_reason == "stop"
    assert expected["stop-token"].outputs[0].finish_reason == "stop"
    assert isinstance(expected["stop-token"].outputs[0].stop_reason, int)
    core = EngineCore(config, log=lambda _: None)
    finals, processor = _run_split(core, requests, stop_delay)
    assert set(finals) == set(expected)
    for rid, out in finals.items():
        assert _view(out) == _view(expected[rid]), rid
        assert out.prompt_token_ids == expected[rid].prompt_token_ids
    assert processor.finished == expected_finishes     # "stop" for the stop string that met max_tokens
    assert not processor.requests                       # each forgotten once the core retired it
    stats = core.engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_num_used_blocks == 0
    core.engine.shutdown()


def test_log_probabilities_with_their_ranks_cross_the_socket_as_floats():
    from minillm.outputs import Logprob
    seq = m.SeqOutput(0, [5], [{5: Logprob(-2.5, 7), 6: -0.25}])
    step = m.StepOutputs(1, 0.0, [m.RequestStepOutput("r", [seq], False, 0, None, None, None,
                                                      [None, {3: Logprob(-1.0, 2)}])])
    [got] = m.up_decoder().decode(m.encoder().encode(step)).outputs
    assert got.seqs[0].new_logprobs == [{5: -2.5, 6: -0.25}] and got.new_prompt_logprobs == [None, {3: -1.0}]
    with pytest.raises(TypeError, match="Encoding objects of type object is unsupported"):
        m.encoder().encode([object()])


def test_a_prompt_tokens_rank_travels_beside_its_prompt_logprobs_entry():
    from minillm.outputs import Logprob
    ids = [1, 3, 7]
    entries = [None, {3: Logprob(-1.0, 2), 4: -0.5}, {7: Logprob(-9.0, 40), 4: -0.1}]
    assert m.prompt_token_ranks(entries, ids, 0) == [None, 2, 40] and m.prompt_token_ranks(entries[2:], ids, 2) == [40]
    sent = m.RequestStepOutput("r", [], False, 0, None, None, None, entries[1:],
                               m.prompt_token_ranks(entries[1:], ids, 1))
    got = m.up_decoder().decode(m.encoder().encode(m.StepOutputs(1, 0.0, [sent]))).outputs[0]
    assert got.new_prompt_logprobs == [{3: -1.0, 4: -0.5}, {7: -9.0, 4: -0.1}]
    rebuilt = m.with_prompt_token_ranks(got.new_prompt_logprobs, got.new_prompt_logprob_ranks, ids, 1)
    assert [(e[t], e[t].rank) for e, t in zip(rebuilt, ids[1:])] == [(-1.0, 2), (-9.0, 40)]
    assert type(rebuilt[0][4]) is float and type(rebuilt[1][4]) is float    # alternatives are ranked by their order


@dataclass
class InprocCore:
    """An EngineCoreProc on this thread, its sockets over inproc: commands go in, outputs come out."""

    commands: zmq.Socket           # PUSH: what an API server sends
    outputs: zmq.Socket            # PULL: what the core sends back
    input_sock: zmq.Socket         # the core's end of commands
    core: EngineCore
    proc: EngineCoreProc
    encoder: Any
    decoder: Any


@contextlib.contextmanager
def inproc_core(config):
    """An InprocCore over config's engine; its engine is shut down and its sockets closed after."""
    ctx = zmq.Context()
    commands, outputs = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    commands.bind("inproc://commands")
    outputs.bind("inproc://outputs")
    parent_end, _child_end = multiprocessing.Pipe(duplex=False)
    spec = CoreSpec(config, ["inproc://commands"], ["inproc://outputs"], parent_end)
    input_sock, output_socks = _connect(ctx, spec)
    core = EngineCore(config, log=lambda _: None)
    try:
        yield InprocCore(commands, outputs, input_sock, core, EngineCoreProc(core, spec, input_sock, output_socks),
                         m.encoder(), m.up_decoder())
    finally:
        core.engine.shutdown()
        ctx.destroy(linger=0)


def test_an_abort_that_has_reached_the_core_is_applied_before_its_next_step(config):
    """The c.core's loop takes every command waiting in its socket before it launches a step."""
    with inproc_core(config) as c:
        ids = c.core.engine.tokenizer.encode("Once upon a time", add_special_tokens=True)
        fields = {"max_tokens": 300, "temperature": 0.0, "ignore_eos": True}
        for rid in ("kept", "aborted"):
            c.commands.send(c.encoder.encode(m.AddRequest(rid, ids, fields, time.time())))
        while c.core.engine.metrics.num_steps < 4:
            assert c.proc.run_once()
        assert c.core.engine.stats().kv_num_used_blocks > 0
        c.commands.send(c.encoder.encode(m.AbortRequests(["aborted"])))
        assert c.input_sock.poll(30_000), "the abort never reached the c.core's socket"
        steps = c.core.engine.metrics.num_steps
        while c.outputs.poll(0):
            c.outputs.recv()          # what the steps so far sent
        assert c.proc.run_once()
        assert c.core.engine.metrics.num_steps == steps + 1
        step = c.decoder.decode(c.outputs.recv())
        by_id = {out.request_id: out.seqs[0] for out in step.outputs}
        assert by_id["aborted"].finish_reason == "abort" and by_id["aborted"].new_token_ids == []
        assert len(by_id["kept"].new_token_ids) == 1 and by_id["kept"].finish_reason is None
        assert c.core.engine.metrics.finished["abort"] == 1
        assert [req.request_id for req in c.core.engine.requests.values() if not req.is_finished] == ["kept"]


# ---- the core in its own process -------------------------------------------------------------

@pytest.fixture
def async_llm(config):
    engine = AsyncLLM(config)
    yield engine
    engine.shutdown()


def test_a_stop_string_frees_the_request_in_the_core(async_llm):
    params = SamplingParams(temperature=0, max_tokens=300, stop=["Lily"], ignore_eos=True)

    async def scenario():
        before = await async_llm.call_utility("stats")      # the core's own counts
        stream = await async_llm.add_request("stopped", "Once upon a time", params)
        outputs = [out async for out, _ in stream]
        return before, outputs[-1]

    before, last = asyncio.run(scenario())
    assert last.finished and last.outputs[0].finish_reason == "stop" and last.outputs[0].stop_reason == "Lily"
    assert "Lily" not in last.outputs[0].text
    stats = wait_for(lambda: (s := asyncio.run(async_llm.get_stats())).num_running == 0 and s)
    assert stats and stats.kv_num_used_blocks == 0
    assert asyncio.run(async_llm.call_utility("has_unfinished_requests")) is False
    # The stop string ended the sequence in the core too (it ran a few steps past it, not to max_tokens).
    after = asyncio.run(async_llm.call_utility("stats"))
    finished_by = {k: after["num_requests_finished"].get(k, 0) - before["num_requests_finished"].get(k, 0)
                   for k in ("stop", "length", "abort")}
    assert finished_by == {"stop": 1, "length": 0, "abort": 0}
    assert len(last.outputs[0].token_ids) <= after["generation_tokens_total"] - before["generation_tokens_total"] < 300


def test_a_killed_core_process_is_seen_at_once(async_llm):
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def scenario():
        stream = await async_llm.add_request("victim", "Once upon a time", params)
        async for out, _ in stream:
            if len(out.outputs[0].token_ids) >= 3:
                os.kill(async_llm.core_pid, signal.SIGKILL)
                killed = time.monotonic()
                break
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            async for _ in stream:
                pass
        return time.monotonic() - killed

    seen_after = asyncio.run(scenario())
    assert seen_after < 2.0
    assert async_llm.ended.is_set() and async_llm.has_failed and not async_llm.is_healthy
    assert "killed by SIGKILL" in async_llm.dead_reason
    with pytest.raises(EngineDeadError):
        asyncio.run(async_llm.add_request("late", "Once upon a time", params))


def _run_script(tmp_path: Path, body: str, env: dict | None = None) -> subprocess.Popen:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def _is_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
def test_the_core_exits_when_the_server_process_is_killed(stories_path, tmp_path):
    proc = _run_script(tmp_path, f"""
        import time
        from minillm.config import EngineConfig
        from minillm.server.async_llm import AsyncLLM

        if __name__ == "__main__":
            engine = AsyncLLM(EngineConfig(model={str(stories_path)!r}, device="cpu"))
            print(engine.core_pid, flush=True)
            time.sleep(600)
        """)
    try:
        core_pid = int(proc.stdout.readline())
        assert not _is_gone(core_pid)
        proc.kill()
        proc.wait()
        assert wait_for(lambda: _is_gone(core_pid), timeout=30), "the engine core outlived the server process"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cuda_is_touched_in_the_core_process_only(stories_path, tmp_path):
    # A stand-in CuPy that notes which processes import it (and has no GPU, so the core picks the CPU).
    fake = tmp_path / "fake" / "cupy"
    fake.mkdir(parents=True)
    imports = tmp_path / "cupy-imports"
    (fake / "__init__.py").write_text(f"import os\nwith open({str(imports)!r}, 'a') as f:\n"
                                      "    f.write(f'{os.getpid()}\\n')\n")
    proc = _run_script(tmp_path, f"""
        import os, sys
        from minillm.config import EngineConfig
        from minillm.server.async_llm import AsyncLLM

        if __name__ == "__main__":
            engine = AsyncLLM(EngineConfig(model={str(stories_path)!r}, device="auto"))
            print(os.getpid(), engine.core_pid, "cupy" in sys.modules, engine.startup_stats.device, flush=True)
            engine.shutdown()
        """, env={"PYTHONPATH": f"{fake.parent}{os.pathsep}{REPO}"})
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    server_pid, core_pid, imported_here, device = out.split()
    assert imported_here == "False" and device == "numpy"
    assert imports.read_text().split() == [core_pid]    # the core probed for a GPU; the server never did
    assert server_pid != core_pid


def test_prompt_block_keys_sent_with_a_request_serve_its_prefix_lookup(config):
    """An AddRequest's prompt_block_keys are what the core's prefix cache looks the prompt up by;
    keys of the wrong shape, or for a prompt the core truncates, are ignored and it hashes itself."""
    from minillm.block_manager import prompt_block_keys
    core = EngineCore(config)
    engine, bs = core.engine, core.engine.block_manager.block_size
    prompt = [(7 * i) % 200 + 3 for i in range(4 * bs + 1)]
    params = {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}

    def cached_tokens(request_id, ids, keys, **extra):
        assert core.add_request(m.AddRequest(request_id, ids, {**params, **extra}, time.time(), 0, keys)) is None
        seq = engine.requests[request_id].seqs[0]
        while engine.has_unfinished_requests():
            engine.step()
        return seq.num_cached_tokens

    assert cached_tokens("first", prompt, prompt_block_keys(prompt, bs)) == 0
    assert cached_tokens("same", prompt, prompt_block_keys(prompt, bs)) == 4 * bs
    other = [t + 1 for t in prompt]
    # The core trusts the API server's keys: another prompt's keys find that prompt's blocks.
    assert cached_tokens("trusted", other, prompt_block_keys(prompt, bs)) == 4 * bs
    assert cached_tokens("short", other, prompt_block_keys(prompt, bs)[:2]) == 0
    assert cached_tokens("truncated", [1] + other, prompt_block_keys([1] + prompt, bs),
                         truncate_prompt_tokens=len(other)) == 4 * bs   # hashed again: `other` is cached now


SUMMARY_FIELDS = ("num_running", "num_waiting", "num_preempted", "num_preemptions", "kv_num_blocks",
                  "kv_num_used_blocks", "kv_num_free_blocks", "kv_num_cached_blocks", "kv_usage",
                  "prefix_cache_queries", "prefix_cache_hits", "num_steps", "prompt_tokens_total",
                  "generation_tokens_total", "num_requests_finished")


def test_a_summary_snapshot_has_the_counters_of_a_full_one_without_its_rows(config):
    # The throughput log and /metrics read counters; a full snapshot (a row per request, a cell per KV
    # block) cost the core about 5 ms between two steps at 256 requests, a step every stream waited for.
    engine = LLMEngine(config, log=lambda _: None)
    for i in range(6):
        engine.add_request(f"r{i}", "Once upon a time", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(4):
        engine.step()
    full, summary = engine.stats(FULL_RESOLUTION), engine.stats(1, summary=True)
    assert not full.is_summary and summary.is_summary
    assert {f: getattr(summary, f) for f in SUMMARY_FIELDS} == {f: getattr(full, f) for f in SUMMARY_FIELDS}
    assert full.num_running == 6 and len(full.requests) == 6 and full.block_map and full.kv_token_utilization
    assert (summary.requests, summary.block_map, summary.recent_steps) == ([], [], [])
    assert summary.kv_token_utilization is None and summary.itl_p50_s is None


def test_the_core_process_sends_a_summary_with_the_counters_of_a_full_snapshot(async_llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def scenario():
        stream = await async_llm.add_request("s", "Once upon a time", params)
        [out async for out, _ in stream]
        return await async_llm.get_summary_stats(), await async_llm.get_full_stats()

    summary, full = asyncio.run(scenario())     # nothing runs between the two: the same counts
    assert summary.is_summary and (summary.block_map, summary.requests) == ([], [])
    assert not full.is_summary and len(full.block_map) == full.kv_num_blocks
    assert {f: getattr(summary, f) for f in SUMMARY_FIELDS} == {f: getattr(full, f) for f in SUMMARY_FIELDS}
    assert summary.generation_tokens_total >= 8 and summary.num_requests_finished.get("length") == 1
