"""AsyncLLMEngine: one thread owns the (not thread-safe) LLMEngine; asyncio callers talk to it by queue.

Commands (add, abort, stats, stop) go into a thread-safe queue. The engine thread drains it,
calls engine.step() while there is work and blocks on the queue when idle. Each request's
outputs are handed to the event loop that asked for it with loop.call_soon_threadsafe, into
that request's own asyncio.Queue. If step() raises, the loop dies: every open request gets an
EngineDeadError and later calls fail at once.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from minillm.outputs import RequestOutput
from minillm.sampling_params import SamplingParams
from minillm.server.errors import EngineDeadError
from minillm.stats import EngineStats

logger = logging.getLogger("minillm.server")


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    stream: "RequestStream"
    done: asyncio.Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Stats:
    cells: int
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop


@dataclass
class _Stop:
    pass


@dataclass
class RequestStream:
    """One engine request as the event loop sees it.

    Its items land in `queue` as (stream, RequestOutput or exception, time seen on the engine
    thread). The streams of one API call (a batch of prompts) may share a queue, so the caller
    wakes once per step for all of them.
    """

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False

    def put_threadsafe(self, payload: Any, seen: float | None = None) -> None:
        """Hand an output (or an exception) to the request's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (self, payload, seen))
        except RuntimeError:
            pass  # the loop is closed: nobody is listening any more

    async def __aiter__(self) -> AsyncIterator[tuple[RequestOutput, float]]:
        """(output, seen) in order; for a stream that has its queue to itself."""
        while not self.finished:
            _, payload, seen = await self.queue.get()
            if isinstance(payload, BaseException):
                self.finished = True
                raise payload
            self.finished = payload.finished
            yield payload, seen


def _deliver(batch: list[tuple[RequestStream, RequestOutput, float]]) -> None:
    """On the event loop: put each output into its request's queue."""
    for item in batch:
        item[0].queue.put_nowait(item)


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result: Any = None,
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


class AsyncLLMEngine:
    """Runs an LLMEngine on its own thread and serves many asyncio requests."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.config = engine.config
        self.max_model_len: int = engine.max_model_len
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()   # orders "is it dead?" against "enqueue a command"
        self._dead: BaseException | None = None
        self._stopped = False
        self.last_stats: EngineStats | None = None
        # The NumPy backend holds the GIL for most of a step, so without a pause the event loop
        # waits for a forced switch (5 ms) to send tokens or pass on a client's hang-up; yielding
        # after each step gets an abort into the very next step. The CUDA backend releases the
        # GIL while it waits for the device, which is when the loop runs: no pause needed there.
        self._yield_each_step = getattr(engine, "backend", None) == "numpy"
        self._thread = threading.Thread(target=self._run, name="minillm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: Any) -> "AsyncLLMEngine":
        """Build the LLMEngine from an EngineConfig and start its thread."""
        from minillm.engine import LLMEngine
        return cls(LLMEngine(config))

    # ---- asyncio side -------------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        """True while the engine thread is alive and has not failed."""
        return self._dead is None and self._thread.is_alive()

    @property
    def dead_reason(self) -> str:
        """Why the engine loop stopped, for error messages."""
        if self._dead is None:
            return "the engine loop is not running"
        return f"the engine loop has died: {type(self._dead).__name__}: {self._dead}"

    def _send(self, command: Any) -> None:
        with self._lock:
            if self._dead is not None or self._stopped:
                raise EngineDeadError(self.dead_reason)
            self._commands.put(command)

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          arrival_time: float | None = None,
                          output_queue: asyncio.Queue | None = None) -> RequestStream:
        """Submit a request; returns its stream once the engine accepted it (ValueError if not).

        output_queue: where its outputs go (shared by the requests of one call); a new one if None.
        """
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop, output_queue if output_queue is not None else asyncio.Queue())
        done = loop.create_future()
        self._send(_Add(request_id, prompt, params, arrival_time or time.time(), stream, done))
        try:
            await done
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller left while the add was in flight
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, returns at once; unknown ids are ignored)."""
        try:
            self._send(_Abort(request_id))
        except EngineDeadError:
            pass

    async def get_stats(self, cells: int = 64) -> EngineStats:
        """A consistent EngineStats snapshot, taken on the engine thread between steps."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._send(_Stats(cells, done, loop))
        return await done

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (open requests get an error) and wait for it."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._commands.put(_Stop())
        self._thread.join(timeout)

    # ---- engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                if not self.engine.has_unfinished_requests():
                    # Idle: sleep on the queue rather than spin.
                    if not self._handle(self._commands.get()):
                        break
                if not self._drain_commands():
                    break
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._route(outputs, time.time())
                    if self._yield_each_step:
                        time.sleep(0)   # hand the GIL to the event loop (see __init__)
        except BaseException as exc:  # noqa: BLE001 - any failure ends the loop, reported to all
            logger.exception("engine loop died")
            self._die(exc)
            return
        self._die(EngineDeadError("the engine was shut down"), log=False)

    def _drain_commands(self) -> bool:
        """Handle every queued command without blocking; False once told to stop."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if not self._handle(command):
                return False

    def _handle(self, command: Any) -> bool:
        """Run one command on the engine thread; False for stop."""
        if isinstance(command, _Add):
            self._handle_add(command)
        elif isinstance(command, _Abort):
            self._streams.pop(command.request_id, None)
            self.engine.abort_request(command.request_id)
        elif isinstance(command, _Stats):
            try:
                stats = self.engine.stats(command.cells)
                self.last_stats = stats
                _resolve(command.loop, command.done, stats)
            except Exception as exc:  # noqa: BLE001 - a stats bug must not kill serving
                _resolve(command.loop, command.done, error=exc)
        elif isinstance(command, _Stop):
            return False
        return True

    def _handle_add(self, command: _Add) -> None:
        loop = command.stream.loop
        if command.done.cancelled():
            return
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params,
                                    arrival_time=command.arrival_time)
        except Exception as exc:  # noqa: BLE001 - ValueError is a 400; anything else a 500
            _resolve(loop, command.done, error=exc)
            return
        self._streams[command.request_id] = command.stream
        _resolve(loop, command.done, True)

    def _route(self, outputs: list[RequestOutput], seen: float) -> None:
        # One wake-up per event loop per step (not per request): fewer GIL hand-offs.
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted by its client: nobody waits for it
            if output.finished:
                del self._streams[output.request_id]
            batches.setdefault(stream.loop, []).append((stream, output, seen))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:
                pass  # that loop is closed: nobody is listening any more

    def _die(self, exc: BaseException, log: bool = True) -> None:
        with self._lock:
            self._dead = exc if isinstance(exc, Exception) else EngineDeadError(repr(exc))
            pending = []
            while True:
                try:
                    pending.append(self._commands.get_nowait())
                except queue.Empty:
                    break
        error = EngineDeadError(self.dead_reason)
        for stream in list(self._streams.values()):
            stream.put_threadsafe(error)
        self._streams.clear()
        for command in pending:
            if isinstance(command, _Add):
                _resolve(command.stream.loop, command.done, error=error)
            elif isinstance(command, _Stats):
                _resolve(command.loop, command.done, error=error)
