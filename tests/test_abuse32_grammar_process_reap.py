"""A grammar process killed while the engine is idle is reaped at once (it stayed a zombie until the
next constrained request looked at it), and the next constrained request still gets a new process."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from test_grammar_process import mask_inodes, new_engine, run
from test_structured_engine import assert_valid, constrained


def is_zombie_or_running(pid: int) -> bool:
    """Whether pid is still in the process table (a zombie counts: nobody reaped it)."""
    try:
        return bool(Path(f"/proc/{pid}/stat").read_text())
    except (FileNotFoundError, ProcessLookupError):     # gone before the open, or between open and read
        return False


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    """Poll condition until it holds or timeout_s passes; whether it held."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


@pytest.mark.parametrize("has_waitid", [True, False], ids=["waitid", "no-waitid"])
def test_a_grammar_process_killed_while_idle_is_reaped_and_replaced(stories_path, monkeypatch, has_waitid):
    if not has_waitid:                    # as on macOS
        monkeypatch.delattr(os, "waitid", raising=False)
    engine = new_engine(stories_path, True)
    try:
        assert_valid("date", run(engine, {"a": constrained("date", 0)})["a"])
        first = engine.structured_outputs._process
        pid = first._proc.pid
        os.kill(pid, signal.SIGKILL)          # outside Popen: nothing in the test waits on it
        assert wait_until(lambda: not is_zombie_or_running(pid)), \
            f"the killed grammar process {pid} is still in the process table: {Path(f'/proc/{pid}/stat').read_text()}"
        # Popen sets returncode just after its waitpid has taken the process out of the table
        assert wait_until(lambda: first._proc.returncode is not None)
        assert first._proc.returncode == -signal.SIGKILL
        done = run(engine, {"b": constrained("date", 1), "c": constrained("json", 1)})
        assert_valid("date", done["b"])
        assert_valid("json", done["c"])
        second = engine.structured_outputs._process
        assert second is not first and second._proc.poll() is None
    finally:
        engine.shutdown()


def reapers() -> list[str]:
    """The names of the threads that wait on grammar processes."""
    return [t.name for t in threading.enumerate() if t.name.startswith("minillm-grammar-reaper")]


def test_shutdown_leaves_no_grammar_process_or_thread_waiting_on_one(stories_path):
    engine = new_engine(stories_path, True)
    try:
        assert_valid("date", run(engine, {"a": constrained("date", 0)})["a"])
        process = engine.structured_outputs._process
        assert f"minillm-grammar-reaper-{process._proc.pid}" in reapers()
    finally:
        engine.shutdown()
    assert process._proc.returncode is not None
    assert wait_until(lambda: f"minillm-grammar-reaper-{process._proc.pid}" not in reapers()), reapers()


def test_a_grammar_process_that_cannot_start_leaves_no_shared_masks(stories_path, monkeypatch):
    # The shared memory of its masks was made first and kept (page-locked on a GPU) until the engine's
    # process ended.
    from minillm import grammar_process

    made = []
    real_masks = grammar_process.SharedMasks

    def recorded(*args, **kwargs):
        made.append(real_masks(*args, **kwargs))
        return made[-1]

    def cannot_start(spec):
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(grammar_process, "SharedMasks", recorded)
    monkeypatch.setattr(grammar_process, "_start", cannot_start)
    tokenizer_json = (stories_path / "tokenizer.json").read_text()
    before = mask_inodes()
    with pytest.raises(OSError, match="Resource temporarily unavailable"):
        grammar_process.GrammarProcess(tokenizer_json, 512, [2], num_rows=4)
    [masks] = made
    assert masks.mapping.closed and mask_inodes() == before
