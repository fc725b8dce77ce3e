"""`minillm serve` stopped and started as service managers do it: a SIGTERM to the whole process group
(systemd's default KillMode=control-group, `kill -TERM -PGID`, supervisord's stopasgroup)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from test_abuse20_deploy import MODEL, REPO, SLOW_LOAD_SERVE, Serve, is_gone, serve_command
from test_server_helpers import sse_events, wait_for


class GroupServe(Serve):
    """A `minillm serve` process leading a process group of its own (its children join it), as a
    service manager starts it."""

    def __init__(self, command: list[str], tmp_path: Path) -> None:
        self.tmp = tmp_path / "tmp"
        self.tmp.mkdir()
        env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(self.tmp)}
        self.proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def members(self) -> list[int]:
        """The live processes of its group (zombies left for an init that never reaps them do not count)."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                state, _, pgrp = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:3]
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(pgrp) == self.proc.pid and state not in ("Z", "X"):
                found.append(int(entry.name))
        return found

    def stop(self) -> None:
        """Kill the whole group if the test left any of it running."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


@pytest.fixture
def group_serve(tmp_path):
    started: list[GroupServe] = []

    def start(command: list[str]) -> GroupServe:
        started.append(GroupServe(command, tmp_path))
        return started[-1]
    yield start
    for server in started:
        server.stop()


class BodyStream(threading.Thread):
    """A streamed completion of `body` read on a thread; `first` is set once its first event is in."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.lines, self.first = url, body, [], threading.Event()
        self.start()

    def run(self) -> None:
        with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body, timeout=60) as r:
            for line in r.iter_lines():
                self.lines.append(line)
                self.first.set()


# ---- SIGTERM to the whole process group --------------------------------------------------------------

@pytest.mark.parametrize("options, constraint", [
    (("--tensor-parallel-size", "2"), {"ignore_eos": True}),
    (("--grammar-process",), {"structured_outputs": {"regex": "[a-z ]{300,}"}}),
], ids=["tensor-parallel-workers", "grammar-process"])
def test_a_sigterm_to_the_whole_group_lets_open_streams_finish(stories_path, group_serve, options, constraint):
    # The engine core ignores SIGTERM (the API server stops it), but the processes it starts did not:
    # a tensor-parallel worker died at once, the engine with it, and every open stream ended with
    # EngineDeadError, the server with status 1 and a traceback; a grammar process died, and every
    # constrained stream ended with finish_reason "error".
    server = group_serve(serve_command(stories_path, "--timeout-graceful-shutdown", "300", *options))
    url = server.wait_line(r"Uvicorn running on (http://\S+)").group(1)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "stream": True, **constraint}
    streams = [BodyStream(url, body) for _ in range(3)]
    assert all(stream.first.wait(60) for stream in streams), server.text()
    os.killpg(server.proc.pid, signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0, server.text()
    for stream in streams:
        stream.join(30)
        assert not stream.is_alive() and stream.lines[-2:] == ["data: [DONE]", ""], stream.lines[-3:]
        last = sse_events(stream.lines)[-1]
        assert "error" not in last and last["choices"][0]["finish_reason"] == "length", last
    assert "Traceback" not in server.text(), server.text()
    assert wait_for(lambda: not server.members(), timeout=30), f"left running: {server.members()}"
    assert server.leftovers() == []


# ---- the model load, cut short -----------------------------------------------------------------------

def slow_load_command(tmp_path: Path, stories_path: Path, *args: str) -> tuple[list[str], Path]:
    """`minillm serve` whose engine core's model load waits until the returned file exists (60 s at most)."""
    script, go = tmp_path / "slow_serve.py", tmp_path / "go"
    script.write_text(SLOW_LOAD_SERVE)
    return [sys.executable, str(script), str(go), *serve_command(stories_path, *args)[3:]], go


def test_an_engine_core_whose_server_is_killed_during_the_model_load_stops_loading(stories_path, group_serve, tmp_path):
    # The core looked for its server only once serving: killed outright while the model loaded (by the
    # OOM killer, or a supervisor's SIGKILL), the server left its core loading, for minutes with a large
    # model, holding the device's memory that the restarted server then needs.
    command, go = slow_load_command(tmp_path, stories_path)
    server = group_serve(command)
    core_pid = int(server.wait_line(r"minillm-test: loading in process (\d+)").group(1))
    server.proc.kill()
    server.proc.wait()
    try:
        assert wait_for(lambda: is_gone(core_pid), timeout=30), "the engine core went on loading"
        assert wait_for(lambda: server.leftovers() == [], timeout=30), server.leftovers()
    finally:
        go.touch()
    assert "Traceback" not in server.text(), server.text()


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_several_api_servers_stopped_during_the_model_load_stop_at_once(stories_path, group_serve, tmp_path, stop):
    # The API servers took a SIGTERM while they waited for the core as a note for later: the stop came
    # once the model had loaded, after the servers had started serving. A supervisor's stop during a
    # long load hung until its own timeout, then killed everything (--api-server-count 1 stops at once).
    command, go = slow_load_command(tmp_path, stories_path, "--api-server-count", "2")
    server = group_serve(command)
    core_pid = int(server.wait_line(r"minillm-test: loading in process (\d+)").group(1))
    server.wait_line(r"API server 1 in process \d+")
    os.killpg(server.proc.pid, stop)        # a terminal's Ctrl-C reaches the whole group
    try:
        assert server.proc.wait(timeout=30) == 0, server.text()
        assert wait_for(lambda: is_gone(core_pid), timeout=30), "the engine core went on loading"
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running:\n{server.text()}") from None
    finally:
        go.touch()
    assert "minillm: stopped while the model loaded" in server.text(), server.text()
    assert "Uvicorn running" not in server.text() and "Traceback" not in server.text(), server.text()
    assert wait_for(lambda: not server.members(), timeout=30), f"left running: {server.members()}"
    assert server.leftovers() == []


# ---- vLLM's --shutdown-timeout ------------------------------------------------------------------------


def _streams_then_sigterm(server, max_tokens: int) -> list:
    """Three streams open on the server once each has its first event, then a SIGTERM to it, which
    exits with status 0."""
    url = server.wait_line(r"Uvicorn running on (http://\S+)").group(1)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    streams = [BodyStream(url, body) for _ in range(3)]
    assert all(stream.first.wait(60) for stream in streams), server.text()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0, server.text()
    return streams

def test_vllms_shutdown_timeout_gives_open_streams_that_long(stories_path, group_serve):
    # vLLM's Kubernetes guide (and KServe's, llm-d's) runs `vllm serve ... --shutdown-timeout 45`:
    # minillm refused the flag, so such a deployment never started.
    server = group_serve(serve_command(stories_path, "--shutdown-timeout", "300"))
    streams = _streams_then_sigterm(server, max_tokens=400)
    for stream in streams:
        stream.join(30)
        assert not stream.is_alive() and stream.lines[-2:] == ["data: [DONE]", ""], stream.lines[-3:]
        assert sse_events(stream.lines)[-1]["choices"][0]["finish_reason"] == "length"


def test_shutdown_timeout_0_ends_open_streams_at_once_with_the_shutdown_error(stories_path, group_serve):
    # vLLM's default: a SIGTERM aborts the requests in flight. Each stream still ends with an error
    # event and [DONE], never cut.
    server = group_serve(serve_command(stories_path, "--shutdown-timeout", "0"))
    streams = _streams_then_sigterm(server, max_tokens=480)
    ended_by_error = 0
    for stream in streams:
        stream.join(30)
        assert not stream.is_alive() and stream.lines[-2:] == ["data: [DONE]", ""], stream.lines[-3:]
        last = sse_events(stream.lines)[-1]
        if "error" in last:
            assert "shut down" in last["error"]["message"], last
            ended_by_error += 1
    assert ended_by_error, "every stream finished before the stop: the test needs longer streams"
    assert "Traceback" not in server.text() and "Cancel" not in server.text(), server.text()


def test_shutdown_timeout_and_timeout_graceful_shutdown_that_disagree_are_a_usage_error(stories_path):
    result = subprocess.run(serve_command(stories_path, "--shutdown-timeout", "30", "--timeout-graceful-shutdown",
                                          "10"), cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "--shutdown-timeout and --timeout-graceful-shutdown disagree" in result.stderr, result.stderr
