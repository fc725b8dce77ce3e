"""Priority scheduling (vLLM's scheduling_policy="priority"): the waiting queue ordered by
(priority, arrival_time), the preemption victim chosen by the same order, and the check of a
request's priority.

A lower priority value is served earlier; ties go by arrival time, then by sequence id (a
request's n sequences share an arrival time and keep their order). A sequence preempted by
recompute goes back to its place in that order, not to the front. Built only with the priority
policy: under "fcfs" (the default) the scheduler keeps its own FIFO queue and none of this runs.
"""
from __future__ import annotations

import bisect
import numbers
import sys
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from minillm.sampling_params import short_repr

if TYPE_CHECKING:
    from minillm.sequence import Sequence

# The range a priority may take: an int64, as the engine core's messages carry it.
MIN_PRIORITY, MAX_PRIORITY = -2 ** 63, 2 ** 63 - 1

__all__ = ["MAX_PRIORITY", "MIN_PRIORITY", "PriorityWaitingQueue", "check_priority",
           "check_priorities", "lowest_priority_index", "priority_key"]


def priority_key(seq: Sequence) -> tuple[int, float, int]:
    """seq's place in the priority order: smaller is served first and preempted last."""
    return seq.priority, seq.arrival_time, seq.seq_id


def _front_last(seq: Sequence) -> tuple[int, float, int]:
    """priority_key negated: a list sorted by it ascending has the front of the queue at its end."""
    return -seq.priority, -seq.arrival_time, -seq.seq_id


def lowest_priority_index(seqs: list[Sequence]) -> int:
    """The index in seqs of the sequence with the largest (priority, arrival_time): the one
    preempted when the block pool runs dry."""
    return max(range(len(seqs)), key=lambda i: priority_key(seqs[i]))


class PriorityWaitingQueue:
    """The waiting sequences in priority order, with the methods the scheduler calls on its FIFO
    queue. A sorted list whose last element is the front: taking the front is O(1), and adding or
    removing one (an abort) a binary search and one move of the list's tail."""

    def __init__(self) -> None:
        self._seqs: list[Sequence] = []     # sorted by _front_last: the next to admit is the last
        self._members: set[Sequence] = set()

    def append(self, seq: Sequence) -> None:
        """Queue seq at its place in the order."""
        bisect.insort(self._seqs, seq, key=_front_last)
        self._members.add(seq)

    # A priority queue has no front to put a sequence at: a preempted or skipped one goes back by its key.
    appendleft = append

    def extendleft(self, seqs) -> None:
        """Queue each of seqs at its place in the order."""
        for seq in seqs:
            self.append(seq)

    def popleft(self) -> Sequence:
        """Take the front sequence (the smallest priority key)."""
        seq = self._seqs.pop()
        self._members.discard(seq)
        return seq

    def remove(self, seq: Sequence) -> None:
        """Take seq out, wherever it is."""
        i = bisect.bisect_left(self._seqs, _front_last(seq), key=_front_last)
        if i == len(self._seqs) or self._seqs[i] is not seq:
            raise ValueError(f"sequence {seq.request_id!r} is not in the waiting queue")
        del self._seqs[i]
        self._members.discard(seq)

    def __getitem__(self, index: int) -> Sequence:
        if index != 0:
            raise IndexError("only the front of the waiting queue can be read")
        if not self._seqs:
            raise IndexError("the waiting queue is empty")
        return self._seqs[-1]

    def __contains__(self, seq: object) -> bool:
        return seq in self._members

    def __iter__(self):
        return reversed(self._seqs)

    def __len__(self) -> int:
        return len(self._seqs)


def check_priority(priority, scheduling_policy: str) -> int:
    """One request's priority (vLLM's LLMEngine.add_request argument) as an int; ValueError naming
    priority unless it is an integer (not a bool) in the int64 range, and 0 under the fcfs policy."""
    if type(priority) is int and priority == 0:      # every request under fcfs: nothing to check
        return 0
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
        raise ValueError(f"priority must be an integer, got {short_repr(priority)}")
    priority = int(priority)
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority must be an integer in [-2**63, 2**63 - 1], got {short_repr(priority)}")
    if priority and scheduling_policy != "priority":
        raise ValueError(f"priority must be 0 under scheduling_policy 'fcfs', got {short_repr(priority)}: requests "
                         f"are served first come, first served (scheduling_policy 'priority' orders them by it)")
    return priority


def check_priorities(priority, num_prompts: int, scheduling_policy: str) -> list[int]:
    """LLM.generate's priority (None, or a sequence of integers, one a prompt: a list, a tuple, a
    1-D NumPy array of an integer dtype) as one int a prompt; ValueError naming priority otherwise."""
    if priority is None:
        return [0] * num_prompts
    if _is_integer_array(priority):
        priority = priority.tolist()
    if not isinstance(priority, Seq) or isinstance(priority, (str, bytes)):
        raise ValueError(f"priority must be a list of integers, one a prompt, got {short_repr(priority)}")
    if len(priority) != num_prompts:
        raise ValueError(f"priority has {len(priority)} entries for {num_prompts} prompts")
    if any(isinstance(p, bool) or not isinstance(p, numbers.Integral) for p in priority):
        raise ValueError(f"priority must be a list of integers, one a prompt, got {short_repr(priority)}")
    return [check_priority(p, scheduling_policy) for p in priority]


def _is_integer_array(value) -> bool:
    """A 1-D NumPy array of a signed or unsigned integer dtype (no bools, floats or strings); False
    without NumPy loaded, as none can exist then."""
    np = sys.modules.get("numpy")
    return (np is not None and isinstance(value, np.ndarray) and value.ndim == 1
            and np.issubdtype(value.dtype, np.integer))
