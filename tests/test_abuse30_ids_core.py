"""Request ids on an engine core shared by several API servers (--api-server-count): an abort or a
stop string from one server touches only that server's request of the id, and an id one server
aborts is free at once for another, each server getting only its own request's reports."""
from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time

import pytest
import zmq
from core_hooks import install

from minillm.config import EngineConfig
from minillm.engine_core import messages as m
from minillm.engine_core.client import CoreProcess
from minillm.engine_core.core import CoreSpec, EngineCore, EngineCoreProc, _connect
from minillm.sampling_params import SamplingParams
from minillm.server.async_llm import AsyncLLM

LONG = {"max_tokens": 300, "temperature": 0.0, "ignore_eos": True}
SHORT = {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def config(stories_path):
    return EngineConfig(model=str(stories_path), device="cpu")


class TwoClients:
    """An EngineCoreProc for two API servers on this thread, its sockets over inproc; `presences` holds
    the write end of each server's presence pipe (closing one is that server's process ending)."""

    def __init__(self, config):
        self.ctx = zmq.Context()
        self.commands = self.ctx.socket(zmq.PUSH)
        self.commands.bind("inproc://commands")
        self.outputs = [self.ctx.socket(zmq.PULL) for _ in range(2)]
        for i, sock in enumerate(self.outputs):
            sock.bind(f"inproc://outputs-{i}")
        self.parent_end, self.child_end = multiprocessing.Pipe(duplex=False)
        pipes = [multiprocessing.Pipe(duplex=False) for _ in range(2)]
        self.presences = [writer for _, writer in pipes]
        spec = CoreSpec(config, ["inproc://commands"], ["inproc://outputs-0", "inproc://outputs-1"], self.parent_end,
                        presence_pipes=[reader for reader, _ in pipes])
        input_sock, output_socks = _connect(self.ctx, spec)
        self.input_sock = input_sock
        self.core = EngineCore(config, log=lambda _: None)
        self.proc = EngineCoreProc(self.core, spec, input_sock, output_socks)
        self.encoder, self.decoder = m.encoder(), m.up_decoder()
        self.ids = self.core.engine.tokenizer.encode("Once upon a time", add_special_tokens=True)

    def send(self, *commands) -> None:
        """Send commands and run the core once they have all arrived (their batch, then a step)."""
        for command in commands:
            self.commands.send(self.encoder.encode(command))
        assert self.input_sock.poll(30_000), "the commands never reached the core's socket"
        assert self.proc.run_once()

    def step(self) -> None:
        assert self.proc.run_once()

    def take(self, client: int) -> list:
        """Every message sent to a client so far."""
        got = []
        while self.outputs[client].poll(0):
            got.append(self.decoder.decode(self.outputs[client].recv()))
        return got

    def reports(self, client: int) -> list:
        """(request id, its sequence's new tokens, finish reason, finished) of each report sent to a client."""
        return [(out.request_id, list(out.seqs[0].new_token_ids), out.seqs[0].finish_reason, out.finished)
                for message in self.take(client) if isinstance(message, m.StepOutputs) for out in message.outputs]

    def close(self) -> None:
        self.core.engine.shutdown()
        self.ctx.destroy(linger=0)


@pytest.fixture
def two(config):
    cores = TwoClients(config)
    yield cores
    cores.close()


def _add(two: TwoClients, request_id: str, client: int, fields: dict) -> m.AddRequest:
    return m.AddRequest(request_id, two.ids, dict(fields), time.time(), client)


def _live(two: TwoClients) -> list[str]:
    return sorted(req.request_id for req in two.core.engine.requests.values() if not req.is_finished)


def test_an_abort_from_another_api_server_leaves_the_request_alone(two):
    two.send(_add(two, "x", 0, LONG))
    two.step()
    two.take(0)
    two.send(m.AbortRequests(["x"], client_index=1))          # the other server's late abort of an id it had
    assert _live(two) == ["x"]
    assert two.core.engine.metrics.finished["abort"] == 0
    [(rid, new, reason, finished)] = two.reports(0)
    assert (rid, len(new), reason, finished) == ("x", 1, None, False)
    two.send(m.AbortRequests(["x"], client_index=0))           # its own server's abort
    assert _live(two) == [] and two.reports(0)[-1][2:] == ("abort", True)
    assert two.reports(1) == []


def test_a_stop_string_from_another_api_server_leaves_the_request_alone(two):
    two.send(_add(two, "x", 0, LONG))
    two.send(m.StopSequences([("x", 0, "Lily")], client_index=1))
    assert _live(two) == ["x"]
    two.send(m.StopSequences([("x", 0, "Lily")], client_index=0))
    assert _live(two) == []
    assert two.reports(0)[-1][2:] == ("stop", True)


def test_an_id_one_server_aborted_is_taken_at_once_by_another_and_each_gets_its_own_reports(two):
    two.send(_add(two, "x", 0, LONG))
    two.step()
    two.take(0)
    two.send(m.AbortRequests(["x"], client_index=0), _add(two, "x", 1, SHORT))
    first = two.take(1)
    assert [msg.results for msg in first if isinstance(msg, m.AddResults)] == [[("x", None)]]   # the id was free
    assert two.reports(0) == [("x", [], "abort", True)]        # the aborted one's last report, to its server
    while _live(two):
        two.step()
    got = [(out.request_id, list(out.seqs[0].new_token_ids), out.seqs[0].finish_reason, out.finished)
           for msg in first if isinstance(msg, m.StepOutputs) for out in msg.outputs] + two.reports(1)
    assert {r[0] for r in got} == {"x"}
    assert [r[3] for r in got] == [False] * (len(got) - 1) + [True] and got[-1][2] == "length"
    assert sum(len(r[1]) for r in got) == SHORT["max_tokens"]
    assert two.reports(0) == [] and not two.proc.client_of
    # The later server's request is its own: the first server's abort of the id touches nothing now.
    two.send(_add(two, "y", 1, LONG))
    two.send(m.AbortRequests(["y"], client_index=0))
    assert _live(two) == ["y"]


# ---- two AsyncLLMs on one core process ------------------------------------------------------------

@contextlib.contextmanager
def two_async_llms(config):
    core = CoreProcess(config, 2, install)
    engines = [AsyncLLM(config, link=link) for link in core.links]
    try:
        yield engines
    finally:
        for engine in engines:
            engine.shutdown()
        core.stop()
        core.close()


def test_an_async_llm_aborts_only_its_own_request_of_an_id(config):
    async def scenario(first, second):
        await first.call_utility("pace_steps", 0.05)     # 300 tokens take 15 seconds at least
        params = SamplingParams(**LONG)
        outputs = first.generate("Once upon a time", params, "shared")
        seen = await anext(outputs)
        second.abort("shared")                            # an id the second never had
        aborted = await second.call_utility("aborted_requests")   # after its abort, on its own socket
        first.abort("shared")
        last = [out async for out in outputs][-1] if not seen.finished else seen
        await first.call_utility("pace_steps", 0)
        return aborted, last, await first.call_utility("aborted_requests")

    with two_async_llms(config) as (first, second):
        aborted, last, later = asyncio.run(asyncio.wait_for(scenario(first, second), 120))
    assert aborted == []
    assert last.outputs[0].finish_reason == "abort"
    assert [entry[0] for entry in later] == ["shared"]
