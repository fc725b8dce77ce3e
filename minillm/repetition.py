"""repetition_detection (vLLM's): stop a completion whose output ends in a pattern repeated min_count times.

After each output token a request that sets it looks at its output's tail for a pattern of
min_pattern_size (0: 1) to max_pattern_size tokens written min_count times in a row, the shortest
size first; one found ends it with finish_reason "repetition" and stop_reason "repetition_detected",
the repeats kept. Only output tokens count, never the prompt's, and not before min_tokens. The
engine's check_stop reads this module only for requests whose SamplingParams.repetition_detection
is set, so the others pay nothing.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from minillm.sampling_params import _is_int, _plain, short_repr

# vLLM's hard bounds on a request's pattern size and repeats, and its budget of the tokens one check
# may compare (max_pattern_size x min_count) on a server with no --max-repetition-detection-pattern-size.
MAX_PATTERN_SIZE = 65536
MAX_MIN_COUNT = 1000
MAX_SCAN_WORK = MAX_PATTERN_SIZE * 10
STOP_REASON = "repetition_detected"      # the stop_reason of a completion it ended, as vLLM's
FIELDS = ("max_pattern_size", "min_pattern_size", "min_count")


@dataclass
class RepetitionDetectionParams:
    """vLLM's RepetitionDetectionParams: which repeated N-grams of the output stop it.

    max_pattern_size: the longest pattern looked for, in tokens (0: no detection); min_pattern_size:
    the shortest (0: 1), at most max_pattern_size; min_count: how many times in a row a pattern must
    be written to stop the output (at least 2 where max_pattern_size is set)."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        self.validate()

    @property
    def is_enabled(self) -> bool:
        """True when a check can find a pattern (max_pattern_size set)."""
        return self.max_pattern_size > 0

    def validate(self) -> None:
        """Raise ValueError naming the first field that is out of range or of the wrong type."""
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name} {why}, got {short_repr(getattr(self, name))}")

        for name in FIELDS:
            value = getattr(self, name)
            if not _is_int(value):
                bad(name, "must be an integer")
            setattr(self, name, _plain(value))     # a NumPy integer as Python's (msgpack carries it)
        if not 0 <= self.max_pattern_size <= MAX_PATTERN_SIZE:
            bad("max_pattern_size", f"must be an integer in [0, {MAX_PATTERN_SIZE}] (0: no repetition detection)")
        if not 0 <= self.min_pattern_size <= self.max_pattern_size:
            bad("min_pattern_size", f"must be an integer in [0, max_pattern_size] (0: 1; max_pattern_size is "
                                    f"{self.max_pattern_size}, and both 0 turn detection off)")
        if self.min_count > MAX_MIN_COUNT:
            bad("min_count", f"must be at most {MAX_MIN_COUNT}")
        if self.is_enabled and self.min_count < 2:
            bad("min_count", "must be at least 2 where max_pattern_size is set (a pattern written once is no "
                             "repetition; max_pattern_size 0 turns detection off)")


def check_scan_work(params: RepetitionDetectionParams) -> None:
    """ValueError naming repetition_detection when one check may compare more tokens than vLLM's budget."""
    work = params.max_pattern_size * params.min_count
    if work > MAX_SCAN_WORK:
        raise ValueError(f"repetition_detection compares up to max_pattern_size x min_count = {work} tokens after "
                         f"each token, more than the budget of {MAX_SCAN_WORK}: lower max_pattern_size or "
                         f"min_count")


def ends_in_repetition(token_ids: list[int], num_outputs: int, params: RepetitionDetectionParams) -> bool:
    """Whether the last num_outputs of token_ids (the output) end in a pattern of params' sizes
    written params.min_count times in a row."""
    count, end = params.min_count, len(token_ids)
    for size in range(max(params.min_pattern_size, 1), params.max_pattern_size + 1):
        if size * count > num_outputs:      # longer patterns fit even less
            return False
        tail = token_ids[end - size:]
        # Each earlier copy compared whole (a slice compare in C), nearest first: a loop breaks there.
        if all(token_ids[end - (m + 1) * size:end - m * size] == tail for m in range(1, count)):
            return True
    return False


def renamed(message: str, names: dict[str, str]) -> str:
    """message (a RepetitionDetectionParams error) with its field names as names spells them (a
    request's repetition_detection.min_count, or vLLM's earlier repetition_min_count)."""
    return _FIELD_NAME.sub(lambda m: names[m.group(0)], message)


_FIELD_NAME = re.compile(r"\b(?:" + "|".join(FIELDS) + r")\b")
