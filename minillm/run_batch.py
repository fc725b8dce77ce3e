"""minillm run-batch: an OpenAI Batch API file (JSONL, a request a line) run through the server's own
app in this process, its answers written a line each in input order, as vLLM's run-batch writes them."""
from __future__ import annotations

import asyncio
import codecs
import json
import os
import re
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, TextIO

from minillm.server.errors import body_parse_error, error_body, json_error_reason, unexpected_error

SUPPORTED_URLS = ("/v1/chat/completions", "/v1/completions")
STREAM_ERROR = "Request must not be sent in stream mode"
# A surrogate code point in a str is a lone one (json.loads joins an escaped pair into one character).
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class BatchFiles:
    """Where the batch comes from and where its answers go (paths or http(s) URLs)."""

    input_file: str
    output_file: str
    output_tmp_dir: str | None = None


@dataclass(frozen=True)
class BatchRequest:
    """One input line read as a request: it is sent when `error` is None, else answered with it."""

    index: int
    custom_id: str | None
    url: str = ""
    body: dict = field(default_factory=dict)
    error: str | None = None


@dataclass
class BatchSummary:
    """What a run did: requests read, answered with a 200, and failed."""

    num_requests: int = 0
    num_succeeded: int = 0
    num_failed: int = 0
    elapsed_s: float = 0.0


def is_url(path: str) -> bool:
    """Whether PATH is an http(s) URL rather than a local path."""
    return path.startswith(("http://", "https://"))


def read_input(path: str) -> list[str]:
    """The input's non-blank lines (a local path, an http(s) URL, or - for stdin); ValueError naming
    --input-file when it cannot be read."""
    try:
        if path == "-":
            stdin = getattr(sys.stdin, "buffer", None)
            data = stdin.read() if stdin is not None else sys.stdin.read().encode("utf-8", "surrogateescape")
        elif is_url(path):
            data = _fetch_bytes(path)
        else:
            with open(path, "rb") as f:
                data = f.read()
    except OSError as exc:
        raise ValueError(f"--input-file {path}: {_reason(exc)}") from None
    return input_lines(data)


def input_lines(data: bytes) -> list[str]:
    """The non-blank lines of a JSONL file, split at newlines only (str.splitlines also splits at
    U+2028, U+0085 and the other separators a JSON string may hold as they are), a leading byte order
    mark dropped. A line that is not UTF-8 keeps its bad bytes as surrogates, for parse_line to answer."""
    data = data.removeprefix(codecs.BOM_UTF8)
    lines = (raw.decode("utf-8", "surrogateescape").strip() for raw in data.split(b"\n"))
    return [line for line in lines if line]


def _fetch_bytes(url: str) -> bytes:
    """The bytes at URL (an HTTP GET); OSError when they cannot be had."""
    import httpx
    try:
        response = httpx.get(url, timeout=60, follow_redirects=True)
    except httpx.HTTPError as exc:
        raise OSError(_http_failure(exc)) from None
    if not response.is_success:
        raise OSError(f"the download got HTTP {response.status_code} {response.reason_phrase}".rstrip())
    return response.content


def check_output(files: BatchFiles) -> None:
    """ValueError naming the flag when the output cannot be written: a missing or unwritable directory."""
    if files.output_tmp_dir is not None and not os.path.isdir(files.output_tmp_dir):
        raise ValueError(f"--output-tmp-dir {files.output_tmp_dir}: no such directory")
    if is_url(files.output_file) or files.output_file == "-":
        return
    if not files.output_file or files.output_file.endswith(("/", os.sep)):
        # abspath takes "" for the working directory and drops the slash: the check below would pass.
        raise ValueError(f"--output-file {files.output_file!r}: names no file")
    if os.path.isdir(files.output_file):
        raise ValueError(f"--output-file {files.output_file}: is a directory")
    folder = os.path.dirname(os.path.abspath(files.output_file))
    if not os.path.isdir(folder):
        raise ValueError(f"--output-file {files.output_file}: no such directory {folder}")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--output-file {files.output_file}: directory {folder} is not writable")


def parse_line(index: int, line: str) -> BatchRequest:
    """One input line as a BatchRequest; what is wrong with it (as vLLM's message where it has one) in `error`."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError as exc:      # bytes input_lines could not decode, kept as surrogates
        bad = ord(line[exc.start]) - 0xDC00
        return BatchRequest(index, None, error=f"Invalid JSON: the line is not UTF-8 text "
                                               f"(byte 0x{bad:02x} at character {exc.start})")
    try:
        item = json.loads(line)
    except (ValueError, RecursionError) as exc:    # RecursionError: arrays or objects nested too deeply
        return BatchRequest(index, None, error=f"Invalid JSON: {json_error_reason(exc)}")
    if not isinstance(item, dict):
        return BatchRequest(index, None, error="A batch line must be a JSON object")
    custom_id = item.get("custom_id")
    custom_id = custom_id if isinstance(custom_id, str) else None
    return BatchRequest(index, custom_id, str(item.get("url")), item.get("body"),
                        error=line_error(item, custom_id))


def line_error(item: dict, custom_id: str | None) -> str | None:
    """Why a parsed line cannot be sent (None: it can)."""
    for name, kind in (("custom_id", str), ("method", str), ("url", str), ("body", dict)):
        if not isinstance(item.get(name), kind):
            what = "an object" if kind is dict else "a string"
            return f"{name} must be {what}" if name in item else f"{name}: field required"
    if item["method"].upper() != "POST":
        return f"method {item['method']} is not supported: only POST is"
    if item["url"] not in SUPPORTED_URLS:
        return f"URL {item['url']} was used. Supported endpoints: {', '.join(SUPPORTED_URLS)}."
    return None


def batch_output(custom_id: str | None, status: int, body: Any = None, error: Any = None) -> dict:
    """One output line, as vLLM's BatchRequestOutput: the body on a 200, else the error."""
    response = {"status_code": status, "request_id": f"vllm-batch-{uuid.uuid4().hex}", "body": body}
    return {"id": f"vllm-{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}


async def answer(client: Any, request: BatchRequest) -> dict:
    """The output line for one request, sent to the app as a POST to its url."""
    if request.error is not None:
        return batch_output(request.custom_id, 400, error=request.error)
    try:
        # The body as the line wrote it, NaN included, for the server's own checks to answer (httpx's json=
        # refuses NaN with a message of its own); lone surrogates go as escapes, as they came.
        content = json.dumps(request.body).encode()
    except RecursionError as exc:
        # A body json.loads read near its depth limit, encoded again deeper in the stack: serve's answer
        # to a body nested too deeply, as sending the line's own text would have had.
        err = body_parse_error(exc)
        return batch_output(request.custom_id, err.status, error=error_body(err.status, err.message, code=err.code))
    try:
        headers = {"content-type": "application/json"}
        response = await client.send(client.build_request("POST", request.url, content=content, headers=headers),
                                     stream=True)
    except Exception as exc:     # the app's own failure: this line's error, never the batch's
        # What the server answers for it (its handler of last resort), status and body alike.
        err = unexpected_error(exc)
        return batch_output(request.custom_id, err.status,
                            error=error_body(err.status, err.message, err.param, err.code, err.type))
    try:
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return batch_output(request.custom_id, 400, error=STREAM_ERROR)
        body = json.loads(await response.aread())
    finally:
        await response.aclose()
    if response.status_code == 200:
        return batch_output(request.custom_id, 200, body=body)
    return batch_output(request.custom_id, response.status_code, error=body)


def output_line(output: dict) -> str:
    """One output line: JSON with its text as it is, as vLLM writes it (U+2028 included: the file is split at
    newlines only), but a lone surrogate (a line's custom_id or url escaped one, and its answer repeats it)
    as its \\u escape, which reads back the same and which UTF-8 can hold."""
    text = json.dumps(output, ensure_ascii=False)
    return LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text) + "\n"


class OrderedWriter:
    """Writes output lines in input order as they come in, holding those that come early."""

    def __init__(self, out: TextIO, total: int) -> None:
        self.out, self.total = out, total
        self.waiting: dict[int, dict] = {}
        self.next_index = 0
        self.summary = BatchSummary(num_requests=total)
        self.next_report = 1

    def add(self, index: int, output: dict) -> None:
        """Take the output of line INDEX; write every line now ready."""
        self.waiting[index] = output
        ok = output["error"] is None
        self.summary.num_succeeded += ok
        self.summary.num_failed += not ok
        while self.next_index in self.waiting:
            self.out.write(output_line(self.waiting.pop(self.next_index)))
            self.next_index += 1
        self.report_progress()

    def report_progress(self) -> None:
        """A progress line on stderr at each tenth of the batch done."""
        done = self.summary.num_succeeded + self.summary.num_failed
        if done * 10 >= self.next_report * self.total:
            print(f"minillm run-batch: {done}/{self.total} requests done", file=sys.stderr, flush=True)
            self.next_report = done * 10 // self.total + 1


async def run_requests(app: Any, requests: list[BatchRequest], out: TextIO, concurrency: int) -> BatchSummary:
    """Send the requests to the app concurrently (at most CONCURRENCY at once); write their lines to OUT."""
    import httpx
    writer = OrderedWriter(out, len(requests))
    slots = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, request: BatchRequest) -> None:
        async with slots:
            writer.add(request.index, await answer(client, request))

    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client:
            await asyncio.gather(*(one(client, r) for r in requests))
    return writer.summary


def write_outputs(engine: Any, options: Any, lines: list[str], files: BatchFiles) -> BatchSummary:
    """Run the batch's lines through the server's app over ENGINE; write the output file (or upload it)."""
    from minillm.server.app import create_app
    app = create_app(engine, options)
    requests = [parse_line(i, line) for i, line in enumerate(lines)]
    concurrency = 2 * engine.config.max_num_seqs
    started = time.perf_counter()
    if files.output_file == "-":      # stdout, as --input-file - reads stdin (./- names a file called -)
        summary = asyncio.run(run_requests(app, requests, sys.stdout, concurrency))
        sys.stdout.flush()
    elif not is_url(files.output_file):
        try:
            with open(files.output_file, "w", encoding="utf-8") as out:
                summary = asyncio.run(run_requests(app, requests, out, concurrency))
        except OSError as exc:       # the app's own failures are answered line by line: this is the file's
            raise OSError(f"--output-file {files.output_file}: {_reason(exc)}") from None
    else:
        summary = _run_and_upload(app, requests, files, concurrency)
    summary.elapsed_s = time.perf_counter() - started
    return summary


def _run_and_upload(app: Any, requests: list[BatchRequest], files: BatchFiles, concurrency: int) -> BatchSummary:
    """Write the answers under --output-tmp-dir and PUT them to the --output-file URL; an upload that fails
    leaves the file there, named in its OSError, so that a batch's answers are not lost with it."""
    with tempfile.NamedTemporaryFile("w+", encoding="utf-8", dir=files.output_tmp_dir, delete=False,
                                     prefix="tmp_batch_output_", suffix=".jsonl") as out:
        try:
            summary = asyncio.run(run_requests(app, requests, out, concurrency))
        except BaseException:
            os.remove(out.name)
            raise
    try:
        upload(files.output_file, out.name)
    except OSError as exc:
        raise OSError(f"{exc}; the answers are kept in {out.name}") from None
    os.remove(out.name)
    return summary


def upload(url: str, path: str) -> None:
    """PUT the file at PATH to URL, as vLLM uploads a batch's output."""
    import httpx
    with open(path, "rb") as f:
        try:
            response = httpx.put(url, content=f.read(), timeout=1000)
        except httpx.HTTPError as exc:
            raise OSError(f"--output-file {url}: the upload failed: {_http_failure(exc)}") from None
    if response.status_code != 200:
        raise OSError(f"--output-file {url}: the upload got HTTP {response.status_code}")


def _http_failure(exc: Exception) -> str:
    """An httpx error on one line: its kind and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def describe_summary(summary: BatchSummary, output_file: str) -> str:
    """The one-line summary printed at the end."""
    return (f"minillm run-batch: {summary.num_requests} requests, {summary.num_succeeded} succeeded, "
            f"{summary.num_failed} failed, in {summary.elapsed_s:.1f} s; wrote "
            f"{'stdout' if output_file == '-' else output_file}")


def _reason(exc: BaseException) -> str:
    """An OSError's reason without the path it repeats."""
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
