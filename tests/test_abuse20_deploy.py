"""Deploying and running `minillm serve` as operators run `vllm serve`: signals, child processes,
what is left on disk, the lines that say where the server listens."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_server_helpers import running_server, sse_events, wait_for

REPO = Path(__file__).resolve().parents[1]
MODEL = "stories"
STREAM_BODY = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}

# The engine core's model load waits here until the test lets it go (its process runs this module
# again as __mp_main__, so the patch is in place there too).
SLOW_LOAD_SERVE = """
import os, sys, time
import minillm.engine

real_init = minillm.engine.LLMEngine.__init__

def slow_init(self, *args, **kwargs):
    print(f"minillm-test: loading in process {os.getpid()}", file=sys.stderr, flush=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
        time.sleep(0.05)
    real_init(self, *args, **kwargs)

minillm.engine.LLMEngine.__init__ = slow_init

if __name__ == "__main__":
    from minillm.cli import main
    main(sys.argv[2:])
"""


class Serve:
    """A `minillm serve` process whose stdout and stderr are read line by line on a thread."""

    def __init__(self, command: list[str], tmp_path: Path) -> None:
        # Its temporary files (the engine core's socket directory) go under tmp_path, to be counted.
        self.tmp = tmp_path / "tmp"
        self.tmp.mkdir()
        env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(self.tmp)}
        self.proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.lines: list[str] = []
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line.rstrip("\n"))
                self.changed.notify_all()
        with self.changed:
            self.lines.append(None)     # end of output
            self.changed.notify_all()

    def wait_line(self, pattern: str, timeout: float = 120) -> re.Match:
        """The first output line matching pattern; fails once the output ends or timeout passes."""
        deadline = time.monotonic() + timeout
        with self.changed:
            seen = 0
            while True:
                for line in self.lines[seen:]:
                    if line is None:
                        raise AssertionError(f"no line matched {pattern!r}:\n{self.text()}")
                    found = re.search(pattern, line)
                    if found:
                        return found
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no line matched {pattern!r} within {timeout} s:\n{self.text()}")
                self.changed.wait(left)

    def text(self) -> str:
        """Everything printed so far."""
        return "\n".join(line for line in list(self.lines) if line is not None)

    def leftovers(self) -> list[str]:
        """What the server left in its temporary directory."""
        return sorted(p.name for p in self.tmp.iterdir())

    def stop(self) -> None:
        """Kill it if the test left it running."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def serve_command(model: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "minillm.cli", "serve", str(model), "--device", "cpu", "--port", "0",
            "--served-model-name", MODEL, *args]


def is_gone(pid: int) -> bool:
    """True when the process has exited (a zombie waiting for its parent counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


class Stream(threading.Thread):
    """A long streamed completion read on a thread; `first` is set once its first event is in."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.lines, self.first = url, [], threading.Event()
        self.start()

    def run(self) -> None:
        with httpx.stream("POST", f"{self.url}/v1/completions", json=STREAM_BODY, timeout=60) as r:
            for line in r.iter_lines():
                self.lines.append(line)
                self.first.set()


@pytest.fixture
def serve(tmp_path):
    started: list[Serve] = []

    def start(command: list[str]) -> Serve:
        started.append(Serve(command, tmp_path))
        return started[-1]
    yield start
    for server in started:
        server.stop()


@pytest.mark.parametrize("engine_core", ["process", "thread"])
def test_sigterm_during_streams_ends_them_and_exits_0_leaving_nothing_behind(stories_path, serve, engine_core):
    # uvicorn raises SIGTERM again once it has shut down: its default action killed the process
    # there (status -15), so the engine was never shut down and its socket directory stayed in /tmp.
    # A grace far past what the streams need on the busiest machine: they end whole, never by its timeout.
    server = serve(serve_command(stories_path, "--engine-core", engine_core, "--timeout-graceful-shutdown", "300"))
    url = server.wait_line(r"Uvicorn running on (http://\S+)").group(1)
    streams = [Stream(url) for _ in range(3)]
    assert all(stream.first.wait(60) for stream in streams), server.text()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0, server.text()
    for stream in streams:
        stream.join(30)
        assert not stream.is_alive() and stream.lines[-2:] == ["data: [DONE]", ""], stream.lines[-3:]
        assert "error" not in sse_events(stream.lines)[-1]
    assert server.leftovers() == []
    assert "Traceback" not in server.text()


def test_sigterm_while_the_model_loads_stops_the_core_and_removes_its_sockets(stories_path, serve, tmp_path):
    script, go = tmp_path / "slow_serve.py", tmp_path / "go"
    script.write_text(SLOW_LOAD_SERVE)
    server = serve([sys.executable, str(script), str(go), *serve_command(stories_path)[3:]])
    core_pid = int(server.wait_line(r"minillm-test: loading in process (\d+)").group(1))
    server.proc.send_signal(signal.SIGTERM)
    status = server.proc.wait(timeout=60)
    assert wait_for(lambda: is_gone(core_pid), timeout=30), "the engine core outlived its server"
    go.touch()
    # A supervisor's stop is no failure: status 0, as once serving (Ctrl-C there is status 130).
    assert status == 0 and server.text().splitlines()[-1] == "minillm: stopped by SIGTERM while the model loaded", \
        server.text()
    assert server.leftovers() == []
    assert "Traceback" not in server.text()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_several_api_servers_say_where_they_listen(stories_path, serve, host):
    # uvicorn logs its address only when it binds the socket itself; the API servers are handed
    # theirs, so with --port 0 nothing said which port to call.
    server = serve(serve_command(stories_path, "--api-server-count", "2", "--host", host))
    url = server.wait_line(r"Uvicorn running on (http://\S+)").group(1)
    assert re.fullmatch(r"http://(127\.0\.0\.1|\[::1\]):\d+", url) and not url.endswith(":0"), url
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0, server.text()
    assert server.text().count("Uvicorn running on") == 1, server.text()


def test_ping_answers_as_health_does_to_get_head_and_post_without_the_key(stories_path):
    # vLLM's /ping (SageMaker's health check) was a 404: a probe set up for vLLM restarted the server.
    with running_server(stories_path, api_key="sekrit", engine_core="process") as (url, engine):
        for method in ("GET", "HEAD", "POST"):
            response = httpx.request(method, f"{url}/ping", timeout=30)
            assert response.status_code == 200, (method, response.text)
        assert httpx.get(f"{url}/ping", timeout=30).json() == httpx.get(f"{url}/health", timeout=30).json()
        os.kill(engine.core_pid, signal.SIGKILL)
        assert wait_for(lambda: httpx.get(f"{url}/health", timeout=30).status_code == 503, timeout=30)
        for method in ("GET", "POST"):
            response = httpx.request(method, f"{url}/ping", timeout=30)
            assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead", response.text
