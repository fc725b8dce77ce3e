"""Leftovers: a prefill server's lease whose response never left, chat --url after a server's restart
under another model name, /set parameter's lines, monitor URLs with an endpoint's path, and run-batch's
status for a handler's failure."""
from __future__ import annotations

import io
import json
import socket
import threading

import httpx
from test_abuse30_chat import _EchoBackend
from test_server_helpers import CHAT_TEMPLATE, get_stats, running_server, wait_for

from minillm.chat import ChatSession, ChatSettings
from minillm.server.app import ServerOptions

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
