"""A grammar's first compile, tried in a process of its own before the engine's.

llguidance's regex derivatives can take time and memory that grow with the square of a regex's
length (40 KB of ".?": minutes and gigabytes), checked against its fuel only between
derivatives, and a compile thread cannot be stopped. So a grammar the engine has not compiled
yet (one past the length that cannot cost much: structured_output._needs_check) is compiled first
in a child process under an address-space cap, killed once the compile timeout passes: a grammar
that outgrows either is refused, and the engine's own compile (the same work: the matcher, its
first masks, the probe walk) runs only for grammars that fit both.

    compile thread (GrammarChecker.check)        child (python -m minillm.grammar_check)
    start: tokenizer, vocab size, EOS, cap   ->  builds llguidance's tokenizer, caps its address
                                                 space at what it holds then plus the cap, "ready"
    the grammar's text                       ->  compiles it as the engine would, "done" (its
                                                 errors are the engine's to report)
    no answer by the timeout, or none at all     killed; the next check starts another child

Messages are JSON, each after its length (8 bytes, little-endian), on the child's stdin/stdout.
"""
from __future__ import annotations

import json
import os
import queue
import resource
import select
import struct
import subprocess
import sys
import threading
import time

CHECK_MEMORY_BYTES = 2 << 30    # address space a trial compile may add to the child's
MAX_IDLE_CHILDREN = 2           # children kept for the next checks (more run while compiles overlap)
START_TIMEOUT_S = 120.0         # a child's start: llguidance's tokenizer of a large vocabulary


class GrammarTooCostly(Exception):
    """The trial compile ran past the timeout or the memory cap; str() says which."""


def _send(stream, message: dict) -> None:
    data = json.dumps(message).encode()
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _read_exact(fd: int, size: int, deadline: float | None) -> bytes | None:
    """size bytes from fd, or None at EOF or once deadline (monotonic) passes."""
    chunks, left = [], size
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                return None
        chunk = os.read(fd, left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _receive(fd: int, deadline: float | None = None) -> dict | None:
    head = _read_exact(fd, 8, deadline)
    if head is None:
        return None
    body = _read_exact(fd, struct.unpack("<Q", head)[0], deadline)
    return None if body is None else json.loads(body)


class _Child:
    """One child process and its pipes (started, and told what to build, without waiting)."""

    def __init__(self, start: dict) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "minillm.grammar_check"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        _send(self.proc.stdin, start)
        self.ready = False

    def wait_ready(self) -> None:
        """Block until the child has built its tokenizer (a RuntimeError if it never does)."""
        if not self.ready:
            answer = _receive(self.proc.stdout.fileno(), time.monotonic() + START_TIMEOUT_S)
            if not answer or not answer.get("ready"):
                self.kill()
                raise RuntimeError("the grammar check process did not start")
            self.ready = True

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class GrammarChecker:
    """Trial compiles in child processes, one child a check at a time (started on first use)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids, timeout_s: float,
                 memory_bytes: int | None = None) -> None:
        self.timeout_s = timeout_s
        self.memory_bytes = CHECK_MEMORY_BYTES if memory_bytes is None else memory_bytes
        self._start = {"tokenizer": tokenizer_json, "vocab_size": int(vocab_size),
                       "eos": sorted(int(i) for i in eos_token_ids), "memory_bytes": int(self.memory_bytes)}
        self._lock = threading.Lock()
        self._idle: list[_Child] = []
        self._closed = False

    def prestart(self) -> None:
        """Start a child now if none is idle, so that its start overlaps the engine's own tokenizer
        build (it does not wait for the child)."""
        with self._lock:
            if self._idle or self._closed:
                return
            self._idle.append(_Child(self._start))

    def check(self, grammar: str) -> None:
        """Return once a child has compiled grammar within the timeout and the memory cap (whether
        or not it compiles cleanly); GrammarTooCostly otherwise."""
        with self._lock:
            child = self._idle.pop() if self._idle else None
        if child is None:
            child = _Child(self._start)
        child.wait_ready()
        deadline = time.monotonic() + self.timeout_s
        try:
            _send(child.proc.stdin, {"grammar": grammar})
            answer = _receive(child.proc.stdout.fileno(), deadline)
        except OSError:
            answer = None
        if answer is None or answer.get("memory"):
            timed_out = answer is None and time.monotonic() >= deadline     # else the child ended: out of memory
            child.kill()
            if timed_out:
                raise GrammarTooCostly(f"takes longer than {self.timeout_s:g} s to compile")
            raise GrammarTooCostly(f"needs more than {self.memory_bytes / 2**30:g} GiB of memory to compile")
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE_CHILDREN:
                self._idle.append(child)
                return
        child.kill()

    def close(self) -> None:
        """Stop the idle children (a check under way stops its own when it ends)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()


def _vm_size() -> int | None:
    """This process's address space in bytes (VmSize; None where /proc does not say)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _trial(tok, grammar: str, vocab_size: int, eos: frozenset) -> None:
    """What StructuredOutputManager._compile asks of llguidance: the matcher, two first masks, the
    probe walk (errors ignored: the engine's compile reports them)."""
    import numpy as np
    import llguidance
    from minillm.structured_output import _LOG_LEVEL, _PROBE_TOKENS
    template = llguidance.LLMatcher(tok, grammar, log_level=_LOG_LEVEL)
    if template.is_error():
        return
    for _ in range(2):
        probe = template.deep_copy()
        probe.compute_bitmask()
        if probe.is_error():
            return
    probe = template.deep_copy()
    for _ in range(_PROBE_TOKENS):
        mask = np.unpackbits(np.frombuffer(probe.compute_bitmask(), np.uint8), bitorder="little")
        allowed = [t for t in np.flatnonzero(mask[:vocab_size]).tolist() if t not in eos]
        if probe.is_error() or not allowed:
            return
        probe.consume_token(allowed[0])
        if probe.is_stopped():
            return


def _work(tok, vocab_size: int, eos: frozenset, grammars: queue.Queue, answers: queue.Queue) -> None:
    """The child's compile thread: each grammar's trial, answered "done" or "memory"."""
    while (grammar := grammars.get()) is not None:
        try:
            _trial(tok, grammar, vocab_size, eos)
        except MemoryError:
            answers.put({"memory": True})
            return
        except Exception:       # a grammar llguidance refuses by raising: the engine's compile reports it
            pass
        answers.put({"done": True})


def main() -> None:
    """The child: read the start message, then compile each grammar sent until stdin closes, on a
    thread with the engine's compile stack (llguidance recurses along a grammar's rule chains),
    started before the address space is capped (its stack is reserved in it)."""
    from minillm.structured_output import _large_stack, warm_ll_tokenizer
    fd, out = sys.stdin.buffer.fileno(), sys.stdout.buffer
    start = _receive(fd)
    if start is None:
        return
    eos = frozenset(start["eos"])
    tok = warm_ll_tokenizer(start["tokenizer"], start["vocab_size"], eos)
    grammars: queue.Queue = queue.Queue()
    answers: queue.Queue = queue.Queue()
    with _large_stack():
        worker = threading.Thread(target=_work, args=(tok, start["vocab_size"], eos, grammars, answers), daemon=True)
        worker.start()
    size = _vm_size()
    if start["memory_bytes"] and size is not None:        # (without /proc: the timeout alone)
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        limit = size + start["memory_bytes"]
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    _send(out, {"ready": True})
    while (message := _receive(fd)) is not None:
        grammars.put(message["grammar"])
        answer = answers.get()
        _send(out, answer)
        if answer.get("memory"):
            return
    grammars.put(None)


if __name__ == "__main__":
    main()
