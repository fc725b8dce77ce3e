"""`minillm serve --api-server-count N` ended as operators end it: killed outright."""
from __future__ import annotations

import os
import signal

import httpx
import pytest
from test_abuse20_deploy import Serve, is_gone, serve_command
from test_server_helpers import wait_for


@pytest.fixture
def serve_multi(tmp_path):
    """Start a `minillm serve` (a Serve); the processes it names are killed at the end if still running
    (its API servers lead process groups of their own, so a kill of its group misses them)."""
    started: list[Serve] = []

    def start(command: list[str]) -> Serve:
        started.append(Serve(command, tmp_path))
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
