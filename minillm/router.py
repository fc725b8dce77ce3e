"""`minillm router`: an OpenAI-compatible proxy in front of prefill and decode servers, speaking
vLLM's kv_transfer_params protocol between them (as vLLM's disaggregated-serving proxy does).

    minillm serve MODEL --port 8100 --kv-role producer
    minillm serve MODEL --port 8200 --kv-role consumer
    minillm router --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Each request goes first to a prefill server with max_tokens 1, stream false and kv_transfer_params
{"do_remote_decode": true}; the kv_transfer_params its response carries go with the original
request to a decode server, whose answer (an event stream or JSON) is passed through. A server is
given as http(s)://host:port or as unix:PATH (serve --uds PATH). Several URLs of a role take turns
(round robin); one that refuses the connection is skipped for the next, and is down for a backoff
(1 s, doubled for each failure since it last took a request, up to 30 s): requests go to the others
without trying it, until its backoff ends and its /health answers 200. A role with no server up or
reachable is a 503 (with Retry-After), a server that fails mid-request a 502 (an error event when the
stream had begun): never a hang, since connects time out. GET /metrics: the router's own Prometheus
series (minillm_router_*: requests and errors by route, requests and failures and health by server,
request durations). A request that comes back (its Via header names this router:
a URL that leads to the router itself) is a 508. The router's own errors take the
shape of the route's API, as a server's do: Anthropic's on /v1/messages (its `error` event
mid-stream), and a Responses stream ends with response.failed. One log line per request says
where its time went: prefill, KV transfer, decode (the decode server's x-minillm-kv-transfer
header, passed on to the client). A request the protocol cannot hand over as one prompt's lease
(several prompts, n > 1, any /v1/responses or /v1/messages request) goes whole to a decode server, which
computes its prompts itself. A lease no decode server takes (it refused the request, none was
reachable, or the client left first, even mid-prefill: that prefill is read to its end for its lease)
is given back to the prefill server at once, not left to run out; one a decode server claimed is left
to that server, whose engine may still copy its blocks.
A server's 400 naming the kv_transfer_params the router wrote (servers that do not fit together:
another block size or model, no --kv-role) is the router's 502, not the client's 400.
/v1/models (and /v1/models/{model}), /v1/responses/{id}, /tokenize, /detokenize, /version and
/v1/messages/count_tokens need no KV: a decode server answers them, with the client's credentials (Authorization or x-api-key). With --api-key the
router itself wants one of its keys on /v1, as a server does, before any server sees the request.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import math
import socket
import sys
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import httpx
import uvicorn
from pydantic import TypeAdapter, ValidationError
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from minillm.server.errors import (
    APIError, anthropic_error_event, body_parse_error, error_response, install_error_handlers, openai_error_events,
    response_failed_event,
)
from minillm.server.http import uvicorn_settings
from minillm.server.json_body import LARGE_BODY_BYTES, parse_body
from minillm.server.limits import ServerLimits, check_limit
from minillm.server.middleware import GENERATION_PATHS, APIKeyMiddleware, BodyLimitMiddleware, is_messages_path
from minillm import sse
from minillm.router_metrics import RouterMetrics
from minillm.urls import check_server_url, client_endpoint, http_url, server_base_url, shown_url, unix_socket_path
from minillm.kv_connector.endpoint import ClaimClient
from minillm.server.kv_transfer import CLAIM_TIMEOUT_S, HEADER as KV_TRANSFER_HEADER
from minillm.server.streaming import ClientGone, EventStreamResponse, HangUpWatch

logger = logging.getLogger("minillm.router")

ROUTES = GENERATION_PATHS      # the routes that generate, the server's own list
# Where a server takes --api-key from: OpenAI's clients send Authorization, Anthropic's x-api-key.
KEY_HEADERS = ("authorization", "x-api-key")
MAX_SAMPLES = 4096
SLICE_ITEMS = 4096       # list items a large body's encoding takes per call (about 1 ms of token ids)
RELEASE_WAIT_S = 1.0     # how long closing waits for the lease releases already sent
MAX_HELD_EVENT_BYTES = 1 << 20    # of a decode server's event, held to relay it whole


@dataclass(frozen=True)
class RouterConfig:
    """The backends and how long to wait for them."""

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    connect_timeout_s: float = 3.0      # a server that does not accept in this long is down
    timeout_s: float = 600.0            # a response (a long prompt's prefill) may take this long
    health_timeout_s: float = 2.0
    # A body larger than a server takes by default is refused here, before it is read whole and
    # parsed on the event loop (a 1 GB one held the router's memory and loop, then was a 413 anyway).
    max_body_bytes: int = ServerLimits.max_body_bytes
    body_timeout_s: float = ServerLimits.body_timeout_s
    api_keys: tuple[str, ...] = ()      # a client must send one of these on /v1 (none: open), as serve's --api-key
    # A server that refused a connection (or did not accept one in connect_timeout_s) is down this long,
    # doubled for each failure since it last answered, up to max_backoff_s; then its /health is checked
    # before a request goes to it again.
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        for role, urls in (("prefill", self.prefill_urls), ("decode", self.decode_urls)):
            if not urls:
                raise ValueError(f"give at least one --{role} URL")
            for url in urls:
                check_server_url(url, f"--{role}")
        for name, value in (("connect timeout", self.connect_timeout_s), ("timeout", self.timeout_s),
                            ("health timeout", self.health_timeout_s), ("backoff", self.backoff_s),
                            ("max backoff", self.max_backoff_s)):
            if not value > 0:   # a negative one fails every request, NaN too
                raise ValueError(f"the {name} must be a positive number of seconds, got {value}")
        check_limit("max_body_bytes", self.max_body_bytes)
        if not all(isinstance(key, str) and key.strip() for key in self.api_keys):
            # An empty key (an unset variable in `--api-key "$KEY"`) must not quietly mean "no auth".
            raise ValueError("an API key must not be empty (leave it out to take requests without a key)")
        check_limit("body_timeout_s", self.body_timeout_s)


class RouterError(Exception):
    """A failure the client sees as an error with this status, in the shape of its route's API."""

    def __init__(self, status: int, message: str, code: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.retry_after_s = retry_after_s      # when a server may be up again (the Retry-After header)

    def response(self, path: str) -> JSONResponse:
        """The error as the response of a request to path (Anthropic's shape on the Messages API's routes)."""
        response = error_response(APIError(self.status, self.message, code=self.code),
                                  is_anthropic=is_messages_path(path))
        if self.retry_after_s is not None:
            response.headers["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
        return response


@dataclass
class ServerHealth:
    """Whether a server is taken to be up: down from a failed connection until its backoff ends and
    a check of its /health finds it up."""

    down_until: float | None = None     # time.monotonic() when its backoff ends; None while it is up
    reason: str = ""                    # what put it down (ConnectError, /health answered 503, ...)
    num_down: int = 0                   # failed connections and checks since it last took a request
    is_checking: bool = False           # a check of its /health is in flight

    @property
    def is_up(self) -> bool:
        return self.down_until is None

    def mark_down(self, reason: str, config: RouterConfig) -> None:
        """Down for the backoff, doubled for each failure since it last took a request."""
        backoff_s = min(config.backoff_s * 2 ** self.num_down, config.max_backoff_s)
        self.down_until, self.reason, self.num_down = time.monotonic() + backoff_s, reason, self.num_down + 1

    def down_for_s(self) -> float:
        """Seconds left of its backoff (0 when up or due for a check)."""
        return 0.0 if self.down_until is None else max(0.0, self.down_until - time.monotonic())

    def is_due_for_check(self) -> bool:
        return not self.is_up and not self.is_checking and self.down_for_s() == 0.0


class Backends:
    """One role's servers, in turns, and what each took and failed (by the URL as shown)."""

    def __init__(self, role: str, urls: tuple[str, ...]) -> None:
        # A URL given as an OpenAI base URL (.../v1) names the same server: the routes add /v1.
        self.role, self.urls = role, [server_base_url(u) for u in urls]
        self._turn = itertools.count()
        self.num_requests: Counter[str] = Counter()    # requests a server took (its answer began)
        self.num_failures: Counter[str] = Counter()    # connections it refused, requests it failed

    def order(self) -> list[str]:
        """Every server, starting with the one whose turn it is."""
        start = next(self._turn) % len(self.urls)
        return self.urls[start:] + self.urls[:start]

    @property
    def shown_urls(self) -> list[str]:
        """The URLs as they may be shown (a password in one as ***): /health and /v1/stats need no key."""
        return [shown_url(u) for u in self.urls]


CLIENT_CLOSED = 499     # a request whose client went away before its response ended (nginx's status)


@dataclass
class RequestTiming:
    """Where one request's time went (seconds; transfer times as the decode server measured them)."""

    prefill_s: float = 0.0
    kv_claim_s: float = 0.0
    kv_copy_s: float = 0.0
    kv_tokens: int = 0
    kv_bytes: int = 0
    decode_first_s: float | None = None    # decode request sent -> its first byte
    decode_s: float = 0.0
    ttft_s: float | None = None            # request in -> the first decode byte out
    total_s: float = 0.0
    status: int = 200
    prefill_url: str = "-"
    decode_url: str = "-"
    decode_only: str | None = None         # why the request went whole to a decode server (no prefill server)


@dataclass
class Handoff:
    """A request's lease on a prefill server, until a decode server takes it."""

    kv: dict | None = None        # the prefill server's kv_transfer_params
    is_taken: bool = False        # a decode server answered 200, or may still hold the request


@dataclass
class RouterStats:
    """Recent per-request timings and counts, for GET /v1/stats."""

    num_requests: int = 0
    num_failed: int = 0
    num_client_closed: int = 0           # clients that left mid-stream (neither served whole nor failed)
    num_decode_only: int = 0             # requests a decode server computed whole (several prompts or n > 1)
    samples: deque = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    num_by_route: Counter = field(default_factory=Counter)          # route -> requests
    num_errors_by_route: Counter = field(default_factory=Counter)   # (route, status) -> requests not answered 200

    def record(self, timing: RequestTiming, route: str = "") -> None:
        """Count one finished request (of route)."""
        self.num_requests += 1
        self.num_by_route[route] += 1
        if timing.status != 200:
            self.num_errors_by_route[route, timing.status] += 1
        self.num_decode_only += timing.decode_only is not None
        if timing.status == CLIENT_CLOSED:
            self.num_client_closed += 1
        elif timing.status != 200:
            self.num_failed += 1
        else:
            self.samples.append(timing)

    def to_dict(self, backends: dict[str, list[str]]) -> dict:
        """Counts and, per stage, mean / p50 / p99 in milliseconds over the recent requests."""
        def summary(values: list[float]) -> dict:
            if not values:
                return {"mean": None, "p50": None, "p99": None}
            ordered = sorted(v * 1e3 for v in values)
            pick = lambda q: ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]  # noqa: E731
            return {"mean": sum(ordered) / len(ordered), "p50": pick(0.5), "p99": pick(0.99)}

        s = list(self.samples)
        return {"num_requests": self.num_requests, "num_failed": self.num_failed,
                "num_client_closed": self.num_client_closed, "num_decode_only": self.num_decode_only,
                "backends": backends,
                "prefill_ms": summary([t.prefill_s for t in s if t.decode_only is None]),
                "kv_transfer_ms": summary([t.kv_claim_s + t.kv_copy_s for t in s]),
                "kv_copy_ms": summary([t.kv_copy_s for t in s]),
                "decode_first_token_ms": summary([t.decode_first_s for t in s if t.decode_first_s is not None]),
                "decode_ms": summary([t.decode_s for t in s]),
                "ttft_ms": summary([t.ttft_s for t in s if t.ttft_s is not None]),
                "kv_transfer_tokens": sum(t.kv_tokens for t in s), "kv_transfer_bytes": sum(t.kv_bytes for t in s)}


def prefill_body(body: dict) -> dict:
    """The prefill server's request: the prompt, one token, no stream, and the ask for a lease."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def encode_body(body: dict, in_slices: bool = False) -> bytes:
    """body as JSON no longer than the client's: compact, its text in UTF-8. json.dumps's defaults
    spaced every item and wrote each character past ASCII as a 6-byte escape, so a body within the
    servers' limit could pass it on the way (their 413 for a body they take from a client, where they
    name the field at fault). NaN and Infinity go on as the client wrote them, for the server's 400
    naming the field (httpx's json= refuses them); text with a lone surrogate keeps its escapes.
    in_slices: encoded a slice at a time (_sliced), for a worker thread."""
    try:
        return _dumps(body, ensure_ascii=False, in_slices=in_slices).encode()
    except UnicodeEncodeError:       # a lone surrogate (\ud800) is no UTF-8
        return _dumps(body, ensure_ascii=True, in_slices=in_slices).encode()


def _dumps(value: Any, ensure_ascii: bool, in_slices: bool) -> str:
    dumps = functools.partial(json.dumps, ensure_ascii=ensure_ascii, separators=(",", ":"))
    return _sliced(value, dumps) if in_slices else dumps(value)


def _sliced(value: Any, dumps: Callable[[Any], str]) -> str:
    """dumps(value), a dict a field per call and a list SLICE_ITEMS items per call (one of lists or
    objects an item per call): each call back into Python lets a worker thread hand the GIL to the
    event loop, which one json.dumps of 3 million token ids held for 0.6 s."""
    if isinstance(value, dict):
        return "{" + ",".join(dumps(key) + ":" + _sliced(item, dumps) for key, item in value.items()) + "}"
    if not isinstance(value, list):
        return dumps(value)
    parts = []
    for start in range(0, len(value), SLICE_ITEMS):
        chunk = value[start:start + SLICE_ITEMS]
        if any(isinstance(item, (list, dict)) for item in chunk):
            parts.extend(_sliced(item, dumps) for item in chunk)
        else:
            parts.append(dumps(chunk)[1:-1])       # the items, less the brackets
    return "[" + ",".join(parts) + "]"


async def encoded(body: dict, is_large: bool) -> bytes:
    """encode_body(body), a large one on a worker thread a slice at a time (as a large body is parsed)."""
    if is_large:
        return await asyncio.to_thread(encode_body, body, True)
    return encode_body(body)


_INT = TypeAdapter(int)
_BOOL = TypeAdapter(bool)


def _count(value: Any) -> int:
    """A request's n or best_of as a server reads it (pydantic's integer: "2" and 2.0 are 2, which went
    with kv_transfer_params to a decode server that refused n = 2 with them); 1 when absent or no
    integer (the server's 400 then)."""
    try:
        return _INT.validate_python(value)
    except ValidationError:
        return 1


def _is_set(value: Any) -> bool:
    """A request's boolean as a server reads it (pydantic's: "true" and 1 are true); False when absent
    or no boolean (the server's 400 then)."""
    try:
        return _BOOL.validate_python(value)
    except ValidationError:
        return False


def _num_prompts(prompt: Any) -> int:
    """How many prompts a completions request carries (a list of strings or of token-id lists)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return 1


def decode_only_reason(path: str, body: dict) -> str | None:
    """Why one prompt's lease cannot carry this request (several prompts, or several completions of
    one, which the protocol hands over one at a time; a beam search, whose steps are requests of
    their own); None when it can. Such a request goes whole to a decode server, which computes its
    prompts itself. A Responses or Anthropic Messages API request (which carries no
    kv_transfer_params) goes so too."""
    if path in ("/v1/responses", "/v1/messages"):
        return "the Responses API" if path == "/v1/responses" else "the Messages API"
    if _is_set(body.get("use_beam_search")):
        return "beam search"
    num_prompts = _num_prompts(body.get("prompt")) if path == "/v1/completions" else 1
    if num_prompts > 1:
        return f"{num_prompts} prompts"
    n = max(_count(body.get("n")), _count(body.get("best_of")))
    return f"n = {n}" if n > 1 else None


def client_headers(raw: Request, names: tuple[str, ...]) -> dict[str, bytes]:
    """The client's headers of these names as the bytes it sent: a value need not be ASCII (httpx
    refuses to encode such a str, a 500 here), and the server reads the bytes as it would the client's."""
    return {name.decode("latin-1"): value for name, value in raw.headers.raw if name.decode("latin-1") in names}


def kv_transfer_refusal(response: httpx.Response) -> str | None:
    """The message of a server's 4xx that names kv_transfer_params (the router writes that field for
    a prefill server, whatever the client sent), else None."""
    if not 400 <= response.status_code < 500:
        return None
    try:
        error = sse.loads(response.content)["error"]
        return str(error["message"]) if error.get("param") == "kv_transfer_params" else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


# A server's response headers that the client gets too: what the KV transfer took, vLLM's X-Request-Id
# (--enable-request-id-headers), the scheme of a 401 (RFC 9110 says it must name one) and when to try again.
PASSED_HEADERS = (KV_TRANSFER_HEADER, "x-request-id", "www-authenticate", "retry-after")


def passed_headers(response: httpx.Response) -> dict[str, str]:
    """The headers of PASSED_HEADERS that a server's response carries."""
    return {name: response.headers[name] for name in PASSED_HEADERS if name in response.headers}


def is_event_stream(response: httpx.Response) -> bool:
    """Whether a server's response is an event stream (a streamed answer, relayed event by event)."""
    return response.headers.get("content-type", "").split(";", 1)[0].strip().lower() == "text/event-stream"


def read_transfer_header(response: httpx.Response, timing: RequestTiming) -> None:
    """What the decode server says the KV transfer took (its x-minillm-kv-transfer header); a header
    no minillm server writes (1e999 tokens, JSON nested past the stack) is left out of the log line."""
    try:
        kv = sse.loads(response.headers.get(KV_TRANSFER_HEADER, "{}"))
        timing.kv_claim_s, timing.kv_copy_s = kv.get("claim_ms", 0) / 1e3, kv.get("copy_ms", 0) / 1e3
        timing.kv_tokens, timing.kv_bytes = int(kv.get("tokens", 0)), int(kv.get("bytes", 0))
    except (ValueError, TypeError, AttributeError, OverflowError):
        pass


class RelayedEvents:
    """What the router has relayed of a decode server's stream, to end it as the route's API ends a failed one."""

    def __init__(self, path: str, model: Any = None) -> None:
        self.path = path
        self.model = model                     # the request's, for a response the server never began
        self.num_events = 0
        self.response: dict | None = None      # the response.created event's
        self.items: list[dict] = []            # the response.output_item.done events'

    def note(self, events: bytes) -> None:
        """Take note of whole events on their way to the client."""
        if self.path != "/v1/responses":     # the other APIs' error events need nothing of the stream
            return
        # response.failed is numbered next and carries the response with the items done. Every event
        # ends with a blank line, and the server's JSON has no raw newline.
        self.num_events += events.count(b"\n\n")
        if b"event: response.created\n" in events or b"event: response.output_item.done\n" in events:
            for event in events.split(b"\n\n"):     # only these are parsed: a few per stream, not one per token
                self._read(event)

    def _read(self, event: bytes) -> None:
        kind, _, data = event.partition(b"\ndata: ")
        try:
            if kind == b"event: response.created":
                self.response = sse.loads(data)["response"]
            elif kind == b"event: response.output_item.done":
                self.items.append(sse.loads(data)["item"])
        except (ValueError, KeyError, TypeError):
            pass          # not the event a server writes: the failure says what it can without it

    def failure_events(self, err: APIError) -> bytes:
        """The events that end the stream with err, in the route's API's shape."""
        if is_messages_path(self.path):
            return anthropic_error_event(err).encode()
        if self.path != "/v1/responses":
            return openai_error_events(err).encode()
        response = self.response or {"id": f"resp_{uuid.uuid4().hex}", "object": "response",
                                     "created_at": int(time.time()), "model": self.model}
        return response_failed_event(err, {**response, "output": self.items}, self.num_events).encode()


class Router:
    """The proxy's state: its HTTP client, the backends of each role, the stats."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.prefill, self.decode = Backends("prefill", config.prefill_urls), Backends("decode", config.decode_urls)
        # Each server's, whichever role it has: a server given as both is down for both.
        self.server_health = {url: ServerHealth() for url in [*self.prefill.urls, *self.decode.urls]}
        self.stats = RouterStats()
        self.metrics = RouterMetrics(self)
        self._checks: dict[str, asyncio.Task] = {}     # the /health checks in flight, by server
        self.client: httpx.AsyncClient | None = None
        self.socket_clients: dict[str, httpx.AsyncClient] = {}    # the servers on Unix sockets (serve --uds)
        self.leases: ClaimClient | None = None     # gives back the leases no decode server took
        self._releases: set[asyncio.Task] = set()
        self._prefills: set[asyncio.Task] = set()      # prefills whose clients left, run to their end
        self._ids = itertools.count()
        # What this router adds to the Via header of its requests, by which one that comes back is known.
        self.via_name = f"minillm-router-{uuid.uuid4().hex[:12]}".encode()

    def via(self, headers: dict[str, bytes]) -> dict[str, bytes]:
        """headers with this router added to their Via (RFC 9110's list of the proxies a request passed)."""
        own = b"1.1 " + self.via_name
        return {**headers, "via": headers["via"] + b", " + own if headers.get("via") else own}

    async def start(self) -> None:
        """Open the HTTP client (on the serving event loop)."""
        timeout = httpx.Timeout(self.config.timeout_s, connect=self.config.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)
        for url in {*self.prefill.urls, *self.decode.urls}:
            path = unix_socket_path(url)
            if path is not None:
                self.socket_clients[url] = httpx.AsyncClient(
                    transport=httpx.AsyncHTTPTransport(uds=path, limits=limits), timeout=timeout)

    async def close(self) -> None:
        """Close the HTTP client, and the lease releases' sockets once the releases sent have gone
        (a second at most: one still waiting then is left to the lease's end)."""
        # Prefills whose clients have left (their leases run out) and /health checks in flight.
        for task in [*self._prefills, *self._checks.values()]:
            task.cancel()
        for client in [self.client, *self.socket_clients.values()]:
            if client is not None:
                await client.aclose()
        if self._releases:
            await asyncio.wait(self._releases, timeout=RELEASE_WAIT_S)
        if self.leases is not None:
            self.leases.close()

    def endpoint(self, url: str) -> tuple[httpx.AsyncClient, str]:
        """The client that reaches the server at url and the base URL its requests name (http://localhost
        for a server on a Unix socket, which has a client of its own)."""
        base, path = client_endpoint(url)
        return (self.client if path is None else self.socket_clients[url]), base

    async def live(self, backends: Backends) -> list[str]:
        """The role's servers that are up, starting with the one whose turn it is. A down server whose
        backoff has ended has its /health checked: in the background while another is up, waited
        for (health_timeout_s at most) when none is. None up: a 503 saying when one may be."""
        order, health = backends.order(), self.server_health
        for url in order:
            if health[url].is_due_for_check():
                self._check(url)
        up = [url for url in order if health[url].is_up]
        checks = [self._checks[url] for url in order if url in self._checks]
        if not up and checks:
            await asyncio.wait(checks, timeout=self.config.health_timeout_s + 1)   # a check's own timeout ends it
            up = [url for url in order if health[url].is_up]
        if up:
            return up
        reasons = "; ".join(f"{shown_url(url)}: down for another {health[url].down_for_s():.1f} s after "
                            f"{health[url].reason}" for url in backends.urls)
        raise RouterError(503, f"no {backends.role} server is reachable ({reasons})", f"{backends.role}_unavailable",
                          retry_after_s=min(health[url].down_for_s() for url in backends.urls))

    def _check(self, url: str) -> None:
        """Check a down server's /health in the background: up again if it answers 200, else down for
        a longer backoff."""
        health = self.server_health[url]
        health.is_checking = True

        async def check() -> None:
            client, base = self.endpoint(url)
            try:
                response = await client.get(base + "/health", headers=self.via({}),
                                            timeout=self.config.health_timeout_s)
                reason = None if response.status_code == 200 else f"/health answered {response.status_code}"
            except httpx.HTTPError as exc:
                reason = f"/health: {type(exc).__name__}"
            finally:
                health.is_checking = False
                self._checks.pop(url, None)
            if reason is None:
                health.down_until = None
                logger.info("%s is up again (/health answered 200)", shown_url(url))
            else:
                health.mark_down(reason, self.config)

        self._checks[url] = asyncio.ensure_future(check())

    def health_answered(self, url: str, down_reason: str | None, is_ok: bool) -> None:
        """The router's view of a server that GET /health checked: down and answering 200 (is_ok), it is
        up again, as its own check would find it; up and refusing the connection (down_reason), it is
        down for its backoff, as a request would leave it (another status leaves it up, as a request's
        answer does). A probe neither lengthens a down server's backoff nor counts as a request's failure."""
        health = self.server_health[url]
        if is_ok and not health.is_up:
            health.down_until = None
            logger.info("%s is up again (/health answered 200)", shown_url(url))
        elif down_reason is not None and health.is_up:
            health.mark_down(down_reason, self.config)
            logger.warning("server %s is down for %.1f s: %s", shown_url(url), health.down_for_s(), down_reason)

    def _connect_failed(self, backends: Backends, url: str, exc: Exception) -> str:
        """Mark a server that refused a connection down; the failure as the 503 lists it."""
        health = self.server_health[url]
        if health.is_up:
            health.mark_down(type(exc).__name__, self.config)
            logger.warning("%s server %s is down for %.1f s: %s", backends.role, shown_url(url),
                           health.down_for_s(), type(exc).__name__)
        backends.num_failures[shown_url(url)] += 1
        return f"{shown_url(url)}: {type(exc).__name__}"

    def _took(self, backends: Backends, url: str) -> str:
        """Count a request a server took: it answered, so the failures before it are forgotten."""
        self.server_health[url].num_down = 0
        backends.num_requests[shown_url(url)] += 1
        return shown_url(url)

    async def send(self, backends: Backends, path: str, content: bytes, headers: dict, stream: bool
                   ) -> tuple[str, httpx.Response]:
        """POST a JSON body (encode_body's) to the role's servers that are up, in turn, until one accepts
        the connection; (its URL as it may be shown, its response)."""
        failures = []
        for url in await self.live(backends):
            client, base = self.endpoint(url)
            request = client.build_request("POST", base + path, content=content,
                                           headers={**headers, "content-type": "application/json"})
            try:
                response = await client.send(request, stream=stream)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                failures.append(self._connect_failed(backends, url, exc))
                continue
            except httpx.HTTPError as exc:
                backends.num_failures[shown_url(url)] += 1
                raise RouterError(502, f"the {backends.role} server {shown_url(url)} failed: "
                                  f"{type(exc).__name__}: {exc}", f"{backends.role}_server_failed") from None
            return self._took(backends, url), response
        raise RouterError(503, f"no {backends.role} server is reachable ({'; '.join(failures)})",
                          f"{backends.role}_unavailable", retry_after_s=self.config.backoff_s)

    async def route(self, path: str, raw: Request) -> Response:
        """One OpenAI request through a prefill server and a decode server."""
        started = time.monotonic()
        request_id = f"router-{next(self._ids)}"
        timing = RequestTiming()
        raw_body = await raw.body()
        if not raw_body:
            return RouterError(400, "the request body is empty; send a JSON object",
                               "invalid_body").response(path)
        try:
            body = await parse_body(raw_body)     # a large one on a worker thread, as the servers parse it
        except (ValueError, RecursionError) as exc:   # bad JSON, not UTF-8, nested too deeply: the server's 400
            err = body_parse_error(exc)
            return RouterError(400, err.message, err.code).response(path)
        if not isinstance(body, dict):
            return RouterError(400, "the request body must be a JSON object", "invalid_body").response(path)
        # The client's key (either header a server takes it from), and its request id, which names
        # the response as a single server would.
        headers = self.via(client_headers(raw, (*KEY_HEADERS, "x-request-id", "via")))
        timing.decode_only = decode_only_reason(path, body)
        handoff = Handoff()
        try:
            # A client that hangs up before the decode server's answer cancels the requests in flight
            # (their connections close, which aborts them on the servers), as a server's own would.
            return await HangUpWatch.of(raw.scope, raw.receive).run(
                self._serve(request_id, path, body, headers, timing, started, handoff,
                            is_large=len(raw_body) > LARGE_BODY_BYTES))
        except ClientGone:
            timing.status = CLIENT_CLOSED
            self._finish(request_id, path, timing, started)
            return RouterError(CLIENT_CLOSED, "client disconnected", "client_closed_request").response(path)
        finally:
            if handoff.kv is not None and not handoff.is_taken:
                self._give_back(handoff.kv)

    async def _serve(self, request_id: str, path: str, body: dict, headers: dict, timing: RequestTiming,
                     started: float, handoff: "Handoff", is_large: bool) -> Response:
        """The request through a prefill server (unless a decode server computes it whole) and a decode
        server: the decode server's answer, or its stream relayed."""
        try:
            if timing.decode_only is None:
                content = await encoded(prefill_body(body), is_large)
                kv = await self._prefill_to_its_end(path, content, headers, timing)
                if isinstance(kv, Response):        # the prefill server refused it: its answer is the client's
                    timing.status = kv.status_code
                    self._finish(request_id, path, timing, started)
                    return kv
                handoff.kv = kv
                body = {**body, "kv_transfer_params": kv}
            content = await encoded(body, is_large)
            sent = time.monotonic()
            timing.decode_url, response = await self.send(self.decode, path, content, headers, stream=True)
        except RouterError as exc:
            # A 503 is a connection no decode server took; after any other failure one may hold the request.
            handoff.is_taken = exc.status != 503
            timing.status = exc.status
            self._finish(request_id, path, timing, started)
            return exc.response(path)
        # A decode server that refused the request holds no claim on the lease (it gives back one it made).
        handoff.is_taken = response.status_code == 200
        read_transfer_header(response, timing)
        passed = passed_headers(response)
        # The server's answer says whether it streams: it reads "stream" by its own rules ("false" is
        # false to it), which Python's truth need not follow.
        if response.status_code != 200 or not is_event_stream(response):
            try:
                data, failure = await response.aread(), None
            except httpx.HTTPError as exc:
                data, failure = b"", exc
            finally:
                await response.aclose()
            if failure is not None:
                self.decode.num_failures[timing.decode_url] += 1
                timing.status = 502
                self._finish(request_id, path, timing, started)
                return RouterError(502, f"the decode server {timing.decode_url} failed: {type(failure).__name__}: "
                                   f"{failure}", "decode_server_failed").response(path)
            # A 400 naming the params the router wrote (not the client) says the servers do not fit
            # together: another block size, no --kv-role. The lease goes back (it was not taken).
            refusal = kv_transfer_refusal(response) if handoff.kv is not None else None
            if refusal is not None:
                timing.status = 502
                self._finish(request_id, path, timing, started)
                return RouterError(502, f"the decode server {timing.decode_url} refused the KV transfer: {refusal}",
                                   "decode_server_failed").response(path)
            timing.decode_s, timing.status = time.monotonic() - sent, response.status_code
            timing.ttft_s = time.monotonic() - started
            self._finish(request_id, path, timing, started)
            return Response(data, status_code=response.status_code, headers=passed,
                            media_type=response.headers.get("content-type", "application/json"))
        relayed = RelayedEvents(path, body.get("model"))
        # Written as the servers write theirs: a client that hangs up ends the relay, which closes
        # the decode server's stream (and so aborts its request there).
        stream = EventStreamResponse(self._relay(request_id, relayed, response, timing, started, sent))
        stream.headers.update(passed)
        return stream

    def _give_back(self, kv: dict) -> None:
        """Release a lease no decode server took (it refused the request, none was reachable, or the
        client left first), without waiting: its blocks go back to the prefill server's pool now, not
        when the lease runs out. A decode server releases the leases it claims itself."""
        host, port, lease_id = kv.get("remote_host"), kv.get("remote_port"), kv.get("remote_lease_id")
        if not (isinstance(host, str) and isinstance(lease_id, str) and type(port) is int and 1 <= port <= 65535):
            return              # not a lease the router can name: it runs out on the prefill server
        if self.leases is None:
            self.leases = ClaimClient(CLAIM_TIMEOUT_S)
        # A decode server that claimed it (the client left while it held the request) releases it
        # itself, once no copy of its engine reads the blocks: the producer ignores this one then.
        task = asyncio.ensure_future(self.leases.release(host, port, lease_id, if_unclaimed=True))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _prefill_to_its_end(self, path: str, content: bytes, headers: dict, timing: RequestTiming
                                  ) -> dict | Response:
        """_prefill, which a client that leaves meanwhile does not cut short: a prefill server that has
        finished the request holds its prompt's blocks under a lease that only its response names
        (a closed connection cannot tell whether one was made), so the response is read to its end
        and its lease given back, as the lease of any request no decode server took."""
        task = asyncio.ensure_future(self._prefill(path, content, headers, timing))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._prefills.add(task)
            task.add_done_callback(self._give_back_prefilled)
            raise

    def _give_back_prefilled(self, task: asyncio.Task) -> None:
        """Give back the lease of a prefill whose client left before it ended."""
        self._prefills.discard(task)
        if not task.cancelled() and task.exception() is None and isinstance(task.result(), dict):
            self._give_back(task.result())

    async def _prefill(self, path: str, content: bytes, headers: dict, timing: RequestTiming) -> dict | Response:
        """The prefill server's kv_transfer_params for the request prefill_body made, or its error
        response to pass on."""
        t0 = time.monotonic()
        url, response = await self.send(self.prefill, path, content, headers, stream=False)
        timing.prefill_url = url
        timing.prefill_s = time.monotonic() - t0
        refusal = kv_transfer_refusal(response)
        if refusal is not None:      # a 400 naming the router's own field: the server is no prefill server
            raise RouterError(502, f"the prefill server {url} refused the KV transfer: {refusal}",
                              "prefill_server_failed")
        if response.status_code != 200:
            return Response(response.content, status_code=response.status_code, headers=passed_headers(response),
                            media_type=response.headers.get("content-type", "application/json"))
        try:
            # sse.loads: JSON nested past the stack is a ValueError too, not a RecursionError (a 500).
            kv = sse.loads(response.content).get("kv_transfer_params")
        except (ValueError, AttributeError):
            kv = None
        if not isinstance(kv, dict):
            raise RouterError(502, f"the prefill server {url} returned no kv_transfer_params (is it started with "
                              f"--kv-role producer?)", "prefill_server_failed")
        return kv

    async def _relay(self, request_id: str, relayed: RelayedEvents, response: httpx.Response, timing: RequestTiming,
                     started: float, sent: float) -> AsyncIterator[bytes]:
        """The decode server's events, whole events at a time; if it fails mid-stream, the API's error events."""
        pending = bytearray()         # an event begun and not yet ended
        try:
            async for chunk in response.aiter_raw():
                if timing.decode_first_s is None:
                    now = time.monotonic()
                    timing.decode_first_s, timing.ttft_s = now - sent, now - started
                start = max(len(pending) - 1, 0)     # the event's bytes before the chunk hold no blank line
                pending += chunk
                cut = pending.rfind(b"\n\n", start)
                if cut >= 0:
                    events = bytes(pending[:cut + 2])
                    del pending[:cut + 2]
                    relayed.note(events)
                    yield events
                elif len(pending) > MAX_HELD_EVENT_BYTES:
                    # A longer event (a long prompt's prompt_logprobs) goes on in pieces: held whole, one of
                    # 64 MB was copied at each chunk, 33 s with the router's loop held.
                    yield bytes(pending)
                    pending.clear()
            if pending:
                yield bytes(pending)
        except httpx.HTTPError as exc:
            self.decode.num_failures[timing.decode_url] += 1
            timing.status = 502
            message = f"the decode server {timing.decode_url} failed mid-stream: {type(exc).__name__}: {exc}"
            yield relayed.failure_events(APIError(502, message, code="decode_server_failed"))
        except (asyncio.CancelledError, GeneratorExit):
            timing.status = CLIENT_CLOSED          # the client went away: the decode server's stream is closed
            raise
        finally:
            await response.aclose()
            timing.decode_s = time.monotonic() - sent
            self._finish(request_id, relayed.path, timing, started)

    def _finish(self, request_id: str, path: str, timing: RequestTiming, started: float) -> None:
        timing.total_s = time.monotonic() - started
        self.stats.record(timing, path)
        self.metrics.observe(path, timing.total_s)
        first = f"{timing.decode_first_s * 1e3:.1f} ms" if timing.decode_first_s is not None else "-"
        if timing.decode_only is not None:
            logger.info("%s %s: decode only (%s) · first token %s, all %.1f ms (%s) · total %.1f ms · status %d",
                        request_id, path, timing.decode_only, first, timing.decode_s * 1e3, timing.decode_url,
                        timing.total_s * 1e3, timing.status)
            return
        logger.info("%s %s: prefill %.1f ms (%s) · kv transfer %.2f ms (claim %.2f, copy %.2f; %d tokens, %.2f MB) "
                    "· decode first token %s, all %.1f ms (%s) · total %.1f ms · status %d", request_id, path,
                    timing.prefill_s * 1e3, timing.prefill_url, (timing.kv_claim_s + timing.kv_copy_s) * 1e3,
                    timing.kv_claim_s * 1e3, timing.kv_copy_s * 1e3, timing.kv_tokens, timing.kv_bytes / 1e6,
                    first, timing.decode_s * 1e3, timing.decode_url, timing.total_s * 1e3, timing.status)

    async def health(self, raw: Request) -> JSONResponse:
        """Each backend's /health; 200 while at least one server of each role answers ok. What each
        answers is the router's view of it from then on (health_answered)."""
        headers = self.via(client_headers(raw, ("via",)))

        async def check(url: str) -> dict:
            try:
                client, base = self.endpoint(url)
                r = await client.get(base + "/health", headers=headers, timeout=self.config.health_timeout_s)
            except httpx.HTTPError as exc:
                is_refused = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
                self.health_answered(url, f"/health: {type(exc).__name__}" if is_refused else None, False)
                return {"url": shown_url(url), "ok": False, "error": type(exc).__name__}
            self.health_answered(url, None, r.status_code == 200)
            return {"url": shown_url(url), "ok": r.status_code == 200, "status": r.status_code}

        prefill, decode = await asyncio.gather(asyncio.gather(*map(check, self.prefill.urls)),
                                               asyncio.gather(*map(check, self.decode.urls)))
        ok = any(r["ok"] for r in prefill) and any(r["ok"] for r in decode)
        return JSONResponse({"status": "ok" if ok else "unavailable", "prefill": prefill, "decode": decode},
                            status_code=200 if ok else 503)

    async def forward(self, path: str, raw: Request) -> Response:
        """A request that needs no KV (the model list or one model, /tokenize, /detokenize, /version, a
        Messages request's token count) answered by the first decode server that takes the connection,
        with the client's credentials, at the path (and query) the client sent."""
        content = await raw.body() if raw.method == "POST" else None
        headers = self.via(client_headers(raw, (*KEY_HEADERS, "content-type", "x-request-id", "via")))
        target = (raw.scope.get("raw_path") or raw.scope["path"].encode()).decode("latin-1")
        if raw.scope.get("query_string"):
            target += "?" + raw.scope["query_string"].decode("latin-1")
        try:
            urls = await self.live(self.decode)
        except RouterError as exc:
            return exc.response(path)
        for url in urls:
            try:
                client, base = self.endpoint(url)
                r = await client.request(raw.method, base + target, content=content, headers=headers)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                self._connect_failed(self.decode, url, exc)
                continue
            except httpx.HTTPError as exc:
                self.decode.num_failures[shown_url(url)] += 1
                return RouterError(502, f"the decode server {shown_url(url)} failed: {type(exc).__name__}: {exc}",
                                   "decode_server_failed").response(path)
            self._took(self.decode, url)
            return Response(r.content, status_code=r.status_code, headers=passed_headers(r),
                            media_type=r.headers.get("content-type", "application/json"))
        return RouterError(503, "no decode server is reachable", "decode_unavailable",
                           retry_after_s=self.config.backoff_s).response(path)


def create_router_app(config: RouterConfig) -> FastAPI:
    """The proxy as a FastAPI app."""
    router = Router(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await router.start()
        yield
        await router.close()

    app = FastAPI(title="minillm router", lifespan=lifespan)
    app.state.router = router
    install_error_handlers(app)     # an unknown path or method is an OpenAI-shaped 404 / 405 too
    for path in ROUTES:
        app.add_api_route(path, _handler(router, path), methods=["POST"])

    @app.api_route("/health", methods=["GET", "HEAD"])   # probes and load balancers check with HEAD too
    async def health(raw: Request):
        return await router.health(raw)

    # A server's routes that need no KV, each with its methods there (HEAD where GET).
    for path, methods in (("/v1/models", ["GET", "HEAD"]), ("/v1/models/{model:path}", ["GET", "HEAD"]),
                          ("/v1/responses/{response_id}", ["GET", "HEAD"]), ("/version", ["GET", "HEAD"]),
                          ("/tokenize", ["POST"]), ("/detokenize", ["POST"]), ("/v1/messages/count_tokens", ["POST"])):
        app.add_api_route(path, _forwarder(router, path), methods=methods)

    @app.get("/metrics")
    async def metrics(raw: Request):
        from minillm.server.app import metrics_response     # the servers' /metrics answer (name[], gzip)
        return metrics_response(router.metrics, raw)

    @app.get("/v1/stats")
    async def stats():
        return JSONResponse(router.stats.to_dict({"prefill": router.prefill.shown_urls, "decode": router.decode.shown_urls}))

    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes, timeout_s=config.body_timeout_s)
    if config.api_keys:       # /health stays open to probes, as a server's
        app.add_middleware(APIKeyMiddleware, api_keys=config.api_keys)
    app.add_middleware(LoopGuard, name=router.via_name)
    return app


class LoopGuard:
    """508 Loop Detected for a request whose Via header names this router: one of its --prefill or
    --decode URLs leads back to it (its own port, or a router that sends there), which sent each
    request round again until the sockets ran out, and /health with it."""

    def __init__(self, app, name: bytes) -> None:
        self.app, self.name = app, name

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and any(key == b"via" and self.name in value for key, value in scope["headers"]):
            message = (f"the request came back to the router that sent it ({self.name.decode()} in its Via "
                       f"header): a --prefill or --decode URL of that router leads to itself")
            response = RouterError(508, message, "loop_detected").response(scope["path"])
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


def _handler(router: Router, path: str):
    async def handle(raw: Request) -> Any:
        return await router.route(path, raw)
    return handle


def _forwarder(router: Router, path: str):
    async def forward(raw: Request) -> Response:
        if raw.path_params.get("model") == "":
            # /v1/models/ matches {model:path} with no name: the list, by the redirect a server gives
            # (whose Location would name the server).
            return RedirectResponse(str(raw.url.replace(path=raw.url.path.rstrip("/"))))
        return await router.forward(path, raw)
    return forward


def run_router(config: RouterConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve the proxy until interrupted, one log line per request on stderr. The port is bound
    before the start-up line, which names the one bound (port 0: a free one, as `minillm serve`)."""
    from minillm.server.app import hold_port   # the server's socket: bound here, listened on by uvicorn
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%m-%d %H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO)
    sock = hold_port(host, port)
    try:
        print(f"minillm router: {http_url(host, sock.getsockname()[1])}, prefill "
              f"{', '.join(map(shown_url, config.prefill_urls))}, decode {', '.join(map(shown_url, config.decode_urls))}",
              file=sys.stderr, flush=True)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as hold_port says: it listens now
        server = uvicorn.Server(uvicorn.Config(create_router_app(config), **router_uvicorn_settings(config)))
        try:
            server.run(sockets=[sock])     # a failed start-up exits with uvicorn's status 3
        except KeyboardInterrupt:
            pass     # uvicorn has shut down and raised the signal again, as uvicorn.run takes it
    finally:
        sock.close()


def router_uvicorn_settings(config: RouterConfig) -> dict[str, Any]:
    """uvicorn's settings for the proxy: the servers' HTTP protocol, with their deadlines for slow
    clients, and bytes that are not HTTP answered with a JSON 400 after the responses due before
    them (uvicorn's own protocol wrote a plain-text 400 over them)."""
    limits = ServerLimits(max_body_bytes=config.max_body_bytes, body_timeout_s=config.body_timeout_s)
    return {**uvicorn_settings(limits), "log_level": "warning", "access_log": False}
