"""A client process of --num-client-processes that dies without a result (killed, out of memory)
ends the run with an error naming it, and the other client processes are stopped: the parent waited
for its result for ever, and the others for it at the start barrier."""
from __future__ import annotations

import multiprocessing as mp
import threading
import time

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
