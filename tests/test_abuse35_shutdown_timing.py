"""How long a stop of several API servers takes, and what its closing line blames: one deadline for the
whole shutdown (vLLM's --shutdown-timeout), a core that exits as soon as it is let go, and a summary that
names what failed first and leaves out what the supervisor stopped itself."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from test_server_failure import REPO, _serve, _Stream
from test_server_helpers import listening_address, sse_events, wait_for

from minillm.server.app import API_SERVER_EXIT_MARGIN_S, ProcessEnds

DEFAULT_TIMEOUT_S = 5.0     # --timeout-graceful-shutdown's default


def _two_servers(stories_path: Path, *options: str) -> list[str]:
    return [sys.executable, "-m", "minillm.cli", "serve", str(stories_path), "--api-server-count", "2", *options]


class _CutStream(_Stream):
    """A stream that may be cut (its server killed): it keeps what came, the cut is no error here."""

    def run(self) -> None:
        try:
            super().run()
        except httpx.HTTPError:
            self.lines.append(None)


def _streams_in_flight(url: str, count: int) -> list[_Stream]:
    streams = [_CutStream(url) for _ in range(count)]
    assert all(stream.first.wait(60) for stream in streams), "a stream never started"
    return streams


def _stop_and_time(proc: subprocess.Popen, log: Path, limit_s: float) -> tuple[int, float]:
    """SIGTERM proc; its exit status and the seconds from the signal to its exit (waiting past limit_s,
    so that a slow exit fails with its time rather than hanging the test)."""
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        status = proc.wait(timeout=limit_s + 60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"no exit within {limit_s + 60:.0f} s:\n{log.read_text()}") from None
    return status, time.monotonic() - sent


def test_sigterm_with_two_api_servers_and_streams_in_flight_exits_within_the_graceful_timeout(stories_path,
                                                                                               tmp_path):
    with _serve(tmp_path, _two_servers(stories_path)) as (proc, url, log):
        streams = _streams_in_flight(url, 20)
        status, took = _stop_and_time(proc, log, DEFAULT_TIMEOUT_S)
        # The streams end a second before the timeout; the servers, the core and the supervisor
        # follow within moments (the core waited 2 s on outputs for the servers that had left).
        assert status == 0, log.read_text()
        assert took < DEFAULT_TIMEOUT_S + API_SERVER_EXIT_MARGIN_S + 0.5, f"SIGTERM took {took:.2f} s:\n{log.read_text()}"
        for stream in streams:
            stream.join(10)
            assert not stream.is_alive() and None not in stream.lines
            assert [line for line in stream.lines if line][-1] == "data: [DONE]"
            last = sse_events(stream.lines)[-1]
            assert "error" not in last or last["error"]["code"] == "engine_dead", last
        assert "killed" not in log.read_text()


def test_an_api_server_that_does_not_stop_is_killed_at_the_one_shutdown_deadline(stories_path, tmp_path):
    timeout_s = 4.0     # long enough that a wait of its own (another timeout_s) stands out of a busy host's delays
    with _serve(tmp_path, _two_servers(stories_path, "--timeout-graceful-shutdown", str(timeout_s))) \
            as (proc, url, log):
        stuck = int(re.search(r"API server 1 in process (\d+)", log.read_text()).group(1))
        # The log's URL is the first server's: the streams wait until the second listens (and serves) too.
        assert wait_for(lambda: listening_address(stuck), timeout=120), log.read_text()
        _streams_in_flight(url, 20)     # the kernel spreads them over both servers
        os.kill(stuck, signal.SIGSTOP)  # its share of the core's outputs piles up in the core
        try:
            status, took = _stop_and_time(proc, log, timeout_s)
        finally:
            if Path(f"/proc/{stuck}").exists():
                os.kill(stuck, signal.SIGKILL)
        # Killed at the deadline (the stop, the timeout, then API_SERVER_EXIT_MARGIN_S), not after a
        # wait of its own; the core, let go, exits at once (it waited 2 s on the outputs for it).
        deadline_s = timeout_s + API_SERVER_EXIT_MARGIN_S
        assert took < deadline_s + 0.75 * timeout_s, f"SIGTERM took {took:.2f} s:\n{log.read_text()}"
        text = log.read_text()
        assert status == 1, text
        assert f"minillm-api-server-1 did not stop within {deadline_s:.1f} s; killing it" in text
        assert "exit status 1: minillm-api-server-1 killed by SIGKILL\n" in text, text


def test_the_summary_of_a_killed_core_names_the_core_first(stories_path, tmp_path):
    with _serve(tmp_path, _two_servers(stories_path)) as (proc, url, log):
        core = int(re.search(r"engine core in process (\d+)", log.read_text()).group(1))
        streams = _streams_in_flight(url, 6)
        os.kill(core, signal.SIGKILL)
        assert proc.wait(timeout=60) == 1, log.read_text()
        for stream in streams:
            stream.join(30)
            assert not stream.is_alive() and None not in stream.lines
            assert "engine core process ended" in sse_events(stream.lines)[-1]["error"]["message"]
    text = log.read_text()
    assert "the engine core process ended (killed by SIGKILL)" in text, text
    (summary,) = [line for line in text.splitlines() if "exit status 1:" in line]
    assert summary.split("exit status 1: ", 1)[1].startswith("minillm-engine-core killed by SIGKILL"), summary
    assert "killed by SIGTERM" not in text


def test_process_ends_keep_the_first_failure_first_and_leave_out_the_supervisors_own_signal():
    ends = ProcessEnds()
    ends.signalled["minillm-api-server-0"] = signal.SIGTERM
    assert not ends.saw("minillm-engine-core", None)             # still running: nothing to note
    assert ends.saw("minillm-engine-core", -signal.SIGKILL)
    assert not ends.saw("minillm-engine-core", -signal.SIGKILL)  # noted once
    assert ends.saw("minillm-api-server-1", 1)
    assert not ends.saw("minillm-api-server-0", -signal.SIGTERM)   # the supervisor's own stop
    assert ends.summary() == ("exit status 1: minillm-engine-core killed by SIGKILL; "
                              "after it: minillm-api-server-1 exit code 1")
    stopped = ProcessEnds()
    stopped.signalled.update({"minillm-api-server-0": signal.SIGTERM, "minillm-api-server-1": signal.SIGINT})
    assert not stopped.saw("minillm-api-server-0", 0) and not stopped.saw("minillm-api-server-1", -signal.SIGINT)
    assert stopped.saw("minillm-api-server-0-other", -signal.SIGTERM)      # a SIGTERM from elsewhere
    assert stopped.summary() == "exit status 1: minillm-api-server-0-other killed by SIGTERM"
    assert ProcessEnds().summary() is None


LEAVING_SERVER = """
import multiprocessing as mp, os, signal, sys
from minillm.config import EngineConfig
from minillm.engine_core.client import CoreLink
from minillm.server.app import APIServerSpec, ServerOptions, run_api_server
from minillm.server.metrics_dir import make_metrics_dir

model, gone = sys.argv[1], sys.argv[2]
reader, writer = mp.Pipe(duplex=False)
link = CoreLink(1, f"ipc://{gone}/input-1", f"ipc://{gone}/output-1", reader)
spec = APIServerSpec(EngineConfig(model=model, device="cpu"), ServerOptions(), link, "127.0.0.1", 0, reader, 1,
                     make_metrics_dir().path)
try:
    run_api_server(spec)            # its core is gone: it exits with status 1
except SystemExit as exc:
    status = exc.code
os.kill(os.getpid(), signal.SIGTERM)    # the supervisor stopping the others, as this one leaves
print(f"left with status {status}", flush=True)
sys.exit(status)
"""


def test_a_stop_signal_reaching_an_api_server_on_its_way_out_leaves_its_exit_status_alone(stories_path, tmp_path):
    script = tmp_path / "leaving_server.py"
    script.write_text(LEAVING_SERVER)
    done = subprocess.run([sys.executable, str(script), str(stories_path), str(tmp_path / "gone")], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "left with status 1" in done.stdout and "Traceback" not in done.stderr, done.stderr
