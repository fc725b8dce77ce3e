"""Request ids and engine identity as operators see them: the id a client sends (the body's
request_id, the X-Request-Id header) names its engine requests as vLLM names them, so /v1/stats and
the monitor show it; two clients that send one id run as two engine requests, and the hang-up of one
leaves the other; each engine's stats carry a run id the monitor tells restarts by."""
from __future__ import annotations

import json
import logging
import re
import socket
import threading

import httpx
import pytest
from test_abuse29_monitor import monitor, stats_dict
from test_abuse29d_server_pd import StepGate
from test_server_helpers import CHAT_TEMPLATE, get_stats, running_server, wait_for

from minillm.server.app import ServerOptions
from minillm.tui.app import is_new_run
from minillm.tui.client import parse_stats

HEX8 = "[0-9a-f]{8}"


GATE = StepGate()


@pytest.fixture(scope="module")
def server(stories_path):
    """(url, engine) of a server whose steps wait while GATE is closed."""
    options = ServerOptions(chat_template=CHAT_TEMPLATE, log_requests=True)
    with running_server(stories_path, engine_core="thread", options=options, core_hook=GATE.install,
                        max_model_len=256) as running:
        yield running


@pytest.fixture
def gated():
    """GATE closed for the test (requests wait in the engine), open again after it."""
    GATE.is_open.clear()
    yield
    GATE.is_open.set()


class Post(threading.Thread):
    """A POST in the background; .response once it is answered."""

    def __init__(self, url: str, body: dict, headers: dict | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.headers, self.response = url, body, headers or {}, None

    def run(self) -> None:
        self.response = httpx.post(self.url, json=self.body, headers=self.headers, timeout=120)


def engine_ids(url: str) -> list[str]:
    """The request ids of /v1/stats' rows."""
    return [row["request_id"] for row in get_stats(url)["requests"]]


def rows_matching(url: str, pattern: str, count: int) -> list[str] | None:
    """The ids of /v1/stats' rows that match pattern, once there are `count` of them."""
    ids = [rid for rid in engine_ids(url) if re.fullmatch(pattern, rid)]
    return ids if len(ids) == count else None


STORY = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 4}
CHAT = {"model": "stories", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.mark.parametrize("path, body, headers, pattern, count, response_id", [
    ("/v1/completions", {**STORY, "request_id": "body-1"}, {}, rf"cmpl-body-1-0-{HEX8}", 1, "cmpl-body-1"),
    ("/v1/completions", STORY, {"X-Request-Id": "hdr-1"}, rf"cmpl-hdr-1-0-{HEX8}", 1, "cmpl-hdr-1"),
    ("/v1/completions", {**STORY, "prompt": ["Once", "The dog"], "request_id": "two"}, {},
     rf"cmpl-two-[01]-{HEX8}", 2, "cmpl-two"),
    ("/v1/completions", {**STORY, "n": 2, "request_id": "fan"}, {}, rf"cmpl-fan-0-{HEX8}#[01]", 2, "cmpl-fan"),
    ("/v1/chat/completions", {**CHAT, "request_id": "body-2"}, {}, rf"chatcmpl-body-2-{HEX8}", 1, "chatcmpl-body-2"),
    ("/v1/chat/completions", CHAT, {"X-Request-Id": "hdr-2"}, rf"chatcmpl-hdr-2-{HEX8}", 1, "chatcmpl-hdr-2"),
], ids=["body", "header", "batch", "n", "chat-body", "chat-header"])
def test_the_engine_and_its_stats_name_a_request_by_the_clients_id_as_vllm_does(
        server, gated, path, body, headers, pattern, count, response_id):
    # vLLM's engine id: cmpl-<client id>-<prompt index> (chatcmpl-<client id>) and 8 random hex digits;
    # the engine ran cmpl-<fresh hex> and the operator could not find the client's request.
    post = Post(f"{server[0]}{path}", body, headers)
    post.start()
    ids = wait_for(lambda: rows_matching(server[0], pattern, count), timeout=60)
    assert ids, engine_ids(server[0])
    if count == 2 and "n" not in body:
        assert {rid.split("-")[-2] for rid in ids} == {"0", "1"}, ids
    GATE.is_open.set()
    post.join(120)
    assert post.response.status_code == 200, post.response.text
    assert post.response.json()["id"] == response_id


def open_stream(url: str, body: dict) -> socket.socket:
    """Send a streaming completion on a bare socket and leave it unread."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return sock


def test_two_clients_sending_one_request_id_are_two_engine_requests_and_one_leaving_ends_only_its_own(
        server, gated):
    body = {**STORY, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "request_id": "same"}
    pattern = rf"cmpl-same-0-{HEX8}"
    stays = Post(f"{server[0]}/v1/completions", body)
    stays.start()
    [kept] = wait_for(lambda: rows_matching(server[0], pattern, 1), timeout=60)
    leaves = open_stream(server[0], body)
    both = wait_for(lambda: rows_matching(server[0], pattern, 2), timeout=60)
    assert both and kept in both, engine_ids(server[0])
    leaves.close()                                      # its client hangs up: the server aborts its request
    assert wait_for(lambda: rows_matching(server[0], pattern, 1) == [kept], timeout=60), engine_ids(server[0])
    GATE.is_open.set()
    stays.join(120)
    assert stays.response.status_code == 200, stays.response.text
    [choice] = stays.response.json()["choices"]
    assert choice["finish_reason"] == "length" and stays.response.json()["usage"]["completion_tokens"] == 12


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("client_id", ["x\nINFO forged", "a\rb\x1b[2Jc", "t\tu\u2028v"])
def test_a_client_id_with_control_characters_is_logged_escaped_on_one_line(server, client_id):
    # The request log shows the engine id, which holds the client's: a newline in it wrote a forged line.
    logger, records = logging.getLogger("minillm.server"), _Records()
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        response = httpx.post(f"{server[0]}/v1/completions", json={**STORY, "request_id": client_id}, timeout=60)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    assert response.status_code == 200 and response.json()["id"] == f"cmpl-{client_id}"
    [line] = [m for m in records.messages if m.startswith("Received request")]
    assert line.isprintable(), line
    escaped = client_id.encode("unicode_escape").decode("ascii")
    assert re.match(rf"Received request cmpl-{re.escape(escaped)}-0-{HEX8}: params: ", line), line


# ---- the engine's run id ---------------------------------------------------------------------------

@pytest.mark.parametrize("engine_core", ["thread", "process"])
def test_each_engine_has_its_own_run_id_and_the_monitor_tells_a_restart_that_counted_past_the_old_one(
        stories_path, engine_core):
    def serve_and_snapshot(num_requests: int) -> dict:
        with running_server(stories_path, engine_core=engine_core, max_model_len=128) as (url, _):
            for _ in range(num_requests):
                assert httpx.post(f"{url}/v1/completions", json=STORY, timeout=60).status_code == 200
            first, again = get_stats(url), get_stats(url)
            assert re.fullmatch("[0-9a-f]{32}", first["run_id"]) and again["run_id"] == first["run_id"]
            return again

    before, after = serve_and_snapshot(1), serve_and_snapshot(3)
    assert after["run_id"] != before["run_id"]
    old, new = parse_stats(before), parse_stats(after)
    # The restarted server (same model and pool) counted past the old one: only its run id tells.
    assert new.num_steps > old.num_steps and new.generation_tokens_total > old.generation_tokens_total
    assert is_new_run(old, new)
    assert not is_new_run(old, parse_stats({**after, "run_id": before["run_id"]}))


@pytest.mark.anyio
@pytest.mark.parametrize("run_ids, restarts", [(["a1", "a1", "b2"], 1), (["a1", "a1", "a1"], 0),
                                               (["", "b2", "b2"], 0), (["a1", "", "a1"], 0)])
async def test_the_monitor_marks_a_restart_when_the_run_id_changes_though_the_counters_went_on(run_ids, restarts):
    # make_stats' counters grow frame by frame: before run ids a restart like this went unmarked.
    frames = [stats_dict(k + 1, run_id=run_id) for k, run_id in enumerate(run_ids)]
    async with monitor(frames) as (app, _):
        assert app.num_restarts == restarts
        assert ("↻" in app.title_bar.content.plain) == bool(restarts)


@pytest.fixture
def anyio_backend():
    return "asyncio"
