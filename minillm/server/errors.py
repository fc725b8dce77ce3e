"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the right status (and
Anthropic's shape, {"type": "error", "error": {...}}, on its Messages API's routes)."""
from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus
from typing import TYPE_CHECKING

SSE_DONE = "data: [DONE]\n\n"    # the last event of an OpenAI completions or chat stream

if TYPE_CHECKING:   # FastAPI is imported where the app is built, not by the CLI that reads ServerLimits
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

# SamplingParams / add_request messages start with the field they complain about.
KNOWN_PARAMS = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "max_tokens", "min_tokens", "stop",
    "stop_token_ids", "logprobs", "prompt", "request_id", "ignore_eos", "skip_special_tokens",
    "include_stop_str_in_output", "kv_transfer_params", "logit_bias", "truncate_prompt_tokens",
    "allowed_token_ids", "bad_words", "prompt_logprobs", "priority",
)
# No error quotes more of what the client sent than this: a 1 MB field must not come back as a 1 MB error.
MAX_MESSAGE_CHARS = 1000
MAX_PARAM_CHARS = 100
# FastAPI's HTTPException detail when reading a JSON body failed other than on syntax (its cause says why).
FASTAPI_BODY_ERROR = "There was an error parsing the body"


class APIError(Exception):
    """An error the client should see, with its HTTP status and OpenAI fields."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or default_error_type(status)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can make progress."""


class EngineShutDownError(EngineDeadError):
    """The engine was shut down (the server is stopping): a 503, a server that cannot serve now, where
    an engine that failed is a 500."""


def engine_dead_status(exc: EngineDeadError) -> int:
    """The HTTP status of a request the engine could not serve: 503 while it shuts down, else 500."""
    return 503 if isinstance(exc, EngineShutDownError) else 500


def engine_dead_error(exc: EngineDeadError) -> APIError:
    """What a request the engine could not serve reports, streamed or not: its plain message, as vLLM's."""
    return APIError(engine_dead_status(exc), str(exc) or "the engine loop has stopped", code="engine_dead")


def is_template_error(exc: BaseException) -> bool:
    """Whether exc is a jinja2 TemplateError (or one of its kinds), known without importing jinja2."""
    return any(cls.__name__ == "TemplateError" for cls in type(exc).__mro__)


def unexpected_error(exc: BaseException) -> APIError:
    """What one request reports for an exception that is neither an APIError nor a dead engine, as vLLM's
    create_error_response reads one: bad input (ValueError, TypeError, OverflowError, a template's error)
    is a 400, NotImplementedError a 501, anything else a 500 for this request alone; the message is
    str(exc), or the exception's type where that is empty."""
    if isinstance(exc, (ValueError, TypeError, OverflowError)) or is_template_error(exc):
        status = 400
    elif isinstance(exc, NotImplementedError):
        status = 501
    else:
        status = 500
    return APIError(status, str(exc) or type(exc).__name__)


class RemoteError(Exception):
    """An exception raised in the engine core process, known here by its type's name and its message."""

    def __init__(self, type_name: str, message: str = "") -> None:
        super().__init__(message)
        self.type_name = type_name

    def __str__(self) -> str:
        return f"{self.type_name}: {self.args[0]}"


def describe_error(exc: BaseException) -> str:
    """'Type: message' of an exception, whichever process raised it."""
    return str(exc) if isinstance(exc, RemoteError) else f"{type(exc).__name__}: {exc}"


class RequestFailedError(APIError):
    """One request failed inside an engine step that the engine survived (a 500 naming the cause)."""

    def __init__(self, request_id: str, cause: BaseException) -> None:
        super().__init__(500, f"the request failed in the engine: {describe_error(cause)}",
                         code="engine_step_failed")
        self.request_id = request_id
        self.cause = cause


def safe_text(text: str, limit: int) -> str:
    """text cut to `limit` characters and made encodable (a lone surrogate becomes its escape)."""
    if len(text) > limit:
        text = text[:limit] + f"... ({len(text)} chars)"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def short_text(text: str, limit: int = 60) -> str:
    """text quoted, cut to `limit` characters."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def default_error_type(status: int) -> str:
    """OpenAI's error type for a status code."""
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status < 500:
        return "invalid_request_error"
    return "server_error"


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None, type: str | None = None) -> dict:
    """The JSON body of an error response (message and param cut short and made encodable)."""
    return {"error": {"message": safe_text(message, MAX_MESSAGE_CHARS), "type": type or default_error_type(status),
                      "param": None if param is None else safe_text(param, MAX_PARAM_CHARS), "code": code}}


# Anthropic's error types by status (its Messages API's clients read these): any other 4xx is an
# invalid_request_error and any other 5xx an api_error, as Anthropic's error reference says. A 503
# (the server cannot take the request now: try again) is its overloaded_error, as its 529 is.
ANTHROPIC_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                         413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                         504: "timeout_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """error_body in Anthropic's shape ({"type": "error", "error": {"type", "message", ...}}), its type
    Anthropic's name for the status; OpenAI's param and code stay in the error object."""
    kind = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", **error_body(status, message, param, code, type=kind)}


def responses_error(err: APIError) -> dict:
    """The `error` of a failed Responses API response: OpenAI's code for err's status, and err's message."""
    # The API's codes are an enum (server_error, rate_limit_exceeded, invalid_prompt, ...), not free text.
    code = "rate_limit_exceeded" if err.status == 429 else "invalid_prompt" if err.status < 500 else "server_error"
    return {"code": code, "message": safe_text(err.message, MAX_MESSAGE_CHARS)}


def _sse_event(data: dict, kind: str | None = None) -> str:
    """One server-sent event of compact JSON, named kind where given."""
    head = f"event: {kind}\n" if kind is not None else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


def openai_error_event(err: APIError) -> str:
    """OpenAI's in-band error of a completions or chat stream: a data-only event of the error body."""
    return _sse_event(error_body(err.status, err.message, err.param, err.code))


def openai_error_events(err: APIError) -> str:
    """The end of a completions or chat stream that failed after it began: the error event, then [DONE]."""
    return openai_error_event(err) + SSE_DONE


def anthropic_error_event(err: APIError) -> str:
    """The end of a Messages API stream that failed after it began: Anthropic's `error` event."""
    # Its clients raise it; they skip an event without a name, as OpenAI's data-only error is.
    return _sse_event(anthropic_error_body(err.status, err.message, err.param, err.code), "error")


def response_failed_event(err: APIError, response: dict, sequence_number: int) -> str:
    """The end of a Responses API stream that failed after it began: `response.failed`, response failed with err."""
    failed = {**response, "status": "failed", "error": responses_error(err)}
    return _sse_event({"type": "response.failed", "sequence_number": sequence_number, "response": failed},
                      "response.failed")


def error_response(err: APIError, is_anthropic: bool = False) -> JSONResponse:
    """Render an APIError as a JSONResponse, in Anthropic's shape where is_anthropic."""
    from fastapi.responses import JSONResponse
    body = anthropic_error_body(err.status, err.message, err.param, err.code) if is_anthropic else \
        error_body(err.status, err.message, err.param, err.code, err.type)
    return JSONResponse(body, status_code=err.status)


def param_from_message(message: str) -> str | None:
    """The field a ValueError from the engine names (its first word), if it is a known one."""
    first = message.split(" ", 1)[0].strip(":,")
    return first if first in KNOWN_PARAMS else None


def bad_request_from_value_error(exc: ValueError) -> APIError:
    """Map an engine ValueError to a 400 naming the field."""
    message = str(exc)
    return APIError(400, message, param=param_from_message(message))


def _validation_to_api_error(exc: RequestValidationError, content_type: str = "application/json",
                             indexed: bool = False) -> APIError:
    """Turn pydantic's list of errors into one 400 that names the first bad field (its list indices
    as input[0].content[1] where indexed, else as messages.0.content.1)."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    # A union (e.g. prompt: str | list[int]) reports one error per member: undecodable text says most.
    first = next((e for e in errors if e.get("type") == "invalid_text"), None) or _deepest_of_first_field(errors)
    if tuple(first.get("loc", ())) == ("body",):     # the body as a whole, not one of its fields
        if first.get("type") == "missing":
            return APIError(400, "the request body is empty; send a JSON object")
        media_type = content_type.split(";", 1)[0].strip().lower()
        if media_type != "application/json" and not media_type.endswith("+json"):
            # FastAPI parses JSON only under a JSON media type; anything else arrives as raw bytes.
            given = f"Content-Type {short_text(content_type)}" if content_type else "no Content-Type"
            return APIError(400, f"the request body must be JSON sent with Content-Type: application/json, "
                            f"got {given}")
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON in request body: {_json_error_reason(first)}", code="json_invalid")
    loc = list(first.get("loc", ()))
    if loc and loc[0] in ("body", "query", "path", "header"):
        loc = loc[1:]
    # Union members add their type name to the path (e.g. prompt.str); keep the field path only.
    loc = [p for p in loc if not _is_type_tag(str(p))]
    # A field name that is not Unicode reaches the path as U+FFFD (and a dict's key as "[key]"):
    # the param is the field that holds it.
    cut = next((i for i, p in enumerate(loc) if isinstance(p, str) and (
        p == "[key]" or "\ufffd" in p or not p.isprintable())), len(loc))
    param = _param_of(loc[:cut], indexed)
    if first.get("type") == "missing":
        message = f"{param} is required" if param else "a required field is missing"
    elif first.get("type") == "string_unicode":
        # Values are checked by protocol.check_text; what pydantic cannot read is a field name.
        where = f"{param} has" if param else "the request body has"
        message = f"{where} a field name that is not valid Unicode (a lone surrogate such as \\ud800)"
    elif param is None:
        message = f"request body must be a JSON object: {first.get('msg', '')}"
    else:
        # pydantic says "a valid dictionary or instance of ChatMessage": its class names are not the API's.
        message = f"{param}: {re.sub(r' or instance of [A-Za-z_]+', '', first.get('msg', 'invalid value'))}"
    return APIError(400, message, param=param)


def _param_of(loc: list, indexed: bool) -> str | None:
    """A field path as a param: messages.0.content, or input[0].content where indexed."""
    if not indexed:
        return ".".join(str(p) for p in loc) or None
    param = ""
    for part in loc:
        param += f"[{part}]" if isinstance(part, int) else f".{part}" if param else str(part)
    return param or None


def _json_error_reason(error: dict) -> str:
    """What the JSON decoder said and where (FastAPI's own message is only "JSON decode error")."""
    why = (error.get("ctx") or {}).get("error") or error.get("msg") or "JSON decode error"
    loc = error.get("loc", ())
    where = loc[1] if len(loc) == 2 and isinstance(loc[1], int) else None
    return why if where is None else f"{why} at character {where}"


def body_parse_error(cause: BaseException | None) -> APIError:
    """The 400 for a body FastAPI could not decode for a reason other than bad JSON syntax (it
    says only "There was an error parsing the body"): cause is what json.loads raised."""
    if isinstance(cause, UnicodeDecodeError):
        # json.loads reads a body that opens with a UTF-16 or UTF-32 byte order mark in that encoding
        encoding = "UTF-8" if cause.encoding.lower().replace("-", "") == "utf8" else cause.encoding.upper()
        why = f"the body is not {encoding} text (byte 0x{cause.object[cause.start]:02x} at {cause.start})"
    elif isinstance(cause, (json.JSONDecodeError, RecursionError)) or (
            isinstance(cause, ValueError) and "integer string conversion" in str(cause)):
        why = json_error_reason(cause)
    else:
        why = f"{type(cause).__name__}: {cause}" if cause is not None else "the body could not be read"
    return APIError(400, f"malformed JSON in request body: {why}", code="json_invalid")


def json_error_reason(exc: ValueError | RecursionError) -> str:
    """Why json.loads refused some text, in JSON's terms (not Python's advice on its own limits)."""
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at character {exc.pos}"
    if isinstance(exc, RecursionError):
        return "arrays or objects are nested too deeply"
    if "integer string conversion" in str(exc):
        return "a number has too many digits"       # Python refuses to read an int of over 4300 digits
    return str(exc)


def _deepest_of_first_field(errors: list[dict]) -> dict:
    """The first error, or for a message or a Responses input one deeper inside the same field: a union
    (content: str | list of parts) reports each member, and a part's bad "type" says more than "not a
    valid string"."""
    def path(error):
        parts = [str(p) for p in error.get("loc", ()) if not _is_type_tag(str(p))]
        return parts[1:] if parts[:1] == ["body"] else parts

    head = path(errors[0])
    # A prompt's union (text, ids, lists of them) reads best as a whole; a conversation's (a Responses
    # input is text or items) by the item that is wrong.
    if head[:1] not in (["messages"], ["input"]):
        return errors[0]
    inside = [e for e in errors if path(e)[:len(head)] == head]
    return max(inside, key=lambda e: len(path(e)))      # max keeps the first of equal depth


def _is_type_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool", "list", "dict") or part.startswith(("list[", "function-"))


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app returns OpenAI-shaped, or Anthropic-shaped on Anthropic's Messages API
    routes: a body that does not parse, an unknown path or method, an internal failure, as well as
    the errors the handlers raise."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from minillm.server.middleware import is_messages_route

    def respond(request: Request, err: APIError) -> JSONResponse:
        return error_response(err, is_anthropic=is_messages_route(request.scope))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(request, _validation_to_api_error(exc, request.headers.get("content-type", "")))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == FASTAPI_BODY_ERROR:
            return respond(request, body_parse_error(exc.__cause__))
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        response = respond(request, APIError(exc.status_code, message or HTTPStatus(exc.status_code).phrase))
        response.headers.update(exc.headers or {})    # a 405's Allow (RFC 9110 requires it)
        return response

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return respond(request, engine_dead_error(exc))

    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # As a stream that fails after its headers reports it (serving.stream_failure): vLLM's status
        # and message for the exception's type.
        return respond(request, unexpected_error(exc))

    # The routes' failures are answered by the middleware below: Starlette runs an exception_handler(Exception)
    # in its outermost middleware, which re-raises once it has answered, so uvicorn logged a crash and
    # dropped the connection (the client's next request on it was reset). That handler stays for the
    # middlewares added after this one, outside it.
    app.add_middleware(_AnswerUnexpectedErrors, handler=_internal)
    app.exception_handler(Exception)(_internal)


class _AnswerUnexpectedErrors:
    """ASGI middleware: an exception no handler took is logged and answered with handler(request, exc)
    where no response has started, and goes no further, so the connection stays open for the next request."""

    def __init__(self, app, handler) -> None:
        self.app, self.handler = app, handler

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def sending(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            if started:
                raise
            from starlette.requests import Request
            logging.getLogger("minillm.server").error("%s %s failed", scope.get("method"), scope.get("path"),
                                                      exc_info=exc)
            response = await self.handler(Request(scope), exc)
            await response(scope, receive, send)
