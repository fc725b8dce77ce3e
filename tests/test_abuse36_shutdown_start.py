"""A stop's deadline reaching API servers not yet serving (importing on a slow host) is a clean stop."""
from __future__ import annotations

import logging
import signal
import threading
import time

import pytest

from minillm.server import app
from minillm.server.app import ProcessEnds, _join_servers


@pytest.fixture
def server_log(caplog, monkeypatch):
    """caplog of the server's logger, which a served app in the same process stops from propagating."""
    monkeypatch.setattr(app.logger, "propagate", True)
    caplog.set_level(logging.INFO, logger=app.logger.name)
    return caplog


class FakeServer:
    """An API server process that exits at a SIGTERM-like `stop()`, or only when killed (stuck)."""

    def __init__(self, name: str, exits_on_stop: bool) -> None:
        self.name, self.exitcode = name, None
        self._ended = threading.Event()
        if exits_on_stop:
            self.exitcode = 0
            self._ended.set()

    def join(self, timeout: float | None = None) -> None:
        self._ended.wait(timeout)

    def is_alive(self) -> bool:
        return not self._ended.is_set()

    def kill(self) -> None:
        self.exitcode = -signal.SIGKILL
        self._ended.set()


def _serving(flag: bool) -> threading.Event:
    event = threading.Event()
    if flag:
        event.set()
    return event


def test_a_server_not_serving_yet_at_the_deadline_is_stopped_without_a_failure(server_log):
    servers = [FakeServer("minillm-api-server-0", exits_on_stop=True),
               FakeServer("minillm-api-server-1", exits_on_stop=False)]
    ends = ProcessEnds()
    for proc in servers:
        ends.signalled[proc.name] = signal.SIGTERM
    _join_servers(servers, [_serving(True), _serving(False)], time.monotonic(), 5.0, ends)
    assert servers[1].exitcode == -signal.SIGKILL
    assert ends.summary() is None                      # the exit status stays 0
    assert "was not serving yet at the stop's deadline" in server_log.text
    assert "did not stop within" not in server_log.text


def test_a_started_server_that_does_not_stop_is_still_a_failure(server_log):
    servers = [FakeServer("minillm-api-server-0", exits_on_stop=False)]
    ends = ProcessEnds()
    ends.signalled[servers[0].name] = signal.SIGTERM
    _join_servers(servers, [_serving(True)], time.monotonic(), 5.0, ends)
    assert "minillm-api-server-0 did not stop within 5.0 s; killing it" in server_log.text
    assert ends.summary() == "exit status 1: minillm-api-server-0 killed by SIGKILL"
