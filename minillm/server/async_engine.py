"""AsyncLLMEngine: one thread owns the (not thread-safe) LLMEngine; asyncio callers talk to it by queue.

This is the server's engine with `--engine-core thread`; with `--engine-core process` the engine
core runs in its own process instead (AsyncLLM, minillm/server/async_llm.py), behind the same face.
start_async_engine() builds either.

Commands (add, abort, stats, stop) go into a thread-safe queue. The engine thread handles a bounded
batch of them between two steps (so no flood of commands can starve generation), calls
engine.step() while there is work and blocks on the queue when idle. Stats requests of one batch
share one snapshot. Each request's outputs are handed to the event loop that asked for it with
loop.call_soon_threadsafe, into its OutputQueue, which keeps only the newest output of each request.

Failures: a StepError (a step failed for some requests only; the engine already aborted them and
is intact) fails just those requests with a 500 naming the cause. Any other exception from step()
ends the loop: every open request gets an EngineDeadError, later calls fail at once, and
`ended` is set so the server can exit and be restarted.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing.connection
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Protocol

import msgspec

from minillm.engine import StepError, check_arrival_time, check_reset_flags, own_sampling_params
from minillm.engine_core.core import (
    FULL_RESOLUTION, LOOP_METHODS, MAX_COMMAND_SECONDS_PER_STEP, MAX_COMMANDS_PER_STEP, release_refused_claim,
)
from minillm.outputs import CompletionOutput, RequestOutput
from minillm.prompts import PromptType, request_add_special_tokens
from minillm.request_queue import check_priority
from minillm.sampling_params import RequestOutputKind, SamplingParams
from minillm.server.errors import EngineDeadError, EngineShutDownError, RequestFailedError
from minillm.server.stats_hub import with_cells
from minillm.stats import EngineStats

logger = logging.getLogger("minillm.server")

__all__ = ["AsyncLLMEngine", "ENGINE_CORE_MODES", "EngineClient", "MAX_COMMANDS_PER_STEP",
           "MAX_COMMAND_SECONDS_PER_STEP", "FULL_RESOLUTION", "OutputQueue", "RequestStream", "StepError",
           "Generate", "start_async_engine"]

# Where the engine core runs: its own process (apart from HTTP, as vLLM serves), or a thread here.
ENGINE_CORE_MODES = ("process", "thread")


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    arrival_time: float
    stream: "RequestStream"
    done: asyncio.Future
    cache_salt: str | None = None
    add_special_tokens: bool = True     # for a text prompt (vLLM's tokenization_kwargs)
    priority: int = 0                   # vLLM's (checked against the scheduling policy)


@dataclass
class _Abort:
    request_id: str
    stream: "RequestStream | None" = None   # only the request of this add (None: whichever holds the id)


@dataclass
class _Stats:
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop
    summary: bool = False            # the counters and gauges alone (EngineStats.is_summary)


@dataclass
class _Utility:
    method: str
    args: tuple
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop


@dataclass
class _Stop:
    pass


@dataclass
class _WorkerExited:
    """A tensor-parallel worker process has ended: the engine thread checks its workers (and dies)."""


class OutputQueue:
    """Outputs of one API call's requests, one waiting per request, on the caller's event loop.

    When the caller falls behind (a client that does not read) a cumulative output replaces the one
    waiting, and a DELTA output is added to it: what waits is one output per request, not a growing
    backlog. An error is final: later outputs of that request do not replace it.
    """

    def __init__(self) -> None:
        self._latest: dict[RequestStream, tuple[Any, float | None]] = {}
        self._waiter: asyncio.Future | None = None     # the caller's, while it waits on an empty queue

    def __len__(self) -> int:
        return len(self._latest)

    def put(self, stream: "RequestStream", payload: Any, seen: float | None) -> None:
        """Leave a request's newest output (or an exception); on the event loop."""
        held = self._latest.get(stream)
        if held is not None:
            if isinstance(held[0], BaseException):
                return
            if stream.is_delta and isinstance(payload, RequestOutput):
                backlog = held[0] if isinstance(held[0], DeltaBacklog) else DeltaBacklog(held[0])
                backlog.add(payload)
                payload = backlog
        self._latest[stream] = (payload, seen)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def get_all(self) -> list[tuple["RequestStream", Any, float | None]]:
        """Wait for something, then take everything waiting: [(stream, output or exception, seen)]."""
        while not self._latest:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        items = [(stream, payload.output() if isinstance(payload, DeltaBacklog) else payload, seen)
                 for stream, (payload, seen) in self._latest.items()]
        self._latest.clear()
        return items


@dataclass(eq=False)
class RequestStream:
    """One engine request as the event loop sees it.

    Its outputs land in `queue` (shared by the streams of one API call, so the caller wakes once per
    step for all of them). `observer` sees every output as it arrives, even those the queue drops
    for a newer one, with the time it was seen on the engine thread (for latency metrics).
    """

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: OutputQueue = field(default_factory=OutputQueue)
    observer: Callable[[RequestOutput, float], None] | None = None
    finished: bool = False
    is_delta: bool = False      # its outputs are RequestOutputKind.DELTA ones: what waits is added up

    def deliver(self, payload: Any, seen: float | None) -> None:
        """On the event loop: note an output (or an exception) and queue it."""
        if self.observer is not None and isinstance(payload, RequestOutput):
            self.observer(payload, seen)
        self.queue.put(self, payload, seen)

    def put_threadsafe(self, payload: Any, seen: float | None = None) -> None:
        """Hand an output (or an exception) to the request's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.deliver, payload, seen)
        except RuntimeError:
            pass  # the loop is closed: nobody is listening any more

    async def __aiter__(self) -> AsyncIterator[tuple[RequestOutput, float]]:
        """(output, seen) in order; for a stream that has its queue to itself."""
        while not self.finished:
            for _, payload, seen in await self.queue.get_all():
                if isinstance(payload, BaseException):
                    self.finished = True
                    raise payload
                self.finished = payload.finished
                yield payload, seen


class EngineClient(Protocol):
    """What the server needs of its engine, wherever the core runs (AsyncLLMEngine, AsyncLLM)."""

    tokenizer: Any
    config: Any
    max_model_len: int
    vocab_size: int
    ended: threading.Event

    @property
    def is_healthy(self) -> bool: ...
    @property
    def has_failed(self) -> bool: ...
    @property
    def dead_reason(self) -> str: ...
    @property
    def startup_stats(self) -> EngineStats: ...

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          arrival_time: float | None = None, output_queue: OutputQueue | None = None,
                          observer: Callable[[RequestOutput, float], None] | None = None,
                          cache_salt: str | None = None, *, lora_request: Any = None, priority: int = 0,
                          tokenization_kwargs: dict | None = None, trace_headers: Any = None) -> RequestStream: ...
    def abort(self, request_id: str | Iterable[str]) -> None: ...
    async def get_full_stats(self) -> EngineStats: ...
    async def get_stats(self, cells: int = 64) -> EngineStats: ...
    async def get_summary_stats(self) -> EngineStats: ...
    async def call_utility(self, method: str, *args: Any) -> Any: ...
    def shutdown(self, timeout: float = 10.0) -> None: ...


class Generate:
    """vLLM's AsyncLLM.generate and reset_prefix_cache over a class's add_request, _abort_stream and
    call_utility (AsyncLLM's and AsyncLLMEngine's)."""

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str, *,
                       arrival_time: float | None = None, cache_salt: str | None = None,
                       **options: Any) -> AsyncIterator[RequestOutput]:
        """The request's RequestOutputs as they come (params.output_kind says which), the last one
        finished; a caller that leaves first (the generator closed or its task cancelled) aborts the
        request. options: vLLM's lora_request, priority, tokenization_kwargs and trace_headers, as
        add_request takes them."""
        stream = await self.add_request(request_id, prompt, params, arrival_time, cache_salt=cache_salt, **options)
        try:
            async for output, _ in stream:
                yield output
        finally:
            if not stream.finished:
                # Its own request only: its caller may have aborted it, and another taken the id since.
                self._abort_stream(stream)


    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's: forget the engine's prefix cache between two steps (LLMEngine.reset_prefix_cache);
        False, with nothing forgotten, while requests hold KV blocks, unless reset_running_requests
        preempts them first."""
        check_reset_flags(reset_running_requests, reset_connector)
        return await self.call_utility("reset_prefix_cache", reset_running_requests, reset_connector)


class DeltaBacklog:
    """DELTA outputs of one request its caller has not taken yet, added up as vLLM's RequestOutput.add
    (aggregate) adds them: each completion's text, token ids and log-probabilities joined, the rest the
    newest output's. They grow in place, and the text is joined once, when the caller takes it: a
    backlog of k outputs costs O(k) however far the caller has fallen behind."""

    def __init__(self, first: RequestOutput) -> None:
        self.latest = first
        self.prompt_logprobs = first.prompt_logprobs
        self.completions: dict[int, _CompletionBacklog] = {}
        self._add_completions(first)

    def add(self, new: RequestOutput) -> None:
        """Add the request's next DELTA output."""
        self.latest = new
        if self.prompt_logprobs is None:
            self.prompt_logprobs = new.prompt_logprobs
        self._add_completions(new)

    def _add_completions(self, output: RequestOutput) -> None:
        completions = self.completions
        for c in output.outputs:
            held = completions.get(c.index)
            if held is None:
                completions[c.index] = _CompletionBacklog(c)
            else:
                held.add(c)

    def output(self) -> RequestOutput:
        """The backlog as one RequestOutput."""
        outputs = [self.completions[i].output() for i in sorted(self.completions)]
        return dataclasses.replace(self.latest, outputs=outputs, prompt_logprobs=self.prompt_logprobs)


class _CompletionBacklog:
    """One completion's DELTA outputs added up (DeltaBacklog's)."""

    def __init__(self, first: CompletionOutput) -> None:
        self.latest = first
        self.texts = [first.text]
        self.token_ids = list(first.token_ids)
        self.logprobs = None if first.logprobs is None else list(first.logprobs)
        self.finish_reason, self.stop_reason = first.finish_reason, first.stop_reason

    def add(self, new: CompletionOutput) -> None:
        """Add the completion's next delta: a finish reason (and its stop reason) once it comes."""
        self.latest = new
        self.texts.append(new.text)
        self.token_ids.extend(new.token_ids)
        if self.logprobs is not None:
            if new.logprobs is None:
                self.logprobs = None
            else:
                self.logprobs.extend(new.logprobs)
        if new.finish_reason is not None:
            self.finish_reason, self.stop_reason = new.finish_reason, new.stop_reason

    def output(self) -> CompletionOutput:
        """The deltas as one CompletionOutput (the text joined here, once)."""
        return dataclasses.replace(self.latest, text="".join(self.texts), token_ids=self.token_ids,
                                   finish_reason=self.finish_reason, stop_reason=self.stop_reason,
                                   logprobs=self.logprobs)


def request_params(params: SamplingParams | None) -> SamplingParams:
    """The request's own validated copy of the caller's params, as LLMEngine.add_request makes it
    (None: the defaults): a bad field, output_kind included, is a ValueError naming it before
    anything is queued, and what the caller changes later is not this request's."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    params.validate()
    return own_sampling_params(params)


def is_delta_stream(params: SamplingParams) -> bool:
    """Whether a request's outputs are DELTA ones (its stream then adds up those waiting)."""
    return params.output_kind is RequestOutputKind.DELTA


def abort_ids(request_id: Any) -> list[str]:
    """The ids an abort names: one id, or each of a list of them as vLLM's abort takes them (ids that
    are no strings name no request: left out)."""
    if isinstance(request_id, str):
        return [request_id]
    if isinstance(request_id, Iterable) and not isinstance(request_id, bytes):
        return [one for one in list(request_id) if isinstance(one, str)]
    return []


def deliver_batch(batch: list[tuple[RequestStream, RequestOutput, float]]) -> None:
    """On the event loop: hand each output to its request's stream."""
    for stream, output, seen in batch:
        stream.deliver(output, seen)


def deliver(outputs: list[tuple[RequestStream, RequestOutput]], seen: float) -> None:
    """Hand a step's outputs to their streams' event loops (from the engine's thread), one wake-up
    per loop, not per request: fewer GIL hand-offs."""
    batches: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, output in outputs:
        batches.setdefault(stream.loop, []).append((stream, output, seen))
    for loop, batch in batches.items():
        try:
            loop.call_soon_threadsafe(deliver_batch, batch)
        except RuntimeError:
            pass  # that loop is closed: nobody is listening any more


def resolve_future(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result: Any = None,
                   error: BaseException | None = None) -> None:
    """Complete a future that belongs to another thread's loop (if still wanted)."""
    def settle() -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass


class AsyncLLMEngine(Generate):
    """Runs an LLMEngine on its own thread and serves many asyncio requests."""

    def __init__(self, engine: Any, owns_engine: bool = False) -> None:
        self.engine = engine
        self.owns_engine = owns_engine  # built for it (from_config): shutdown() releases the engine too
        self.tokenizer = engine.tokenizer
        self.config = engine.config
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.model_config.vocab_size
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        # By id, oldest first, the requests the engine has ended (aborted, or failed in a step) whose
        # last report is still to come, where their stream has left _streams: a new request took
        # the id (the engine takes an aborted one's at once), or the caller has had the error (None).
        # The engine reports them in that order, before any report of the request now in _streams.
        self._ending: dict[str, list[RequestStream | None]] = {}
        self._lock = threading.Lock()   # orders "is it dead?" against "enqueue a command"
        self._dead: BaseException | None = None
        self._failed = False            # the loop ended by an exception, not by shutdown()
        self._stopped = False
        self._shutdown_lock = threading.Lock()   # one shutdown at a time (the HTTP server's, then the caller's)
        self.ended = threading.Event()  # set when the engine thread has ended (failure or shutdown)
        # The NumPy backend holds the GIL for most of a step, so without a pause the event loop
        # waits for a forced switch (5 ms) to send tokens or pass on a client's hang-up; yielding
        # after each step gets an abort into the very next step. The CUDA backend releases the
        # GIL while it waits for the device, which is when the loop runs: no pause needed there.
        self._yield_each_step = getattr(engine, "backend", None) == "numpy"
        self._thread = threading.Thread(target=self._run, name="minillm-engine", daemon=True)
        self._thread.start()
        # A tensor-parallel worker that dies while the engine is idle wakes the engine thread, which
        # then fails (EngineDeadError, /health 503) instead of waiting for the next request to find it.
        sentinels = engine.runner.worker_sentinels()
        if sentinels:
            threading.Thread(target=self._watch_workers, args=(sentinels,), name="minillm-tp-watch",
                             daemon=True).start()

    @classmethod
    def from_config(cls, config: Any, core_hook: Callable[[Any], None] | None = None) -> "AsyncLLMEngine":
        """Build the LLMEngine from an EngineConfig (core_hook, if given, is called with it) and start its thread."""
        from minillm.engine import LLMEngine
        engine = LLMEngine(config)
        if core_hook is not None:
            core_hook(engine)
        return cls(engine, owns_engine=True)

    @property
    def startup_stats(self) -> EngineStats:
        """A snapshot for the start-up banner (call it before serving begins)."""
        return self.engine.stats(cells=1)

    # ---- asyncio side -------------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        """True while the engine thread is alive and has not failed."""
        return self._dead is None and self._thread.is_alive()

    @property
    def has_failed(self) -> bool:
        """True once the loop has ended by an exception (not by shutdown())."""
        return self._failed

    @property
    def dead_reason(self) -> str:
        """Why the engine loop stopped, for error messages."""
        if not self._failed and (self._stopped or self._dead is not None):
            return "the engine was shut down"
        if self._dead is None:
            return "the engine loop is not running"
        return f"the engine loop has died: {type(self._dead).__name__}: {self._dead}"

    def dead_error(self) -> EngineDeadError:
        """The error of a request the engine can no longer serve: EngineShutDownError once shutdown()
        began (a 503), else EngineDeadError (a 500)."""
        return (EngineDeadError if self._failed else EngineShutDownError)(self.dead_reason)

    def _send(self, command: Any) -> None:
        with self._lock:
            if self._dead is not None or self._stopped:
                raise self.dead_error()
            self._commands.put(command)

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          arrival_time: float | None = None, output_queue: OutputQueue | None = None,
                          observer: Callable[[RequestOutput, float], None] | None = None,
                          cache_salt: str | None = None, *, lora_request: Any = None, priority: int = 0,
                          tokenization_kwargs: dict | None = None, trace_headers: Any = None) -> RequestStream:
        """Submit a request; returns its stream once the engine accepted it (ValueError if not).

        output_queue: where its outputs go (shared by the requests of one call); a new one if None.
        observer: called on the event loop with every output and the time it was seen.
        cache_salt: vLLM's; the request shares prefix-cache blocks only with requests of the same salt.
        lora_request, priority, tokenization_kwargs, trace_headers: vLLM's, as LLMEngine.add_request takes them.
        """
        add_special_tokens = request_add_special_tokens(lora_request, tokenization_kwargs, trace_headers)
        priority = check_priority(priority, self.engine.config.scheduling_policy)
        check_arrival_time(arrival_time)
        params = request_params(params)
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop, output_queue if output_queue is not None else OutputQueue(),
                               observer, is_delta=is_delta_stream(params))
        done = loop.create_future()
        arrival = time.time() if arrival_time is None else arrival_time     # 0 is a time, as offline
        self._send(_Add(request_id, prompt, params, arrival, stream, done, cache_salt,
                        add_special_tokens, priority))
        try:
            await done
        except asyncio.CancelledError:
            # The caller left while the add was in flight: abort its request if the engine took it,
            # not another one that holds the id (an add refused as a duplicate aborts nothing).
            self._abort_stream(stream)
            raise
        return stream

    def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort a request, or each of a list (thread-safe, returns at once; unknown ids are ignored).
        Its caller's stream ends with the engine's next output of it, finished by "abort"."""
        try:
            for one in abort_ids(request_id):
                self._send(_Abort(one))
        except EngineDeadError:
            pass

    def _abort_stream(self, stream: RequestStream) -> None:
        """Abort the request of this stream only (not a later request that has taken its id)."""
        try:
            self._send(_Abort(stream.request_id, stream))
        except EngineDeadError:
            pass

    async def get_full_stats(self) -> EngineStats:
        """A consistent snapshot with one block-map cell per block, taken on the engine thread between steps."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._send(_Stats(done, loop))
        return await done

    async def get_stats(self, cells: int = 64) -> EngineStats:
        """A consistent EngineStats snapshot whose block map has at most `cells` cells."""
        return with_cells(await self.get_full_stats(), cells)

    async def get_summary_stats(self) -> EngineStats:
        """The engine's counters and gauges (EngineStats.is_summary), taken on the engine thread:
        what the throughput log and /metrics read, at a fraction of a full snapshot's cost."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._send(_Stats(done, loop, summary=True))
        return await done

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Call a public method of the LLMEngine on the engine thread, between two steps; its result as plain data."""
        if not isinstance(method, str):
            raise TypeError(f"method must be a string, got {method!r}")
        if method.startswith("_") or method in LOOP_METHODS:
            raise AttributeError(f"no utility {method!r}")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._send(_Utility(method, args, done, loop))
        return await done

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (open requests get an error) and wait for it; an engine built
        here then lets go of its KV pool, weights and KV transfer endpoint (not while its thread
        may still step it). A second call waits for the first."""
        with self._shutdown_lock:
            with self._lock:
                if not self._stopped:
                    self._stopped = True
                    self._commands.put(_Stop())
            self._thread.join(timeout)
            if self.owns_engine and not self._thread.is_alive():
                self.engine.shutdown()

    def _watch_workers(self, sentinels: list[int]) -> None:
        multiprocessing.connection.wait(sentinels)
        with self._lock:
            if self._dead is None and not self._stopped:
                self._commands.put(_WorkerExited())

    # ---- engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                # Idle: sleep on the queue rather than spin (a KV producer's leases may wake it sooner).
                idle = not self.engine.has_unfinished_requests()
                wait = self.engine.service_kv_transfers() if idle else None
                if not self._run_commands(block=idle, timeout=wait):
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as exc:  # noqa: BLE001 - any failure ends the loop, reported to all
            logger.exception("engine loop died")
            self._failed = True
            self._die(exc)
            return
        self._die(EngineShutDownError("the engine was shut down"), log=False)

    def _step(self) -> None:
        """One engine step; outputs to their streams, a contained failure to the requests it hit."""
        try:
            outputs = self.engine.step()
        except StepError as exc:
            self._fail_requests(exc)
            return
        self._route(outputs, time.time())
        if self._yield_each_step:
            time.sleep(0)   # hand the GIL to the event loop (see __init__)

    def _run_commands(self, block: bool, timeout: float | None = None) -> bool:
        """Handle a bounded batch of queued commands (waiting for the first, at most timeout seconds,
        if block); False once told to stop."""
        stats: list[_Stats] = []
        started = time.perf_counter()
        try:
            for count in range(MAX_COMMANDS_PER_STEP):
                if count and time.perf_counter() - started > MAX_COMMAND_SECONDS_PER_STEP:
                    break
                try:
                    if block and count == 0:
                        command = self._commands.get(timeout=timeout)
                    else:
                        command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(command, _Stats):
                    stats.append(command)   # one snapshot answers every stats request of the batch
                elif not self._handle(command):
                    return False
        finally:
            if stats:
                self._answer_stats(stats)
        return True

    def _handle(self, command: Any) -> bool:
        """Run one command on the engine thread; False for stop."""
        if isinstance(command, _Add):
            self._handle_add(command)
        elif isinstance(command, _Abort):
            # Its stream stays: the engine's next step reports the request finished by "abort",
            # which ends its caller's stream (vLLM's generate ends so too).
            if command.stream is None or self._streams.get(command.request_id) is command.stream:
                self.engine.abort_request(command.request_id)
        elif isinstance(command, _Utility):
            try:
                # Plain data, as the engine core process sends it.
                result = msgspec.to_builtins(getattr(self.engine, command.method)(*command.args))
                resolve_future(command.loop, command.done, result)
            except Exception as exc:  # noqa: BLE001 - the caller gets the error, the loop goes on
                resolve_future(command.loop, command.done, error=exc)
        elif isinstance(command, _WorkerExited):
            self.engine.runner.check_workers()      # raises, naming the worker that exited
        elif isinstance(command, _Stop):
            return False
        return True

    def _answer_stats(self, commands: list[_Stats]) -> None:
        summary = all(command.summary for command in commands)   # one snapshot answers them all
        try:
            stats = self.engine.stats(1, summary=True) if summary else self.engine.stats(FULL_RESOLUTION)
        except Exception as exc:  # noqa: BLE001 - a stats bug must not kill serving
            for command in commands:
                resolve_future(command.loop, command.done, error=exc)
            return
        for command in commands:
            resolve_future(command.loop, command.done, stats)

    def _handle_add(self, command: _Add) -> None:
        loop = command.stream.loop
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params,
                                    arrival_time=command.arrival_time, cache_salt=command.cache_salt,
                                    tokenization_kwargs={"add_special_tokens": command.add_special_tokens},
                                    priority=command.priority)
        except Exception as exc:  # noqa: BLE001 - ValueError is a 400; anything else a 500
            release_refused_claim(self.engine, command.params.extra_args)
            resolve_future(loop, command.done, error=exc)
            return
        request_id = command.request_id
        if (ended := self._streams.pop(request_id, None)) is not None:
            # The id was an aborted request's, whose last report is still to come (first).
            self._ending.setdefault(request_id, []).append(ended)
        if command.done.cancelled():
            # Its caller left while the add was queued, leaving to the engine what the request holds
            # (a decode server's claimed KV lease): added and aborted, its KV connector releases it
            # now; nobody follows its last report.
            self.engine.abort_request(request_id)
            self._ending.setdefault(request_id, []).append(None)
            return
        self._streams[request_id] = command.stream
        resolve_future(loop, command.done, True)

    def _fail_requests(self, exc: StepError) -> None:
        """A step failed for these requests only (already aborted by the engine): tell their callers."""
        cause = exc.cause if exc.cause is not None else exc
        logger.error("a step failed for %d request(s), which were aborted; serving goes on: %s: %s",
                     len(exc.request_ids), type(cause).__name__, cause)
        for request_id in exc.request_ids:
            stream = self._streams.pop(request_id, None)
            self._ending.setdefault(request_id, []).append(None)   # its last report (an abort) is still to come
            if stream is not None:
                stream.put_threadsafe(RequestFailedError(request_id, cause))

    def _route(self, outputs: list[RequestOutput], seen: float) -> None:
        routed = []
        for output in outputs:
            request_id = output.request_id
            ending = self._ending.get(request_id)
            if ending:          # the last report of an ended request (see _ending)
                stream = ending.pop(0)
                if not ending:
                    del self._ending[request_id]
            else:
                stream = self._streams.get(request_id)
                if stream is not None and output.finished:
                    del self._streams[request_id]
            if stream is not None:
                routed.append((stream, output))
        deliver(routed, seen)

    def _die(self, exc: BaseException, log: bool = True) -> None:
        with self._lock:
            self._dead = exc if isinstance(exc, Exception) else EngineDeadError(repr(exc))
            pending = []
            while True:
                try:
                    pending.append(self._commands.get_nowait())
                except queue.Empty:
                    break
        error = self.dead_error()
        ending = [stream for streams in self._ending.values() for stream in streams if stream is not None]
        for stream in list(self._streams.values()) + ending:
            stream.put_threadsafe(error)
        self._streams.clear()
        self._ending.clear()
        for command in pending:
            if isinstance(command, _Add):
                resolve_future(command.stream.loop, command.done, error=error)
            elif isinstance(command, (_Stats, _Utility)):
                resolve_future(command.loop, command.done, error=error)
        self.ended.set()


def start_async_engine(config: Any, engine_core: str = "process",
                       core_hook: Callable[[Any], None] | None = None) -> EngineClient:
    """The server's engine for an EngineConfig: the core in its own process (AsyncLLM) or on a
    thread of this one (AsyncLLMEngine). core_hook is called with the LLMEngine before it serves."""
    if engine_core == "process":
        from minillm.server.async_llm import AsyncLLM
        return AsyncLLM.from_config(config, core_hook)
    if engine_core == "thread":
        return AsyncLLMEngine.from_config(config, core_hook)
    raise ValueError(f"engine_core must be one of {', '.join(ENGINE_CORE_MODES)}, got {engine_core!r}")
