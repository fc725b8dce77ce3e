"""The API server's end of the engine core process: spawn it, send it commands, read what it sends.

The core is spawned (never forked: the server has threads, and CUDA must be initialised in the
core only) and joined by two ZeroMQ PUSH/PULL pairs over ipc sockets in a private directory. A
pipe whose write end only this process holds tells the core when we are gone, however we end.
"""
from __future__ import annotations

import multiprocessing as mp
import shutil
import signal
import tempfile
import threading
import weakref
from typing import Any, Callable

import zmq

from minillm.config import EngineConfig
from minillm.engine_core import messages as m
from minillm.engine_core.core import CoreSpec, run_engine_core


SEND_TIMEOUT_MS = 2000


class CoreStartupError(RuntimeError):
    """The engine core could not start; the message says why (as the core raised it)."""


def describe_exit(exitcode: int | None) -> str:
    """How a process ended, in words: 'exit code 3' or 'killed by SIGKILL'."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _stop_process(proc: mp.process.BaseProcess, timeout: float) -> None:
    """Wait up to `timeout` for a process to end, then kill it (the core ignores SIGTERM: it stops
    when told to, or when we are gone)."""
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


class EngineCoreClient:
    """Starts the core process and talks to it; send() is thread-safe, reading is one thread's job."""

    def __init__(self, config: EngineConfig, core_hook: Callable[[Any], None] | None = None) -> None:
        self.ctx = zmq.Context()
        self.dir = tempfile.mkdtemp(prefix="minillm-core-")
        input_address, output_address = f"ipc://{self.dir}/input", f"ipc://{self.dir}/output"
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDHWM, 0)     # commands are small and few: never drop them
        # A send waits while there is no core at the other end (connecting, or gone), at most this long.
        self.input.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.bind(input_address)
        self.output = self.ctx.socket(zmq.PULL)
        self.output.setsockopt(zmq.RCVHWM, 0)
        self.output.setsockopt(zmq.LINGER, 0)
        self.output.bind(output_address)
        self.encoder, self.decoder = m.encoder(), m.up_decoder()
        self._send_lock = threading.Lock()      # zmq sockets are not thread-safe
        spawn = mp.get_context("spawn")
        reader, self._parent_pipe = spawn.Pipe(duplex=False)
        # Not a daemon: a core with tensor parallelism spawns workers of its own.
        self.proc = spawn.Process(target=run_engine_core, name="minillm-engine-core",
                                  args=(CoreSpec(config, input_address, output_address, reader, core_hook),))
        self.proc.start()
        reader.close()
        self._finalizer = weakref.finalize(self, _stop_process, self.proc, 0.0)   # never outlive this process
        self._poller = zmq.Poller()
        self._poller.register(self.output, zmq.POLLIN)
        self._poller.register(self.proc.sentinel, zmq.POLLIN)
        self.ready = self._wait_ready()

    @property
    def sentinel(self) -> int:
        """A descriptor that becomes readable when the core process ends."""
        return self.proc.sentinel

    def _wait_ready(self) -> m.Ready:
        while True:
            events = dict(self._poller.poll())
            if self.output in events:
                message = self.decoder.decode(self.output.recv())
                if isinstance(message, m.Ready):
                    return message
                if isinstance(message, m.StartupFailed):
                    self.stop(timeout=10)
                    self.close()
                    if message.error_type == "ValueError":
                        raise ValueError(message.error)
                    raise CoreStartupError(f"the engine core failed to start: {message.error_type}: {message.error}")
            elif self.sentinel in events:
                self.stop(timeout=0)
                self.close()
                raise CoreStartupError(f"the engine core process ended during start-up "
                                       f"({describe_exit(self.proc.exitcode)})")

    def send(self, message: Any) -> None:
        """Send a command (any thread); ConnectionError once the core has gone away."""
        data = self.encoder.encode(message)
        with self._send_lock:
            try:
                self.input.send(data)
            except (zmq.Again, zmq.ZMQError) as exc:   # no core at the other end any more
                raise ConnectionError(f"the engine core is not reachable: {exc}") from None

    def receive(self, timeout_ms: int | None) -> list[Any] | None:
        """Every message waiting (waiting up to timeout_ms for the first); None once the core has ended
        and sent everything it will send."""
        events = dict(self._poller.poll(timeout_ms))
        messages = self._drain()
        if not messages and self.sentinel in events:
            # It has ended: what it sent last (EngineDead) may still be on its way through the socket.
            if self.output.poll(200):
                return self._drain()
            return None
        return messages

    def _drain(self) -> list[Any]:
        messages = []
        while True:
            try:
                messages.append(self.decoder.decode(self.output.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return messages

    def stop(self, timeout: float = 10.0) -> None:
        """Wait up to `timeout` for the core process to exit, then kill it."""
        _stop_process(self.proc, timeout)
        self._finalizer.detach()

    def close(self) -> None:
        """Release the sockets (once the core has stopped and nothing reads them any more)."""
        self._parent_pipe.close()
        with self._send_lock:
            self.input.close()
        self.output.close()
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)
