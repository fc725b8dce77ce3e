"""`minillm router` as a process: its start-up line names the port it bound (--port 0 picks a free
one, as `minillm serve --port 0` does), and that address answers."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
from test_server_helpers import wait_for

REPO = Path(__file__).resolve().parents[1]


def start_router(*args: str) -> subprocess.Popen:
    """A `minillm router` process with its stderr on a pipe."""
    return subprocess.Popen([sys.executable, "-m", "minillm.cli", "router", *args], cwd=REPO, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/stats", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def test_router_on_port_0_prints_the_port_it_bound_and_serves_there():
    proc = start_router("--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9", "--port", "0")
    try:
        line = proc.stderr.readline()
        match = re.match(r"minillm router: (http://127\.0\.0\.1:(\d+)), prefill ", line)
        assert match, line
        assert int(match.group(2)) != 0, line
        assert wait_for(lambda: answers(match.group(1)) or proc.poll() is not None, timeout=30)
        assert proc.poll() is None and answers(match.group(1))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    assert proc.returncode == 0, proc.stderr.read()
