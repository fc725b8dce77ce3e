"""Errors and bounded waits of a tensor-parallel group.

Every wait on another process is a loop of short blocking tries with a liveness check between
them, so a peer that died is reported as an error within a fraction of a second, and a peer that
hangs is reported when the generous overall limit runs out, never a silent hang.
"""
from __future__ import annotations

import time
from collections.abc import Callable

POLL_S = 0.1                 # longest a blocked wait goes without checking its peers
DEFAULT_TIMEOUT_S = 600.0    # a step slower than this on any rank is taken for a hang


class TensorParallelError(RuntimeError):
    """A rank died, failed or hung: the group is unusable and the engine cannot go on."""


class PeerGone(Exception):
    """Raised in a worker whose rank-0 process has gone: the worker exits quietly."""


def wait_for(try_once: Callable[[float], bool], what: str, check_peers: Callable[[], None],
             timeout: float | None) -> None:
    """Call try_once(POLL_S) until it returns True; check_peers() runs between tries and raises
    when a peer is gone; after `timeout` seconds (None: never) a TensorParallelError names `what`."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not try_once(POLL_S):
        check_peers()
        if deadline is not None and time.monotonic() > deadline:
            raise TensorParallelError(f"timed out after {timeout:.0f} s waiting for {what}")
