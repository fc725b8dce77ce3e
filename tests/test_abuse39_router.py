"""`minillm router` as operators and clients use it: a client that leaves while its prompt is
prefilled, bodies that grow on the way to a server, backends on Unix sockets, a router that names
itself as its own backend, and the headers of a server's refusal."""
from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest
from test_abuse29_pd_router import BODY, Backend, prefill_backend, released
from test_server_helpers import running_router, wait_for

from minillm.router import RouterConfig


class LateBackend(Backend):
    """Backend whose prefill (path /late/...) answers only once the test says so, its lease made
    whether or not the router still reads the answer."""

    def do_POST(self) -> None:
        if not self.path.startswith("/late/"):
            return super().do_POST()
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        assert body["kv_transfer_params"] == {"do_remote_decode": True}
        self.server.prefill_seen.set()
        assert self.server.go.wait(30)
        lease = self.server.leases.create([3, 4], "hash", 5)
        try:
            self._send(200, {"choices": [{"text": "x"}], "kv_transfer_params": {
                "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": self.server.endpoint.port,
                "remote_lease_id": lease.lease_id, "remote_num_tokens": 5, "remote_prompt_hash": "hash"}})
        except OSError:
            pass          # the router closed the connection: nobody will read the lease's id


@pytest.fixture
def late_backend():
    with prefill_backend(LateBackend, prefill_seen=threading.Event(), go=threading.Event(),
                         taken=threading.Event(), closed=threading.Event()) as both:
        yield both


def test_a_client_that_leaves_during_the_prefill_has_its_lease_given_back(late_backend):
    # The router dropped the prefill request when its client left. A prefill server that had finished
    # it by then (its response on the way) held the prompt's blocks under a lease nobody could name,
    # for the whole lease (30 s): clients that time out under load filled the prefill server's pool.
    url, server = late_backend
    with running_router(RouterConfig((url + "/late",), (url,))) as router:
        data = json.dumps(BODY).encode()
        with socket.create_connection(("127.0.0.1", int(router.rsplit(":", 1)[1]))) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
                           b"content-length: %d\r\n\r\n%s" % (len(data), data))
            assert server.prefill_seen.wait(10)
        stats = lambda: httpx.get(f"{router}/v1/stats").json()     # noqa: E731
        assert wait_for(lambda: stats()["num_client_closed"] == 1, timeout=10), stats()
        server.go.set()
        assert wait_for(lambda: released(server) == 1, timeout=10), server.leases.snapshot()
