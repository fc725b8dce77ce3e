"""A server's end as operators meet it: a crash of a server and its engine core leaves their socket
directory behind, and the next core started on the machine sweeps it."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from test_server_helpers import wait_for

from minillm.engine_core.client import STALE_DIR_GRACE_S, socket_dir, sweep_stale_socket_dirs

REPO = Path(__file__).resolve().parents[1]


def _backdate(path: Path) -> None:
    old = time.time() - STALE_DIR_GRACE_S - 5
    os.utime(path, (old, old))


def _socket_dir(parent: Path, name: str, listening: bool) -> tuple[Path, socket.socket]:
    """A directory like a core's, its one socket bound (and listening, or left as a dead process leaves it)."""
    path = parent / f"minillm-core-{name}"
    path.mkdir()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path / "input-0"))
    if listening:
        sock.listen()
    else:
        sock.close()
    return path, sock


def test_only_old_directories_of_sockets_nobody_listens_on_are_swept(tmp_path):
    stale, _ = _socket_dir(tmp_path, "stale", listening=False)
    fresh, _ = _socket_dir(tmp_path, "fresh", listening=False)       # its server may be binding now
    live, server = _socket_dir(tmp_path, "live", listening=True)
    other = tmp_path / "minillm-core-other"
    other.mkdir()
    (other / "notes").write_text("not a socket")
    empty = tmp_path / "minillm-core-empty"
    empty.mkdir()
    for path in (stale, live, other, empty):
        _backdate(path)
    try:
        assert sweep_stale_socket_dirs([str(tmp_path)]) == [str(stale)]
        assert not stale.exists() and fresh.exists() and live.exists() and other.exists() and empty.exists()
    finally:
        server.close()


def _core_socket_dirs(pid: int) -> set[str]:
    """The minillm-core-* directories of the unix sockets process pid holds open."""
    inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")
              if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
    found = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes and "/minillm-core-" in fields[7]:
            found.add(os.path.dirname(fields[7]))
    return found


def _serve(stories_path: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """A server on a port the kernel picks (--port 0: a port chosen here and closed could be taken by
    any process's connection before the server binds it), and the URL its log names once it is up."""
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "minillm.cli", "serve", str(stories_path), "--device", "cpu",
                                 "--port", "0"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                                stdout=out, stderr=subprocess.STDOUT)

    def url():
        assert proc.poll() is None, log.read_text()
        found = re.search(r"Uvicorn running on (http://\S+)", log.read_text())
        return found and found.group(1)
    address = wait_for(url, timeout=120, interval=0.1)
    assert address, log.read_text()
    assert httpx.get(f"{address}/health", timeout=30).status_code == 200, log.read_text()
    return proc, address


def _crash(proc: subprocess.Popen, core: int) -> None:
    """SIGKILL a server and its engine core, as a machine failure would (the core frozen first, so it
    cannot see its server go and clean up)."""
    os.kill(core, signal.SIGSTOP)
    proc.kill()
    proc.wait(30)
    os.kill(core, signal.SIGKILL)
    assert wait_for(lambda: not Path(f"/proc/{core}").exists(), timeout=30)


def test_a_crashed_servers_socket_directory_is_swept_when_it_restarts(stories_path, tmp_path):
    proc, _ = _serve(stories_path, tmp_path / "first.log")
    try:
        core = int(re.search(r"engine core in process (\d+)", (tmp_path / "first.log").read_text()).group(1))
        (left,) = _core_socket_dirs(proc.pid)
        _crash(proc, core)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sorted(os.listdir(left)) == ["input-0", "output-0"]      # nothing could remove it
    _backdate(Path(left))
    again, url = _serve(stories_path, tmp_path / "second.log")
    try:
        assert not os.path.exists(left)
        assert httpx.post(f"{url}/v1/completions", timeout=60,
                          json={"prompt": "Once upon a time", "max_tokens": 4}).status_code == 200
    finally:
        again.send_signal(signal.SIGTERM)
        assert again.wait(60) == 0


def test_making_a_socket_directory_sweeps_the_stale_ones_beside_it(tmp_path, monkeypatch):
    stale, _ = _socket_dir(tmp_path, "stale", listening=False)
    live, server = _socket_dir(tmp_path, "live", listening=True)
    _backdate(stale)
    _backdate(live)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    try:
        made = socket_dir("output-0")
        assert not stale.exists() and live.exists() and os.path.dirname(made) == str(tmp_path)
        os.rmdir(made)
    finally:
        server.close()
