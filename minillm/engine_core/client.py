"""The API server's end of the engine core process: spawn it, send it commands, read what it sends.

The core is spawned (never forked: the server has threads, and CUDA must be initialised in the
core only) and joined to each API server by two ZeroMQ PUSH/PULL pairs over ipc sockets in a
private directory. A pipe whose write end only the starting process holds tells the core when
that process is gone, however it ends; another, whose write end only the core holds, tells the
API servers (which, with several, are not the core's parent) when the core is gone.
"""
from __future__ import annotations

import errno
import multiprocessing as mp
import os
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from minillm.config import EngineConfig
from minillm.engine_core import messages as m
from minillm.engine_core.core import CoreSpec, run_engine_core
from minillm.exit_signals import start_resource_tracker


SEND_TIMEOUT_MS = 2000
READY_POLL_MS = 100
SOCKET_DIR_PREFIX = "minillm-core-"
STALE_DIR_GRACE_S = 60.0     # a socket directory changed more recently may be one whose server is binding


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


@dataclass
class CoreLink:
    """How one API server reaches the core (picklable: an API server process is spawned with it)."""

    client_index: int
    input_address: str          # this server binds a PUSH here; the core's PULL connects
    output_address: str         # this server binds a PULL here; the core's PUSH for it connects
    alive: Any                  # the read end of a pipe only the core writes to: EOF once it is gone
    # The write end of a pipe only the core reads, held by this API server alone once its process has
    # started (hand_over): EOF there tells the core that the server is gone, and it aborts its requests.
    presence: Any = None

    def hand_over(self) -> None:
        """Close this process's copy of `presence`: the API server process started with this link holds its own."""
        if self.presence is not None:
            self.presence.close()


def socket_dir(longest_name: str) -> str:
    """A private directory for the core's ipc sockets: in the temporary directory ($TMPDIR), or in
    /tmp where a socket's path there would be too long to bind (sun_path holds about 107 bytes; a
    deep $TMPDIR, as macOS's or a test runner's, passes it). Stale ones there are swept first."""
    sweep_stale_socket_dirs([tempfile.gettempdir(), "/tmp"])
    path = tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX)
    if len(os.fsencode(os.path.join(path, longest_name))) <= getattr(zmq, "IPC_PATH_MAX_LEN", 107):
        return path
    os.rmdir(path)
    return tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX, dir="/tmp")


def _refuses(path: str) -> bool:
    """Whether the unix socket at path is one nobody listens on any more (its process is gone)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
    return False


def is_stale_socket_dir(path: str, now: float) -> bool:
    """Whether path is a core's socket directory left by processes that all died (a crash, or a
    SIGKILL of both an API server and its core, leaves it): unchanged for STALE_DIR_GRACE_S, and
    holding sockets only, none of which takes a connection."""
    try:
        if now - os.stat(path).st_mtime < STALE_DIR_GRACE_S:
            return False
        names = os.listdir(path)
    except OSError:
        return False
    sockets = [os.path.join(path, name) for name in names]
    return bool(sockets) and all(_is_socket(p) and _refuses(p) for p in sockets)


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def sweep_stale_socket_dirs(parents: list[str]) -> list[str]:
    """Remove the stale core socket directories (is_stale_socket_dir) in these directories; what was removed."""
    removed, now = [], time.time()
    for parent in dict.fromkeys(os.path.realpath(p) for p in parents):
        try:
            names = [n for n in os.listdir(parent) if n.startswith(SOCKET_DIR_PREFIX)]
        except OSError:
            continue
        for name in names:
            path = os.path.join(parent, name)
            if is_stale_socket_dir(path, now):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


class CoreProcess:
    """The engine core process for `num_clients` API servers: its sockets' addresses (in a private
    directory), a link for each server, and the pipes that tie its life to ours."""

    def __init__(self, config: EngineConfig, num_clients: int = 1,
                 core_hook: Callable[[Any], None] | None = None) -> None:
        self.dir = socket_dir(f"output-{num_clients - 1}")
        inputs = [f"ipc://{self.dir}/input-{i}" for i in range(num_clients)]
        outputs = [f"ipc://{self.dir}/output-{i}" for i in range(num_clients)]
        start_resource_tracker()       # it must outlive a hang-up of the core and its workers
        spawn = mp.get_context("spawn")
        reader, self._parent_pipe = spawn.Pipe(duplex=False)
        self._alive, alive_writer = spawn.Pipe(duplex=False)
        presences = [spawn.Pipe(duplex=False) for _ in range(num_clients)]    # (core's reader, server's writer)
        # Not a daemon: a core with tensor parallelism spawns workers of its own.
        self.proc = spawn.Process(target=run_engine_core, name="minillm-engine-core", args=(CoreSpec(
            config, inputs, outputs, reader, alive_writer, core_hook, [r for r, _ in presences]),))
        self.proc.start()
        reader.close()
        alive_writer.close()    # the core holds the only write end now
        for presence_reader, _ in presences:
            presence_reader.close()
        self._finalizer = weakref.finalize(self, _stop_process, self.proc, 0.0)   # never outlive this process
        self.links = [CoreLink(i, inputs[i], outputs[i], self._alive, presences[i][1]) for i in range(num_clients)]

    @property
    def pid(self) -> int:
        """The core's process id."""
        return self.proc.pid

    def stop(self, timeout: float = 10.0) -> None:
        """Let the core go (it exits once we close its parent pipe), wait up to `timeout`, then kill it."""
        self._parent_pipe.close()
        _stop_process(self.proc, timeout)
        self._finalizer.detach()

    def close(self) -> None:
        """Remove the socket directory (once the core and its API servers are done with it)."""
        self._alive.close()
        for link in self.links:
            link.hand_over()
        shutil.rmtree(self.dir, ignore_errors=True)


class EngineCoreClient:
    """One API server's end of the core: send() is thread-safe, reading is one thread's job.

    Built with an EngineConfig it starts the core process and owns it (one API server); built with
    a CoreLink it joins a core that another process started for several API servers.
    """

    def __init__(self, config: EngineConfig | None = None, core_hook: Callable[[Any], None] | None = None,
                 link: CoreLink | None = None) -> None:
        self.owned = CoreProcess(config, 1, core_hook) if link is None else None
        self.link = link if link is not None else self.owned.links[0]
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDHWM, 0)     # commands are small and few: never drop them
        # A send waits while there is no core at the other end (connecting, or gone), at most this long.
        self.input.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        self.input.setsockopt(zmq.LINGER, 0)
        self.output = self.ctx.socket(zmq.PULL)
        self.output.setsockopt(zmq.RCVHWM, 0)
        self.output.setsockopt(zmq.LINGER, 0)
        self._bind()
        self.encoder, self.decoder = m.encoder(), m.up_decoder()
        self._send_lock = threading.Lock()      # zmq sockets are not thread-safe
        self._wake_r, self._wake_w = os.pipe()  # stop() wakes the reader out of its poll
        self._poller = zmq.Poller()
        self._poller.register(self.output, zmq.POLLIN)
        self._poller.register(self.sentinel, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        try:
            self.ready = self._wait_ready()
        except KeyboardInterrupt:     # Ctrl-C or SIGTERM while the model loads: the core goes with us
            self.close()
            raise

    def _bind(self) -> None:
        """Bind both sockets in the core's socket directory. A joining API server that finds the
        directory gone was started by a process that has since died: the core saw that and left."""
        try:
            self.input.bind(self.link.input_address)
            self.output.bind(self.link.output_address)
        except zmq.ZMQError as exc:
            self.ctx.destroy(linger=0)
            if self.owned is None and exc.errno == errno.ENOENT:
                raise CoreStartupError("the engine core ended before this API server could join it (its socket "
                                       "directory is gone: the process that started them has ended)") from None
            if self.owned is not None:
                self.owned.stop(timeout=0)
                self.owned.close()
            raise

    @property
    def client_index(self) -> int:
        """Which of the core's API servers this is (0 when there is one)."""
        return self.link.client_index

    @property
    def sentinel(self) -> int:
        """A descriptor that becomes readable when the core process ends."""
        return self.owned.proc.sentinel if self.owned is not None else self.link.alive.fileno()

    def describe_end(self) -> str:
        """How the core ended, in words ('killed by SIGKILL'; 'ended' where it is not our child)."""
        if self.owned is None:
            return "it is gone; its exit status is for the process that started it"
        self.owned.proc.join(5)     # its sentinel fired: it is exiting, if not yet reaped
        return describe_exit(self.owned.proc.exitcode)

    def _wait_ready(self) -> m.Ready:
        while True:
            # Never an endless poll: a signal caught just before it began (its handler runs only
            # between bytecodes) would wait until the model had loaded, or for ever.
            events = dict(self._poller.poll(READY_POLL_MS))
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
                end = self.describe_end()
                self.close()
                raise CoreStartupError(f"the engine core process ended during start-up ({end})")

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
        and sent everything it will send, or once wake() was called."""
        events = dict(self._poller.poll(timeout_ms))
        if self._wake_r in events:
            return None
        messages = self._drain()
        if not messages and self.sentinel in events:
            # It has ended: what it sent last (EngineDead) may still be on its way through the socket.
            if self.output.poll(200):
                return self._drain()
            return None
        return messages

    def wake(self) -> None:
        """Make the reader's receive() return None (we are shutting down)."""
        os.write(self._wake_w, b"x")

    def _drain(self) -> list[Any]:
        messages = []
        while True:
            try:
                messages.append(self.decoder.decode(self.output.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return messages

    def stop(self, timeout: float = 10.0) -> None:
        """Wait up to `timeout` for a core we own to exit, then kill it (one we joined is its owner's)."""
        if self.owned is not None:
            self.owned.stop(timeout)

    def close(self) -> None:
        """Release the sockets (once the core has stopped or we leave it, and nothing reads them)."""
        with self._send_lock:
            self.input.close()
        self.output.close()
        self.ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self.owned is not None:
            self.owned.stop(timeout=0)
            self.owned.close()
