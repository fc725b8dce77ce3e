"""The FastAPI app (create_app) and the process entry point of `minillm serve` (run_server).

With --api-server-count N (N > 1) the process that runs `minillm serve` holds the port, starts
the engine core for N API servers and N API server processes that each listen on that port with
SO_REUSEPORT, so the kernel spreads new connections evenly over them (one shared accept queue
goes mostly to whichever process wakes first; each joined to the core by its own ZeroMQ pair; the core sends each only its own
requests' outputs), then supervises them: a signal is passed on to the servers, and when one
ends by a failure (the core dying is seen by all) the others are stopped and the exit status is 1.
As in vLLM (wait_for_completion_or_failure), an API server that dies (a crash, SIGKILL) stops the
whole server; the core has already aborted the dead server's requests, which nobody can read, and
the others get the stop's graceful time for their open requests.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gzip
import logging
import multiprocessing as mp
import multiprocessing.connection
from multiprocessing import resource_sharer
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import uvicorn
from fastapi import Body, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, RedirectResponse, Response
from prometheus_client.exposition import gzip_accepted

from minillm.engine_core.heap import freeze_startup_heap
from minillm.generation_config import model_sampling_defaults, override_max_tokens
from minillm.server.async_engine import ENGINE_CORE_MODES, EngineClient, start_async_engine
from minillm.sampling_params import short_repr
from minillm.server.errors import APIError, EngineDeadError, error_body, install_error_handlers
from minillm.server.http import AcceptErrorLog, ListeningSocket, raise_open_files_limit, uvicorn_config
from minillm.server.json_body import JSONBodyRoute
from minillm.server.limits import ServerLimits
from minillm.server.metrics import CONTENT_TYPE, ServerMetrics
from minillm.server.metrics_dir import join_metrics_dir, make_metrics_dir
from minillm.server.middleware import (
    INVOCATIONS_PATH, APIKeyMiddleware, BodyLimitMiddleware, RequestIdHeaderMiddleware, ServerLoad,
    ServerLoadMiddleware, add_user_middleware,
)
from minillm.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest
from minillm.server.reasoning_parsers import REASONING_PARSERS
from minillm.server.serving import ServingContext, ShutdownFlag, sse_error
from minillm.server.serving_chat import check_default_template_kwargs, create_chat_completion
from minillm.server.serving_completion import create_completion
from minillm.server.serving_messages import MessagesRequest, count_message_tokens, create_message
from minillm.server.serving_responses import ResponsesRequest, create_response
from minillm.server.serving_tokenization import create_detokenize, create_tokenize
from minillm.server.stats_hub import StatsHub
from minillm.server.tool_parsers import TOOL_PARSERS
from minillm.server.transport import TransportOptions, bind_uds, listen_url, refresh_ssl_files, remove_uds
from minillm.server.streaming import EventStreamResponse
from minillm.spec_decode.metrics import interval_log_line as spec_decode_log_line
from minillm.structured_outputs_config import check_structured_outputs_config, closing
from minillm.tokenizer import check_content_format
from minillm.urls import http_url

logger = logging.getLogger("minillm.server")

MAX_STATS_CELLS = 4096
# Stats-stream subscribers share one engine snapshot per MIN_STATS_INTERVAL_S, however many they are.
MIN_STATS_INTERVAL_S, MAX_STATS_INTERVAL_S = 0.1, 60.0
# Probes and load balancers check with HEAD as well as GET (FastAPI adds no HEAD by itself).
GET_OR_HEAD = ["GET", "HEAD"]
# After the engine loop fails, open requests have this long to get their error before the process exits.
ENGINE_FAILURE_DRAIN_S = 2.0
# A forced exit (a second Ctrl-C) gives the requests still open this long to end with the engine's error.
FORCED_EXIT_WAIT_S = 1.0
# uvicorn's log levels, quietest first (--uvicorn-log-level).
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ServerOptions:
    """How the server serves: auth, CORS, the model's name, chat templates, limits, the log, engine failures."""

    # The bearer tokens /v1 requires (vLLM's --api-key KEY...): a request carrying any of them is served.
    # A bare string is one key; None: no key.
    api_key: str | tuple[str, ...] | None = None
    # The names the model answers to (vLLM's --served-model-name NAME...): a request may name any of
    # them, a response names the first. A bare string is one name; None: the engine config's name.
    served_model_name: str | tuple[str, ...] | None = None
    chat_template: str | None = None            # replaces the model's (--chat-template)
    trust_request_chat_template: bool = False   # let a request's chat_template field be rendered
    limits: ServerLimits = field(default_factory=ServerLimits)
    log_interval: float | None = None           # seconds between throughput lines; None: no lines
    log_requests: bool = False                  # a log line for each request received (--enable-log-requests)
    response_role: str = "assistant"            # a chat reply's role when the request opens its turn
    root_path: str = ""                         # the path prefix of a proxy in front of the server (--root-path)
    enable_docs: bool = True                    # /docs, /redoc and /openapi.json (off: --disable-fastapi-docs)
    request_id_headers: bool = False            # X-Request-Id on every response (--enable-request-id-headers)
    # vLLM's --chat-template-content-format: message content handed to the template as one string
    # ("string"), as a list of text parts ("openai"), or as the template reads it ("auto").
    chat_template_content_format: str = "auto"
    return_tokens_as_token_ids: bool = False    # logprobs name tokens "token_id:<id>" unless a request says
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens (prefix-cache hits)
    enable_force_include_usage: bool = False    # every stream ends with a usage chunk, whatever stream_options say
    # vLLM's --stream-interval: streams send a chunk once a completion has this many new tokens (its
    # first and last at once); a request's stream_interval may raise it, never lower it.
    stream_interval: int = 1
    # Chat template variables every conversation gets unless its chat_template_kwargs set them
    # (vLLM's --default-chat-template-kwargs, e.g. {"enable_thinking": false}).
    default_chat_template_kwargs: dict | None = None
    enable_server_load_tracking: bool = False   # GET /load counts the requests in flight (else it stays 0)
    reasoning_parser: str | None = None         # reasoning apart from content in chat replies (--reasoning-parser)
    # vLLM's --structured-outputs-config: enable_in_reasoning true holds a reasoning model's output to its
    # constraint from the first token (else from </think> on); its other keys as check_structured_outputs_config
    # takes them (its reasoning_parser is reasoning_parser's other spelling).
    structured_outputs_config: dict | None = None
    # tool_choice "auto" served by parsing the model's calls (--enable-auto-tool-choice --tool-call-parser)
    tool_call_parser: str | None = None
    uvicorn_log_level: str = "info"             # uvicorn's own log (--uvicorn-log-level)
    uvicorn_access_log: bool = True             # uvicorn's line per request (off: --disable-uvicorn-access-log)
    exit_on_engine_error: bool = True           # exit (status 1) once the engine loop has failed
    engine_core: str = "process"                # the engine core in its own process, or "thread" here
    api_server_count: int = 1                   # API server processes sharing the port and the one core
    # CORS, as vLLM's --allowed-origins, --allowed-methods, --allowed-headers and --allow-credentials
    # (every origin, method and header by default).
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # Seconds a stopping server gives open requests (uvicorn's --timeout-graceful-shutdown); those
    # still open shortly before it end with the engine's shutdown error instead of being cut.
    timeout_graceful_shutdown: float = 5.0
    # vLLM's --shutdown-timeout, which replaces it where given: 0 ends open requests at once with the
    # engine's shutdown error (vLLM's default, an abort); None: timeout_graceful_shutdown.
    shutdown_timeout: float | None = None
    # A Unix domain socket instead of host and port (--uds), and TLS (--ssl-*), as vLLM's flags set them.
    transport: TransportOptions = field(default_factory=TransportOptions)
    # Import paths of the operator's ASGI middleware (vLLM's --middleware), added outermost in this order.
    middleware: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.middleware, (list, tuple)) or not all(isinstance(m, str) for m in self.middleware):
            raise ValueError(f"middleware must be a list of import paths, got {self.middleware!r}")
        object.__setattr__(self, "middleware", tuple(self.middleware))
        if self.served_model_name is not None:
            names = (self.served_model_name,) if isinstance(self.served_model_name, str) else self.served_model_name
            if not isinstance(names, (list, tuple)) or not names or not all(
                    isinstance(n, str) and n.strip() for n in names):
                raise ValueError(f"served_model_name must be a name or a list of names, none empty, "
                                 f"got {self.served_model_name!r}")
            object.__setattr__(self, "served_model_name", tuple(dict.fromkeys(names)))
        check_content_format(self.chat_template_content_format)
        if self.structured_outputs_config is not None:
            named = check_structured_outputs_config(self.structured_outputs_config)
            if named and self.reasoning_parser not in (None, named):
                raise ValueError(f"structured_outputs_config.reasoning_parser {named!r} disagrees with the reasoning "
                                 f"parser {self.reasoning_parser!r} (--reasoning-parser); give the parser once")
            object.__setattr__(self, "reasoning_parser", self.reasoning_parser or named or None)
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got {self.tool_call_parser!r}")
        if not self.response_role.strip():
            raise ValueError("response_role must not be empty")
        check_default_template_kwargs(self.default_chat_template_kwargs)
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"uvicorn_log_level must be one of {', '.join(UVICORN_LOG_LEVELS)}, "
                             f"got {self.uvicorn_log_level!r}")
        if self.root_path and not self.root_path.startswith("/"):
            raise ValueError(f"root_path must be a path starting with /, such as /llm, got {self.root_path!r}")
        # "/llm/" is "/llm" (the router would match no request under it); "/" is no prefix.
        object.__setattr__(self, "root_path", self.root_path.rstrip("/"))
        if self.api_key is not None and not isinstance(self.api_key, str):
            object.__setattr__(self, "api_key", tuple(self.api_key))
        if self.api_key is not None and (not self.api_keys or not all(k.strip() for k in self.api_keys)):
            # An empty key (an unset variable in `--api-key "$KEY"`) must not quietly mean "no auth".
            raise ValueError("api_key must not be empty (leave it out to serve without a key)")
        if self.engine_core not in ENGINE_CORE_MODES:
            raise ValueError(f"engine_core must be one of {', '.join(ENGINE_CORE_MODES)}, got {self.engine_core!r}")
        if self.api_server_count < 1:
            raise ValueError(f"api_server_count must be >= 1, got {self.api_server_count}")
        if isinstance(self.stream_interval, bool) or not isinstance(self.stream_interval, int) or \
                self.stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, got {self.stream_interval!r}")
        if not 0 < self.timeout_graceful_shutdown <= 3600:
            raise ValueError(f"timeout_graceful_shutdown must be in (0, 3600] seconds, got {self.timeout_graceful_shutdown}")
        if self.shutdown_timeout is not None and not 0 <= self.shutdown_timeout <= 3600:
            raise ValueError(f"shutdown_timeout must be in [0, 3600] seconds, got {self.shutdown_timeout}")
        if self.api_server_count > max_api_server_count():
            # Each is a process with two sockets to the core: a count in the thousands spawned
            # processes until file descriptors ran out, then hung with the core dead.
            raise ValueError(f"api_server_count must be at most {max_api_server_count()} (4 per CPU core), "
                             f"got {self.api_server_count}")
        if self.api_server_count > 1 and self.engine_core != "process":
            raise ValueError("several API servers need the engine core in its own process (--engine-core process)")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            # A bare string would be read as its characters (--allowed-origins '"*"' is JSON for one).
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{name} must be a list of strings, got {value!r}")
            object.__setattr__(self, name, tuple(value))     # a list (json.loads of the flag) kept hashable

    @property
    def disable_additional_properties(self) -> bool | None:
        """How JSON schemas' objects are read where a request leaves its structured_outputs'
        disable_additional_properties unset: None, closed (vLLM's default backend, xgrammar in its strict
        mode); under --structured-outputs-config's guidance backend, that config's
        disable_additional_properties (false, its default: JSON Schema's reading, objects open)."""
        return closing(self.structured_outputs_config)

    @property
    def structured_outputs_in_reasoning(self) -> bool:
        """Whether constraints hold a reasoning model's output from its first token (vLLM's enable_in_reasoning)."""
        return bool((self.structured_outputs_config or {}).get("enable_in_reasoning"))

    @property
    def graceful_shutdown_s(self) -> float:
        """Seconds a stopping server gives open requests (0: none, they end at once)."""
        return self.timeout_graceful_shutdown if self.shutdown_timeout is None else self.shutdown_timeout

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The keys a request may carry, any of them (none: /v1 is open)."""
        if self.api_key is None:
            return ()
        return (self.api_key,) if isinstance(self.api_key, str) else self.api_key


def max_api_server_count() -> int:
    """The most API server processes one serve starts: more than a few per core only costs memory."""
    return 4 * (os.cpu_count() or 1)


def _stats_cells(cells: int) -> int:
    if not 1 <= cells <= MAX_STATS_CELLS:
        raise APIError(400, f"cells must be in [1, {MAX_STATS_CELLS}], got {cells}", param="cells")
    return cells


def _body_route(ctx: ServingContext, create: Callable):
    """A POST route that hands its JSON object body and request to create(ctx, body, raw)."""
    async def route(raw: Request, body: dict[str, Any] = Body()):
        return await create(ctx, body, raw)
    return route


def _add_openai_routes(app: FastAPI, ctx: ServingContext) -> None:
    # The bodies are read as requests by the handlers, off the event loop when large (serving.py).
    for path, name, create in (("/v1/completions", "completions", create_completion),
                               ("/v1/chat/completions", "chat_completions", create_chat_completion),
                               ("/v1/responses", "responses", create_response),
                               ("/v1/messages", "messages", create_message),
                               ("/v1/messages/count_tokens", "count_tokens", count_message_tokens)):
        app.add_api_route(path, _body_route(ctx, create), methods=["POST"], name=name)
    app.add_api_route(INVOCATIONS_PATH, _body_route(ctx, invoke), methods=["POST"], name="invocations")

    @app.api_route("/v1/responses/{response_id}", methods=GET_OR_HEAD)
    async def stored_response(response_id: str):
        raise APIError(404, f"Response {short_repr(response_id)} not found: this server does not store responses",
                       param="response_id", code="response_not_found")

    def model_card(name: str) -> dict:
        # vLLM's ModelCard: parent names a LoRA adapter's base model (none here), permission is one
        # ModelPermission of its defaults.
        created = int(time.time())
        return {"id": name, "object": "model", "created": created, "owned_by": "minillm",
                "root": str(ctx.engine.config.model), "parent": None, "max_model_len": ctx.engine.max_model_len,
                "permission": [model_permission(created)]}

    _document_request_bodies(app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                                   "/v1/responses": ResponsesRequest, "/v1/messages": MessagesRequest})

    @app.api_route("/v1/models", methods=GET_OR_HEAD)
    async def models():
        return {"object": "list", "data": [model_card(name) for name in ctx.model_names]}

    @app.api_route("/v1/models/{model:path}", methods=GET_OR_HEAD)
    async def model(model: str, raw: Request):
        if not model:       # /v1/models/: the list, by the redirect every other trailing slash gets
            return without_trailing_slash(raw)
        ctx.check_model(model)
        return model_card(model)


def without_trailing_slash(raw: Request) -> RedirectResponse:
    """The 307 to the request's URL less its trailing slash, query kept, as Starlette redirects a path
    that matches a route only without it (/v1/models/{model:path} matches /v1/models/ with no name)."""
    return RedirectResponse(str(raw.url.replace(path=raw.url.path.rstrip("/"))))


async def invoke(ctx: ServingContext, body: dict, raw: Request):
    """vLLM's /invocations (SageMaker's one route): a body with messages is a chat completion, one
    with a prompt a completion; anything else is a 400 saying which it may be."""
    if "messages" in body:
        return await create_chat_completion(ctx, body, raw)
    if "prompt" in body:
        return await create_completion(ctx, body, raw)
    raise APIError(400, "Cannot find suitable handler for request. Expected one of: [ChatCompletionRequest, "
                   "CompletionRequest] (a body with messages or with a prompt)")


def model_permission(created: int) -> dict:
    """vLLM's ModelPermission with its defaults (what OpenAI's model objects once carried)."""
    return {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
            "organization": "*", "group": None, "is_blocking": False}


def _document_request_bodies(app: FastAPI, bodies: dict[str, type]) -> None:
    """/openapi.json shows these routes' request models, as it would for a typed body (the routes take
    a plain object and validate it in the handler, off the event loop when it is large)."""
    default = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            spec = default()
            schemas = spec.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}), **{model.__name__: schema})
                content = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
                content["schema"] = {"$ref": f"#/components/schemas/{model.__name__}"}
        return app.openapi_schema

    app.openapi = openapi


def _one_operation_id_per_method(app: FastAPI) -> None:
    """/openapi.json names each operation once: FastAPI gives every method of a route (GET and HEAD, /ping's
    POST) one id, ending in whichever method its set yields first, which makes the document invalid."""
    previous = app.openapi
    renamed: list[bool] = []

    def openapi() -> dict:
        if not renamed:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Duplicate Operation ID")
                spec = previous()
            for operations in spec.get("paths", {}).values():
                for method, operation in operations.items():
                    if "operationId" in operation:
                        stem = re.sub(r"_(get|head|post|put|patch|delete|options|trace)$", "", operation["operationId"])
                        operation["operationId"] = f"{stem}_{method}"
            renamed.append(True)
        return app.openapi_schema

    app.openapi = openapi


def _add_vllm_routes(app: FastAPI, ctx: ServingContext, load: ServerLoad) -> None:
    """vLLM's utility endpoints. Outside /v1, so the API key does not guard them (as in vLLM)."""
    # The generation requests in flight with --enable-server-load-tracking (ServerLoadMiddleware), else 0.
    @app.api_route("/load", methods=GET_OR_HEAD)
    async def server_load():
        return {"server_load": load.num_requests}

    @app.post("/tokenize")
    async def tokenize(raw: Request, body: dict[str, Any] = Body()):
        return await create_tokenize(ctx, body, raw)

    @app.post("/detokenize")
    async def detokenize(raw: Request, body: dict[str, Any] = Body()):
        return await create_detokenize(ctx, body, raw)

    _document_request_bodies(app, {"/detokenize": DetokenizeRequest})

    @app.api_route("/version", methods=GET_OR_HEAD)
    async def version():
        from minillm import __version__
        return {"version": __version__}


def _add_ops_routes(app: FastAPI, ctx: ServingContext) -> None:
    engine = ctx.engine
    hub = StatsHub(engine, MIN_STATS_INTERVAL_S, ctx.limits.max_stats_streams)

    @app.api_route("/health", methods=GET_OR_HEAD)
    async def health():
        if engine.is_healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse(error_body(503, engine.dead_reason, code="engine_dead"), status_code=503)

    # vLLM's SageMaker health check: /health's answer, to GET and POST.
    app.add_api_route("/ping", health, methods=[*GET_OR_HEAD, "POST"])

    @app.api_route("/metrics", methods=GET_OR_HEAD)
    async def metrics(raw: Request):
        with contextlib.suppress(EngineDeadError):
            ctx.metrics.update(await engine.get_summary_stats())   # counters: no stall of the step loop
        return metrics_response(ctx.metrics, raw)

    @app.get("/v1/stats")
    async def stats(cells: int = 64):
        snapshot = await engine.get_stats(_stats_cells(cells))
        return JSONResponse(snapshot.to_dict())

    @app.get("/v1/stats/stream")
    async def stats_stream(cells: int = 64, interval: float = 0.25):
        if not MIN_STATS_INTERVAL_S <= interval <= MAX_STATS_INTERVAL_S:
            raise APIError(400, f"interval must be in [{MIN_STATS_INTERVAL_S}, {MAX_STATS_INTERVAL_S}] "
                           f"seconds, got {interval}", param="interval")
        _stats_cells(cells)
        first = await hub.event(cells)   # fail with a status code, not in-band
        hub.subscribe()
        return EventStreamResponse(_stats_events(hub, first, cells, interval, ctx.stopping), on_close=hub.unsubscribe)


def metrics_response(metrics: ServerMetrics, raw: Request) -> Response:
    """/metrics as prometheus_client's app (vLLM's /metrics) answers: only the series named by name[]
    query parameters where there are any, gzipped for a scraper that accepts it."""
    names = raw.query_params.getlist("name[]")
    body = metrics.render(names or None)
    if not gzip_accepted(raw.headers.get("accept-encoding", "")):
        return Response(body, media_type=CONTENT_TYPE)
    return Response(gzip.compress(body), media_type=CONTENT_TYPE, headers={"Content-Encoding": "gzip"})


async def _stats_events(hub: StatsHub, first: str, cells: int, interval: float,
                        stopping: ShutdownFlag) -> AsyncIterator[str]:
    """One event every `interval` seconds until the client leaves, the engine dies or the server stops."""
    event = first
    while True:
        yield event
        deadline = time.monotonic() + interval
        while time.monotonic() < deadline:
            if stopping.is_set():
                return  # an endless stream must not hold up a graceful shutdown
            await asyncio.sleep(min(0.1, max(deadline - time.monotonic(), 0.0)))
        try:
            event = await hub.event(cells)
        except Exception as exc:  # noqa: BLE001 - tell the watcher why the stream ends
            yield sse_error(exc)
            return


class ThroughputLogger:
    """Logs one line per interval while there is activity, as vLLM's engine loop does."""

    def __init__(self, engine: EngineClient, interval: float) -> None:
        self.engine, self.interval = engine, interval
        self.last: Any = None
        self.last_time = time.monotonic()

    async def run(self) -> None:
        """Loop until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                stats = await self.engine.get_summary_stats()
            except EngineDeadError:
                logger.error("engine loop is dead: %s", self.engine.dead_reason)
                return
            self.log(stats)

    def log(self, stats: Any) -> None:
        """Log the interval's throughput, queues and KV usage if anything happened."""
        now = time.monotonic()
        elapsed, self.last_time = max(now - self.last_time, 1e-9), now
        last, self.last = self.last, stats
        prompt = stats.prefill_tokens_total - (last.prefill_tokens_total if last else 0)
        generated = stats.generation_tokens_total - (last.generation_tokens_total if last else 0)
        if not (prompt or generated or stats.num_running or stats.num_waiting):
            return
        hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                    "Running: %d reqs, Waiting: %d reqs, Preemptions: %d, KV cache usage: %.1f%%, "
                    "Prefix cache hit rate: %.1f%%", prompt / elapsed, generated / elapsed, stats.num_running,
                    stats.num_waiting, stats.num_preemptions, 100 * stats.kv_usage, 100 * hit_rate)
        spec_line = spec_decode_log_line(stats.spec_decode, last.spec_decode if last else None, elapsed)
        if spec_line:
            logger.info(spec_line)


def create_app(async_engine: EngineClient, options: ServerOptions | None = None) -> FastAPI:
    """The OpenAI-compatible app over a running engine (AsyncLLM or AsyncLLMEngine; the caller owns and
    stops it)."""
    options = options or ServerOptions()
    names = options.served_model_name or (async_engine.config.served_model_name or str(async_engine.config.model),)
    metrics = ServerMetrics(names[0], async_engine.max_model_len)
    ctx = ServingContext(async_engine, metrics, names[0], model_names=tuple(names),
                         limits=options.limits, chat_template=options.chat_template,
                         trust_request_chat_template=options.trust_request_chat_template,
                         response_role=options.response_role, log_requests=options.log_requests,
                         sampling_defaults=model_sampling_defaults(async_engine.config, async_engine.tokenizer),
                         max_tokens_cap=override_max_tokens(async_engine.config),
                         chat_template_content_format=options.chat_template_content_format,
                         return_tokens_as_token_ids=options.return_tokens_as_token_ids,
                         enable_prompt_tokens_details=options.enable_prompt_tokens_details,
                         enable_force_include_usage=options.enable_force_include_usage,
                         default_chat_template_kwargs=dict(options.default_chat_template_kwargs or {}),
                         reasoning_parser=options.reasoning_parser, tool_call_parser=options.tool_call_parser,
                         structured_outputs_in_reasoning=options.structured_outputs_in_reasoning,
                         disable_additional_properties=options.disable_additional_properties,
                         stream_interval=options.stream_interval)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        log_interval = options.log_interval
        task = asyncio.create_task(ThroughputLogger(async_engine, log_interval).run()) if log_interval else None
        yield
        if task is not None:
            task.cancel()
        if ctx.kv_claims is not None:
            ctx.kv_claims.close()
        ctx.executor.shutdown(wait=False, cancel_futures=True)

    docs = {} if options.enable_docs else {"openapi_url": None, "docs_url": None, "redoc_url": None}
    app = FastAPI(title="minillm", lifespan=lifespan, **docs)
    # As vLLM sets it: behind a proxy that serves the API under a prefix, a path is matched with the
    # prefix or without it (whether or not the proxy strips it), and the docs name their URLs under it.
    app.root_path = options.root_path
    app.state.ctx = ctx
    app.router.route_class = JSONBodyRoute     # a large JSON body is parsed off the event loop
    install_error_handlers(app)
    _add_openai_routes(app, ctx)
    load = ServerLoad()
    _add_vllm_routes(app, ctx, load)
    _add_ops_routes(app, ctx)
    _one_operation_id_per_method(app)
    if options.enable_server_load_tracking:    # else /load answers 0, as vLLM's does without the flag
        app.add_middleware(ServerLoadMiddleware, load=load)
    app.add_middleware(BodyLimitMiddleware, max_bytes=options.limits.max_body_bytes,
                       timeout_s=options.limits.body_timeout_s)
    if options.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=options.api_keys)
    if options.request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
    # Added last, so it runs first: preflights are answered here, and every response, errors
    # included (a 401, a 413), carries the CORS headers a browser needs to read it.
    app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                       allow_methods=list(options.allowed_methods), allow_headers=list(options.allowed_headers),
                       allow_credentials=options.allow_credentials)
    add_user_middleware(app, options.middleware)
    return app


class _Server(uvicorn.Server):
    """uvicorn.Server that tells the app when shutdown begins, so endless streams can end.

    end_requests (the engine client's shutdown): called on a thread once the open requests have had
    all but the last second of the graceful shutdown, so that those still open end with the engine's
    error (an error event and [DONE], or a 503) rather than being cancelled mid-response.
    """

    def __init__(self, config: uvicorn.Config, stopping: ShutdownFlag,
                 end_requests: Callable[[], None] | None = None, end_at_once: bool = False,
                 interrupt_forces: bool = False, transport: TransportOptions | None = None) -> None:
        super().__init__(config)
        self.stopping = stopping
        self.transport = transport or TransportOptions()
        self.ssl_refresh: asyncio.Task | None = None
        self.end_requests = end_requests
        self.end_at_once = end_at_once      # open requests end as the shutdown begins, not near its end
        self.interrupt_forces = interrupt_forces    # a SIGINT is the second Ctrl-C, even if it comes first

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.stopping.set()
        if sig == signal.SIGINT and self.interrupt_forces:
            # The supervisor sends its SIGTERM first, but a pending SIGINT is delivered first (the
            # lower number): taken as a first Ctrl-C it would only ask for the graceful stop again.
            self.should_exit = True
        super().handle_exit(sig, frame)
        # uvicorn raises each signal it caught again once it has stopped: a second Ctrl-C (which
        # forces the exit) raised two, and the second interrupted the shutdown with a traceback.
        self._captured_signals = list(dict.fromkeys(self._captured_signals))

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(AcceptErrorLog())
        await super().startup(sockets)
        if sockets and self.started:    # uvicorn names only an address it bound itself
            logging.getLogger("uvicorn.error").info("Uvicorn running on %s (Press CTRL+C to quit)",
                                                    listen_url(sockets[0], self.config.is_ssl))
        if self.started and self.transport.enable_ssl_refresh:
            self.ssl_refresh = asyncio.get_running_loop().create_task(
                refresh_ssl_files(self.config.ssl, self.transport))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.ssl_refresh is not None:
            self.ssl_refresh.cancel()
        if self.end_requests is not None:
            timeout = self.config.timeout_graceful_shutdown or 0
            grace = 0.0 if self.end_at_once else max(timeout - min(1.0, timeout / 2), 0.0)
            asyncio.get_running_loop().call_later(grace, lambda: threading.Thread(
                target=self.end_requests, name="minillm-end-requests", daemon=True).start())
        await super().shutdown(sockets)
        if self.force_exit:
            await self._end_forcibly()

    async def _end_forcibly(self) -> None:
        """A forced exit (a second Ctrl-C) waits for no request and skips the app's shutdown: the
        requests still open and the app were then cancelled as the loop closed, each logged with a
        traceback. The requests end now with the engine's shutdown error (an error event and
        [DONE]), within FORCED_EXIT_WAIT_S, and the app shuts down (it waits for nothing)."""
        loop = asyncio.get_running_loop()
        if self.end_requests is not None and self.server_state.tasks:
            await asyncio.to_thread(self.end_requests)
            deadline = loop.time() + FORCED_EXIT_WAIT_S
            while self.server_state.tasks and loop.time() < deadline:
                await asyncio.sleep(0.02)
        await self.lifespan.shutdown()


class ServerThread:
    """A uvicorn server on a background thread, bound before start so port 0 picks a free port (http:
    "auto", "httptools" or "h11", the HTTP/1.1 implementation)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 http: str = "auto", sock: socket.socket | None = None,
                 transport: TransportOptions | None = None) -> None:
        self.sock = sock if sock is not None else port_socket(host, port, reuse_port=False)   # sock: bound there
        self.transport = transport or TransportOptions()
        self.host, self.port = host, (self.sock.getsockname()[1] if self.sock.family != socket.AF_UNIX else None)
        config = uvicorn_config(app, app.state.ctx.limits, http, log_level=log_level, timeout_graceful_shutdown=2,
                                **self.transport.uvicorn_kwargs())
        self.stopping = app.state.ctx.stopping
        self.server = _Server(config, self.stopping, transport=self.transport)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="minillm-http", daemon=True)

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:8000 (https:// with TLS; unix:PATH on a Unix socket)."""
        if self.sock.family == socket.AF_UNIX or self.transport.is_tls:
            return listen_url(self.sock, self.transport.is_tls)
        return http_url(self.host, self.port)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        """Start serving and wait until the socket accepts connections."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Ask uvicorn to exit and wait for the thread."""
        self.stopping.set()
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _configure_logging() -> None:
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%m-%d %H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO)


def _exit_when_engine_fails(engine: EngineClient, server: _Server, drain_s: float) -> None:
    """Wait for the engine loop to end; if it failed, stop the server after a short drain."""
    engine.ended.wait()
    if not engine.has_failed:
        return
    logger.error("%s; the server exits in %.0f s so that a supervisor can restart it "
                 "(--no-exit-on-engine-error keeps it up, answering 503)", engine.dead_reason, drain_s)
    time.sleep(drain_s)   # open requests get their error event or 500, /health its 503, meanwhile
    server.stopping.set()
    server.should_exit = True


def check_chat_template(source: str) -> None:
    """ValueError when a --chat-template does not compile (found at start-up, not on the first request)."""
    from minillm.tokenizer import compile_chat_template
    try:
        compile_chat_template(source)
    except Exception as exc:  # jinja2.TemplateSyntaxError and friends
        raise ValueError(f"--chat-template does not compile: {exc}") from None


def api_key_note(options: ServerOptions) -> str | None:
    """The start-up line saying what /v1 requires: a key, or any of several (None: no key)."""
    num_keys = len(options.api_keys)
    if not num_keys:
        return None
    which = "an API key" if num_keys == 1 else f"any of {num_keys} API keys"
    return f"minillm: /v1 requires {which} (Authorization: Bearer KEY, or x-api-key: KEY)"


def run_server(config: Any, host: str = "127.0.0.1", port: int = 8000, options: ServerOptions | None = None,
               monitor: bool = False, core_hook: Any = None) -> int:
    """Load the engine from an EngineConfig and serve the OpenAI API until interrupted; the exit status.

    0 when stopped by a signal: SIGTERM at any time (a supervisor's stop, during the model load
    too), Ctrl-C once serving; Ctrl-C while the model loads raises KeyboardInterrupt (the command
    line's status 130). 1 when the engine loop failed (with exit_on_engine_error the server stops
    by itself then). As vLLM's, the port is bound before the model loads: held during the load, and
    a second server on it fails at once. core_hook (picklable) is called with the LLMEngine before it
    serves (benchmarks/host_cost.py paces it).
    """
    options = options or ServerOptions(log_interval=5.0)
    options.transport.check_tls_files()     # before the model loads, as a bad flag
    if options.chat_template is not None:
        check_chat_template(options.chat_template)
    note = api_key_note(options)
    if note is not None:
        print(note, file=sys.stderr, flush=True)
    if options.api_server_count > 1:
        if options.transport.uds is None:
            check_can_listen(host, port)     # before the model loads: a taken port is known at once
        if monitor:
            raise ValueError("--monitor shows one API server's engine: leave out --api-server-count")
        return run_api_servers(config, host, port, options, core_hook)
    sock = server_socket(host, port, options.transport)      # bound (not listening) while the model loads
    _configure_logging()
    try:
        with stop_signals_as_interrupt() as signals:
            try:
                return _serve_one(config, sock, options, monitor, core_hook)
            except KeyboardInterrupt:
                if signals.received != signal.SIGTERM:
                    raise
                print("minillm: stopped by SIGTERM while the model loaded", file=sys.stderr, flush=True)
                return 0
    finally:
        close_server_socket(sock)


def server_socket(host: str, port: int, transport: TransportOptions) -> socket.socket:
    """The socket one server listens on, bound: transport.uds, else host:port (hold_port)."""
    return bind_uds(transport.uds) if transport.uds is not None else hold_port(host, port)


def close_server_socket(sock: socket.socket) -> None:
    """Close a server's socket; a Unix socket's file is removed (the next start binds the path afresh)."""
    remove_uds(sock)      # a Unix socket's file (nothing for TCP)
    sock.close()


def _serve_one(config: Any, sock: socket.socket, options: ServerOptions, monitor: bool, core_hook: Any) -> int:
    """run_server with one API server: load the engine, serve on sock until stopped, shut the engine down."""
    engine = start_async_engine(config, options.engine_core, core_hook)
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # see hold_port: it listens now
    from minillm.engine_stats import describe_engine
    if options.engine_core == "process":
        print(f"minillm: engine core in process {engine.core_pid}", file=sys.stderr, flush=True)
    print(describe_engine(engine.startup_stats), file=sys.stderr, flush=True)
    try:
        if monitor:
            # The dashboard owns the terminal: the server runs quietly on a thread.
            app = create_app(engine, dataclasses.replace(options, log_interval=None))
            host = sock.getsockname()[0] if sock.family != socket.AF_UNIX else ""
            with ServerThread(app, host, log_level="critical", sock=sock, transport=options.transport) as server:
                from minillm.tui.app import run_monitor
                run_monitor(server.url, api_key=options.api_keys[0] if options.api_keys else None)
        else:
            serve_http(engine, options, {"log_level": options.uvicorn_log_level}, sockets=[sock])
    except KeyboardInterrupt:
        pass  # uvicorn has already shut down gracefully and re-raised Ctrl-C (or SIGTERM) for us
    finally:
        engine.shutdown()
    return 1 if engine.has_failed else 0


class _StopSignals:
    """The signal handler of a serve in the main thread: the first SIGINT or SIGTERM raises
    KeyboardInterrupt (a model load stops there, and uvicorn's graceful shutdown, which raises the
    signal again once done, reaches run_server's cleanup); later ones are ignored while the process
    stops (a second Ctrl-C broke the cleanup off, and the process died by SIGINT)."""

    def __init__(self) -> None:
        self.received: int | None = None     # the first signal

    def __call__(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
            raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def stop_signals_as_interrupt():
    """SIGINT and SIGTERM handled by a _StopSignals (yielded) in the block, as vLLM's run_server takes
    SIGTERM as Ctrl-C; by default SIGTERM killed the process, leaving the engine core's socket
    directory behind and the exit status -15. Once one has come, both stay ignored after the block:
    the process is on its way out, and one more during the interpreter's teardown killed it (status
    -2). Off the main thread: nothing is installed."""
    handler = _StopSignals()
    if threading.current_thread() is not threading.main_thread():
        yield handler
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield handler
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if handler.received is None else signal.SIG_IGN)


def serve_http(engine: EngineClient, options: ServerOptions, uv_kwargs: dict,
               sockets: list[socket.socket] | None = None, parent: Any = None,
               stop: threading.Event | None = None, interrupt_forces: bool = False) -> None:
    """Serve the app over `engine` with uvicorn until told to stop (or the engine fails, or `parent`,
    a pipe's read end, reports its writer gone, or `stop` is set). interrupt_forces: a SIGINT forces
    the exit at once (an API server of several, whose supervisor sends one for a second Ctrl-C)."""
    app = create_app(engine, options)
    # With no time for open requests they end at once, and get FORCED_EXIT_WAIT_S to send their error.
    graceful_s = options.graceful_shutdown_s
    uv_config = uvicorn_config(app, options.limits, timeout_graceful_shutdown=graceful_s or FORCED_EXIT_WAIT_S,
                               access_log=options.uvicorn_access_log, **options.transport.uvicorn_kwargs(),
                               **uv_kwargs)
    server = _Server(uv_config, app.state.ctx.stopping, end_requests=engine.shutdown, end_at_once=not graceful_s,
                     interrupt_forces=interrupt_forces, transport=options.transport)
    if options.exit_on_engine_error:
        threading.Thread(target=_exit_when_engine_fails, args=(engine, server, ENGINE_FAILURE_DRAIN_S),
                         name="minillm-exit-on-engine-error", daemon=True).start()
    if parent is not None:
        threading.Thread(target=_exit_when_parent_gone, args=(parent, server), name="minillm-parent-watch",
                         daemon=True).start()
    if stop is not None:
        threading.Thread(target=_exit_when_set, args=(stop, server), name="minillm-stop-watch", daemon=True).start()
    raise_open_files_limit()
    freeze_startup_heap()
    server.run(sockets=sockets)


def _exit_when_parent_gone(parent: Any, server: _Server) -> None:
    """An API server of several: stop when the supervising process is gone, however it ended."""
    mp.connection.wait([parent])
    logger.error("the supervising minillm serve process is gone; this API server stops")
    server.stopping.set()
    server.should_exit = True


def _exit_when_set(stop: threading.Event, server: _Server) -> None:
    """An API server of several: stop once `stop` is set (a SIGTERM that came before uvicorn's handler)."""
    stop.wait()
    server.stopping.set()
    server.should_exit = True


@dataclass
class APIServerSpec:
    """What one of several API server processes starts from (pickled when it is spawned)."""

    config: Any
    options: ServerOptions
    link: Any                   # CoreLink: its sockets to the engine core, and the core's life
    host: str
    port: int                   # the port every API server listens on (SO_REUSEPORT)
    parent: Any                 # a pipe's read end: EOF once the supervising process is gone
    index: int
    metrics_dir: str            # the API servers' Prometheus directory, which the last process out removes
    # --uds: the one listening Unix socket all API servers accept on (a resource_sharer.DupFd), as vLLM's
    # API servers share the socket their supervisor bound; None: each binds host:port with SO_REUSEPORT.
    shared_sock: Any = None
    # Set as the process begins to serve HTTP: one still unset at a stop's deadline (importing, or joining
    # the core, on a slow host) holds no request, and is killed as part of the stop, not as a failure.
    serving: Any = None


def run_api_server(spec: APIServerSpec) -> None:
    """An API server process's entry point: join the engine core, serve on the shared socket; exit 1
    if the engine failed. The last process out of the Prometheus directory removes it."""
    metrics_dir = join_metrics_dir(spec.metrics_dir)
    try:
        _run_api_server(spec)
    finally:
        # On its way out, its status is its own: the supervisor's SIGTERM (sent to every server once
        # one has ended) reached a server exiting with status 1 after the interpreter's teardown had
        # put the default action back, and killed it (status -15).
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        metrics_dir.leave()


def _run_api_server(spec: APIServerSpec) -> None:
    os.setpgrp()    # signals come from the supervisor, once (a terminal's Ctrl-C reaches it alone)
    # The supervisor spawned this process with SIGTERM and SIGINT blocked, so one sent while it started
    # is held, not fatal; a Ctrl-C that reached the group before setpgrp is the supervisor's, dropped
    # here (SIG_IGN discards it). A SIGTERM asks for a stop: while this process joins the engine core
    # (the model may still be loading) it ends the join (the supervisor then lets the core go); once
    # serving, through `stop` until uvicorn takes the signals over; after, uvicorn shuts down gracefully
    # and raises it again for this handler, which must not kill the process (its exit status says
    # whether the engine failed).
    stop, joining = threading.Event(), threading.Event()
    joining.set()

    def on_sigterm(*_: Any) -> None:
        stop.set()
        if joining.is_set():
            joining.clear()
            raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
        _configure_logging()
        from minillm.server.async_llm import AsyncLLM
        engine = AsyncLLM(spec.config, link=spec.link)
        joining.clear()
    except KeyboardInterrupt:    # stopped before the core was ready
        if spec.index == 0:
            print("minillm: stopped while the model loaded", file=sys.stderr, flush=True)
        sys.exit(0)
    except Exception as exc:  # noqa: BLE001 - the core did not start; the supervisor exits 1
        if spec.index == 0:
            print(f"minillm serve: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    if spec.index == 0:
        from minillm.engine_stats import describe_engine
        print(describe_engine(engine.startup_stats), file=sys.stderr, flush=True)
    try:
        if spec.serving is not None:       # before it listens: a server seen listening is one that serves
            spec.serving.set()
        sock = api_server_socket(spec)
        log_level = api_server_log_level(spec.options.uvicorn_log_level, spec.index)
        serve_http(engine, spec.options, {"log_level": log_level}, sockets=[sock], parent=spec.parent, stop=stop,
                   interrupt_forces=True)
    finally:
        engine.shutdown()
    sys.exit(1 if engine.has_failed else 0)


def api_server_socket(spec: APIServerSpec) -> socket.socket:
    """The socket API server spec.index listens on: the supervisor's Unix socket, else its own on the shared port."""
    if spec.shared_sock is None:
        return port_socket(spec.host, spec.port)
    return ListeningSocket(fileno=spec.shared_sock.detach())


def api_server_log_level(level: str, index: int) -> str:
    """uvicorn's log level for API server `index` of several: the first logs at the level given, the
    others at most warnings (their start-up lines would repeat the first's)."""
    if index == 0:
        return level
    return min(level, "warning", key=UVICORN_LOG_LEVELS.index)


def check_can_listen(host: str, port: int) -> None:
    """ValueError naming host and port when a socket cannot be bound there (port taken, no such
    address); the socket is closed again."""
    bind_port(host, port).close()


def hold_port(host: str, port: int) -> socket.socket:
    """bind_port's socket, held for this server alone until it listens: Linux lets another socket
    with SO_REUSEADDR bind a port whose sockets all have it and none listens, so it is cleared
    (bound with it, the port is taken over connections of an earlier run in TIME_WAIT); set it again
    before listening, or the connections it accepts leave TIME_WAITs that block the next run's bind."""
    sock = bind_port(host, port)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    return sock


def bind_port(host: str, port: int) -> socket.socket:
    """A socket bound to host:port for one server alone (no SO_REUSEPORT); a ValueError naming host
    and port when it cannot be (port taken, no such address)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {port}")
    try:
        return port_socket(host, port, reuse_port=False)
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def socket_url(sock: socket.socket) -> str:
    """The http:// URL of a bound socket's address (an IPv6 address in brackets)."""
    return http_url(*sock.getsockname()[:2])


def port_socket(host: str, port: int, reuse_port: bool = True) -> socket.socket:
    """A TCP socket bound to host:port (port 0: a free one). With reuse_port other processes of ours
    can bind it too (SO_REUSEPORT): each API server listens on its own, and the kernel spreads
    connections over the listening ones."""
    # proto TCP, not 0: asyncio sets TCP_NODELAY only on connections of a TCP-proto socket, and
    # without it Nagle holds each keep-alive response ~40 ms for the client's delayed ACK.
    sock = ListeningSocket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                           socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


# As vLLM's --shutdown-timeout, a stop of several API servers has one deadline, not a wait per
# process: the graceful shutdown's seconds (FORCED_EXIT_WAIT_S where it is 0), then this long for a
# server's own exit (uvicorn's forced close, the app's and the engine client's shutdown). A server
# still up then is killed (and logged by name, as a failed one is); the core gets what is left of the
# deadline, at least CORE_EXIT_WAIT_S (it exits within a step once let go).
API_SERVER_EXIT_MARGIN_S = 1.0
CORE_EXIT_WAIT_S = 5.0


def shutdown_deadline(options: ServerOptions, since: float) -> float:
    """The time.monotonic() by which every API server of a stop that began at `since` must have exited."""
    return since + (options.graceful_shutdown_s or FORCED_EXIT_WAIT_S) + API_SERVER_EXIT_MARGIN_S


class ProcessEnds:
    """The supervised processes' ends, in the order the supervisor saw them, and which were failures:
    a nonzero status, but not the death by a stop signal the supervisor itself sent that process."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.seen: set[str] = set()
        self.signalled: dict[str, int] = {}     # process name -> the stop signal the supervisor sent it

    def saw(self, name: str, exitcode: int | None) -> bool:
        """Note once that process `name` ended with `exitcode`; whether that was a failure."""
        if exitcode is None or name in self.seen:
            return False
        self.seen.add(name)
        if exitcode == 0 or exitcode == -self.signalled.get(name, 0):
            return False
        from minillm.engine_core.client import describe_exit
        self.failures.append(f"{name} {describe_exit(exitcode)}")
        return True

    def summary(self) -> str | None:
        """The closing log line: the first failure (the cause) first; None when nothing failed."""
        if not self.failures:
            return None
        first, *after = self.failures
        return f"exit status 1: {first}" + (f"; after it: {', '.join(after)}" if after else "")


def run_api_servers(config: Any, host: str, port: int, options: ServerOptions, core_hook: Any = None) -> int:
    """Start the engine core and options.api_server_count API server processes on one port; supervise
    them until a signal or a failure; the exit status (1 when any of them failed)."""
    from minillm.engine_core.client import CoreProcess
    _configure_logging()
    count = options.api_server_count
    uds = options.transport.uds
    # bound: the Unix socket the servers share, or the port held, never listening (port 0 picks one)
    held = bind_uds(uds) if uds is not None else port_socket(host, port)
    port = held.getsockname()[1] if uds is None else 0
    # Each API server writes its latency histograms here; /metrics on any of them adds all up. The
    # last process to leave removes it: the supervisor, or its API servers when it was killed outright.
    metrics_dir = make_metrics_dir()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir.path
    try:
        core = CoreProcess(config, count, core_hook)
    except BaseException:
        close_server_socket(held)
        metrics_dir.leave()
        raise
    print(f"minillm: engine core in process {core.pid}", file=sys.stderr, flush=True)
    spawn = mp.get_context("spawn")
    parent_reader, parent_writer = spawn.Pipe(duplex=False)
    servers = []
    serving = []                    # by server: set as it begins to serve (APIServerSpec.serving)
    stopping = ShutdownFlag()       # set in a signal handler: no lock
    stop_began: list[float] = []    # when the first stop signal went out
    ends = ProcessEnds()

    def stop_servers(signum: int | None = None, frame: Any = None) -> None:
        # A Ctrl-C while stopping forces the exit, as uvicorn's second one does: the servers get it as
        # SIGINT (they take their supervisor's SIGINT as forcing); anything else asks for a graceful stop.
        forced = signum == signal.SIGINT and stopping.is_set()
        if not stopping.is_set():
            stop_began.append(time.monotonic())
        stopping.set()
        sig = signal.SIGINT if forced else signal.SIGTERM
        for proc in servers:
            if proc.is_alive():
                ends.signalled.setdefault(proc.name, sig)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)

    previous = {sig: signal.signal(sig, stop_servers) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # The servers start with SIGTERM and SIGINT blocked (a child inherits the mask) until they can
        # take them: a Ctrl-C while they imported killed them with a traceback each.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        try:
            for i, link in enumerate(core.links):
                server_options = dataclasses.replace(options, log_interval=options.log_interval if i == 0 else None)
                shared = None if uds is None else resource_sharer.DupFd(held.fileno())
                serving.append(spawn.Event())
                proc = spawn.Process(target=run_api_server, name=f"minillm-api-server-{i}", args=(
                    APIServerSpec(config, server_options, link, host, port, parent_reader, i, metrics_dir.path,
                                  shared, serving[-1]),))
                proc.start()
                link.hand_over()    # the server holds the core's only sign of its life now
                servers.append(proc)
                print(f"minillm: API server {i} in process {proc.pid}", file=sys.stderr, flush=True)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
        parent_reader.close()
        _supervise(servers, core.proc, stopping, stop_servers, ends,
                   lambda: shutdown_deadline(options, stop_began[0]) if stop_began else None)
    finally:
        if not stopping.is_set():
            stop_servers()
        deadline = shutdown_deadline(options, stop_began[0])
        # While it waits, a second Ctrl-C still forces the servers' exit (stop_servers is the handler).
        _join_servers(servers, serving, deadline, deadline - stop_began[0], ends)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        parent_writer.close()
        close_server_socket(held)
        core.stop(timeout=max(deadline - time.monotonic(), CORE_EXIT_WAIT_S))
        ends.saw(core.proc.name, core.proc.exitcode)
        core.close()
        metrics_dir.leave()
    summary = ends.summary()
    if summary:
        logger.error("%s", summary)
    return 1 if summary else 0


def _supervise(servers: list, core: Any, stopping: ShutdownFlag, stop_servers: Callable[[], None],
               ends: ProcessEnds, deadline: Callable[[], float | None]) -> None:
    """Wait until every API server has ended or the stop's deadline (None before a stop) has passed,
    noting each end (the core's too) as it comes; once a server ends by itself, stop the others (the
    core aborts a dead server's requests on its own). A core that ends is logged and left to the
    servers, which see it and exit after their drain (or answer 503, with --no-exit-on-engine-error)."""
    from minillm.engine_core.client import describe_exit
    while any(proc.is_alive() for proc in servers):
        until = deadline()
        if until is not None and time.monotonic() >= until:
            return
        watched = {proc.sentinel: proc for proc in servers if proc.name not in ends.seen}
        if core.name not in ends.seen:
            watched[core.sentinel] = core
        wait_s = 1.0 if until is None else min(1.0, until - time.monotonic())
        for sentinel in mp.connection.wait(list(watched), timeout=max(wait_s, 0.0)):
            watched[sentinel].join(1.0)        # it is exiting: reap it, so its status is known
        if core.exitcode is not None and core.name not in ends.seen:
            ends.saw(core.name, core.exitcode)
            logger.error("the engine core process ended (%s)", describe_exit(core.exitcode))
        ended = [proc for proc in servers if proc.exitcode is not None and proc.name not in ends.seen]
        for proc in ended:
            ends.saw(proc.name, proc.exitcode)
        if ended and not stopping.is_set():
            logger.error("an API server ended (%s); stopping the others", ", ".join(
                f"{proc.name}: {describe_exit(proc.exitcode)}" for proc in ended))
            stop_servers()


def _join_servers(servers: list, serving: list, deadline: float, allowed_s: float,
                  ends: ProcessEnds) -> None:
    """Wait for the API servers until `deadline` (one for all, allowed_s after the stop), kill those
    still up, note each end. One not yet serving (its `serving` event unset: importing or joining the
    core on a slow host) holds no request: its kill is part of the stop, not a failure."""
    for proc in servers:
        proc.join(max(deadline - time.monotonic(), 0.0))
    for proc, is_serving in zip(servers, serving):
        if not proc.is_alive():
            continue
        if is_serving.is_set():
            logger.error("%s did not stop within %.1f s; killing it", proc.name, allowed_s)
        else:
            logger.info("%s was not serving yet at the stop's deadline; stopping it", proc.name)
            ends.signalled[proc.name] = signal.SIGKILL
        proc.kill()
    for proc in servers:
        proc.join(5)
        ends.saw(proc.name, proc.exitcode)
