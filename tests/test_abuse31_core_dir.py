"""The engine core's private socket directory is removed when the API server is killed outright."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

STARTER = """
import signal, sys
from minillm.config import EngineConfig
from minillm.engine_core.client import EngineCoreClient
client = EngineCoreClient(EngineConfig(model=sys.argv[1], device="cpu"))
print(client.owned.dir, client.owned.pid, flush=True)
signal.pause()
"""


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:      # a zombie (its parent, killed, has not reaped it) is gone too
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_a_core_whose_api_server_was_killed_removes_its_socket_directory(stories_path):
    # Only the API server removed /tmp/minillm-core-*: one killed with SIGKILL left its directory
    # behind for good (some 230 of them on a development machine).
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(stories_path)], stdout=subprocess.PIPE, text=True)
    try:
        folder, pid = starter.stdout.readline().split()
        assert os.path.isdir(folder)
        starter.send_signal(signal.SIGKILL)
        starter.wait(30)
        deadline = time.monotonic() + 60
        while not _gone(int(pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(int(pid)), "the core did not exit once its API server was gone"
        assert not os.path.exists(folder)
    finally:
        starter.kill()
