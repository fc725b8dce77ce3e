"""A tensor-parallel worker that dies while the server is idle ends the engine at once (EngineDead,
/health 503), as one that dies mid-step does; it was found only by the next request."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
from test_server_helpers import running_server, wait_for


def children(pid: int) -> list[int]:
    """The child processes of pid."""
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def test_a_worker_killed_while_idle_ends_the_engine_before_any_request(stories_path):
    with running_server(stories_path, engine_core="process", tensor_parallel_size=2) as (url, engine):
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        # rank 1, spawned by the core (multiprocessing's resource tracker is no spawn_main)
        workers = [pid for pid in children(engine.core_pid)
                   if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        assert wait_for(lambda: httpx.get(f"{url}/health", timeout=30).status_code == 503, timeout=60)
        error = httpx.get(f"{url}/health", timeout=30).json()["error"]
        assert error["code"] == "engine_dead" and "rank 1" in error["message"], error
