"""Helpers the server test modules share: a real server on a free port, a chat-capable model copy."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from minillm.config import EngineConfig
from minillm.server.app import ServerOptions, ServerThread, create_app
from minillm.server.async_engine import start_async_engine

# Simple enough for the tiny model; BOS first, as stories260K was trained.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def chat_model_dir(src: Path, dst: Path) -> Path:
    """Copy a model directory and give its tokenizer_config.json a chat template."""
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file():
            shutil.copyfile(item, dst / item.name)
    config_path = dst / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return dst


class RunningServer(tuple):
    """(base_url, AsyncLLMEngine), with the ServerThread as .http."""

    http: ServerThread


def engine_core_under_test(options: ServerOptions | None = None) -> str:
    """Where the servers of the tests run the engine core: $MINILLM_TEST_ENGINE_CORE, else the server's default."""
    return os.environ.get("MINILLM_TEST_ENGINE_CORE") or (options or ServerOptions()).engine_core


@contextlib.contextmanager
def api_servers_on_one_core(config: EngineConfig, count: int, core_hook, model_name: str):
    """count API servers in this process (each its own port and loop) on one engine core process
    built by core_hook: yield ([urls], [AsyncLLM]); stop them all after."""
    from minillm.engine_core.client import CoreProcess
    from minillm.server.async_llm import AsyncLLM

    core = CoreProcess(config, count, core_hook)
    engines = [AsyncLLM(config, link=link) for link in core.links]
    servers = [ServerThread(create_app(engine, ServerOptions(served_model_name=model_name))).start()
               for engine in engines]
    try:
        yield [server.url for server in servers], engines
    finally:
        for server in servers:
            server.stop()
        for engine in engines:
            engine.shutdown()
        core.stop()
        core.close()


@contextlib.contextmanager
def running_server(model: Path, api_key: str | None = None, served_model_name: str = "stories",
                   max_body_bytes: int | None = None, log_interval: float | None = None,
                   options: ServerOptions | None = None, send_buffer_bytes: int | None = None,
                   engine_core: str | None = None, core_hook=None, http: str = "auto", **engine_kwargs):
    """Yield (base_url, engine) for a real server on 127.0.0.1 (its ServerThread as .http); stop both after.

    options: the server's options (limits, templates); api_key, served_model_name, max_body_bytes
    and log_interval override theirs. send_buffer_bytes: the kernel send buffer of each connection
    (small, so that a client that does not read fills it soon). engine_core: "process" or "thread"
    (default: engine_core_under_test()); core_hook: called with the LLMEngine wherever it runs (core_hooks.py);
    http: the HTTP/1.1 implementation ("auto": httptools where installed, else h11).
    """
    options = dataclasses.replace(options or ServerOptions(), api_key=api_key, served_model_name=served_model_name,
                                  log_interval=log_interval, engine_core=engine_core or engine_core_under_test(options))
    if max_body_bytes is not None:
        options = dataclasses.replace(options, limits=dataclasses.replace(options.limits,
                                                                          max_body_bytes=max_body_bytes))
    config = EngineConfig(model=str(model), device="cpu", **engine_kwargs)
    engine = start_async_engine(config, options.engine_core, core_hook)
    app = create_app(engine, options)
    server = ServerThread(app, "127.0.0.1", 0, http=http)
    if send_buffer_bytes is not None:   # accepted connections inherit it from the listening socket
        server.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    server.start()
    running = RunningServer((server.url, engine))
    running.http = server
    try:
        yield running
    finally:
        server.stop()
        engine.shutdown()


def call_utility(engine, method: str, *args):
    """Call a method of the server's LLMEngine between two steps (in the core's process or thread)."""
    return asyncio.run(engine.call_utility(method, *args))


def get_stats(url: str, headers: dict | None = None) -> dict:
    """GET /v1/stats as a dict."""
    response = httpx.get(f"{url}/v1/stats", headers=headers or {}, timeout=10)
    response.raise_for_status()
    return response.json()


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02):
    """Poll predicate() until it returns something truthy; return it (or the last value on timeout)."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value


# http://, https:// (--ssl-certfile) or unix:PATH (--uds)
SERVER_URL_LINE = re.compile(r"(?:Uvicorn running on|minillm router:) ((?:https?://|unix:)[^\s,]+)")


def stop_server(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM a server process and wait for it; SIGKILL it if it outlives timeout."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def started_url(proc: subprocess.Popen, log: Path, timeout: float = 180) -> str:
    """The base URL that a `minillm serve` or `minillm router` started with --port 0 writes to its log
    once bound (a port picked by binding 0 and closing could be any connection's local port before
    the server binds it)."""
    def url():
        assert proc.poll() is None, log.read_text()
        found = SERVER_URL_LINE.search(log.read_text())
        return found and found.group(1)
    address = wait_for(url, timeout=timeout, interval=0.05)
    assert address, f"no URL in the log after {timeout} s:\n{log.read_text()}"
    return address


def listening_address(pid: int) -> str | None:
    """The base URL of an IPv4 TCP port process pid listens on, read from /proc; None while it listens on none."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            inodes.add(os.readlink(f"/proc/{pid}/fd/{fd}").removeprefix("socket:[").removesuffix("]"))
    with open(f"/proc/{pid}/net/tcp") as table:
        for fields in (line.split() for line in list(table)[1:]):
            if fields[3] == "0A" and fields[9] in inodes:        # 0A: LISTEN
                address, port = fields[1].split(":")
                return f"http://{socket.inet_ntoa(bytes.fromhex(address)[::-1])}:{int(port, 16)}"
    return None


def listening_url(proc: subprocess.Popen, log: Path, timeout: float = 180) -> str:
    """The base URL of the IPv4 TCP port proc listens on, read from /proc: for a server started with
    --port 0 whose log names no URL (uvicorn's info lines turned off)."""
    def url():
        assert proc.poll() is None, log.read_text()
        return listening_address(proc.pid)
    address = wait_for(url, timeout=timeout, interval=0.05)
    assert address, f"nothing listening after {timeout} s:\n{log.read_text()}"
    return address


def sse_events(lines) -> list:
    """Parse `data: ...` lines into JSON objects, stopping at [DONE]."""
    events = []
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        events.append(json.loads(data))
    return events


def choice_texts(events: list[dict]) -> dict[int, str]:
    """Streamed completion chunks -> {choice index: its whole text}."""
    texts: dict[int, str] = {}
    for event in events:
        for choice in event.get("choices", []):
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    return texts


@pytest.fixture(scope="module", name="server")
def chat_template_server(stories_path):
    """(url, engine) of a server named "stories" with max_model_len 256, the tests' CHAT_TEMPLATE and
    --enable-server-load-tracking (GET /load counts), for the module; a test module takes it by
    importing this fixture."""
    options = ServerOptions(chat_template=CHAT_TEMPLATE, enable_server_load_tracking=True)
    with running_server(stories_path, served_model_name="stories", max_model_len=256,
                        options=options) as (url, engine):
        yield url, engine


def _story_streams(server, max_tokens: int):
    """HealthyStreams of a max_tokens story on the module's server "stories", checked when the module ends."""
    streams = HealthyStreams(server[0], {"model": "stories", "prompt": "Once upon a time", "max_tokens": max_tokens})
    yield streams
    streams.check()


@pytest.fixture(scope="module", name="healthy")
def story_streams(server):
    """HealthyStreams of a 200-token story on that server, checked when the module ends."""
    yield from _story_streams(server, 200)


@pytest.fixture(scope="module", name="healthy")
def long_story_streams(server):
    """HealthyStreams of a 400-token story on the module's own server (named "stories"), checked when
    the module ends; a test module takes it by importing this fixture."""
    yield from _story_streams(server, 400)


class HealthyStreams:
    """Greedy streams that tests keep in flight while they misbehave; each must end with its solo text.

    reference: the choices' texts of the same request made alone, before anything else. in_flight():
    a stream running when the with-block starts; a stream that has sent less than a quarter of its
    chunks is reused, so quick tests in a row share one. check(): every stream finished with the
    reference texts and [DONE].
    """

    def __init__(self, url: str, body: dict, headers: dict | None = None) -> None:
        self.url, self.body, self.headers = url, {**body, "temperature": 0, "ignore_eos": True}, headers or {}
        response = httpx.post(f"{url}/v1/completions", json=self.body, headers=self.headers, timeout=60)
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        self.reference = {c["index"]: c["text"] for c in choices}
        self.runs: list[tuple[threading.Thread, dict]] = []

    def _run(self, started: threading.Event, result: dict) -> None:
        lines = result["lines"] = []
        with httpx.stream("POST", f"{self.url}/v1/completions", headers=self.headers, timeout=120,
                          json={**self.body, "stream": True}) as response:
            result["status"] = response.status_code
            for line in response.iter_lines():
                lines.append(line)
                started.set()
        events = sse_events(lines)
        result["texts"] = choice_texts(events)
        result["finish"] = sorted({c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]})
        result["done"] = [line for line in lines if line][-1:] == ["data: [DONE]"]

    def _fresh_enough(self) -> tuple[threading.Thread, dict] | None:
        if not self.runs:
            return None
        thread, result = self.runs[-1]
        num_chunks = sum(1 for line in result["lines"] if line.startswith("data:"))
        return (thread, result) if thread.is_alive() and num_chunks < self.body["max_tokens"] // 4 else None

    @contextlib.contextmanager
    def in_flight(self, fresh: bool = False):
        """A healthy stream in flight from the start of the block to its end (a new one if fresh)."""
        run = None if fresh else self._fresh_enough()
        if run is None:
            started, result = threading.Event(), {"lines": []}
            run = (threading.Thread(target=self._run, args=(started, result), daemon=True), result)
            run[0].start()
            assert started.wait(60), "the healthy stream did not start"
            self.runs.append(run)
        # In flight when the block's requests go out; it may end before a slow block does (a busy
        # machine decides that), and check() still holds it to its solo text.
        assert run[0].is_alive() and not run[1].get("done"), "the healthy stream ended before the block"
        yield

    def check(self) -> None:
        """Wait for every stream started and compare each with the reference."""
        for thread, result in self.runs:
            thread.join(120)
            assert not thread.is_alive()
            result = {k: v for k, v in result.items() if k != "lines"}
            assert result == {"status": 200, "texts": self.reference, "finish": ["length"], "done": True}
        self.runs.clear()


def raw_stream(url: str, body: dict, num_chunks: int) -> socket.socket:
    """Open a streaming request on a bare socket and read until a few events have arrived."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    received = b""
    while received.count(b"data: ") < num_chunks:
        chunk = sock.recv(65536)
        assert chunk, "server closed the stream early"
        received += chunk
    assert b" 200 " in received.split(b"\r\n", 1)[0]
    return sock


# Each step of a paced core lasts at least this long, as a large batch's does on a GPU: steps counted
# between events of two processes then measure the engine, not how long a message takes to cross
# between processes on a busy machine (milliseconds, where an idle stories260K step takes one).
STEP_PACE_S = 0.05


@dataclasses.dataclass
class HangUp:
    """A streaming client that left: its request's abort as the API server sent it and the core applied it."""

    request_id: str
    num_output_tokens: int      # the request's tokens when the core aborted it
    steps_after_sent: int       # engine steps that ended after the API server sent the abort, up to the abort
    steps_after_hang_up: int    # the same, counted from the client's hang-up
    stats: dict                 # /v1/stats once the request's blocks were free


def hang_up_stream(url: str, server_engine, core_engine, body: dict) -> HangUp:
    """Stream `body` from `url` on a core paced at STEP_PACE_S (core_hooks.install), hang up after three
    events, and wait until the core has aborted the request and freed its blocks."""
    num_aborted = len(call_utility(core_engine, "aborted_requests"))
    sent: dict[str, float] = {}
    real_abort = server_engine.abort

    def abort(request_id):
        sent.setdefault(request_id, time.time())
        return real_abort(request_id)

    server_engine.abort = abort
    call_utility(core_engine, "pace_steps", STEP_PACE_S)
    try:
        sock = raw_stream(url, body, num_chunks=3)
        hung_up_at = time.time()
        sock.close()
        aborted = wait_for(lambda: call_utility(core_engine, "aborted_requests")[num_aborted:], timeout=60)
    finally:
        call_utility(core_engine, "pace_steps", 0)
        del server_engine.abort
    assert aborted, "no abort reached the core after the hang-up"
    (request_id, applied_at, _, num_output_tokens), = aborted
    assert list(sent) == [request_id], "the API server aborted something else"
    stats = wait_for(lambda: (s := get_stats(url))["num_running"] == 0 and s["kv_num_used_blocks"] == 0 and s,
                     timeout=60)
    assert stats, "the request kept its blocks after its client left"
    steps = stats["recent_steps"]
    assert stats["num_steps"] - steps[0]["step"] < len(steps), "steps rolled off"

    def ended_between(start: float) -> int:
        return sum(1 for step in steps if start < step["time"] <= applied_at)

    return HangUp(request_id, num_output_tokens, ended_between(sent[request_id]), ended_between(hung_up_at), stats)


def openai_error(response, status: int, param: str | None = None, code: str | None = None) -> dict:
    """The error object of an OpenAI-style JSON error response, checked: its status, its four
    fields, the field it names (param) and, when given, its code."""
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


@contextlib.contextmanager
def running_router(config):
    """Yield the base URL of a router app (minillm.router) for config, served by uvicorn on a thread."""
    import logging

    import uvicorn

    from minillm.router import create_router_app
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    # log_config None: uvicorn leaves the process's logging alone (the router's log is read by other tests)
    http = uvicorn.Server(uvicorn.Config(create_router_app(config), log_level="warning", access_log=False,
                                         log_config=None))
    thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert wait_for(lambda: http.started, timeout=30)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        http.should_exit = True
        thread.join(30)
        sock.close()
        # Requests leave "INFO is off" in the router logger's level cache; setLevel clears it, for the
        # tests that turn the router's log on by assigning its level.
        logger = logging.getLogger("minillm.router")
        logger.setLevel(logger.level)
