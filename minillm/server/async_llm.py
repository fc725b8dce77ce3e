"""AsyncLLM: the server's engine with the engine core in its own process (`--engine-core process`).

The same face as AsyncLLMEngine (the engine on a thread of this process): add_request, abort,
get_stats, call_utility, shutdown, is_healthy. Commands go down to the core as small messages the
moment they are made; the core sends each step's token ids up in one message, which a reader
thread here detokenises (minillm/engine_core/output_processor.py), checks for stop strings and
hands to the requests' event loops, one wake-up per loop per step.

Failures: a contained step failure fails just its requests with a 500 naming the cause. The core
reporting a failure it cannot contain, or its process ending for any reason (the reader watches
the process sentinel beside the socket), ends serving at once: every open request gets an
EngineDeadError, later calls fail, and `ended` is set so the server can exit and be restarted.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
import logging
import threading
import time
from collections import Counter
from typing import Any, Callable, Iterable

import msgspec

from minillm.block_manager import cache_salt_root, prompt_block_keys
from minillm.config import EngineConfig
from minillm.engine import check_arrival_time
from minillm.engine_core import messages as m
from minillm.engine_core.client import CoreLink, EngineCoreClient
from minillm.engine_core.core import SAMPLING_FIELDS
from minillm.engine_core.output_processor import OutputProcessor
from minillm.loader import resolve_model_path
from minillm.outputs import RequestOutput
from minillm.prompts import (
    PromptType, cache_salt_of, checked_token_ids, request_add_special_tokens, text_token_ids, unpack_prompt,
)
from minillm.request_queue import check_priority
from minillm.sampling_params import SamplingParams, check_truncate_prompt_tokens, short_repr
from minillm.server.async_engine import (
    Generate, OutputQueue, RequestStream, abort_ids, deliver, is_delta_stream, request_params, resolve_future,
)
from minillm.server.errors import EngineDeadError, EngineShutDownError, RemoteError, RequestFailedError
from minillm.server.stats_hub import with_cells
from minillm.stats import EngineStats
from minillm.tokenizer import engine_tokenizer

logger = logging.getLogger("minillm.server")


def _wire_constraint(constraint: Any) -> Any:
    """A StructuredOutputsParams as it crosses to the core: a JSON schema as its text, since
    msgpack carries no integer past 64 bits and a schema may hold one (a bound of 10**30)."""
    if not isinstance(constraint.json, dict):
        return constraint
    wire = copy.copy(constraint)       # its key (the schema's canonical text) is already checked
    wire.json = constraint.key[1]
    return wire


# A count past any context, as an AddRequest carries it (msgpack carries no integer past 2**64 - 1).
MAX_WIRE_COUNT = 2**63 - 1


def wire_fields(params: SamplingParams, vocab_size: int) -> dict[str, Any]:
    """params' fields as an AddRequest carries them: a top_k past the vocabulary as -1 and counts past
    MAX_WIRE_COUNT as that, which mean the same to the engine (the whole vocabulary, the whole context)."""
    fields = {name: getattr(params, name) for name in SAMPLING_FIELDS}
    if fields["top_k"] > vocab_size:
        fields["top_k"] = -1
    for name in ("max_tokens", "min_tokens"):      # truncate_prompt_tokens past the context is refused first
        if fields[name] is not None and fields[name] > MAX_WIRE_COUNT:
            fields[name] = MAX_WIRE_COUNT
    return fields


def with_own_finish_counts(stats: EngineStats, reported: dict[str, int], own: dict[str, int]) -> EngineStats:
    """stats with this API server's whole finish counts (own) in place of the part of them that had
    reached the core (reported): a request the core finished before the snapshot is counted even
    while the report of how it ended is on its way, so the counters agree with the gauges."""
    counts = Counter(stats.num_requests_finished)
    counts.subtract(reported)
    counts.update(own)
    return dataclasses.replace(stats, num_requests_finished={reason: n for reason, n in counts.items() if n})


class AsyncLLM(Generate):
    """The engine core in a spawned process; asyncio callers on any event loop."""

    def __init__(self, config: EngineConfig, core_hook: Callable[[Any], None] | None = None,
                 link: CoreLink | None = None) -> None:
        """Start the engine core for `config`, or (with a link) join one started for several API servers."""
        self.config = config
        # Only text work here: the core alone picks the device (CUDA is never touched in this process).
        model_path = resolve_model_path(config.model, config.download_dir, config.revision)
        self.tokenizer = engine_tokenizer(config, model_path)
        self.core = EngineCoreClient(config, core_hook) if link is None else EngineCoreClient(link=link)
        self.client_index = self.core.client_index
        ready = self.core.ready
        self.max_model_len: int = ready.max_model_len
        self.vocab_size: int = ready.vocab_size
        self.startup_stats: EngineStats = ready.stats
        self.prefix_block_size: int = ready.prefix_block_size   # 0: the core caches no prefixes
        self.num_core_steps = 0                 # the core's step counter, as of its latest outputs
        self.processor = OutputProcessor(self.tokenizer)
        self._lock = threading.Lock()           # the processor, the pending calls, "is it dead?"
        self._shut_down = threading.Event()     # set when the first shutdown() has finished
        self._adds: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        # Adds that wait for the core to retire a request their id names, which its caller has seen end.
        self._retiring: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        # Per event loop, the stats request being gathered: calls made in one loop iteration share it.
        self._stats_batches: dict[asyncio.AbstractEventLoop, asyncio.Task] = {}
        self._dead: BaseException | None = None
        self._failed = False
        self._stopping = False
        self.ended = threading.Event()
        self._thread = threading.Thread(target=self._read_outputs, name="minillm-core-outputs", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, core_hook: Callable[[Any], None] | None = None) -> "AsyncLLM":
        """Spawn the engine core for an EngineConfig and wait until it serves."""
        return cls(config, core_hook)

    @property
    def core_pid(self) -> int:
        """The engine core's process id."""
        return self.core.ready.pid

    # ---- asyncio side -------------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        """True while the core process runs and has not failed."""
        return self._dead is None

    @property
    def has_failed(self) -> bool:
        """True once serving ended by a failure of the core (not by shutdown())."""
        return self._failed

    @property
    def dead_reason(self) -> str:
        """Why the engine stopped, for error messages."""
        if self._dead is None:
            return "the engine core is shutting down" if self._stopping else "the engine core is not running"
        if not self._failed:
            return "the engine core was shut down"
        return f"the engine core has died: {self._dead}"

    def dead_error(self) -> EngineDeadError:
        """The error of a request the core can no longer serve: EngineShutDownError once shutdown()
        began (a 503), else EngineDeadError (a 500)."""
        return (EngineDeadError if self._failed else EngineShutDownError)(self.dead_reason)

    def _send(self, message: Any) -> None:
        """Send a command; the caller holds self._lock (which orders it against dying)."""
        if self._dead is not None or self._stopping:
            raise self.dead_error()
        try:
            self.core.send(message)
        except ConnectionError as exc:
            raise EngineDeadError(str(exc)) from None

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          arrival_time: float | None = None, output_queue: OutputQueue | None = None,
                          observer: Callable[[RequestOutput, float], None] | None = None,
                          cache_salt: str | None = None, *, lora_request: Any = None, priority: int = 0,
                          tokenization_kwargs: dict | None = None, trace_headers: Any = None) -> RequestStream:
        """Submit a request; returns its stream once the core accepted it (ValueError if not).
        cache_salt: vLLM's; the request shares prefix-cache blocks only with requests of the same salt.
        lora_request, priority, tokenization_kwargs, trace_headers: vLLM's, as LLMEngine.add_request takes them."""
        # What the core's message decoder would refuse must be refused here: a message it cannot
        # decode is dropped there, and its add would never be answered. The rest is checked here
        # too, in the offline engine's order and words, so a bad request is never queued.
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {short_repr(request_id)}")
        add_special_tokens = request_add_special_tokens(lora_request, tokenization_kwargs, trace_headers)
        priority = check_priority(priority, self.config.scheduling_policy)
        check_arrival_time(arrival_time)
        params = request_params(params)
        params.validate_for_vocab(self.vocab_size)      # as LLMEngine does: ids past 2**64 cannot even be sent
        check_truncate_prompt_tokens(params.truncate_prompt_tokens, self.max_model_len)   # as LLMEngine does
        cache_salt = cache_salt_of(prompt, cache_salt)
        text, ids = self._prompt(prompt, add_special_tokens)
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop, output_queue if output_queue is not None else OutputQueue(),
                               observer, is_delta=is_delta_stream(params))
        arrival = time.time() if arrival_time is None else float(arrival_time)   # 0 is a time, as offline
        fields = wire_fields(params, self.vocab_size)
        if params.structured_outputs is not None:
            fields["structured_outputs"] = _wire_constraint(params.structured_outputs)
        keys = self._prompt_block_keys(ids, params, cache_salt)
        done = loop.create_future()
        while (retired := self._send_add(m.AddRequest(request_id, ids, fields, arrival, self.client_index, keys,
                                                      cache_salt, priority), text, params, stream, done)) is not None:
            await retired
        try:
            await done
        except asyncio.CancelledError:
            self._abort_stream(stream)  # the caller left while the add was in flight
            raise
        return stream

    def _send_add(self, add: m.AddRequest, text: str | None, params: SamplingParams, stream: RequestStream,
                  done: asyncio.Future) -> asyncio.Future | None:
        """Send an add and follow its request: None once sent, or a future to wait for when its id
        still names a request its caller has seen end or left (the core's last word on it, or its
        answer to the add, is on its way; the core would refuse the id until then). ValueError while
        a caller follows the id."""
        with self._lock:
            held = self.processor.requests.get(add.request_id)
            if held is not None and held.is_followed:
                raise ValueError(f"request_id {add.request_id!r} is already in use")
            if held is not None:
                retired = stream.loop.create_future()
                self._retiring.setdefault(add.request_id, []).append((stream.loop, retired))
                return retired
            try:
                self._send(add)
            except (TypeError, OverflowError, msgspec.EncodeError) as exc:   # a value msgpack cannot carry
                raise ValueError(f"the request cannot be sent to the engine core: {exc}") from None
            self.processor.add(add.request_id, text, add.prompt_token_ids, params, add.arrival_time, stream)
            self._adds[add.request_id] = (stream.loop, done)
        return None

    def _prompt(self, prompt: PromptType, add_special_tokens: bool) -> tuple[str | None, list[int]]:
        """(the prompt's text or None, its token ids) for any of vLLM's prompt forms the offline engine
        takes; ValueError as LLMEngine.add_request words it."""
        text, given = unpack_prompt(prompt)
        if isinstance(given, str):
            return text, text_token_ids(self.tokenizer, given, add_special_tokens)
        return text, checked_token_ids(given, self.vocab_size)

    def _prompt_block_keys(self, ids: Any, params: SamplingParams, cache_salt: str | None) -> list[bytes] | None:
        """The prompt's prefix-cache keys, hashed here rather than on the core's one thread (35 us a
        512-token prompt); None where the core keys nothing, would truncate the prompt first, or
        will refuse it (ids that are no integers, a salt that is no string)."""
        if not self.prefix_block_size or params.truncate_prompt_tokens is not None \
                or not isinstance(ids, list) or len(ids) < self.prefix_block_size \
                or not isinstance(cache_salt, (str, type(None))):
            return None
        try:
            return prompt_block_keys(ids, self.prefix_block_size, cache_salt_root(cache_salt))
        except (TypeError, OverflowError):
            return None

    def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort a request, or each of a list of them as vLLM's takes them (thread-safe, returns at
        once; unknown ids are passed on and ignored there, ids that are no strings ignored here).
        Its caller's stream ends at once with an output finished by "abort", as vLLM's does."""
        request_ids = abort_ids(request_id)
        if not request_ids:
            return
        with self._lock:
            self._abort(request_ids)

    def _abort_stream(self, stream: RequestStream) -> None:
        """Abort the request a stream follows, if it still does: not a later request that has
        taken its id since (its caller aborted it, another caller added the id again)."""
        with self._lock:
            req = self.processor.requests.get(stream.request_id)
            if req is not None and req.handle is stream:
                self._abort([stream.request_id])

    def _abort(self, request_ids: list[str]) -> None:
        """abort() under self._lock."""
        now = time.time()
        for one in request_ids:
            ended = self.processor.abort(one, now)
            if ended is not None:      # its caller's stream ends with it, as vLLM's does
                stream, output = ended
                stream.put_threadsafe(output, now)
        try:
            self._send(m.AbortRequests(request_ids, self.client_index))
        except EngineDeadError:
            pass

    async def _call(self, make: Callable[[int], Any]) -> Any:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self._lock:
            call_id = next(self._call_ids)
            self._send(make(call_id))
            self._calls[call_id] = (loop, done)
        return await done

    async def get_full_stats(self) -> EngineStats:
        """A consistent snapshot with one block-map cell per block, taken in the core between steps.

        Calls made in the same event-loop iteration share one request to the core, sent once they
        have all been made (so the snapshot is never older than any of them); a call made after
        the send starts the next request.
        """
        loop = asyncio.get_running_loop()
        batch = self._stats_batches.get(loop)
        if batch is None:
            batch = self._stats_batches[loop] = loop.create_task(self._fetch_stats(loop))
        return await asyncio.shield(batch)

    async def _fetch_stats(self, loop: asyncio.AbstractEventLoop) -> EngineStats:
        del self._stats_batches[loop]      # runs after the calls made beside the first: from here on, a new batch
        return await self._call(lambda call_id: m.GetStats(call_id, self.client_index))

    async def get_stats(self, cells: int = 64) -> EngineStats:
        """A consistent EngineStats snapshot whose block map has at most `cells` cells."""
        return with_cells(await self.get_full_stats(), cells)

    async def get_summary_stats(self) -> EngineStats:
        """The core's counters and gauges (EngineStats.is_summary): what the throughput log and /metrics
        read, at a fraction of a full snapshot's cost to the core's step loop."""
        return await self._call(lambda call_id: m.GetStats(call_id, self.client_index, summary=True))

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Call a public method of the core's LLMEngine between two steps; its result (plain data)."""
        if not isinstance(method, str):
            raise TypeError(f"method must be a string, got {short_repr(method)}")
        return await self._call(lambda call_id: m.UtilityCall(call_id, method, list(args), self.client_index))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core we own, or leave the one we joined (open requests get an error), and wait
        (a second call waits for the first)."""
        with self._lock:
            first = not self._stopping
            self._stopping = True
            if first and self._dead is None and self.core.owned is not None:
                try:
                    self.core.send(m.Shutdown())
                except ConnectionError:
                    pass
        if not first:
            self._shut_down.wait(timeout + 10)
            return
        try:
            if self.core.owned is not None:
                self.core.stop(timeout)
            else:
                self.core.wake()
            self._thread.join(10)      # the reader sees the process end (or the wake), then fails what is still open
            self.core.close()
        finally:
            self._shut_down.set()

    # ---- reader thread ------------------------------------------------------------------

    def _read_outputs(self) -> None:
        try:
            while True:
                messages = self.core.receive(None)
                if messages is None:
                    break
                for message in messages:
                    self._handle(message)
                if self._dead is not None:
                    return
        except BaseException as exc:  # noqa: BLE001 - a bug here must not leave callers waiting for ever
            logger.exception("the engine core's output reader failed")
            self._die(RemoteError(type(exc).__name__, str(exc)), failed=True)
            return
        if self._stopping:
            self._die(EngineShutDownError("the engine was shut down"), failed=False)
        else:
            exit_text = self.core.describe_end()
            logger.error("the engine core process ended unexpectedly (%s)", exit_text)
            self._die(RemoteError("EngineCoreExited", f"the engine core process ended ({exit_text})"), failed=True)

    def _handle(self, message: Any) -> None:
        if isinstance(message, m.StepOutputs):
            self._on_step(message)
        elif isinstance(message, m.AddResults):
            self._on_adds(message)
        elif isinstance(message, m.StatsReply):
            self._on_stats(message)
        elif isinstance(message, m.UtilityReply):
            error = RemoteError(*message.error.split(": ", 1)) if message.error else None
            self._settle_call(message.call_id, message.result, error)
        elif isinstance(message, m.EngineDead):
            logger.error("the engine core failed: %s: %s", message.error_type, message.error)
            self._die(RemoteError(message.error_type, message.error), failed=True)

    def _on_step(self, step: m.StepOutputs) -> None:
        failures = []
        with self._lock:
            done = self.processor.process(step, time.time())
            for failed in step.failed:
                cause = RemoteError(failed.error_type, failed.error)
                for request_id in failed.request_ids:
                    stream = self.processor.abandon(request_id)
                    if stream is not None:
                        failures.append((stream, RequestFailedError(request_id, cause)))
            finished, dropped = self.processor.take_unreported(), self.processor.take_dropped_tokens()
            try:
                if done.stops:
                    self._send(m.StopSequences(done.stops, self.client_index))
                if finished or dropped:
                    self._send(m.FinishedCounts(finished, self.client_index, dropped))
            except EngineDeadError:
                pass
            # Handed on under the lock, so an abort's final output (abort()) never comes before them.
            deliver(done.outputs, step.time)
            waiting = [pending for request_id in done.retired for pending in self._retiring.pop(request_id, ())]
        self.num_core_steps = step.num_steps
        for stream, error in failures:
            stream.put_threadsafe(error)
        for loop, retired in waiting:      # the ids are free: those adds go now
            resolve_future(loop, retired, True)

    def _on_adds(self, message: m.AddResults) -> None:
        for request_id, error in message.results:
            waiting = ()
            with self._lock:
                pending = self._adds.pop(request_id, None)
                if error is not None:   # the id is free: adds waiting for it go now
                    self.processor.remove(request_id)
                    waiting = self._retiring.pop(request_id, ())
                else:
                    self.processor.accepted(request_id)
            if pending is not None:
                resolve_future(*pending, result=True, error=ValueError(error) if error is not None else None)
            for loop, retired in waiting:
                resolve_future(loop, retired, True)

    def _on_stats(self, message: m.StatsReply) -> None:
        stats = message.stats
        if stats is not None:
            with self._lock:    # every step the core sent before the snapshot is processed: its finishes are counted
                stats = with_own_finish_counts(stats, message.reported, self.processor.finished)
        for call_id in message.call_ids:
            error = RemoteError(*message.error.split(": ", 1)) if message.error else None
            self._settle_call(call_id, stats if error is None else None, error)

    def _settle_call(self, call_id: int, result: Any, error: BaseException | None) -> None:
        with self._lock:
            pending = self._calls.pop(call_id, None)
        if pending is not None:
            resolve_future(*pending, result=result, error=error)

    def _die(self, exc: BaseException, failed: bool) -> None:
        with self._lock:
            if self._dead is not None:
                return
            self._dead, self._failed = exc, failed
            streams = [req.handle for req in self.processor.requests.values() if req.handle is not None]
            self.processor.requests.clear()
            pending = list(self._adds.values()) + list(self._calls.values())
            retiring = [waiter for waiters in self._retiring.values() for waiter in waiters]
            self._adds.clear()
            self._calls.clear()
            self._retiring.clear()
        self.ended.set()    # before the callers hear of it: whoever sees the error sees the engine ended
        error = self.dead_error()
        for stream in streams:
            stream.put_threadsafe(error)
        for loop, future in pending + retiring:
            resolve_future(loop, future, error=error)
