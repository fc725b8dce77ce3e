"""Leftovers: a prefill server's lease whose response never left, chat --url after a server's restart
under another model name, /set parameter's lines, monitor URLs with an endpoint's path, and run-batch's
status for a handler's failure."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import socket
import threading

import httpx
from fastapi import FastAPI, Request
from test_abuse30_chat import _EchoBackend
from test_server_helpers import CHAT_TEMPLATE, get_stats, running_server, wait_for

import minillm.tui.client as tui_client
from minillm.chat import ChatSession, ChatSettings
from minillm.chat_client import HttpChatBackend
from minillm.run_batch import parse_line, run_requests
from minillm.server.app import ServerOptions, ServerThread, create_app
from minillm.server.errors import install_error_handlers
from minillm.tui.client import LiveSource, SourceProblem, StatsFrame
from minillm.urls import server_base_url

PROMPT = "Once upon a time there was a little girl named Lily who loved to play"
PREFILL = {"kv_transfer_params": {"do_remote_decode": True}, "temperature": 0, "max_tokens": 8}
ROUTES = {"/v1/completions": {"prompt": PROMPT},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": PROMPT}]}}


# ---- a prefill server's lease, made for a client that left before its response was written ----------

class HeldLeases:
    """A core_hook: a step that ends a request holding a lease waits, once armed, until let go (its
    output, which names the lease, is not yet with the API server)."""

    def __init__(self) -> None:
        self.is_armed = False
        self.leased, self.go = threading.Event(), threading.Event()

    def install(self, engine) -> None:
        real_step = engine.step

        def step():
            outputs = real_step()
            if self.is_armed and any(o.finished and o.kv_transfer_params for o in outputs):
                self.is_armed = False
                self.leased.set()
                self.go.wait(30)
            return outputs

        engine.step = step


def post_and_hang_up(url: str, route: str, body: dict, held: HeldLeases, aborted: threading.Event) -> None:
    """POST body, hang up once the engine has leased its prompt, let the engine go on once the server has
    seen the client leave (it aborts the request, which has finished)."""
    held.leased.clear(), held.go.clear(), aborted.clear()
    held.is_armed = True
    host, port = url.removeprefix("http://").rsplit(":", 1)
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST {route} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(data)}\r\n\r\n".encode() + data)
        assert held.leased.wait(30)
    assert aborted.wait(30)
    held.go.set()


def test_a_prefill_whose_client_left_before_its_response_gives_its_lease_back(stories_path):
    # The lease was made, but its params reached nobody: no decode server could claim it, and its blocks
    # stayed out of the pool until it ran out (60 s here). A response that was delivered keeps its
    # lease: that is how a decode server claims it.
    held = HeldLeases()
    with running_server(stories_path, engine_core="thread", core_hook=held.install,
                        options=ServerOptions(chat_template=CHAT_TEMPLATE),
                        kv_transfer_config={"kv_role": "kv_producer", "kv_lease_s": 60}) as (url, engine):
        aborted = threading.Event()
        real_abort = engine.abort

        def abort(request_id):
            aborted.set()
            real_abort(request_id)

        engine.abort = abort
        delivered = httpx.post(f"{url}/v1/completions", json={**PREFILL, **ROUTES["/v1/completions"]}, timeout=60)
        assert delivered.status_code == 200 and delivered.json()["kv_transfer_params"]["remote_lease_id"]
        for num_gone, (route, fields) in enumerate(ROUTES.items(), 1):
            post_and_hang_up(url, route, {**PREFILL, **fields}, held, aborted)
            assert wait_for(lambda: get_stats(url)["kv_transfer_leases_released"] == num_gone), route
        stats = get_stats(url)
        assert (stats["kv_transfer_num_leases"], stats["kv_transfer_leases_expired"]) == (1, 0)


# ---- chat: /set parameter KEY's usage and errors name KEY as typed ---------------------------------------

def set_lines(*lines: str) -> list[str]:
    """What the chat answers to each line."""
    out = io.StringIO()
    session = ChatSession(_EchoBackend(), ChatSettings(), out=out)
    answers = []
    for line in lines:
        session.handle(line)
        answers.append(out.getvalue().strip())
        out.seek(0), out.truncate()
    return answers


def test_set_parameter_usage_and_errors_name_the_parameter_as_typed():
    # They named /set's own key: "usage: /set seed VALUE", "error: max_tokens must be ..." for num_predict.
    assert set_lines("/set parameter seed", "/set parameter num_predict", "/set parameter num_predict 0",
                     "/set parameter num_predict x", "/set parameter temperature -1") == [
        "usage: /set parameter seed VALUE", "usage: /set parameter num_predict VALUE",
        "error: num_predict must be an integer >= 1, got 0", "error: num_predict needs an integer, got 'x'",
        "error: temperature must be non-negative, got -1.0"]
    # /set's own names are answered as before.
    assert set_lines("/set seed", "/set max_tokens 0", "/set parameter num_predict 5") == [
        "usage: /set seed VALUE", "error: max_tokens must be an integer >= 1, got 0", "(max_tokens = 5)"]


# ---- run-batch: a handler's failure is answered as the server answers it ---------------------------------

FAILURES = {"value": ValueError("bad value"), "type": TypeError("bad type"), "not-implemented": NotImplementedError(
    "not here"), "key": KeyError("k"), "empty": RuntimeError()}


def failing_app() -> FastAPI:
    """An app with the server's error handlers whose completions route raises what the body names."""
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request):
        raise FAILURES[(await request.json())["raise"]]

    return app


def test_a_handlers_failure_in_a_batch_line_has_the_servers_status_and_error_body():
    # It was a 500 with the bare message for every exception: a ValueError a server answers with a 400,
    # a NotImplementedError with a 501, and the error not the body the server sends.
    app = failing_app()
    lines = [json.dumps({"custom_id": kind, "method": "POST", "url": "/v1/completions", "body": {"raise": kind}})
             for kind in FAILURES]
    out = io.StringIO()
    asyncio.run(run_requests(app, [parse_line(i, line) for i, line in enumerate(lines)], out, 4))
    outputs = {o["custom_id"]: o for o in map(json.loads, out.getvalue().removesuffix("\n").split("\n"))}

    async def served(kind: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            return await client.post("/v1/completions", json={"raise": kind})

    statuses = {}
    for kind in FAILURES:
        response = asyncio.run(served(kind))
        assert outputs[kind]["response"]["status_code"] == response.status_code, kind
        assert outputs[kind]["error"] == response.json(), kind
        statuses[kind] = response.status_code
    assert statuses == {"value": 400, "type": 400, "not-implemented": 501, "key": 500, "empty": 500}
    assert outputs["empty"]["error"]["error"]["message"] == "RuntimeError"


# ---- monitor (and chat --url): a URL of one of the server's endpoints reaches the server -------------------

async def first_events(source: LiveSource, count: int) -> list:
    """The first COUNT events of a monitor's source, its generator closed in this task (as the
    dashboard's worker closes it): left to asyncio.run's shutdown, the client it holds is closed
    from another task, which httpcore's locks refuse."""
    events = []
    async with contextlib.aclosing(source.events(lambda: 64)) as stream:
        async for event in stream:
            events.append(event)
            if len(events) >= count:
                return events


def test_the_url_of_a_servers_endpoint_reaches_the_server_and_another_path_is_pointed_at(stories_path, monkeypatch):
    # minillm monitor http://host:port/metrics (Prometheus' scrape target) said "has no /v1/stats: is this a
    # minillm server?", as chat --url with it said the server answered 404.
    monkeypatch.setattr(tui_client, "BACKOFF_START_S", 0.01)
    with running_server(stories_path, engine_core="thread") as (url, _):
        for endpoint in ("/metrics", "/health/", "/version"):
            assert server_base_url(f"{url}{endpoint}") == url
            events = asyncio.run(first_events(LiveSource(f"{url}{endpoint}"), 2))
            assert events[0].text == f"live {url} (stream)" and isinstance(events[1], StatsFrame), (endpoint, events)
        assert HttpChatBackend(f"{url}/metrics").model == "stories"
        # Another path is kept (a server behind a proxy may live under one); its 404 names the URL without it.
        problem = asyncio.run(first_events(LiveSource(f"{url}/stats"), 2))[1]
        assert isinstance(problem, SourceProblem)
        assert problem.message == f"{url}/stats has no /v1/stats (404): is the server at {url}, without the path /stats?"


# ---- chat --url: a server restarted under another model name ---------------------------------------------

def test_chat_url_goes_on_with_the_model_a_restarted_server_serves_under_another_name(stories_path):
    # The chat read /v1/models once, at start: every message after the restart was a 404 ("The model
    # 'stories' does not exist.") until the chat was started again.
    options = ServerOptions(chat_template=CHAT_TEMPLATE)
    with running_server(stories_path, engine_core="thread", options=options) as running:
        url, engine = running
        backend = HttpChatBackend(url)
        out = io.StringIO()
        session = ChatSession(backend, ChatSettings(max_tokens=4, temperature=0.0), out=out)
        session.handle("Hi")
        assert backend.model == "stories" and session.num_failed_replies == 0, out.getvalue()
        running.http.stop()
        app = create_app(engine, dataclasses.replace(options, served_model_name="renamed", engine_core="thread"))
        restarted = ServerThread(app, "127.0.0.1", running.http.port).start()
        try:
            out.seek(0), out.truncate()
            session.handle("Hello again")
            assert session.num_failed_replies == 0, out.getvalue()
            assert out.getvalue().splitlines()[0] == (f"note: the server at {url} no longer serves 'stories'; the "
                                                      "chat goes on with 'renamed', the model it serves now.")
            assert backend.model == "renamed" and backend.name == f"renamed at {url}"
            assert [t["role"] for t in session.conversation.turns] == ["user", "assistant"] * 2
        finally:
            restarted.stop()


def test_chat_url_keeps_the_404_when_the_server_serves_no_one_model_in_its_place(stories_path):
    with running_server(stories_path, engine_core="thread", served_model_name=("first", "second"),
                        options=ServerOptions(chat_template=CHAT_TEMPLATE)) as (url, _):
        backend = HttpChatBackend(url, model="first")
        backend.model = "gone"          # as after a restart under other names
        out = io.StringIO()
        session = ChatSession(backend, ChatSettings(max_tokens=4), out=out)
        session.handle("Hi")
        assert session.num_failed_replies == 1 and backend.model == "gone"
        assert "server answered 404: The model 'gone' does not exist." in out.getvalue(), out.getvalue()
