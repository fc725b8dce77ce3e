"""What completions and chat share: model check, prompt checks, submission, output merging, SSE."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import json
import logging
import uuid
from json.encoder import encode_basestring
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any, AsyncIterator, Awaitable, Callable, NamedTuple, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from minillm.outputs import CompletionOutput, RequestOutput
from minillm.sampling_params import SamplingParams, short_repr
from minillm.server.async_engine import EngineClient, OutputQueue, RequestStream
from minillm.server.errors import (
    APIError, EngineDeadError, bad_request_from_value_error, engine_dead_error, openai_error_event, openai_error_events,
    unexpected_error,
)
from minillm.server.json_body import LARGE_BODY_BYTES
from minillm.server.limits import ServerLimits
from minillm.server.metrics import RequestTimer, ServerMetrics
from minillm.server.middleware import first_header
from minillm.server.streaming import ClientGone, EventStreamResponse, HangUpWatch

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

logger = logging.getLogger("minillm.server")

# Tokenising and template rendering run here, off the event loop (the tokenizer's batch call
# releases the GIL, so they run in parallel with the loop and the engine thread).
NUM_PREPROCESS_THREADS = 4


class ShutdownFlag:
    """Set once the server shuts down. Signal handlers set it, so it holds no lock: a threading.Event
    takes one in set(), and a second signal arriving inside the first handler's set() (GNU timeout
    signals the child and then its group; a quick double Ctrl-C) waited on it forever."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        """Mark the shutdown (one attribute store: safe in a signal handler and from any thread)."""
        self._set = True

    def is_set(self) -> bool:
        """True once set() was called."""
        return self._set


def _no_stop_iteration(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs), a StopIteration raised as a RuntimeError: asyncio cannot set a
    StopIteration on a Future, and the request waiting on it would never be answered."""
    try:
        return fn(*args, **kwargs)
    except StopIteration as exc:
        raise RuntimeError(f"StopIteration in {getattr(fn, '__qualname__', fn)}") from exc


def context_overflow_message(limit: int, num_prompt_tokens: int, max_tokens: int) -> str:
    """vLLM's words for a prompt and max_tokens that together pass the context (clients parse them)."""
    total = num_prompt_tokens + max_tokens
    return (f"This model's maximum context length is {limit} tokens. However, you requested {max_tokens} output "
            f"tokens and your prompt contains {num_prompt_tokens} input tokens, for a total of {total} tokens "
            f"({num_prompt_tokens} + {max_tokens} = {total} > {limit}). Please reduce the length of the input "
            "prompt or the number of requested output tokens.")


@dataclass
class ServingContext:
    """What every handler needs: the engine, the metrics, the names it serves under and the limits."""

    engine: EngineClient
    metrics: ServerMetrics
    model_name: str                                   # the name responses carry (the first served name)
    model_names: tuple[str, ...] = ()                 # every name a request may give (default: model_name)
    limits: ServerLimits = field(default_factory=ServerLimits)
    chat_template: str | None = None                  # the server's template (--chat-template), else the model's
    trust_request_chat_template: bool = False         # whether a request may bring its own template
    stopping: ShutdownFlag = field(default_factory=ShutdownFlag)   # set when the server shuts down
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        NUM_PREPROCESS_THREADS, thread_name_prefix="minillm-preprocess"))
    kv_claims: Any = None             # a decode server's ClaimClient (server/kv_transfer.py), made on first use
    kv_handed: Any = None             # its HandedClaims (server/kv_transfer.py), made on first use
    # The model's sampling defaults for fields a request leaves unset (minillm/generation_config.py).
    sampling_defaults: dict = field(default_factory=dict)
    background: set = field(default_factory=set)   # fire-and-forget tasks, held until they end
    response_role: str = "assistant"                 # a chat reply's role when the request opens its turn
    log_requests: bool = False                       # log each request received (--enable-log-requests)
    max_tokens_cap: int | None = None                # override_generation_config's max_new_tokens (vLLM's cap)
    chat_template_content_format: str = "auto"       # how message content reaches the template (vLLM's)
    return_tokens_as_token_ids: bool = False         # the default of the requests' field of that name
    enable_prompt_tokens_details: bool = False       # usage carries prompt_tokens_details.cached_tokens
    enable_force_include_usage: bool = False         # streams end with a usage chunk whatever they ask
    default_chat_template_kwargs: dict = field(default_factory=dict)   # under each chat_template_kwargs
    reasoning_parser: str | None = None              # --reasoning-parser (server/reasoning_parsers.py)
    tool_call_parser: str | None = None              # with --enable-auto-tool-choice (server/tool_parsers.py)
    structured_outputs_in_reasoning: bool = False    # constraints hold the thinking too (vLLM's enable_in_reasoning)
    # How JSON schemas' objects are read (ServerOptions.disable_additional_properties; None: closed, as
    # vLLM's default backend closes them; a bool: the guidance backend's default, see structured._closing).
    disable_additional_properties: bool | None = None
    stream_interval: int = 1                         # streams send every this many tokens (--stream-interval)

    def __post_init__(self) -> None:
        self.model_names = self.model_names or (self.model_name,)

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer (thread-safe for encode/decode)."""
        return self.engine.tokenizer

    async def run_blocking(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run fn in the preprocessing pool, so tokenising a long prompt does not stall the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(
            _no_stop_iteration, fn, *args, **kwargs))

    async def run_blocking_if(self, slow: bool, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn in the preprocessing pool when it may be slow, else here: a hop through the pool costs
        two thread hand-overs (and the GIL twice) for work of a few microseconds."""
        if slow:
            return await self.run_blocking(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    def check_model(self, model: str | None) -> None:
        """404 for a model name this server does not serve (an omitted name means ours)."""
        if model is not None and model not in self.model_names:
            raise APIError(404, f"The model {short_repr(model)} does not exist.", param="model",
                           code="model_not_found")

    def check_token_ids(self, ids: list[int], param: str = "prompt") -> None:
        """400 for token ids outside the vocabulary."""
        vocab_size = len(self.tokenizer)      # added tokens included
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"{param} holds token ids outside [0, {vocab_size}): {short_repr(bad)}", param=param)

    def resolve_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str = "prompt") -> int:
        """max_tokens for this prompt; 400 when prompt and completion cannot fit the context."""
        limit = self.engine.max_model_len
        if num_prompt_tokens >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your request "
                           f"has {num_prompt_tokens} input tokens. Please reduce the length of the input messages.",
                           param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:           # the rest of the context, or the model's max_new_tokens if smaller
            return min(limit - num_prompt_tokens, self.sampling_defaults.get("max_tokens", limit))
        if isinstance(max_tokens, int) and max_tokens > 0 and num_prompt_tokens + max_tokens > limit:
            raise APIError(400, context_overflow_message(limit, num_prompt_tokens, max_tokens),
                           param="max_tokens", code="context_length_exceeded")
        if self.max_tokens_cap is not None and isinstance(max_tokens, int) and max_tokens > self.max_tokens_cap:
            return self.max_tokens_cap   # as vLLM caps a request's max_tokens by the override's max_new_tokens
        return max_tokens

    def as_token_ids(self, req: Any) -> bool:
        """Whether a request's logprobs name tokens "token_id:<id>": its return_tokens_as_token_ids,
        else the server's (--return-tokens-as-token-ids), as vLLM decides it."""
        asked = req.return_tokens_as_token_ids
        return self.return_tokens_as_token_ids if asked is None else asked

    def usage(self, outputs: list[RequestOutput], completion_tokens: int, is_stream: bool = False) -> dict:
        """The usage block of a response's final outputs: their prompt tokens and the completion
        tokens given, with vLLM's prompt_tokens_details (the prompt tokens served from the prefix
        cache) under --enable-prompt-tokens-details: a stream's as its first output counted them."""
        block = usage(sum(len(o.prompt_token_ids) for o in outputs), completion_tokens)
        if self.enable_prompt_tokens_details:
            count = first_output_cached_tokens if is_stream else final_cached_tokens
            block["prompt_tokens_details"] = {"cached_tokens": sum(count(o) for o in outputs)}
        return block


def final_cached_tokens(output: RequestOutput) -> int:
    """A request's prefix-cache hits as its final output counts them (with n > 1 its last finisher's)."""
    return output.num_cached_tokens or 0


def first_output_cached_tokens(output: RequestOutput) -> int:
    """A request's prefix-cache hits as its first output counted them, which vLLM's streams report
    (first_iteration): with n > 1 its first scheduled completion's."""
    return 0 if output.metrics is None else output.metrics.num_cached_tokens


# A request body past LARGE_BODY_BYTES (json_body.py) is validated in the preprocessing pool, not on
# the event loop: pydantic checks a chat's messages one by one, and 300,000 small ones held the loop
# for 2 s (every stream stalled); in the pool the loop still gets the GIL between them. Such a body's
# JSON is parsed on a thread too.


async def is_large_body(raw: Request) -> bool:
    """True when the request's body is large enough that reading it as a request (validating it,
    walking its messages or token ids) belongs in the preprocessing pool."""
    return len(await raw.body()) > LARGE_BODY_BYTES     # read already (FastAPI parsed it): no I/O


def validate_request(model: type[M], body: dict[str, Any]) -> M:
    """body as `model`; its errors reported under "body", as FastAPI reports a model body's."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


def forced_token_params(params: SamplingParams, token_id: int) -> SamplingParams:
    """params that sample token_id and nothing else, whatever else they asked (no grammar, bad words, bias,
    stop or minimum in the way): a prompt of max_model_len tokens is scored as all but its last token,
    that one sampled, its raw log-probabilities (taken before any mask) the last prompt token's entry."""
    return dataclasses.replace(params, allowed_token_ids=[token_id], bad_words=None, structured_outputs=None,
                               logit_bias=None, truncate_prompt_tokens=None, min_tokens=0, ignore_eos=True)


def new_request_id(prefix: str) -> str:
    """An id in OpenAI's style, e.g. cmpl-3f2a..."""
    return f"{prefix}-{uuid.uuid4().hex}"


# A client's request id (X-Request-Id or the body's request_id) names the response and is in every
# event of its stream: a 10 MB request_id made 640 MB of events for n=8 and 100 tokens and held a
# greedy stream beside it for 3 s. Trace and request ids are far shorter (a UUID is 36 characters).
MAX_REQUEST_ID_CHARS = 1024


def header_request_id(raw: Request) -> str:
    """The client's X-Request-Id ("" without one): the first when it sent several (the one vLLM reads,
    and the one RequestIdHeaderMiddleware echoes), read as UTF-8 where its bytes are UTF-8 (a client's
    'été' is not 'Ã©tÃ©'), else as latin-1, HTTP's reading of other bytes."""
    value = first_header(raw.scope["headers"], b"x-request-id")
    try:
        return value.decode()
    except UnicodeDecodeError:
        return value.decode("latin-1")


def client_response_id(prefix: str, raw: Request, body_id: str | None) -> str | None:
    """The id a response carries when the client chose one, as vLLM names it: prefix-<its
    X-Request-Id header>, else prefix-<the body's request_id>; None when it chose none. Either id
    past MAX_REQUEST_ID_CHARS is a 400 naming it."""
    header = header_request_id(raw)
    for param, given in (("X-Request-Id", header), ("request_id", body_id or "")):
        if len(given) > MAX_REQUEST_ID_CHARS:
            raise APIError(400, f"{param} may be at most {MAX_REQUEST_ID_CHARS} characters, got {len(given)}",
                           param=param)
    chosen = header or body_id
    return f"{prefix}-{chosen}" if chosen else None


def log_unknown_fields(names: list[str]) -> None:
    """Warn about the request fields this server ignored, by name (as vLLM does); they are still accepted."""
    if names:
        shown = ", ".join(short_repr(name, 40) for name in names[:20])
        more = f" and {len(names) - 20} more" if len(names) > 20 else ""
        logger.warning("The following fields were present in the request but ignored: %s%s", shown, more)


async def tokenize_bad_words(ctx: ServingContext, params: list[SamplingParams]) -> None:
    """Tokenize the request's bad words onto each of its params in the preprocessing pool (the
    engine's own tokenizing then finds them remembered); a word no token sequence can ban is a 400
    naming bad_words."""
    if not params or not params[0].bad_words:
        return

    def tokenize() -> None:
        for sp in params:
            sp.update_from_tokenizer(ctx.tokenizer, ctx.engine.vocab_size)

    try:
        await ctx.run_blocking(tokenize)
    except ValueError as exc:
        raise bad_request_from_value_error(exc) from None


def engine_request_id(external_id: str) -> str:
    """The engine's id for a request the server names external_id, as vLLM's input processor makes it:
    that name and 8 random hex digits, so requests sent with the same client id never meet in the
    engine (where the abort of one would end the other)."""
    return f"{external_id}-{uuid.uuid4().hex[:8]}"


def log_received(ctx: ServingContext, job, engine_ids: list[str], prompts: list[list[int]],
                 params: list[SamplingParams]) -> None:
    """vLLM's --enable-log-requests line for each engine request of a job: its engine id (with the
    response's where that is not its stem), its sampling params and its prompt's length (never the
    prompt's text)."""
    if not ctx.log_requests:
        return
    named = "" if job.response_id == job.request_id else f" (response {loggable(job.response_id)})"
    for engine_id, ids, sp in zip(engine_ids, prompts, params):
        logger.info("Received request %s%s: params: %s, num_prompt_tokens: %d.",
                    loggable(engine_id), named, params_for_log(sp), len(ids))


def loggable(text: str) -> str:
    """text with its control characters escaped: a client's id must not start log lines of its own."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def params_for_log(params: SamplingParams) -> str:
    """SamplingParams(field=value, ...) with each value cut short: a request's allowed_token_ids,
    logit_bias or schema could make a line of megabytes."""
    def value(v: Any) -> str:
        return f"{{...}} ({len(v)} items)" if isinstance(v, dict) and len(v) > 8 else short_repr(v, 80)

    shown = ", ".join(f"{f.name}={value(getattr(params, f.name))}" for f in fields(params) if f.repr)
    return f"{type(params).__name__}({shown})"


async def submit(ctx: ServingContext, request_ids: list[str], prompts: list[list[int]],
                 params: list[SamplingParams], cache_salt: str | None = None,
                 on_handed_over: Callable[[], None] | None = None, priority: int = 0,
                 on_output: Callable[[RequestOutput, float], None] | None = None) -> list[RequestStream]:
    """Add one engine request per prompt (request_ids[i] for prompts[i]), all feeding one queue; on a
    rejection abort those added.
    cache_salt: the request's (vLLM's), which keeps its prefix-cache blocks to requests of the same salt.
    priority: the request's (vLLM's), which the engine checks against its scheduling policy.
    on_handed_over: called once the engine holds, or may hold, one of them (accepted; or cancelled
    while its add was in flight, an add the engine may have taken and then aborts).
    on_output: called on the event loop with each of their outputs as it arrives, also after the
    caller has stopped reading them (the streams' observer, with the latency histograms')."""
    streams: list[RequestStream] = []
    shared = OutputQueue()
    try:
        for engine_id, ids, sp in zip(request_ids, prompts, params):
            timer = RequestTimer(ctx.metrics, sp)
            observer = timer.on_output if on_output is None else functools.partial(_observe_both, timer.on_output,
                                                                                    on_output)
            try:
                streams.append(await ctx.engine.add_request(engine_id, ids, sp, output_queue=shared,
                                                            observer=observer, cache_salt=cache_salt,
                                                            priority=priority))
            except asyncio.CancelledError:
                if on_handed_over is not None:
                    on_handed_over()
                raise
            if on_handed_over is not None:
                on_handed_over()
    except BaseException as exc:
        for stream in streams:
            ctx.engine.abort(stream.request_id)
        if isinstance(exc, ValueError):
            raise bad_request_from_value_error(exc) from None
        raise
    return streams


def _observe_both(first: Callable[[RequestOutput, float], None], second: Callable[[RequestOutput, float], None],
                  output: RequestOutput, seen: float) -> None:
    """Two observers of a stream's outputs, in turn."""
    first(output, seen)
    second(output, seen)


async def merged_outputs(ctx: ServingContext, streams: list[RequestStream], stream_interval: int | None = None
                         ) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
    """Per wake-up, [(prompt index, latest output)] for the streams that moved; leaving early aborts.

    Outputs are cumulative, so when several steps passed while the caller was busy only the
    newest of each request is passed on (the queue keeps no more): a loaded server sends fewer,
    larger chunks instead of falling further behind. Every output still fed the latency
    histograms as it arrived (the streams' observers). stream_interval (a request's, vLLM's, raised
    to the server's --stream-interval) holds each completion back as vLLM holds each of its child
    requests: one goes out with its first token, once finished, or once it has that many tokens not
    yet passed on; until then an output passed on for another carries it as it was last passed on.
    """
    stream_interval = effective_stream_interval(ctx.stream_interval, stream_interval)
    queue = streams[0].queue          # submit() gives the streams of one call a shared queue
    index_of = {id(s): i for i, s in enumerate(streams)}
    passed_on: dict[int, dict[int, CompletionOutput]] = {}   # prompt index -> completion index -> last passed on
    remaining = len(streams)
    try:
        while remaining:
            items = await queue.get_all()
            latest: dict[int, RequestOutput] = {}
            for stream, payload, _ in items:
                if isinstance(payload, BaseException):
                    stream.finished = True
                    raise payload
                latest[index_of[id(stream)]] = payload
                if payload.finished:
                    stream.finished = True
                    remaining -= 1
            if stream_interval <= 1:          # every output is due: no bookkeeping on the common path
                yield sorted(latest.items())
                continue
            due = []
            for i, out in sorted(latest.items()):
                out = due_output(out, passed_on.setdefault(i, {}), stream_interval)
                if out is not None:
                    due.append((i, out))
            if due:
                yield due
    finally:
        for stream in streams:
            if not stream.finished:
                ctx.engine.abort(stream.request_id)


def effective_stream_interval(server_interval: int, request_interval: int | None) -> int:
    """A request's stream_interval as vLLM applies it: the server's --stream-interval is its floor."""
    return server_interval if request_interval is None else max(request_interval, server_interval)


def due_output(output: RequestOutput, passed_on: dict[int, CompletionOutput], stream_interval: int
               ) -> RequestOutput | None:
    """output as it goes out under stream_interval, its completions not yet due as last passed on
    (PASSED_ON, by completion index, is updated); None when none is due. A final output goes out whole."""
    comps = [c if is_due(c, passed_on.get(c.index), stream_interval) else passed_on[c.index] for c in output.outputs]
    is_moved = [c is new for c, new in zip(comps, output.outputs)]
    passed_on.update((c.index, c) for c in comps)
    if output.finished or all(is_moved):
        return output
    return dataclasses.replace(output, outputs=comps) if any(is_moved) else None


def is_due(comp: CompletionOutput, sent: CompletionOutput | None, stream_interval: int) -> bool:
    """Whether a completion goes out now under vLLM's stream_interval, given what of it was SENT: its
    first output, its first token, its finish, or stream_interval tokens not yet sent."""
    if sent is None:
        return True
    if comp.finished():
        return not sent.finished()
    num_sent = len(sent.token_ids)
    return len(comp.token_ids) - num_sent >= stream_interval or (num_sent == 0 and len(comp.token_ids) > 0)


def all_finished(streams: list[RequestStream]) -> bool:
    """True once every stream has its final output (merged_outputs marks them as it hands them on)."""
    return all(stream.finished for stream in streams)


async def final_outputs(ctx: ServingContext, streams: list[RequestStream]) -> list[RequestOutput]:
    """Wait for every stream to finish; the last output of each, in prompt order."""
    last: list[RequestOutput | None] = [None] * len(streams)
    async with contextlib.aclosing(merged_outputs(ctx, streams)) as batches:
        async for batch in batches:
            for index, output in batch:
                last[index] = output
    return [o for o in last if o is not None]


async def until_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await something; if the client hangs up first, cancel it (which aborts its requests)."""
    try:
        return await HangUpWatch.of(request.scope, request.receive).run(awaitable)
    except ClientGone:
        raise APIError(499, "client disconnected", code="client_closed_request") from None


# OpenAI's keys of a whole chat or text completion that this server has no value for: null, as vLLM sends them.
UNSERVED_FIELDS = {"service_tier": None, "system_fingerprint": None}
# vLLM's keys after kv_transfer_params in a whole chat or text completion: an encoder cache's transfer (a
# multimodal model's) and the per-request timings of --enable-per-request-metrics, which minillm has not.
UNSERVED_TAIL_FIELDS = {"ec_transfer_params": None, "metrics": None}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's usage block, its keys in the order of vLLM's UsageInfo (a stream's usage is written so)."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens}


def whole_usage(block: dict) -> dict:
    """A whole reply's usage block as vLLM's UsageInfo dumps it: its keys in vLLM's order, the details
    null where there are none (a stream's usage chunk, sent exclude_unset, keeps the block as it is)."""
    return {"prompt_tokens": block["prompt_tokens"], "total_tokens": block["total_tokens"],
            "completion_tokens": block["completion_tokens"],
            "prompt_tokens_details": block.get("prompt_tokens_details"),
            "completion_tokens_details": block.get("completion_tokens_details")}


def sse(obj: Any) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json_dumps(obj)}\n\n"


def json_dumps(obj: Any) -> str:
    """Compact JSON, non-ASCII kept as is (the form every chunk is written in)."""
    return json.dumps(obj, separators=(',', ':'), ensure_ascii=False)


# A str as a JSON string literal, exactly as json_dumps writes one (the json module's C encoder).
json_text: Callable[[str], str] = encode_basestring


class ChunkFormat:
    """The streamed chunks of one response, written from a template made once: only the choices
    differ from chunk to chunk, so a token's event costs one JSON string, not a whole object.

    event(choice) is byte for byte sse({"id": ..., "object": ..., "created": ..., "model": ...,
    "choices": [choice], ("usage": None, or the usage given), ("prompt_token_ids": the ids given),
    ("prompt_text": the text given)})
    with choice already JSON (tests/test_server_sse.py); with_prompt_fields writes both prompt keys,
    null where not given (vLLM's first chunk of a chat choice sets them either way).
    """

    def __init__(self, request_id: str, object_name: str, created: int, model: str, include_usage: bool) -> None:
        self.head = (f'data: {{"id":{json_text(request_id)},"object":{json_text(object_name)},'
                     f'"created":{int(created)},"model":{json_text(model)},"choices":[')
        self.close = '],"usage":null' if include_usage else ']'    # the choices' end, and a null usage
        self.tail = self.close + '}\n\n'

    def event(self, choice_json: str, usage: dict | None = None, prompt_token_ids: list[int] | None = None,
              prompt_text: str | None = None, with_prompt_fields: bool = False) -> str:
        """The event for one choice given as JSON, with the usage, the prompt's token ids and its
        rendered text if given (or, with_prompt_fields, null if not)."""
        if usage is None and prompt_token_ids is None and prompt_text is None and not with_prompt_fields:
            return self.head + choice_json + self.tail
        close = self.close if usage is None else f'],"usage":{json_dumps(usage)}'
        if prompt_token_ids is not None or with_prompt_fields:
            close += f',"prompt_token_ids":{json_dumps(prompt_token_ids)}'
        if prompt_text is not None or with_prompt_fields:
            close += f',"prompt_text":{json_dumps(prompt_text)}'
        return f'{self.head}{choice_json}{close}}}\n\n'


class StreamChoice(NamedTuple):
    """One streamed choice and what its chunk carries beside it."""

    json: str
    num_tokens: int                              # its completion's tokens so far (continuous usage stats)
    prompt_token_ids: list[int] | None = None    # vLLM's return_token_ids, in a chat choice's first chunk
    prompt_text: str | None = None               # vLLM's return_prompt_text, in a chat choice's first chunk
    is_opener: bool = False                      # a chat choice's first chunk (its role)
    num_reasoning: int | None = None             # its reasoning tokens so far, under a reasoning parser


def stream_events(chunks: ChunkFormat, choices: list[StreamChoice], output: RequestOutput,
                  continuous_usage: bool, with_completion_details: bool = False) -> list[str]:
    """The events of one output's moved choices (each with its own usage under continuous usage stats;
    a chat's also with vLLM's completion_tokens_details, null without a reasoning parser)."""
    num_prompt_tokens = len(output.prompt_token_ids)
    return [chunks.event(c.json, chunk_usage(num_prompt_tokens, c, with_completion_details) if continuous_usage
                         else None, c.prompt_token_ids, c.prompt_text, c.is_opener) for c in choices]


def chunk_usage(num_prompt_tokens: int, choice: StreamChoice, with_completion_details: bool) -> dict:
    """A chunk's usage under continuous usage stats, as vLLM writes its UsageInfo (exclude_unset)."""
    block = usage(num_prompt_tokens, choice.num_tokens)
    if with_completion_details:
        is_counted = choice.num_reasoning is not None
        block["completion_tokens_details"] = {"reasoning_tokens": choice.num_reasoning} if is_counted else None
    return block


def text_choice_json(index: int, text: str) -> str:
    """json_dumps of a completions chunk's choice that carries text only (no log-probabilities, no finish)."""
    return f'{{"index":{index},"text":{json_text(text)},"logprobs":null,"finish_reason":null,"stop_reason":null}}'


def content_choice_json(index: int, content: str) -> str:
    """json_dumps of a chat chunk's choice whose delta is content only (no log-probabilities, no finish)."""
    return (f'{{"index":{index},"delta":{{"content":{json_text(content)}}},"logprobs":null,'
            f'"finish_reason":null,"stop_reason":null}}')


def stream_failure(exc: BaseException) -> APIError:
    """The error a stream reports when its request fails after the headers went out: an APIError as it
    is, a dead engine as engine_dead, anything else as vLLM reports it (unexpected_error): a failure of
    this request's output path is not a dead engine, which goes on serving the others."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return engine_dead_error(exc)
    return unexpected_error(exc)


def sse_error(exc: BaseException) -> str:
    """The event a stream ends with when its request fails after the headers went out."""
    return openai_error_event(stream_failure(exc))


def openai_failure_events(exc: BaseException) -> str:
    """The events that end an OpenAI stream whose request failed after the headers went out."""
    return openai_error_events(stream_failure(exc))


def text_delta(sent: str, text: str) -> str:
    """The new part of cumulative text (which only grows; a rewrite resends from the split)."""
    if text.startswith(sent):
        return text[len(sent):]
    common = 0
    for a, b in zip(sent, text):
        if a != b:
            break
        common += 1
    return text[common:]


@dataclass
class ChoiceProgress:
    """What one completion has already been sent: text, log-probability rows, finish."""

    index: int
    cursor: Any = None            # LogprobCursor when log-probabilities were asked for
    num_top: int = 0
    sent_text: str = ""
    pending_rows: list = field(default_factory=list)
    is_started: bool = False
    is_finished: bool = False
    num_sent_tokens: int = 0      # output tokens already in a chunk's token_ids (vLLM's return_token_ids)

    def new_token_ids(self, token_ids: list[int]) -> list[int]:
        """The output tokens no chunk has carried yet (a chunk's token_ids), marked sent."""
        new = token_ids[self.num_sent_tokens:]
        self.num_sent_tokens = len(token_ids)
        return new

    def update(self, text: str, token_ids: list[int], logprobs: list | None,
               finish_reason: str | None) -> tuple[str, list, str | None] | None:
        """(new text, new logprob rows, finish reason) since the last call; None if nothing to send."""
        if self.is_finished:
            return None
        delta = text_delta(self.sent_text, text)
        self.sent_text = text
        if self.cursor is not None and logprobs:
            self.pending_rows.extend(self.cursor.advance(token_ids, logprobs, self.num_top))
        if not delta and finish_reason is None:
            return None   # e.g. text held back while a stop string may be forming
        rows, self.pending_rows = self.pending_rows, []
        self.is_finished = finish_reason is not None
        return delta, rows, finish_reason


async def guard_stream(events: AsyncIterator[str],
                       failure_events: Callable[[BaseException], str] = openai_failure_events) -> AsyncIterator[str]:
    """Errors before the first event propagate (a real HTTP error); later ones end the stream with
    failure_events(exc)."""
    started = False
    async with contextlib.aclosing(events):   # closing it at once is what aborts its requests
        try:
            async for event in events:
                started = True
                yield event
        except Exception as exc:  # noqa: BLE001 - the status line is gone; tell the client in-band
            if not started:
                raise
            if not isinstance(exc, (APIError, EngineDeadError)):
                logger.exception("a stream failed after it began; its request ends, the others go on")
            yield failure_events(exc)


async def streaming_response(ctx: ServingContext, request: Request, events: AsyncIterator[str],
                             failure_events: Callable[[BaseException], str] = openai_failure_events):
    """Wait for the first event (so early failures get a status code), then stream the rest (a
    failure after the first ends the stream with failure_events(exc))."""
    guarded = guard_stream(events, failure_events)
    try:
        first = await until_disconnected(request, anext(guarded))
    except StopAsyncIteration:
        first = None
    except BaseException:
        await guarded.aclose()
        raise
    return EventStreamResponse(guarded, first=first)


def abort_unfinished(ctx: ServingContext, streams: list[RequestStream]) -> None:
    """Abort every stream that has not finished (the caller is leaving)."""
    for stream in streams:
        if not stream.finished:
            ctx.engine.abort(stream.request_id)


async def answer(ctx: ServingContext, raw: Request, job, prompts: list[list[int]], params: list, stream: bool,
                 failure_events: Callable[[BaseException], str] = openai_failure_events,
                 on_handed_over: Callable[[], None] | None = None,
                 on_output: Callable[[RequestOutput, float], None] | None = None) -> Response:
    """Submit a job's prompts, then stream its events (a failure once they have begun ends them with
    failure_events(exc)) or return its JSON response; a failure or a hang-up aborts whatever is
    still running. on_handed_over and on_output: as submit takes them."""
    engine_ids = job.engine_request_ids(len(prompts))
    log_received(ctx, job, engine_ids, prompts, params)
    streams = await until_disconnected(raw, submit(ctx, engine_ids, prompts, params, job.req.cache_salt,
                                                   on_handed_over, job.req.priority or 0, on_output))
    try:
        if stream:
            return await streaming_response(ctx, raw, job.events(streams), failure_events)
        finals = await until_disconnected(raw, final_outputs(ctx, streams))
    except BaseException:
        abort_unfinished(ctx, streams)
        raise
    refuse_uncompiled_constraint(job.req, finals, getattr(job, "constraint_param", None))
    if response_entries(finals) < LARGE_RESPONSE_ENTRIES:
        return JSONResponse(job.response(finals))
    # Hundreds of thousands of log-probability entries take seconds of Python to turn into JSON:
    # on a thread the event loop still gets the GIL every switch interval and serves the others,
    # and the body is encoded a choice at a time (one json.dumps of it all holds the GIL throughout).
    body = await asyncio.to_thread(build_without_collections, lambda: json_in_pieces(job.response(finals)))
    return Response(body, media_type="application/json")


def build_without_collections(build):
    """build() with the cyclic collector off: a large answer allocates millions of containers,
    none of them garbage until it is sent, and a full collection over them stalls every thread
    (the event loop too) for a good part of a second."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return build()
    finally:
        if was_enabled:
            gc.enable()


def json_in_pieces(content: dict) -> bytes:
    """content as JSONResponse renders it, each item of a top-level list encoded on its own."""
    def dumps(value) -> str:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))

    parts = []
    for key, value in content.items():
        encoded = "[" + ",".join(dumps(v) for v in value) + "]" if isinstance(value, list) else dumps(value)
        parts.append(f"{dumps(key)}:{encoded}")
    return ("{" + ",".join(parts) + "}").encode()


# Entries (tokens, and their top log-probabilities) past which a JSON answer is built off the loop.
LARGE_RESPONSE_ENTRIES = 20_000


def response_entries(finals: list[RequestOutput]) -> int:
    """Tokens and log-probability entries a JSON answer will hold (what building it costs)."""
    total = 0
    for output in finals:
        for completion in output.outputs:
            rows = completion.logprobs
            total += len(completion.token_ids) * (1 + (len(rows[0]) if rows else 0))
        prompt_rows = output.prompt_logprobs
        if prompt_rows:
            total += len(prompt_rows) * (1 + max((len(r) for r in prompt_rows[-1:] if r), default=0))
    return total


def refuse_uncompiled_constraint(req, finals: list[RequestOutput], param: str | None = None) -> None:
    """A 400 for a request whose constraint the engine could not compile (a regex no output
    satisfies, a grammar too large to match): checks that need the tokenizer run in the engine,
    after the request was taken in. A stream calls it on its outputs until it first sends (its
    status line waits for its first event). param: the field that gave the constraint, where it is
    not the request's response_format or structured_outputs (a forced tool call's schema)."""
    for output in finals:
        for completion in output.outputs:
            reason = completion.stop_reason
            if completion.finish_reason == "error" and not completion.token_ids and isinstance(reason, str) \
                    and reason.startswith("structured_outputs."):
                field, _, message = reason.partition(": ")
                fmt = getattr(req, "response_format", None)
                if param is not None:
                    field = param
                elif fmt is not None:         # the chat request gave it as response_format
                    field = "response_format.json_schema.schema" if fmt.get("type") == "json_schema" \
                        else "response_format"
                raise APIError(400, f"{field}: {message}", param=field)
