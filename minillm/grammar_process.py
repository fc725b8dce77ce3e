"""Constrained requests' matchers in a process of their own.

With every matcher in the engine's process, a constrained step costs the engine thread the
matchers' advance (a Python call or three a row) and a Python mask thread that takes the GIL
between llguidance's GIL-free fills; on a host-bound step both add to the step. Here the matchers
live in a grammar process with its own interpreter: the engine thread sends each step's sampled
tokens and the rows whose masks it wants, and reads back the matchers' answers and a filled-mask
notice, the masks themselves written into two shared-memory buffers the sampler uploads from. The
buffers are an anonymous mapping (a memfd) passed down as a file descriptor: nothing names it, so
nothing is left behind however either process ends.

    engine thread                                   grammar process
    GrammarProcess.compile(grammar)   GRAMMAR ->    compiles it (its own pool), answers "grammar"
    GrammarProcess.new_matcher(gid)   NEW ->        a GrammarMatcher for the handle
    GrammarProcess.advance(items)     ADVANCE ->    consumes each row's tokens, answers "advanced"
    GrammarProcess.fill(slot, ...)    FILL ->       fills mask buffer `slot` (each draft position's
                                                    row too), answers "filled"
    GrammarProcess.validate(items)    VALIDATE ->   how many of each row's drafts its grammar takes
                                                    (nothing consumed), answers "validated"
    (a matcher or grammar let go)     FREE ->       drops them
    (several commands at once)        BATCH ->      each in turn, as if sent one by one

A step's advance is held back until its next command (the fill of the next step's masks) or the
first look for an answer, and goes with it in one message: one write, and one wake-up of the
process, a step.

Answers come back in order on one pipe, and only the engine thread reads it: a wait for one answer
applies every answer before it (an Answer is completed by that reading). Until its answer
is read, a RemoteMatcher's flags are those of the answer before.
"""
from __future__ import annotations

import itertools
import mmap
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

# Commands (engine -> grammar process), the first item of each message.
GRAMMAR, NEW, FREE, ADVANCE, FILL, STOP, VALIDATE, BATCH = range(8)
_generations = itertools.count()


class GrammarProcessError(RuntimeError):
    """The grammar process failed a command, or is gone."""


@dataclass
class GrammarProcessSpec:
    """What the grammar process starts from (pickled once, when it is spawned)."""

    tokenizer_json: str
    vocab_size: int
    eos_token_ids: list[int]
    mask_fd: int                       # the masks' memory, passed down under the same number
    num_rows: int                      # rows of each of the two mask buffers
    num_fill_threads: int | None


def _mask_buffers(mapping: mmap.mmap, num_rows: int, num_words: int) -> list[np.ndarray]:
    """The two [num_rows, num_words] int32 mask buffers laid one after the other in mapping."""
    size = num_rows * num_words * 4
    return [np.ndarray((num_rows, num_words), np.int32, buffer=mapping, offset=k * size) for k in range(2)]


def _masks_size(num_rows: int, num_words: int) -> int:
    """Bytes of the two mask buffers."""
    return 2 * num_rows * num_words * 4


def _anonymous_file(size: int) -> int:
    """The descriptor of `size` zero bytes of memory that no file name reaches (a memfd; where there is
    none, a temporary file unlinked at once). A named shared-memory segment outlived an engine killed
    outright, or was removed by its resource tracker with a warning about a leak."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("minillm-grammar-masks", os.MFD_CLOEXEC)
    else:
        with tempfile.TemporaryFile() as file:
            fd = os.dup(file.fileno())
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


# ----------------------------------------------------------------------------- the engine's side

class SharedMasks:
    """The two mask buffers in one shared segment (page-locked on a GPU). A restarted grammar process
    takes over its predecessor's: a step in flight may still read them."""

    def __init__(self, num_rows: int, num_words: int,
                 register_host: Callable[[np.ndarray], Callable[[], None]] | None) -> None:
        self.fd = _anonymous_file(_masks_size(num_rows, num_words))   # the grammar process maps it too
        self.mapping = mmap.mmap(self.fd, _masks_size(num_rows, num_words))
        whole = np.ndarray((2 * num_rows * num_words,), np.int32, buffer=self.mapping)
        whole[...] = -1
        # Page-locked on a GPU (the sampler's upload is then a plain async copy), as the engine's own buffers.
        self._unregister = register_host(whole) if register_host is not None else None
        del whole
        self.bitmasks = _mask_buffers(self.mapping, num_rows, num_words)

    def release(self) -> None:
        """Unpin and let go of the buffers (no step may read them any more: closing unmaps them); the
        memory goes once the grammar process has let go too."""
        self.bitmasks = []
        if self._unregister is not None:
            self._unregister()
            self._unregister = None
        os.close(self.fd)
        try:
            self.mapping.close()
        except BufferError:       # a mask view is still held: the mapping goes with the last one
            pass


class Answer:
    """A reply of the grammar process, with a Future's done(), result() and set_* (result() reads the
    pipe until it is in). Only the engine thread completes and reads answers, so there is no lock:
    a concurrent Future's cost 6 us an answer, two or three a step. `value` holds its result and
    `is_read` is set once it is in. An advance's answer is `clean` when every row took its one token
    and no row's grammar ended or failed (most steps): its rows are read without looking."""

    __slots__ = ("_process", "value", "is_read", "clean", "_error")

    def __init__(self, process: GrammarProcess) -> None:
        self._process = process
        self.value: Any = None
        self.is_read = False
        self.clean = False
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self.is_read

    def set_result(self, result: Any) -> None:
        self.value, self.is_read = result, True

    def set_exception(self, exception: BaseException) -> None:
        self._error, self.is_read = exception, True

    def result(self, timeout: float | None = None) -> Any:
        """The answer's value (waits for it; raises what it failed with)."""
        if not self.is_read:
            self._process.wait_for(self)
        if self._error is not None:
            raise self._error
        return self.value


# The flags of a matcher in an advance's answer, one int a row.
TERMINATED, STOPPED, ERROR = 1, 2, 4


class RemoteMatcher:
    """A GrammarMatcher in the grammar process, seen through the flags of its last answer
    (GrammarMatcher's state questions, same meanings). An advance's answer holds every row's
    flags in a few lists; a matcher takes its row from them when it is first asked after the
    answer was read."""

    def __init__(self, process: GrammarProcess, handle: int, on_error: Callable[[], None] | None) -> None:
        self._process, self.handle = process, handle
        self._on_error = on_error          # called once, when an answer first reports an error
        self.num_fed = 0                   # tokens sent to it (its answers may be pending)
        self._pending: Answer | None = None    # the last advance's answer, until its flags are taken
        self._row = 0                          # this matcher's row in it
        self._num_accepted = 0
        self._terminated = self._stopped = False
        self._error = ""
        weakref.finalize(self, process.free, handle)

    def apply(self, state: tuple[int, bool, bool, str]) -> None:
        """Take (num_accepted, terminated, stopped, error) as this matcher's flags."""
        self._pending = None
        self._num_accepted, self._terminated, self._stopped, self._error = state
        if self._error and self._on_error is not None:
            on_error, self._on_error = self._on_error, None
            on_error()

    def _sync(self) -> None:
        """Take this matcher's row of the last advance's answer, once that has been read (a failed
        one was applied by the process's _refuse)."""
        answer = self._pending
        if answer is None or answer.value is None:
            return
        row, self._pending = self._row, None
        if answer.clean:
            self._num_accepted = answer.value[1][row]
            self._terminated = self._stopped = False
            return
        _, num_accepted, flags, errors, _, _ = answer.value
        flag = flags[row]
        self._num_accepted = num_accepted[row]
        self._terminated, self._stopped = bool(flag & TERMINATED), bool(flag & STOPPED)
        if flag & ERROR:
            self.apply((self._num_accepted, self._terminated, self._stopped, errors.get(row, "")))

    def settle(self) -> None:
        """Wait for the answer to the tokens last sent to it (if the process failed, they count as
        refused and its flags carry the error)."""
        if self._pending is not None:
            try:
                self._pending.result()
            except GrammarProcessError:
                pass
            self._sync()

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token now (a round trip: the engine sends whole steps through advance)."""
        answer = self._process.advance([self], [[int(token_id)]])
        self.settle()
        return tokens_taken(answer, 0) == 1

    @property
    def num_accepted(self) -> int:
        if self._pending is not None:
            self._sync()
        return self._num_accepted

    def is_terminated(self) -> bool:
        if self._pending is not None:
            self._sync()
        return self._terminated

    def is_stopped(self) -> bool:
        if self._pending is not None:
            self._sync()
        return self._terminated or self._stopped or self._process.failed

    def is_error(self) -> bool:
        return bool(self.error)

    def is_complete(self) -> bool:
        """Nothing but EOS may follow (or EOS was taken), and not for an error."""
        if self._pending is not None:
            self._sync()
        return (self._terminated or self._stopped) and not self._error

    @property
    def error(self) -> str:
        """Its answer's error; the process's, once that failed, for a matcher still going (its next
        token cannot be taken: it is not filled or sent to another process)."""
        if self._pending is not None:
            self._sync()
        if self._error or not self._process.failed or self._terminated or self._stopped:
            return self._error
        return f"the grammar process failed: {self._process.error}"


def _flags(matcher) -> int:
    """A GrammarMatcher's state as an advance's answer carries it (TERMINATED | STOPPED | ERROR)."""
    flag = (TERMINATED if matcher.is_terminated() else 0) | (STOPPED if matcher.is_stopped() else 0)
    return flag | (ERROR if matcher.is_error() else 0)


def tokens_taken(answer: Answer, row: int) -> int:
    """How many of the tokens an advance sent for its row the matcher took (0 if the process failed)."""
    if answer.value is None:
        try:
            answer.result()
        except GrammarProcessError:
            return 0
    return answer.value[0][row]


class GrammarProcess:
    """The engine's end of the grammar process: the commands, the answers, the shared mask buffers.

    Everything but free() and forget() (which only queue a handle for the next command: weakref
    finalizers call them, on whichever thread) is called on the engine thread.
    """

    # The longest wait for an answer before the process is taken for hung. A fill takes milliseconds
    # and compiles run beside the command loop, so only a stuck process comes near it.
    answer_timeout_s = 30.0

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int], num_rows: int,
                 num_fill_threads: int | None = None,
                 register_host: Callable[[np.ndarray], Callable[[], None]] | None = None,
                 masks: SharedMasks | None = None) -> None:
        from minillm.structured_output import bitmask_words
        self.register_host = register_host
        self._masks = masks if masks is not None else SharedMasks(num_rows, bitmask_words(vocab_size), register_host)
        self.bitmasks = self._masks.bitmasks
        self.spec = spec = GrammarProcessSpec(tokenizer_json, int(vocab_size), [int(i) for i in eos_token_ids],
                                              self._masks.fd, num_rows, num_fill_threads)
        try:
            self._conn, self._proc = _start(spec)
        except BaseException:
            if masks is None:             # made here, so let go here (a restart's stay with the old process)
                self._masks.release()
            raise
        _reap_when_gone(self._proc)
        # One poll object for the pipe, kept: Connection.poll builds a selector each call (three a step).
        self._poller = select.poll() if hasattr(select, "poll") else None
        if self._poller is not None:
            self._poller.register(self._conn.fileno(), select.POLLIN)
        self._generation = next(_generations)      # a grammar's remote_id names the process it was sent to
        self._next_handle = self._next_gid = 0
        self._compiled: dict[int, Answer] = {}
        self._waiting: deque[tuple[Answer, Any]] = deque()    # sent commands' answers, in order
        self._frees: deque[int] = deque()          # handles let go, for the next command
        self._forgets: deque[int] = deque()        # grammar ids let go, likewise
        self._outbox: list[tuple] = []             # commands not written yet (a held advance, the frees)
        self._error: str | None = None

    # ---- commands
    def _send(self, *message, hold: bool = False) -> None:
        """Queue a command (the frees let go since the last one before it) and, unless hold, write
        everything queued as one message."""
        if self._error is not None:
            raise GrammarProcessError(self._error)
        if self._frees or self._forgets:      # popleft: a finalizer may append meanwhile, on another thread
            frees = [self._frees.popleft() for _ in range(len(self._frees))]
            forgets = [self._forgets.popleft() for _ in range(len(self._forgets))]
            self._outbox.append((FREE, frees, forgets))
        self._outbox.append(message)
        if not hold:
            self._flush()

    def _flush(self) -> None:
        """Write the queued commands, several as one BATCH message (raises if the process is gone)."""
        if self._outbox:
            outbox, self._outbox = self._outbox, []
            self._post(outbox[0] if len(outbox) == 1 else (BATCH, outbox))

    def _post(self, message) -> None:
        try:
            self._conn.send(message)
        except (OSError, EOFError) as exc:
            self._fail(f"the grammar process is gone ({type(exc).__name__})")

    def compile(self, grammar) -> Answer:
        """The answer (None, or why it failed) to compiling a CompiledGrammar's text in the process."""
        if grammar.remote_id is None or grammar.remote_id[0] != self._generation:
            gid, self._next_gid = self._next_gid, self._next_gid + 1
            grammar.remote_id = (self._generation, gid)
            self._compiled[gid] = answer = Answer(self)
            weakref.finalize(grammar, self.forget, gid)
            try:
                self._send(GRAMMAR, gid, grammar.grammar)
            except GrammarProcessError as exc:     # never sent, so never answered: it failed with the process
                if not answer.done():
                    answer.set_result(str(exc))
        return self._compiled[grammar.remote_id[1]]

    def is_compiled(self, answer: Answer) -> bool:
        """Whether a compile's answer is in (the answers that have arrived are read, none waited for)."""
        self.poll()
        return answer.done()

    def new_matcher(self, grammar, on_error: Callable[[], None] | None) -> RemoteMatcher:
        """A matcher at the start of a compiled grammar's output (its compile answered without error)."""
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        self._send(NEW, handle, grammar.remote_id[1])
        return RemoteMatcher(self, handle, on_error)

    def free(self, handle: int) -> None:
        """A matcher is let go: dropped with the next command."""
        self._frees.append(handle)

    def forget(self, gid: int) -> None:
        """A compiled grammar is let go: its template is dropped with the next command."""
        self._forgets.append(gid)
        self._compiled.pop(gid, None)

    def advance(self, matchers: list[RemoteMatcher], tokens: list[list[int]]) -> Answer:
        """Send a step's tokens, tokens[i] for matchers[i]; the answer, once read, says how many
        each matcher took (tokens_taken(answer, i): up to the first refused) and holds their flags.
        The command is held until the next one is sent or an answer is looked for (one message)."""
        answer = Answer(self)
        for row, m in enumerate(matchers):
            if (last := m._pending) is not None:      # its last answer's flags, if read, before it is replaced
                if last.clean:                        # _sync's own shortcut, without the call (most rows)
                    m._num_accepted, m._pending = last.value[1][m._row], None
                else:
                    m._sync()
            m.num_fed += len(tokens[row])
            m._pending, m._row = answer, row
        try:
            self._send(ADVANCE, [m.handle for m in matchers], tokens, hold=True)
        except GrammarProcessError as exc:
            self._refuse(matchers, str(exc))
            answer.set_exception(exc)
            return answer
        self._waiting.append((answer, matchers))
        return answer

    def fill(self, slot: int, handles: list[int], no_eos: list[int], drafts: list[list[int]] | None = None) -> Answer:
        """Fill mask buffer slot's rows 0..len(handles)-1 for those matchers (EOS out of the no_eos
        rows); with drafts, handle i takes 1 + len(drafts[i]) rows, one per verified position
        (structured_output.fill_draft_rows). The answer is the fill's seconds. If the process is gone
        the rows allow every token (0 seconds): the step goes on for the other requests, and these
        end with the process's error when their tokens come back (advance)."""
        num_rows = len(handles) if drafts is None else len(handles) + sum(len(d) for d in drafts)
        answer, rows = Answer(self), (slot, num_rows)
        try:
            self._send(FILL, slot, handles, no_eos, drafts)
        except GrammarProcessError:
            self._allow_all(answer, rows)
            return answer
        self._waiting.append((answer, rows))
        return answer

    def validate(self, matchers: list[RemoteMatcher], drafts: list[list[int]]) -> Answer:
        """The answer, once read, is how many of drafts[i] matchers[i] would take from where the
        tokens sent to it put it (GrammarMatcher.validate_tokens); nothing is consumed."""
        answer = Answer(self)
        self._send(VALIDATE, [m.handle for m in matchers], [[int(t) for t in d] for d in drafts])
        self._waiting.append((answer, None))
        return answer

    def _allow_all(self, answer: Answer, rows: tuple[int, int]) -> None:
        slot, num_rows = rows
        self.bitmasks[slot][:num_rows] = -1
        answer.set_result(0.0)

    # ---- answers
    def poll(self) -> None:
        """Read the answers that have arrived, without waiting (a process found gone is recorded:
        failed, and every answer out resolved as _fail says). A held command is sent first."""
        try:
            self._flush()
            while self._error is None and self._readable(0):
                self._read_one()
        except GrammarProcessError:
            pass

    def wait_readable(self, timeout: float) -> None:
        """Wait up to timeout seconds for an answer, and read those that have arrived."""
        try:
            self._flush()                 # a held command
        except GrammarProcessError:
            return
        if self._error is None and self._readable(timeout):
            self.poll()

    def wait_for(self, answer: Answer) -> None:
        """Read answers until this one is in (raises what it failed with, or if the process is gone).
        A process that answers nothing for answer_timeout_s is stopped and counts as gone: the engine
        thread, and every request of the step, would otherwise wait on it for ever."""
        while not answer.done():
            if self._error is not None:
                raise GrammarProcessError(self._error)
            try:
                self._flush()             # the answer's command may be held still
                if not self._readable(self.answer_timeout_s):
                    self._proc.kill()
                    self._fail(f"the grammar process did not answer for {self.answer_timeout_s:g} s")
                self._read_one()
            except GrammarProcessError:
                if not answer.done():         # _fail resolves a fill (every token allowed): not an error
                    raise

    def _readable(self, timeout: float) -> bool:
        try:
            if self._poller is None:
                return self._conn.poll(timeout)
            return bool(self._poller.poll(timeout * 1e3))     # a closed pipe reads as ready (POLLHUP, POLLNVAL)
        except (OSError, EOFError):
            return True                 # the read says what happened

    def _read_one(self) -> None:
        try:
            reply = self._conn.recv()
        except (OSError, EOFError) as exc:
            self._fail(f"the grammar process is gone ({type(exc).__name__})")
        kind = reply[0]
        if kind == "grammar":
            answer = self._compiled.get(reply[1])
            if answer is not None and not answer.done():
                answer.set_result(reply[2])
            return
        answer, context = self._waiting.popleft()
        if kind == "error":
            if isinstance(context, list):       # an advance: its matchers
                self._refuse(context, reply[1])
            answer.set_exception(GrammarProcessError(reply[1]))
        elif kind == "advanced":
            answer.clean = reply[6]
            answer.set_result(reply[1:])
            for row in reply[4]:                 # an error: the grammar is dropped from the cache now
                context[row]._sync()
        else:                            # "filled", "validated"
            answer.set_result(reply[1])

    @staticmethod
    def _refuse(matchers: list[RemoteMatcher], message: str) -> None:
        """An advance that got no answer: its tokens count as refused, its matchers in error."""
        for matcher in matchers:
            matcher.apply((matcher._num_accepted, False, True, f"the grammar process failed: {message}"))

    @property
    def failed(self) -> bool:
        """The process is gone: nothing sent to it is answered."""
        return self._error is not None

    @property
    def error(self) -> str:
        """Why the process failed ('' while it has not)."""
        return self._error or ""

    def _fail(self, message: str):
        """The process is unusable: every waiting answer and every later command fails with message."""
        self._error = message
        self._outbox.clear()
        for answer, context in self._waiting:
            if isinstance(context, list):          # an advance
                self._refuse(context, message)
                answer.set_exception(GrammarProcessError(message))
            elif context is None:                  # a validation
                answer.set_exception(GrammarProcessError(message))
            else:                                  # a fill
                self._allow_all(answer, context)
        self._waiting.clear()
        for answer in list(self._compiled.values()):
            if not answer.done():
                answer.set_result(message)
        raise GrammarProcessError(message)

    def restarted(self) -> GrammarProcess:
        """A new grammar process over this failed one's mask buffers (a step in flight may still read
        them; they are unmapped when released); this one is stopped."""
        spec = self.spec
        new = GrammarProcess(spec.tokenizer_json, spec.vocab_size, spec.eos_token_ids, spec.num_rows,
                             spec.num_fill_threads, self.register_host, self._masks)
        self._masks = None
        self.shutdown()
        return new

    def shutdown(self) -> None:
        """Stop the process and release the shared buffers (once)."""
        if not self._conn.closed:
            self._stop()
        if self._masks is not None:
            self._masks.release()
            self._masks = None
        self.bitmasks = []

    def _stop(self) -> None:
        if self._error is None:
            try:
                self._conn.send((STOP,))
            except (OSError, EOFError):
                pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:    # only a _reap thread frozen at exit inside poll() holds it up
                pass
        self._conn.close()


def _reap_when_gone(proc: subprocess.Popen) -> None:
    """Reap the process from a thread of its own as soon as it ends, so that one which dies while the
    engine is idle is not left a zombie until the next constrained request finds its pipe closed."""
    threading.Thread(target=_reap, args=(proc,), name=f"minillm-grammar-reaper-{proc.pid}", daemon=True).start()


def _reap(proc: subprocess.Popen) -> None:
    # The blocking wait leaves the child unreaped (WNOWAIT) and holds none of Popen's locks: a daemon
    # thread is frozen where it stands at interpreter exit, and one frozen inside Popen.wait would keep
    # its lock from the engine's own wait in _stop. poll() then reaps without blocking.
    if not hasattr(os, "waitid"):      # macOS: look every second instead
        while proc.poll() is None:
            time.sleep(1.0)
        return
    try:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:          # reaped already (by _stop's wait)
        return
    proc.poll()


def start_child(module: str, message, pass_fds: tuple[int, ...] = ()) -> tuple[Connection, subprocess.Popen]:
    """Start `python -m MODULE FD` on one end of a socket pair and send it message (the child reads
    Connection(int(sys.argv[1]))). Not multiprocessing's spawn: that runs the parent's __main__
    again, and a script that builds an engine without a __main__ guard would start another."""
    parent, child = socket.socketpair()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        proc = subprocess.Popen([sys.executable, "-m", module, str(child.fileno())],
                                pass_fds=(child.fileno(), *pass_fds), stdin=subprocess.DEVNULL, env=env)
    finally:
        child.close()
    conn = Connection(parent.detach())
    conn.send(message)
    return conn, proc


def _start(spec: GrammarProcessSpec) -> tuple[Connection, subprocess.Popen]:
    """The grammar process, started and sent spec."""
    return start_child("minillm.grammar_process", spec, (spec.mask_fd,))


# ----------------------------------------------------------------------------- the grammar process

def run_grammar_process(conn, spec: GrammarProcessSpec) -> None:
    """The grammar process: answer the engine's commands until told to stop or the engine is gone."""
    # Ctrl-C, or a service manager's SIGTERM to the whole process group, is the engine's to handle: it
    # stops us once its open requests are done (dying of it failed every constrained request in flight).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server = _GrammarServer(conn, spec)
    try:
        server.serve()
    finally:
        server.close()


def _attach(fd: int, size: int) -> mmap.mmap:
    """The engine's mask buffers, mapped from the descriptor it passed down (closed once mapped)."""
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class _GrammarServer:
    """The matchers and their compiled grammars, and the command loop over them."""

    def __init__(self, conn, spec: GrammarProcessSpec) -> None:
        from minillm import structured_output as so
        self.so = so
        self.conn, self.spec = conn, spec
        num_words = so.bitmask_words(spec.vocab_size)
        self.mapping = _attach(spec.mask_fd, _masks_size(spec.num_rows, num_words))
        self.bitmasks = _mask_buffers(self.mapping, spec.num_rows, num_words)
        self.eos = frozenset(spec.eos_token_ids)
        self.eos_table = so.eos_words(self.eos, spec.vocab_size)
        self.send_lock = threading.Lock()               # the loop and the compile pool both answer
        with so._large_stack():                         # deep schemas recurse on the compiling thread
            self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="minillm-grammar")
            self.tokenizer = self.pool.submit(so.warm_ll_tokenizer, spec.tokenizer_json, spec.vocab_size, self.eos)
        self.templates: dict[int, Future] = {}
        self.matchers: dict[int, Any] = {}
        self._executor = None

    def reply(self, *message) -> None:
        with self.send_lock:
            self.conn.send(message)

    def serve(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (OSError, EOFError):
                return                                  # the engine is gone
            for command in (message[1] if message[0] == BATCH else (message,)):
                kind = command[0]
                if kind == STOP:
                    return
                try:
                    self.handle(kind, command)
                except Exception as exc:  # noqa: BLE001 - the engine gets the error, the loop goes on
                    if kind in (ADVANCE, FILL, VALIDATE):
                        self.reply("error", f"{type(exc).__name__}: {exc}")

    def handle(self, kind: int, message: tuple) -> None:
        if kind == GRAMMAR:
            _, gid, text = message
            with self.so._large_stack():               # the pool may start a thread in submit
                self.templates[gid] = future = self.pool.submit(self.compile, text)
            future.add_done_callback(lambda f, gid=gid: self.answer_compile(gid, f))
        elif kind == NEW:
            _, handle, gid = message
            template = self.templates[gid].result()
            self.matchers[handle] = self.so.GrammarMatcher(template.deep_copy(), self.eos)
        elif kind == FREE:
            _, handles, gids = message
            for handle in handles:
                self.matchers.pop(handle, None)
            for gid in gids:
                self.templates.pop(gid, None)
        elif kind == ADVANCE:
            self.reply("advanced", *self.advance(message[1], message[2]))
        elif kind == FILL:
            self.reply("filled", self.fill(*message[1:]))
        elif kind == VALIDATE:
            _, handles, drafts = message
            self.reply("validated", [len(self.matchers[h].validate_tokens(ids)) for h, ids in zip(handles, drafts)])

    def compile(self, text: str):
        """A template matcher for a grammar text the engine compiled already, its first mask built."""
        import llguidance
        template = llguidance.LLMatcher(self.tokenizer.result(), text, log_level=self.so._LOG_LEVEL)
        template.deep_copy().compute_bitmask()
        return template

    def answer_compile(self, gid: int, future: Future) -> None:
        """Tell the engine how a grammar's compile ended: not a compile cancelled by the stop, nor to an engine gone."""
        if future.cancelled():
            return
        try:
            self.reply("grammar", gid, self.compile_error(future))
        except OSError:
            pass

    @staticmethod
    def compile_error(future: Future) -> str | None:
        error = future.exception()
        return None if error is None else f"{type(error).__name__}: {error}"

    def advance(self, handles: list[int], tokens: list[list[int]]) -> tuple[list, list, list, dict, dict, bool]:
        """Feed each matcher its tokens (up to the first refused): per row the tokens taken, the
        tokens accepted so far and the flags, {row: error} for the rows in error, {row: the flags
        after each token taken} for the rows of several tokens (accepted drafts and the token after),
        and whether the answer is clean (each row one token, taken, and no flag: Answer.clean)."""
        taken, num_accepted, flags, errors, steps = [], [], [], {}, {}
        for row, (handle, ids) in enumerate(zip(handles, tokens)):
            matcher = self.matchers[handle]
            if len(ids) > 1:
                steps[row] = after = []
                for token in ids:
                    if not matcher.accept_token(token):
                        break
                    after.append(_flags(matcher))
                taken.append(len(after))
            else:
                answers = matcher.accept_until_refused(ids)
                taken.append(len(answers) - (not answers[-1]) if answers else 0)
            num_accepted.append(matcher.num_accepted)
            flags.append(_flags(matcher))
            if matcher.is_error():
                errors[row] = matcher.error
        clean = not steps and not errors and not any(flags) and taken.count(1) == len(taken)
        return taken, num_accepted, flags, errors, steps, clean

    def fill(self, slot: int, handles: list[int], no_eos: list[int], drafts: list[list[int]] | None = None) -> float:
        """Fill rows 0..len(handles)-1 of mask buffer slot (with drafts, each handle's row and one per
        draft after it); returns the fill's seconds."""
        start = time.perf_counter()
        bitmask = self.bitmasks[slot]
        if drafts is None:
            self.so.fill_rows(self.executor, [(self.matchers[h]._matcher, i) for i, h in enumerate(handles)], bitmask)
        else:
            first = self.so.mask_layout(drafts)[0].tolist()
            self.so.fill_draft_rows(self.executor, [(self.matchers[h]._matcher, row, d)
                                                    for h, row, d in zip(handles, first, drafts)], bitmask)
        if no_eos:
            self.so.forbid_eos(bitmask, no_eos, self.eos_table)
        return time.perf_counter() - start

    def executor(self):
        if self._executor is None:
            import llguidance
            self._executor = llguidance.LLExecutor(self.spec.num_fill_threads)
        return self._executor

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.matchers.clear()
        self.templates.clear()
        self.bitmasks = []
        try:
            self.mapping.close()
        except BufferError:       # a fill still holds a view: the mapping goes with the process
            pass


if __name__ == "__main__":
    _conn = Connection(int(sys.argv[1]))
    run_grammar_process(_conn, _conn.recv())
