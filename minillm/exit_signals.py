"""SIGTERM in the programs that take the terminal over (chat, monitor): the terminal's modes are put
back before the process ends, and it still ends by the signal. And multiprocessing's resource
tracker, started so that a hang-up does not take it down with the processes it cleans up after.

By default SIGTERM (kill, `timeout`, a supervisor's stop) ends Python at once, no `finally` run: a
chat killed at its prompt or while a reply streamed left the terminal without echo, and the monitor
left it in the alternate screen with mouse reporting on (each mouse move then typed escape
sequences at the shell). A shell that saves the terminal's modes after a command that exits
normally (`timeout --foreground` exits 124 after its SIGTERM) keeps them broken. SIGHUP keeps its
default: the terminal hung up, and has no modes to put back (writing to it can block for good).
"""
from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Callable, Iterator


class Terminated(BaseException):
    """SIGTERM, raised where the program was so that every `finally` on the way out runs (a
    BaseException, as KeyboardInterrupt is: no `except Exception` holds it up)."""


def is_caught() -> bool:
    """Whether SIGTERM is at its default action (one ignored by whoever started us stays ignored)."""
    return signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def end_by_sigterm() -> None:
    """End the process by SIGTERM's default action, so the parent sees how it ended (a shell
    restores the terminal modes it saved and says 'Terminated'; the status is 143)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.raise_signal(signal.SIGTERM)     # to this thread: the process ends before the call returns


@contextmanager
def unwinding_on_sigterm() -> Iterator[None]:
    """Within the block SIGTERM raises Terminated; once the block has unwound (the terminal's modes
    put back by its `finally`s), the process ends by SIGTERM."""
    if not is_caught():
        yield
        return

    def raise_terminated(signum, frame) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    except Terminated:
        end_by_sigterm()
    finally:
        signal.signal(signal.SIGTERM, previous)


def on_sigterm(add_handler: Callable[[int, Callable[[], None]], None], callback: Callable[[], None]) -> None:
    """Route SIGTERM to CALLBACK through ADD_HANDLER (an event loop's add_signal_handler)."""
    if is_caught():
        add_handler(signal.SIGTERM, callback)


def start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker, if it is not running, with SIGHUP blocked.

    The tracker removes the shared memory and semaphores (a tensor-parallel group's) of processes
    that died without doing so; it ignores SIGINT and SIGTERM, but a hang-up (the terminal of
    `minillm serve` closed, an ssh session dropped) reaches every process of the foreground group,
    the tracker too, and they all died by it: the segments stayed in /dev/shm for good. Blocked in
    the tracker (a child inherits the mask, and the tracker unblocks only the two it ignores), the
    signal leaves it to clean up after the others. Call it before the first process is spawned."""
    from multiprocessing import resource_tracker
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
