"""`minillm serve --api-server-count N` ended as operators end it: killed outright, or Ctrl-C twice; and
the grammar process's shared masks when the engine core is killed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_abuse20_deploy import MODEL, Serve, is_gone, serve_command
from test_abuse33_lifecycle import BodyStream, GroupServe
from test_server_helpers import sse_events, wait_for


@pytest.fixture
def serve_multi(tmp_path):
    """Start a `minillm serve` (a Serve, or a GroupServe leading a process group when group is true); the
    processes it names are killed at the end if still running (its API servers lead process groups of
    their own, so a kill of its group misses them)."""
    started: list[Serve] = []

    def start(command: list[str], group: bool = False) -> Serve:
        started.append((GroupServe if group else Serve)(command, tmp_path))
        return started[-1]
    yield start
    for server in started:
        server.stop()
        for pid in named_pids(server):
            if not is_gone(pid):
                os.kill(pid, signal.SIGKILL)


def named_pids(server: Serve) -> list[int]:
    """The engine core's and the API servers' process ids, as the server printed them."""
    return [int(line.rsplit(" ", 1)[1]) for line in server.text().splitlines()
            if line.startswith(("minillm: engine core in process", "minillm: API server "))]


def test_a_sigkill_to_the_supervisor_of_several_api_servers_leaves_no_metrics_directory(stories_path, serve_multi):
    # The supervisor made the API servers' Prometheus directory and alone removed it: killed outright,
    # it left a minillm-metrics-* directory in $TMPDIR after its API servers and core had gone.
    server = serve_multi(serve_command(stories_path, "--api-server-count", "2"))
    url = server.wait_line(r"Uvicorn running on (http://\S+)").group(1)
    assert httpx.get(f"{url}/metrics", timeout=30).status_code == 200
    pids = named_pids(server)
    assert len(pids) == 3, server.text()
    server.proc.kill()
    server.proc.wait()
    assert wait_for(lambda: all(is_gone(pid) for pid in pids), timeout=60), "an API server or the core went on"
    assert wait_for(lambda: server.leftovers() == [], timeout=30), server.leftovers()


# A serve whose engine takes 0.25 s a step: a stream of 480 tokens lasts two minutes.
PACED_SERVE = """
import sys, time
import minillm.engine

real_step = minillm.engine.LLMEngine.step

def paced_step(self, *args, **kwargs):
    started = time.perf_counter()
    outputs = real_step(self, *args, **kwargs)
    time.sleep(max(0.0, 0.25 - (time.perf_counter() - started)))
    return outputs

minillm.engine.LLMEngine.step = paced_step

if __name__ == "__main__":
    from minillm.cli import main
    main(sys.argv[1:])
"""


def paced_command(tmp_path: Path, stories_path: Path, *args: str) -> list[str]:
    """`minillm serve` whose engine core takes 0.25 s a step."""
    script = tmp_path / "paced_serve.py"
    script.write_text(PACED_SERVE)
    return [sys.executable, str(script), *serve_command(stories_path, *args)[3:]]


def test_a_second_ctrl_c_forces_the_exit_of_several_api_servers(stories_path, serve_multi, tmp_path):
    # The supervisor passed every signal on as SIGTERM, which uvicorn never takes as forcing: a second
    # Ctrl-C left the streams running for the whole --timeout-graceful-shutdown (one server ends them).
    server = serve_multi(paced_command(tmp_path, stories_path, "--api-server-count", "2",
                                       "--timeout-graceful-shutdown", "600"))
    url = server.wait_line(r"Uvicorn running on (http://\S+)").group(1)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": True}
    streams = [BodyStream(url, body) for _ in range(4)]
    assert all(stream.first.wait(60) for stream in streams), server.text()
    server.proc.send_signal(signal.SIGINT)
    server.wait_line(r"Shutting down")
    server.proc.send_signal(signal.SIGINT)
    try:
        assert server.proc.wait(timeout=30) == 0, server.text()
    except subprocess.TimeoutExpired:
        raise AssertionError(f"a second Ctrl-C did not force the exit:\n{server.text()}") from None
    for stream in streams:
        stream.join(30)
        assert not stream.is_alive() and stream.lines[-2:] == ["data: [DONE]", ""], stream.lines[-3:]
        last = sse_events(stream.lines)[-1]
        assert "shut down" in last["error"]["message"], last
    assert "Traceback" not in server.text() and "ERROR" not in server.text(), server.text()
    assert server.leftovers() == []


def shared_segments(pid: int) -> set[str]:
    """The /dev/shm files that process `pid` has mapped."""
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split(None, 5)[5].strip() for line in maps if " /dev/shm/" in line}


def test_a_killed_engine_core_leaves_its_grammar_masks_quietly(stories_path, serve_multi):
    # The core's resource tracker removed the masks' shared segment once the core was killed, and said
    # "There appear to be 1 leaked shared_memory objects to clean up at shutdown".
    server = serve_multi(serve_command(stories_path, "--grammar-process"))
    core_pid = int(server.wait_line(r"engine core in process (\d+)").group(1))
    url = server.wait_line(r"Uvicorn running on (http://\S+)").group(1)
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 5, "structured_outputs": {"regex": "[a-z]{5}"}}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    segments = shared_segments(core_pid)
    os.kill(core_pid, signal.SIGKILL)
    assert server.proc.wait(timeout=60) == 1, server.text()
    assert wait_for(lambda: not any(os.path.exists(path) for path in segments), timeout=30), segments
    assert "leaked" not in server.text() and "resource_tracker" not in server.text(), server.text()


def test_a_sigkill_to_the_whole_group_leaves_no_grammar_masks(stories_path, serve_multi):
    # The masks were a named shared-memory segment that only the engine, or its resource tracker, removed:
    # with the whole group killed (a supervisor's SIGKILL after its stop timeout) it stayed in /dev/shm.
    server = serve_multi(serve_command(stories_path, "--grammar-process"), group=True)
    core_pid = int(server.wait_line(r"engine core in process (\d+)").group(1))
    url = server.wait_line(r"Uvicorn running on (http://\S+)").group(1)
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 5, "structured_outputs": {"regex": "[a-z]{5}"}}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    segments = shared_segments(core_pid)
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait()
    assert wait_for(lambda: not server.members(), timeout=30), f"left running: {server.members()}"
    assert not [path for path in segments if os.path.exists(path)], segments


def test_an_engine_core_that_cannot_start_leaves_no_metrics_directory(tmp_path, monkeypatch):
    # The supervisor made the directory (and bound the port) before starting the core, and let go of
    # neither when the start failed (a fork refused under a process limit, say).
    import tempfile

    from minillm.engine_core import client
    from minillm.server.app import ServerOptions, run_api_servers

    def cannot_start(*args):
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "")
    monkeypatch.setattr(client, "CoreProcess", cannot_start)
    with pytest.raises(OSError, match="Resource temporarily unavailable"):
        run_api_servers(None, "127.0.0.1", 0, ServerOptions(api_server_count=2))
    assert os.listdir(tmp_path) == []
