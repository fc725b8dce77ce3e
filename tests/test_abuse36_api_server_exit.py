"""An API server of several that dies (a crash, SIGKILL): the engine core aborts its requests at once,
counted as aborted, and the other servers' requests go on; under `minillm serve` the supervisor then
stops the whole server, as vLLM's does, giving the others' open requests the stop's graceful time."""
from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from core_hooks import install
from test_abuse30_ids_core import TwoClients, _add, _live
from test_server_failure import REPO
from test_server_helpers import call_utility, get_stats, listening_address, sse_events, started_url, wait_for

from minillm.config import EngineConfig
from minillm.engine_core import messages as m
from minillm.server.app import ServerOptions, ServerThread, create_app

MODEL = "stories"
PACE_S = 0.02       # a step lasts at least this long: a request of GHOST_TOKENS outlives the test's checks by seconds
GHOST_TOKENS = 400


def paced_core(engine) -> None:
    """A core hook: core_hooks' utilities, and every step paced from the start."""
    install(engine)
    engine.pace_steps(PACE_S)


class _Stream(threading.Thread):
    """A streamed completion read on a thread; `first` is set once its first event is in, `cut` once its
    connection broke before the end."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.lines: list[str] = []
        self.first, self.cut = threading.Event(), False
        self.start()

    def run(self) -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": self.max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    self.lines.append(line)
                    self.first.set()
        except httpx.HTTPError:
            self.cut = True
        self.first.set()

    def finished_by_length(self) -> bool:
        """Whether the stream ran to max_tokens and closed with [DONE]."""
        events = sse_events(self.lines)
        return (not self.cut and [line for line in self.lines if line][-1] == "data: [DONE]"
                and events[-1]["choices"][0]["finish_reason"] == "length")


def test_the_core_aborts_only_a_gone_servers_requests_and_refuses_its_late_adds(stories_path):
    core = TwoClients(EngineConfig(model=str(stories_path), device="cpu"))
    ghost = {"max_tokens": GHOST_TOKENS, "temperature": 0.0, "ignore_eos": True}
    try:
        for request_id, client in (("a", 0), ("b", 1), ("c", 1)):
            core.send(_add(core, request_id, client, ghost))
        assert _live(core) == ["a", "b", "c"]
        core.presences[1].close()           # its process is gone
        assert core.proc.run_once()
        assert _live(core) == ["a"]
        assert core.proc.snapshot(summary=True)[0].num_requests_finished == {"abort": 2}
        core.take(0)
        core.send(_add(core, "d", 1, ghost))  # sent before it went, read after: nobody would read its outputs
        assert _live(core) == ["a"]
        assert core.proc.run_once()
        reports = [out for message in core.take(0) if isinstance(message, m.StepOutputs) for out in message.outputs]
        assert reports and {out.request_id for out in reports} == {"a"} and not any(out.finished for out in reports)
    finally:
        core.close()


def _second_api_server(config: EngineConfig, link, conn) -> None:
    """An API server process of its own on `link`: it sends its URL down conn and serves until killed."""
    from minillm.server.async_llm import AsyncLLM
    engine = AsyncLLM(config, link=link)
    server = ServerThread(create_app(engine, ServerOptions(served_model_name=MODEL))).start()
    conn.send(server.url)
    threading.Event().wait()


@pytest.fixture
def core_with_a_killable_server(stories_path):
    """A core for two API servers: the first in this process, the second in a process of its own.
    Yields (first's url, first's engine, second's url, second's process)."""
    from minillm.engine_core.client import CoreProcess
    from minillm.server.async_llm import AsyncLLM
    config = EngineConfig(model=str(stories_path), device="cpu")
    core = CoreProcess(config, 2, install)
    spawn = mp.get_context("spawn")
    reader, writer = spawn.Pipe(duplex=False)
    second = spawn.Process(target=_second_api_server, args=(config, core.links[1], writer), daemon=True)
    second.start()
    core.links[1].hand_over()
    writer.close()
    engine = AsyncLLM(config, link=core.links[0])
    server = ServerThread(create_app(engine, ServerOptions(served_model_name=MODEL))).start()
    try:
        assert reader.poll(120), "the second API server did not start"
        yield server.url, engine, reader.recv(), second
    finally:
        second.kill()
        second.join(30)
        server.stop()
        engine.shutdown()
        core.stop()
        core.close()


def test_a_killed_api_servers_requests_are_aborted_in_the_core_and_the_others_go_on(core_with_a_killable_server):
    url, engine, second_url, second = core_with_a_killable_server
    call_utility(engine, "pace_steps", PACE_S)
    ghosts = [_Stream(second_url, GHOST_TOKENS) for _ in range(4)]
    assert all(stream.first.wait(60) for stream in ghosts)
    survivor = _Stream(url, 60)
    assert survivor.first.wait(60)
    assert get_stats(url)["num_running"] == 5
    os.kill(second.pid, signal.SIGKILL)
    # Aborted in the core, where nobody else could count them: no ghost runs on to max_tokens.
    stats = wait_for(lambda: (s := get_stats(url))["num_requests_finished"].get("abort") == 4 and s, timeout=30)
    assert stats, get_stats(url)
    assert stats["num_running"] <= 1 and not stats["num_requests_finished"].get("length", 0) > 1, stats
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert re.search(r'minillm:request_success_total\{finished_reason="abort",model_name="stories"\} 4\.0', metrics)
    survivor.join(60)
    assert survivor.finished_by_length(), survivor.lines[-3:]
    idle = wait_for(lambda: (s := get_stats(url))["num_running"] == 0 and s["kv_usage"] == 0 and s)
    assert idle, get_stats(url)
    assert idle["num_requests_finished"] == {"abort": 4, "length": 1}


SERVE = """
import sys
from minillm.config import EngineConfig
from minillm.server.app import ServerOptions, run_server
from test_abuse36_api_server_exit import paced_core

if __name__ == "__main__":
    sys.exit(run_server(EngineConfig(model=sys.argv[1], device="cpu"), port=0, options=ServerOptions(
        api_server_count=2, served_model_name="stories", timeout_graceful_shutdown=60, log_interval=None),
        core_hook=paced_core))
"""


def test_serve_stops_every_api_server_when_one_dies_and_the_core_aborts_the_dead_ones_requests(stories_path, tmp_path):
    log = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", SERVE, str(stories_path)], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        url = started_url(proc, log, timeout=120)
        victim = int(re.search(r"API server 1 in process (\d+)", log.read_text()).group(1))
        # The log's URL is the first server's: the connections wait until the victim listens too.
        assert wait_for(lambda: listening_address(victim), timeout=120), log.read_text()
        # Sixteen connections: the kernel puts some on each server (all on one: 1 in 32,768).
        streams = [_Stream(url, 250) for _ in range(16)]
        assert all(stream.first.wait(60) for stream in streams)
        os.kill(victim, signal.SIGKILL)
        for stream in streams:
            stream.join(120)
            assert not stream.is_alive()
        cut = [stream for stream in streams if stream.cut]
        assert cut and len(cut) < len(streams)
        # The others ran to the end in the stop's graceful time: the ghosts did not hold them up.
        assert all(stream.finished_by_length() for stream in streams if not stream.cut)
        assert proc.wait(timeout=120) == 1, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "an API server ended (minillm-api-server-1: killed by SIGKILL); stopping the others" in text, text
    assert f"API server 1 is gone; aborted its {len(cut)} request(s)" in text, text
    assert "exit status 1: minillm-api-server-1 killed by SIGKILL\n" in text, text
