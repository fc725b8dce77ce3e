"""A client process of --num-client-processes that dies without a result (killed, out of memory)
ends the run with an error naming it, and the other client processes are stopped: the parent waited
for its result for ever, and the others for it at the start barrier."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_server_helpers import running_server

from minillm.benchmarks import serving as bench
from minillm.benchmarks.cli_args import BenchError


@pytest.fixture(scope="module")
def server(stories_path):
    with running_server(stories_path) as (url, engine):
        yield url, engine


def kill_first_client_process(killed: list) -> None:
    """Kill the first client process as soon as it is started (within 60 s)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        children = [p for p in mp.active_children() if p.name.startswith("minillm-bench-client-")]
        if children:
            children[0].kill()
            killed.append(children[0])
            return
        time.sleep(0.01)


def test_a_client_process_killed_ends_the_run_naming_it(server):
    url, _ = server
    killed: list = []
    killer = threading.Thread(target=kill_first_client_process, args=(killed,), daemon=True)
    killer.start()
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(bench.main(["--base-url", url, "--num-prompts", "4", "--input-len", "4", "--output-len", "3",
                                       "--num-client-processes", "2"]))
        except BenchError as exc:
            outcome.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(60)
    assert not runner.is_alive(), "the run still waits for a client process that was killed"
    assert killed, "no client process was seen"
    [error] = outcome
    assert isinstance(error, BenchError) and "client process" in str(error) and "exit code -9" in str(error), error
    assert not [p for p in mp.active_children() if p.name.startswith("minillm-bench-client-")]


def processes_started_by(pid: int) -> list[int]:
    """The multiprocessing children (spawned) of process pid."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(stat.parent.name))
    return found


def is_running(pid: int) -> bool:
    """Whether pid is a process that has not ended (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_client_processes_end_when_the_run_is_killed(server):
    # They are daemons, which multiprocessing stops when the parent exits, not when it is killed:
    # they went on sending the workload, or waited at the start barrier, for ever.
    url, _ = server
    code = ("import sys; from minillm.benchmarks import serving; "
            "sys.exit(serving.main(sys.argv[1:]))")
    parent = subprocess.Popen([sys.executable, "-c", code, "--base-url", url, "--num-prompts", "2000",
                               "--input-len", "4", "--output-len", "64", "--max-concurrency", "2",
                               "--num-client-processes", "2"],
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    clients: list[int] = []
    try:
        assert wait_until(lambda: len(processes_started_by(parent.pid)) == 2, 60), "no client processes started"
        clients = processes_started_by(parent.pid)
        parent.kill()
        parent.wait()
        assert wait_until(lambda: not any(map(is_running, clients)), 30), \
            f"client processes {[p for p in clients if is_running(p)]} outlived the run"
    finally:
        parent.kill()
        parent.wait()
        for pid in clients:
            if is_running(pid):
                os.kill(pid, signal.SIGKILL)
