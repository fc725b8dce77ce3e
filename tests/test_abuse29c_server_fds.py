"""`minillm serve` and the open-files limit, as a public server meets it with many connections.

A service manager's soft limit is often 1024 open files: the server held that many connections and
no more. It now raises its soft limit towards the hard one (to 65535, as vLLM does). At the hard
limit, asyncio logged "socket.accept() out of system resource" with a traceback for every pending
connection on every try (thousands of lines a second, 160,000 in ten seconds under 800 idle
clients); the server now says it once per interval, with a count.
"""
from __future__ import annotations

import socket

import httpx
from test_abuse20_deploy import serve, serve_command  # noqa: F401 (serve)
from test_server_helpers import wait_for

URL_LINE = r"Uvicorn running on (http://\S+)"


def _limited(soft: int, hard: str, command: list[str]) -> list[str]:
    """command run under an open-files limit (ulimit's soft -S and hard -H)."""
    return ["sh", "-c", f'ulimit -Sn {soft} && ulimit -Hn {hard} && exec "$@"', "sh", *command]


def _soft_limit(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        (line,) = [line for line in f if line.startswith("Max open files")]
    return int(line.split()[3])


def test_serve_raises_its_open_files_soft_limit(stories_path, serve):  # noqa: F811
    server = serve(_limited(256, "4096", serve_command(stories_path)))
    server.wait_line(URL_LINE)
    assert _soft_limit(server.proc.pid) == 4096, server.text()


def test_no_file_descriptor_left_is_logged_once_not_per_connection(stories_path, serve):  # noqa: F811
    server = serve(_limited(64, "64", serve_command(stories_path)))
    url = server.wait_line(URL_LINE).group(1)
    host, port = url.removeprefix("http://").split(":")
    idle = []
    try:
        for _ in range(100):       # more than the server has descriptors for: they wait in its backlog
            idle.append(socket.create_connection((host, int(port)), timeout=10))
        server.wait_line(r"out of (system resource|file descriptors)")
    finally:
        for sock in idle:
            sock.close()
    assert wait_for(lambda: httpx.get(f"{url}/health", timeout=30).status_code == 200, timeout=60)
    text = server.text()
    assert text.count("out of system resource") + text.count("out of file descriptors") <= 2, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


def test_a_retry_of_accepting_on_a_closed_socket_is_not_reported(caplog):
    """asyncio retries accepting a second after a refusal; a server that stopped in that second has
    closed the socket, and the retry's ValueError was logged as a traceback at shutdown."""
    import asyncio

    from minillm.server.http import AcceptErrorLog, ListeningSocket
    loop = asyncio.new_event_loop()
    sock = ListeningSocket()
    try:
        sock.close()
        handle = asyncio.TimerHandle(0.0, lambda *args: None, (None, sock), loop)
        AcceptErrorLog()(loop, {"message": "Exception in callback", "exception": ValueError("Invalid file "
                                "descriptor: -1"), "handle": handle})
        assert caplog.records == []
        AcceptErrorLog()(loop, {"message": "something else", "exception": ValueError("boom")})
        assert [r.getMessage() for r in caplog.records] == ["something else"]
    finally:
        loop.close()
