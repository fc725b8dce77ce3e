"""The stats client: reads EngineStats from a minillm server over SSE (or polling) with retries."""
from __future__ import annotations

import asyncio
import dataclasses
import html
import json
import math
import re
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit, urlunsplit

import anyio
import httpx

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup   # Python 3.10: anyio's groups are the backport's

from minillm import sse
from minillm.sse import LineSplitter, LineTooLong
from minillm.stats import EngineStats, MemoryStats, RequestStats, SpecDecodeStats, StepStats
from minillm.urls import (authorization_headers, check_credentials, client_endpoint, env_ssl_verify, server_base_url,
                          shown_url, tls_failure, url_path)

DEFAULT_INTERVAL_S = 0.25
# The seconds between snapshots the server's /v1/stats/stream takes (minillm/server/app.py's
# MIN_STATS_INTERVAL_S and MAX_STATS_INTERVAL_S).
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.1, 60.0
MAX_CELLS = 4096        # the server refuses larger block maps; the grid folds what it gets
BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 8.0
CONNECT_TIMEOUT_S = 5.0
# While a server without /v1/stats/stream is polled, the stream is asked for again after these
# seconds, doubling: a server restarted or upgraded behind the same URL gets its stream back.
STREAM_RETRY_START_S = 5.0
STREAM_RETRY_MAX_S = 120.0
# One stats event is tens of KB even at MAX_CELLS; a stream whose "event" grows past this is not a
# minillm server's, and gathering it without end would take the monitor's memory.
MAX_EVENT_CHARS = 8 * 1024 * 1024
MAX_ERROR_BYTES = 64 * 1024     # of an error's body: its message is all the banner shows


class StatsFormatError(ValueError):
    """The server answered, but not with an EngineStats payload."""


class StreamSilent(Exception):
    """An open stats stream sent no stats event for `silence_s` seconds (keep-alive comments at most)."""

    def __init__(self, silence_s: float):
        super().__init__(f"no stats event for {silence_s:g} s")
        self.silence_s = silence_s


EMPTY_STREAM = "/v1/stats/stream ended without a stats event: is this a minillm server?"

# A minillm server takes its first snapshot before it answers and sends it right after its headers: a
# stream whose headers come without it for this long is held back on the way (a proxy that buffers), and
# the monitor polls instead of waiting the silence limit, sized for a stalled step between snapshots.
FIRST_EVENT_S = 3.0

# silence_limit_s in words, for the help.
SILENCE_RULE = "3 intervals (10 s at least, the interval + 30 s at most)"


def silence_limit_s(interval_s: float) -> float:
    """The seconds an open stream may go without a stats event before the banner says so: three of the
    server's intervals, at least 10 s (a server's first snapshot may wait for a step) and at most the
    interval + 30 s (20 minutes at --interval 60 kept a dead server's dashboard blank and unexplained)."""
    return min(max(10.0, 3 * interval_s), interval_s + 30.0)


@dataclass
class StatsFrame:
    """One stats snapshot as received: the parsed dataclass and the raw JSON dict."""

    stats: EngineStats
    raw: dict


@dataclass
class SourceProblem:
    """The source cannot deliver right now; it retries after `retry_in_s` (None: it gave up)."""

    message: str
    retry_in_s: float | None


@dataclass
class SourceStatus:
    """A line describing where frames come from (shown in the title bar)."""

    text: str


SourceEvent = StatsFrame | SourceProblem | SourceStatus

# Annotation strings (stats.py uses postponed annotations) mapped to the JSON types they accept.
_NUMBER = (int, float)
MAX_INT = 2**63 - 1      # what a server's counters hold; a longer integer overflows a float
_SCALAR_TYPES = {"int": int, "float": _NUMBER, "str": str}


def _check_value(value, annotation: str, where: str):
    """Raise StatsFormatError unless `value` has the JSON type `annotation` names."""
    if annotation.endswith(" | None"):
        if value is None:
            return value
        annotation = annotation[: -len(" | None")]
    if annotation in _SCALAR_TYPES:
        wanted = _SCALAR_TYPES[annotation]
        if isinstance(value, bool) or not isinstance(value, wanted):
            raise StatsFormatError(f"field {where!r} should be {annotation}, got {value!r:.40}")
        if isinstance(value, float) and not math.isfinite(value):
            # json.loads takes NaN, Infinity and 1e999; the panels scale bars by these values.
            raise StatsFormatError(f"field {where!r} should be a finite number, got {value!r}")
        if isinstance(value, int) and not -MAX_INT <= value <= MAX_INT:
            # json.loads takes integers of any length; the panels turn them into floats.
            raise StatsFormatError(f"field {where!r} should be a 64-bit integer, got {value!r:.40}")
    elif annotation == "list[int]":
        if not isinstance(value, list) or not _is_int_list(value):
            raise StatsFormatError(f"field {where!r} should be a list of ints")
    elif annotation == "dict[str, int]":
        if not isinstance(value, dict) or not all(
            isinstance(v, int) and -MAX_INT <= v <= MAX_INT for v in value.values()
        ):
            raise StatsFormatError(f"field {where!r} should be an object of counts")
    return value


def _is_int_list(values: list) -> bool:
    """Whether every item is an int and none a bool: the set of the items' types is built in C, so a
    block map of a million cells is checked in milliseconds (a test per item took 60 ms a frame)."""
    return set(map(type, values)) <= {int} or all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _dataclass_kwargs(cls, data, where: str, nested: dict[str, Callable]) -> dict:
    """Keyword arguments for `cls` from a JSON object: checks types, ignores unknown keys."""
    if not isinstance(data, dict):
        raise StatsFormatError(f"{where or 'stats'} should be a JSON object")
    kwargs = {}
    for f in dataclasses.fields(cls):
        name = f"{where}.{f.name}" if where else f.name
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise StatsFormatError(f"missing field {name!r}")
            continue
        if f.name in nested:
            kwargs[f.name] = nested[f.name](data[f.name], name)
        else:
            kwargs[f.name] = _check_value(data[f.name], str(f.type), name)
    return kwargs


def _parse_list(cls):
    def parse(items, where: str) -> list:
        if not isinstance(items, list):
            raise StatsFormatError(f"field {where!r} should be a list")
        return [cls(**_dataclass_kwargs(cls, item, f"{where}[{i}]", {})) for i, item in enumerate(items)]

    return parse


def _checked(cls, kwargs: dict, where: str):
    """cls(**kwargs); the ValueError of a dataclass that checks its fields is a StatsFormatError naming it."""
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise StatsFormatError(f"field {where!r}: {exc}") from None


def parse_stats(data) -> EngineStats:
    """EngineStats from the JSON dict of EngineStats.to_dict(); raises StatsFormatError naming the field."""
    nested = {
        "memory": lambda d, where: MemoryStats(**_dataclass_kwargs(MemoryStats, d, where, {})),
        "recent_steps": _parse_list(StepStats),
        "requests": _parse_list(RequestStats),
        "spec_decode": lambda d, where: None if d is None else _checked(
            SpecDecodeStats, _dataclass_kwargs(SpecDecodeStats, d, where, {}), where),
    }
    return EngineStats(**_dataclass_kwargs(EngineStats, data, "", nested))


def parse_frame(text: str) -> StatsFrame:
    """A StatsFrame from the JSON text of one snapshot; raises StatsFormatError."""
    try:
        data = sse.loads(text)
    except json.JSONDecodeError as exc:
        raise StatsFormatError(f"not JSON ({exc.msg} at char {exc.pos}): {text[:60]!r}") from None
    except ValueError as exc:
        raise StatsFormatError(f"{exc}: {text[:60]!r}") from None
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        # The stream ends with an OpenAI-style error event when the engine fails.
        raise StatsFormatError(f"the server reported: {error_message(data) or data['error']}")
    if isinstance(data, dict) and isinstance(data.get("backends"), dict) and "decode" in data["backends"]:
        servers = [str(u) for role in ("decode", "prefill") for u in data["backends"].get(role) or []]
        raise StatsFormatError("this is a minillm router, which has no KV cache of its own: watch one of its "
                               f"servers ({', '.join(servers[:4]) or 'none listed'})")
    return StatsFrame(stats=parse_stats(data), raw=data)


def error_message(data) -> str | None:
    """The message of an OpenAI-style error body, if it is one."""
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        message = data["error"].get("message")
        return str(message) if message else None
    return None


def body_message(data) -> str | None:
    """The message of a JSON error body: OpenAI's {"error": {"message"}} (or {"error": "..."}),
    FastAPI's {"detail": "..."} or its validation errors {"detail": [{"loc", "msg"}, ...]}."""
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("error"), str) and data["error"]:
        return data["error"]
    detail = data.get("detail")
    if isinstance(detail, str) and detail:
        return detail
    if isinstance(detail, list):
        messages = [_validation_message(item) for item in detail]
        return "; ".join(m for m in messages if m) or None
    return error_message(data)


def _validation_message(item) -> str | None:
    """One of FastAPI's validation errors as 'field: message'."""
    if not isinstance(item, dict) or not item.get("msg"):
        return None
    loc = item.get("loc")
    field = ".".join(str(part) for part in loc[1:] if part != "body") if isinstance(loc, list) else ""
    return f"{field}: {item['msg']}" if field else str(item["msg"])


def _body_message(body: str) -> str:
    try:
        message = body_message(sse.loads(body))
    except ValueError:          # not JSON, or JSON nested past the stack
        message = None
    if message:
        return message.strip()[:200]
    # A proxy's error page (nginx's 502 while the server restarts) is shown by its title, not its markup.
    title = _HTML_TITLE.search(body[:4096])     # a page's title is near its top; the search stays cheap
    text = html.unescape(title.group(1)) if title else body
    return " ".join(text.split())[:100]


_HTML_TITLE = re.compile(r"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)


class HTTPStatusProblem(Exception):
    """A non-200 answer, carrying the status code (and a redirect's Location header)."""

    def __init__(self, status: int, url: str, body: str, location: str | None = None):
        super().__init__(f"{status} from {url}")
        self.status = status
        self.url = url
        self.body = body
        self.location = location


def redirect_target(url: str, location: str) -> str:
    """The server a redirect of `url` points at: Location resolved against it, without the query and
    the endpoint (https://host for https://host/v1/stats/stream?cells=64)."""
    parts = urlsplit(urljoin(url, location))
    return shown_url(server_base_url(urlunsplit(parts._replace(query="", fragment=""))))


def describe_problem(exc: BaseException, base_url: str, has_key: bool = True) -> str:
    """A one-line, user-facing explanation of why stats could not be read (has_key: a key was sent)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]   # anyio wraps some connect failures (a port over 65535) in a group
    if isinstance(exc, HTTPStatusProblem):
        if 300 <= exc.status < 400 and exc.location:
            # The monitor does not follow redirects (a key would go where the user did not point it).
            return f"{base_url} redirects to {redirect_target(exc.url, exc.location)} ({exc.status}): give that URL"
        if exc.status in (401, 403) and not has_key:
            return f"{base_url} asks for an API key ({exc.status}): pass --api-key KEY or set $OPENAI_API_KEY"
        if exc.status in (401, 403):
            return f"{base_url} refused the API key ({exc.status}): pass the server's key with --api-key"
        if exc.status == 404:
            path = url_path(base_url)
            if path:      # not one of the server's endpoints (server_base_url takes those off)
                return (f"{base_url} has no /v1/stats ({exc.status}): is the server at "
                        f"{base_url.removesuffix(path)}, without the path {path}?")
            return f"{base_url} has no /v1/stats ({exc.status}): is this a minillm server?"
        return f"{base_url} answered {exc.status}: {_body_message(exc.body)}"
    tls = tls_failure(exc, base_url)
    if tls is not None:
        return tls
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect to {base_url}: is `minillm serve` running there?"
    if isinstance(exc, StreamSilent):
        return (f"no stats from {base_url} for {exc.silence_s:g} s: its stream is open but sends no stats "
                "events (a stalled server, or a proxy's keep-alives)")
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer from {base_url} (timed out)"
    if isinstance(exc, StatsFormatError):
        return f"bad stats from {base_url}: {exc}"
    if isinstance(exc, (httpx.InvalidURL, httpx.UnsupportedProtocol)):
        return f"invalid server URL {base_url!r}: {exc}"
    return f"lost {base_url}: {type(exc).__name__}: {exc}"


async def bounded_lines(chunks: AsyncIterator[str], limit: int) -> AsyncIterator[str]:
    """The lines of a text stream (minillm.sse.LineSplitter); StatsFormatError once a line runs past
    limit characters without its end."""
    splitter = LineSplitter(limit)
    try:
        async for text in chunks:
            for line in splitter.feed(text):
                yield line
    except LineTooLong as exc:
        raise StatsFormatError(f"{exc} in the stats stream: not a minillm server") from None
    for line in splitter.flush():
        yield line


async def read_capped(response: httpx.Response, limit: int) -> tuple[str, bool]:
    """At most limit bytes of response's body as text, and whether there was more (left unread)."""
    data = bytearray()
    async for chunk in response.aiter_bytes():
        data += chunk
        if len(data) > limit:
            return data[:limit].decode(errors="replace"), True
    return data.decode(errors="replace"), False


async def iter_sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The data payloads of server-sent events, one string per event; StatsFormatError for an event
    over MAX_EVENT_CHARS."""
    data: list[str] = []
    size = 0
    async for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
                data, size = [], 0
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
            size += len(data[-1]) + 1
            if size > MAX_EVENT_CHARS:
                raise StatsFormatError(f"a stats event over {MAX_EVENT_CHARS} characters: not a minillm server")
        # "event:", "id:", "retry:" and ": comment" lines carry nothing the monitor uses.
    if data:
        yield "\n".join(data)


class LiveSource:
    """Frames from a running server: SSE at /v1/stats/stream, polling /v1/stats while that is missing.

    silence_s: how long an open stream may send no stats event before it is a problem (default
    silence_limit_s(interval_s)); stream_retry_s: the first wait before a polled server is asked for
    its stream again."""

    def __init__(self, url: str, api_key: str | None = None, interval_s: float = DEFAULT_INTERVAL_S, *,
                 silence_s: float | None = None, stream_retry_s: float = STREAM_RETRY_START_S):
        self.base_url = server_base_url(url)
        check_credentials(self.base_url, api_key)
        self.shown_url = shown_url(self.base_url)   # what the title and the banner say
        self.http_base, self.uds = client_endpoint(self.base_url)   # uds: serve --uds's socket, else None
        self.api_key = api_key or None    # "" (--api-key "$UNSET") sends none: a 401 must not say it was refused
        self.headers = authorization_headers(api_key)   # a key no header can carry fails here, not in the loop
        self.interval_s = interval_s
        self.silence_s = silence_limit_s(interval_s) if silence_s is None else silence_s
        self.stream_retry_start_s = stream_retry_s
        self.stream_retry_s = stream_retry_s      # the next wait before the stream is asked for again
        self.stream_retry_at: float | None = None  # time.monotonic() of that try; None: not polling
        self.use_polling = False
        self.polling_reason = ""                   # why the stream is not used, for the title

    def _client(self) -> httpx.AsyncClient:
        # No bytes at all for silence_s is a timeout; a stream of keep-alive comments only is caught by _stream.
        timeout = httpx.Timeout(CONNECT_TIMEOUT_S, read=self.silence_s)
        # trust_env off (no proxy from the environment); $SSL_CERT_FILE is still honoured, as chat honours it.
        verify = env_ssl_verify()
        transport = httpx.AsyncHTTPTransport(uds=self.uds, verify=verify) if self.uds else None
        return httpx.AsyncClient(headers=self.headers, timeout=timeout, trust_env=False, verify=verify,
                                 transport=transport)

    def _status(self) -> SourceStatus:
        mode = ("polling" + (f": {self.polling_reason}" if self.polling_reason else "")) if self.use_polling else "stream"
        return SourceStatus(f"live {self.shown_url} ({mode})")

    async def events(self, cells: Callable[[], int]) -> AsyncIterator[SourceEvent]:
        """Yield frames forever; on any failure yield a SourceProblem and retry with backoff."""
        backoff = BACKOFF_START_S
        while True:
            try:
                async with self._client() as client, aclosing(self._frames(client, cells)) as events:
                    yield self._status()
                    async for event in events:
                        if isinstance(event, StatsFrame):
                            backoff = BACKOFF_START_S
                        yield event
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # every failure is shown and retried, never raised
                if isinstance(exc, (httpx.NetworkError, httpx.RemoteProtocolError)):
                    self._stream_first()
                yield SourceProblem(describe_problem(exc, self.shown_url, self.api_key is not None), backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _frames(self, client: httpx.AsyncClient, cells: Callable[[], int]) -> AsyncIterator[SourceEvent]:
        """Frames over one client until the cell count changes (the caller reconnects) or an error; a
        SourceStatus when the stream is given up for polling or comes back."""
        retry: StreamRetry | None = None     # the stream asked for again while polling, until its first frame
        try:
            while True:
                wanted = min(max(cells(), 1), MAX_CELLS)
                opened = None
                if self.use_polling:
                    if retry is None and time.monotonic() >= self.stream_retry_at:
                        retry = StreamRetry(self._open_stream(client, wanted), wanted)
                    if retry is None or not retry.task.done():
                        # The polled stats go on while the stream is tried: its first event may take
                        # FIRST_EVENT_S, and a proxy that withholds its headers the silence limit.
                        yield await self._poll(client, wanted)
                        if retry is None:
                            await asyncio.sleep(self.interval_s)
                        else:
                            await retry.wait(self.interval_s)    # a stream's first frame ends the wait
                        continue
                    finished, retry = retry, None
                    shown = self._status().text
                    first = self._retried(finished)
                    if first is None:
                        if self._status().text != shown:    # the stream failed otherwise than before
                            yield self._status()
                        continue
                    opened, wanted = _prepend(first, finished.frames), finished.num_cells
                shown = self._status().text
                self.use_polling = False     # the stream is asked for (again), or a retry's took over
                resized, num_frames = False, 0
                async with aclosing(self._stream(client, wanted, opened)) as frames:
                    async for frame in frames:
                        if self._status().text != shown:    # the stream came back, or went silent and is polled
                            shown = self._status().text
                            yield self._status()
                        num_frames += 1
                        yield frame
                        if min(max(cells(), 1), MAX_CELLS) != wanted:
                            resized = True
                            break  # the grid was resized: reopen the stream with the new cell count
                if num_frames == 0:
                    # A minillm server sends its first snapshot at once; a stream that ends empty (a proxy, another
                    # server) was reopened every interval without end, the dashboard blank and saying nothing.
                    raise StatsFormatError(EMPTY_STREAM)
                if not resized:
                    await asyncio.sleep(self.interval_s)  # the server ended the stream (or was polled): go on gently
        finally:
            if retry is not None:
                await retry.cancel()

    def _retried(self, retry: StreamRetry) -> StatsFrame | None:
        """The first frame of a stream asked for again while polling, or None where it failed as a
        polled stream may (missing, an error status, silent): the polling goes on, the next try after a
        doubled wait. Other failures raise."""
        try:
            return retry.task.result()
        except StopAsyncIteration:
            raise StatsFormatError(EMPTY_STREAM) from None
        except (HTTPStatusProblem, StreamSilent, httpx.ReadTimeout) as failure:
            if isinstance(failure, HTTPStatusProblem) and failure.status in (401, 403):
                raise
            self._fall_back_to_polling(self._polling_reason(failure))
            return None

    async def _poll(self, client: httpx.AsyncClient, num_cells: int) -> StatsFrame:
        url = f"{self.http_base}/v1/stats"
        async with client.stream("GET", url, params={"cells": num_cells}) as response:
            # A body without end (another server on the port) is read no further than one stats event.
            text, is_cut = await read_capped(response, MAX_EVENT_CHARS)
        if response.status_code != 200:
            raise HTTPStatusProblem(response.status_code, url, text, response.headers.get("location"))
        if is_cut:
            raise StatsFormatError(f"/v1/stats answered over {MAX_EVENT_CHARS} bytes: not a minillm server")
        return parse_frame(text)

    def _stream_first(self) -> None:
        """The connection failed or was lost: the server that answers next may be another (restarted,
        upgraded), so it is asked for its stream at once, however long a polled one was to wait."""
        self.use_polling = False
        self.polling_reason = ""
        self.stream_retry_s = self.stream_retry_start_s

    def _fall_back_to_polling(self, reason: str = "") -> None:
        """The stream is missing or failing (reason: how, for the title): poll, and ask for the stream
        again after a wait that doubles each time."""
        self.use_polling = True
        self.polling_reason = reason
        self.stream_retry_at = time.monotonic() + self.stream_retry_s
        self.stream_retry_s = min(self.stream_retry_s * 2, STREAM_RETRY_MAX_S)

    async def _stream(self, client: httpx.AsyncClient, num_cells: int,
                      opened: AsyncIterator[StatsFrame] | None = None) -> AsyncIterator[StatsFrame]:
        """The frames of /v1/stats/stream (opened: a stream a retry opened), or a polled one where the
        stream is missing, answers an error or goes silent."""
        try:
            async with aclosing(opened or self._open_stream(client, num_cells)) as frames:
                async for frame in frames:
                    yield frame
            return
        except (HTTPStatusProblem, StreamSilent, httpx.ReadTimeout) as exc:
            # Nothing for silence_s, before its headers or between events (a proxy that buffers, a
            # stalled stream): the stats are polled while /v1/stats answers.
            failure = exc
        if isinstance(failure, HTTPStatusProblem) and failure.status in (404, 405):
            self._fall_back_to_polling()
            yield await self._poll(client, num_cells)
        else:
            yield await self._poll_instead(client, num_cells, failure)

    async def _open_stream(self, client: httpx.AsyncClient, num_cells: int) -> AsyncIterator[StatsFrame]:
        """The frames of /v1/stats/stream; HTTPStatusProblem for an answer other than 200 (a 404 or 405:
        an older server without the stream, whose snapshot endpoint is polled)."""
        url = f"{self.http_base}/v1/stats/stream"
        params = {"cells": num_cells, "interval": self.interval_s}
        async with client.stream("GET", url, params=params) as response:
            if response.status_code != 200:
                body = "" if response.status_code in (404, 405) else (await read_capped(response, MAX_ERROR_BYTES))[0]
                raise HTTPStatusProblem(response.status_code, url, body, response.headers.get("location"))
            async with aclosing(self._events(response)) as frames:
                async for frame in frames:
                    yield frame

    async def _events(self, response: httpx.Response) -> AsyncIterator[StatsFrame]:
        """The frames of an open 200 answer of /v1/stats/stream."""
        content_type = response.headers.get("content-type", "").partition(";")[0].strip()
        if content_type != "text/event-stream":
            # Another web server on the port (a page for every path): its answer holds no event,
            # and the monitor would wait for stats without end.
            raise StatsFormatError(f"/v1/stats/stream answered {content_type or 'no Content-Type'}, not a stream of "
                                   "stats events: is this a minillm server?")
        events = iter_sse_data(bounded_lines(response.aiter_text(), MAX_EVENT_CHARS))
        limit_s = min(self.silence_s, FIRST_EVENT_S)
        async with aclosing(events):
            while True:
                data = await self._next_event(events, limit_s)
                limit_s = self.silence_s
                if data is None:
                    return
                frame = parse_frame(data)
                # The stream is back once it sends stats (its headers alone may come from a proxy that
                # then sends nothing): a later loss waits the least.
                self.stream_retry_s = self.stream_retry_start_s
                yield frame

    async def _poll_instead(self, client: httpx.AsyncClient, num_cells: int, failure: Exception) -> StatsFrame:
        """A snapshot of /v1/stats while the stream answers an error (a proxy's 502, a stream handler's
        500) or sends nothing: the monitor polls and asks for the stream again after a doubling wait. The
        stream's own failure when the snapshot fails too, or when the key was refused (the poll would be
        refused alike)."""
        if isinstance(failure, HTTPStatusProblem) and failure.status in (401, 403):
            raise failure
        try:
            frame = await self._poll(client, num_cells)
        except Exception:      # the server fails as a whole: its stream's failure says how
            raise failure from None
        self._fall_back_to_polling(self._polling_reason(failure))
        return frame

    def _polling_reason(self, failure: Exception) -> str:
        """Why the stream is polled instead, for the title: how it failed (nothing for a missing one)."""
        if isinstance(failure, HTTPStatusProblem):
            return "" if failure.status in (404, 405) else f"the stream answered {failure.status}"
        silence_s = failure.silence_s if isinstance(failure, StreamSilent) else self.silence_s
        return f"the stream sent nothing for {silence_s:g} s"

    async def _next_event(self, events: AsyncIterator[str], limit_s: float) -> str | None:
        """The next event's data (None at the stream's end); StreamSilent after limit_s without one,
        however many keep-alive comments came (they keep the read timeout from firing)."""
        try:
            with anyio.fail_after(limit_s):
                return await anext(events)
        except StopAsyncIteration:
            return None
        except (TimeoutError, httpx.ReadTimeout):
            raise StreamSilent(limit_s) from None


class StreamRetry:
    """The stats stream asked for again while the stats are polled: a task that waits for its first
    frame; the stream takes over only once it has one."""

    def __init__(self, frames: AsyncIterator[StatsFrame], num_cells: int):
        self.frames = frames
        self.num_cells = num_cells
        self.task = asyncio.create_task(_first(frames))

    async def wait(self, timeout_s: float) -> None:
        """Wait timeout_s, or less where the try ends first."""
        await asyncio.wait({self.task}, timeout=timeout_s)

    async def cancel(self) -> None:
        """Give the try up and close its stream (also when the caller is being cancelled)."""
        self.task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait({self.task})
            if not self.task.cancelled():
                self.task.exception()    # retrieved: a failure of a try given up says nothing
            await self.frames.aclose()


async def _first(frames: AsyncIterator[StatsFrame]) -> StatsFrame:
    """The first frame of frames (StopAsyncIteration where there is none)."""
    return await anext(frames)


async def _prepend(first: StatsFrame, rest: AsyncIterator[StatsFrame]) -> AsyncIterator[StatsFrame]:
    """first, then the frames of rest (closed however this ends)."""
    try:
        yield first
        async for frame in rest:
            yield frame
    finally:
        await rest.aclose()
