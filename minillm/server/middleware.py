"""Pure ASGI middleware: Bearer-key check, a request-body size and encoding check (both streaming-safe),
vLLM's X-Request-Id response header, and the count of generation requests in flight (vLLM's /load)."""
from __future__ import annotations

import hashlib
import hmac
import importlib
import inspect
import json
import uuid

import anyio

from minillm.server.errors import anthropic_error_body, error_body

# As vLLM: the key guards the API (/v1/...); /health and /metrics stay open to probes and scrapers.
PROTECTED_PREFIX = "/v1"
# The routes that generate (what GET /load counts, and what minillm router sends through its servers).
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
# vLLM's SageMaker route: a chat completion or a completion by its body. It generates, so it is
# counted by /load and, unlike vLLM's, guarded by the API key as /v1 is.
INVOCATIONS_PATH = "/invocations"
LOADED_PATHS = frozenset((*GENERATION_PATHS, INVOCATIONS_PATH))


async def _send_error(scope, send, status: int, message: str, code: str | None = None,
                      extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """An error response sent before the app: OpenAI-shaped, or Anthropic-shaped on the Messages API's routes."""
    shape = anthropic_error_body if is_messages_route(scope) else error_body
    body = json.dumps(shape(status, message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra_headers or [])})
    await send({"type": "http.response.body", "body": body})


def _close_if_body_withheld(scope) -> list[tuple[bytes, bytes]]:
    """`Connection: close` for a request whose client holds its body until 100 Continue (`Expect:
    100-continue`), answered before the body was asked for: the body will not come, and the server
    would read the client's next request on the connection as that body (RFC 9110 10.1.1)."""
    expect = dict(scope["headers"]).get(b"expect", b"")
    return [(b"connection", b"close")] if expect.strip().lower() == b"100-continue" else []


class APIKeyMiddleware:
    """401 for the /v1 paths and /invocations unless the request carries one of the keys,
    `Authorization: Bearer <key>` (or, as Anthropic's clients send it for /v1/messages, `x-api-key:
    <key>`), the first of each header as vLLM reads it. As vLLM's, the SHA-256 of what was sent is
    compared with each key's in constant time, every key each time: the time taken tells neither which
    key nor how much of one matched, nor a key's length."""

    def __init__(self, app, api_keys: tuple[str, ...]) -> None:
        if not api_keys:
            raise ValueError("api_keys must hold at least one key")
        self.app = app
        self.expected_digests = [_digest(key.encode()) for key in api_keys]

    def is_key(self, given: bytes) -> bool:
        """Whether GIVEN is one of the keys, each compared (no early end on a match)."""
        digest = _digest(given)
        matched = False
        for expected in self.expected_digests:
            matched |= hmac.compare_digest(digest, expected)
        return matched

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not _is_protected(scope) or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        # The first of several such headers, as vLLM reads Authorization (Starlette's Headers.get): a
        # later one does not stand in for a wrong first one.
        given = bearer_token(first_header(scope["headers"], b"authorization"))
        if not (self.is_key(given) | self.is_key(first_header(scope["headers"], b"x-api-key"))):
            return await _send_error(scope, send, 401, "Invalid or missing API key: send `Authorization: Bearer "
                                     "<key>` or `x-api-key: <key>`.", code="invalid_api_key",
                                     extra_headers=[(b"www-authenticate", b"Bearer"), *_close_if_body_withheld(scope)])
        return await self.app(scope, receive, send)


def is_messages_path(path: str) -> bool:
    """True for Anthropic's Messages API routes (/v1/messages and its count_tokens), whose errors
    Anthropic's clients read in their own shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def is_messages_route(scope) -> bool:
    """True for a request to one of Anthropic's Messages API routes (behind --root-path too)."""
    return is_messages_path(route_path(scope))


def _is_protected(scope) -> bool:
    """True for a /v1 path or /invocations, as the client sent it or as the router matches it (behind
    --root-path)."""
    return any(path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/") or path == INVOCATIONS_PATH
               for path in (scope["path"], route_path(scope)))


def route_path(scope) -> str:
    """The path the router matches: the request's path less the app's root_path (--root-path) where it
    starts with it, as Starlette's router strips it; a path without the prefix is matched as it is."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):]
    return path


class ServerLoadMiddleware:
    """Counts the generation requests (completions and chat completions) this API server is
    answering, from their arrival until their response has gone out, stream included: vLLM's
    GET /load figure (server_load)."""

    def __init__(self, app, load: "ServerLoad") -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or route_path(scope) not in LOADED_PATHS:
            return await self.app(scope, receive, send)
        self.load.num_requests += 1
        try:
            return await self.app(scope, receive, send)
        finally:
            self.load.num_requests -= 1


class ServerLoad:
    """The generation requests in flight in this API server (one event loop writes it)."""

    def __init__(self) -> None:
        self.num_requests = 0


class RequestIdHeaderMiddleware:
    """vLLM's --enable-request-id-headers: every response carries X-Request-Id, the client's own
    header echoed (the first of several), else a fresh id."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # The first X-Request-Id of several, as vLLM reads it (and as the response's id takes it).
        request_id = first_header(scope["headers"], b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start" and not any(
                    name.lower() == b"x-request-id" for name, _ in message.get("headers", [])):
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        return await self.app(scope, receive, send_with_id)


def first_header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes:
    """The first value of header NAME (lower case, as the ASGI server gives names), b"" without one."""
    return next((value for key, value in headers if key == name), b"")


def _digest(token: bytes) -> bytes:
    """SHA-256 of a key as sent (what APIKeyMiddleware compares: every digest is 32 bytes)."""
    return hashlib.sha256(token).digest()


def bearer_token(authorization: bytes) -> bytes:
    """The token of an `Authorization: Bearer <token>` header, b"" for any other scheme: the scheme
    is case-insensitive (RFC 9110 11.1; clients send "bearer" too) and spaces around it may repeat."""
    scheme, _, token = authorization.strip().partition(b" ")
    return token.strip(b" ") if scheme.lower() == b"bearer" else b""


class BodyLimitMiddleware:
    """413 for a request body over max_bytes, checked on Content-Length and on the bytes received;
    408 for one that does not arrive within timeout_s (a client trickling its body holds nothing long);
    415 for a compressed one (Content-Encoding other than identity)."""

    def __init__(self, app, max_bytes: int, timeout_s: float = 60.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        codings = content_codings(scope["headers"])
        if codings:
            # The body would reach the JSON parser compressed; decompressing here would let a
            # small gzip bomb past the size limit.
            return await _send_error(scope, send, 415, f"Content-Encoding {', '.join(codings)!r} is not "
                                     "supported: send the body uncompressed.", code="unsupported_content_encoding",
                                     extra_headers=_close_if_body_withheld(scope))
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(scope, send, _close_if_body_withheld(scope))
        # Read the whole body first (chunked uploads carry no length), then replay it.
        chunks, size, complete = [], 0, False
        with anyio.move_on_after(self.timeout_s):
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client left before sending its body
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if size > self.max_bytes:
                    return await self._too_large(scope, send)
                if not message.get("more_body", False):
                    complete = True
                    break
        if not complete:
            return await _send_error(scope, send, 408, f"The request body did not arrive within "
                                     f"{self.timeout_s:g} s.", code="request_timeout",
                                     extra_headers=[(b"connection", b"close")])
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for http.disconnect, as the server's would

        return await self.app(scope, replay, send)

    async def _too_large(self, scope, send, extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
        await _send_error(scope, send, 413, f"Request body exceeds the limit of {self.max_bytes} bytes.",
                          code="request_too_large", extra_headers=extra_headers)


def content_codings(headers: list[tuple[bytes, bytes]]) -> list[str]:
    """The codings a request's body went through, lower case, identity left out: every Content-Encoding
    header's comma-separated list, in order (several headers are one list, RFC 9110 5.3: `gzip` then
    `identity` is a gzipped body, which the last header alone called identity)."""
    return [coding for name, value in headers if name == b"content-encoding"
            for coding in (part.strip().lower() for part in value.decode("latin-1").split(","))
            if coding not in ("", "identity")]


def import_middleware(path: str):
    """The ASGI middleware class or `async def (request, call_next)` function at PATH (module.name), as
    vLLM's --middleware takes it; anything else is a ValueError naming middleware."""
    module_name, _, name = path.rpartition(".")
    if not module_name or not name.isidentifier():
        raise ValueError(f"middleware must be an import path such as mypackage.auth.MyMiddleware, got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:      # the operator's own module: any error of its import is theirs to read
        hint = " (is its folder on PYTHONPATH?)" if isinstance(exc, ModuleNotFoundError) else ""
        raise ValueError(f"middleware {path!r}: importing {module_name} failed: "
                         f"{type(exc).__name__}: {' '.join(str(exc).split())}{hint}") from None
    if not hasattr(module, name):
        raise ValueError(f"middleware {path!r}: module {module_name} has no {name}")
    found = getattr(module, name)
    if not (inspect.isclass(found) or inspect.iscoroutinefunction(found)):
        what = "a function that is not async" if callable(found) else f"a {type(found).__name__}"
        raise ValueError(f"middleware {path!r} must be a class or an async function, got {what}")
    return found


def add_user_middleware(app, paths: tuple[str, ...]) -> None:
    """The operator's middleware (--middleware), outermost as vLLM adds it: a class by add_middleware, an
    async function as an "http" middleware."""
    for path in paths:
        found = import_middleware(path)
        if inspect.isclass(found):
            app.add_middleware(found)
        else:
            app.middleware("http")(found)
