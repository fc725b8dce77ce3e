"""A grammar's first compile, tried in a process of its own before the engine's.

llguidance's regex derivatives can take time and memory that grow with the square of a regex's
length (40 KB of ".?": minutes and gigabytes), checked against its fuel only between
derivatives, and a compile thread cannot be stopped. So a grammar the engine has not compiled
yet (one past the length that cannot cost much: structured_output._needs_check) is compiled first
in a child process under an address-space cap, killed once the compile timeout passes: a grammar
that outgrows either is refused, and the engine's own compile (the same work: the matcher, its
first masks, the probe walk) runs only for grammars that fit both.

    compile thread (GrammarChecker.check)        child (python -m minillm.grammar_check FD)
    start: tokenizer, vocab size, EOS, cap   ->  builds llguidance's tokenizer, caps its address
                                                 space at what it holds then plus the cap, "ready"
    the grammar's text                       ->  compiles it as the engine would, "done" (its
                                                 errors are the engine's to report)
    no answer by the timeout, or none at all     killed; the next check starts another child

The child is started as the grammar process is (minillm.grammar_process.start_child): a
multiprocessing Connection on a socket pair.
"""
from __future__ import annotations

import queue
import resource
import signal
import sys
import threading
from multiprocessing.connection import Connection

CHECK_MEMORY_BYTES = 2 << 30    # address space a trial compile may add to the child's
MAX_IDLE_CHILDREN = 2           # children kept for the next checks (more run while compiles overlap)
START_TIMEOUT_S = 120.0         # a child's start: llguidance's tokenizer of a large vocabulary


class GrammarTooCostly(Exception):
    """The trial compile ran past the timeout or the memory cap; str() says which."""


class _Child:
    """One child process and its connection (started, and told what to build, without waiting)."""

    def __init__(self, start: dict) -> None:
        from minillm.grammar_process import start_child
        self.conn, self.proc = start_child("minillm.grammar_check", start)
        self.ready = False

    def ask(self, message, timeout_s: float) -> dict | None:
        """The child's answer to message, or None when it ends or gives none within timeout_s."""
        try:
            if message is not None:
                self.conn.send(message)
            return self.conn.recv() if self.conn.poll(timeout_s) else None
        except (EOFError, OSError):
            return {"ended": True}

    def wait_ready(self) -> None:
        """Block until the child has built its tokenizer (a RuntimeError if it never does)."""
        if not self.ready:
            answer = self.ask(None, START_TIMEOUT_S)
            if not answer or not answer.get("ready"):
                self.kill()
                raise RuntimeError("the grammar check process did not start")
            self.ready = True

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.conn.close()


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
        answer = child.ask(grammar, self.timeout_s)
        if answer is None or "done" not in answer:          # past the timeout, or ended: out of memory
            child.kill()
            if answer is None:
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
    """The child: read the start message, then compile each grammar sent until the engine is gone,
    on a thread with the engine's compile stack (llguidance recurses along a grammar's rule chains),
    started before the address space is capped (its stack is reserved in it)."""
    from minillm.structured_output import _large_stack, warm_ll_tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # the engine's to handle: it stops the child
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(int(sys.argv[1]))
    start = conn.recv()
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
    conn.send({"ready": True})
    while True:
        try:
            grammar = conn.recv()
        except (EOFError, OSError):
            break
        grammars.put(grammar)
        answer = answers.get()
        conn.send(answer)
        if answer.get("memory"):
            return
    grammars.put(None)


if __name__ == "__main__":
    main()
