"""Sequence: one completion's tokens, progress counter and block table."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import numpy as np

from minillm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is; the finished states carry the finish reason."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        """True for the three finished states."""
        return self.value in ("stop", "length", "abort")

    @property
    def finish_reason(self) -> str | None:
        """'stop' | 'length' | 'abort', or None while alive."""
        return self.value if self.is_finished else None


_seq_counter = itertools.count()
PLACEHOLDER = -1      # a sampled token whose value is still on the device


@dataclass(eq=False)
class Sequence:
    """One completion of a request: prompt + generated ids, and how many have KV computed."""

    request_id: str
    index: int                       # which of the request's n completions
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    rng: np.random.Generator
    max_tokens: int                  # resolved: params.max_tokens or what max_model_len leaves
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    status: SequenceStatus = SequenceStatus.WAITING
    token_ids: list[int] = field(default_factory=list)     # prompt + output
    num_computed_tokens: int = 0     # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)   # physical block ids, in order
    block_hashes: list = field(default_factory=list)       # prefix-cache keys of full blocks
    num_cached_tokens: int = 0       # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    output_counts: dict[int, int] = field(default_factory=dict)   # token id -> times generated
    num_pending: int = 0             # trailing PLACEHOLDER tokens (steps launched, not resolved)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens so far."""
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated ids."""
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        """True once stopped, length-capped or aborted."""
        return self.status.is_finished

    @property
    def num_resolved_tokens(self) -> int:
        """Tokens whose values are known on the host."""
        return len(self.token_ids) - self.num_pending
