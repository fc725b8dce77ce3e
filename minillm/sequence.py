"""Sequence: one completion's tokens, progress counter and block table."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from minillm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minillm.structured_output import StructuredOutputRequest


class SequenceStatus(enum.Enum):
    """Where a sequence is; the finished states carry the finish reason."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"         # the request itself failed (its grammar); stop_reason says why
    FINISHED_REPETITION = "repetition"   # its output ended in a repeated pattern (minillm/repetition.py)

    @property
    def is_finished(self) -> bool:
        """True for the finished states."""
        return self._finished

    @property
    def finish_reason(self) -> str | None:
        """'stop' | 'length' | 'abort' | 'error' | 'repetition', or None while alive."""
        return self._finish_reason


# Plain attributes on each member: an enum's .value is a descriptor call (about 0.4 us), and the
# engine asks every sequence several times a step whether it has finished.
for _status in SequenceStatus:
    _status._finished = _status.value in ("stop", "length", "abort", "error", "repetition")
    _status._finish_reason = _status.value if _status._finished else None
del _status


_seq_counter = itertools.count()

# Uniforms a sequence draws from its generator at once for the sampling (Sequence.next_uniform).
UNIFORMS_AHEAD = 32


@dataclass(eq=False)
class Sequence:
    """One completion of a request: prompt + generated ids, and how many have KV computed."""

    request_id: str
    index: int                       # which of the request's n completions
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    rng_source: np.random.Generator | int | None   # its generator, or the seed it is built from on first use
    max_tokens: int                  # resolved: params.max_tokens or what max_model_len leaves
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    status: SequenceStatus = SequenceStatus.WAITING
    token_ids: list[int] = field(default_factory=list)     # prompt + output known on the host
    num_computed_tokens: int = 0     # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)   # physical block ids, in order
    block_hashes: list = field(default_factory=list)       # prefix-cache keys of its registered full blocks
    # Keys of its full blocks of known tokens, each hashed once (tokens only grow): a prefix of it
    # is block_hashes; a waiting prompt looked up every step, and the host tier, reuse them.
    token_block_keys: list = field(default_factory=list)
    block_key_root: bytes = b""      # what its key chain starts from: its cache salt's digest, or nothing
    num_cached_tokens: int = 0       # prompt tokens served from the prefix cache or a KV connector at admission
    num_external_tokens: int = 0     # of those, loaded by the KV connector (host tier, prefill engine)
    num_preemptions: int = 0
    priority: int = 0                # vLLM's: under the priority policy a lower value is served first
    stop_reason: int | str | None = None
    output_counts: dict[int, int] = field(default_factory=dict)   # token id -> times generated (if counts_outputs)
    num_output_placeholders: int = 0  # tokens sampled by launched steps, not read back yet
    structured_output: StructuredOutputRequest | None = None   # its grammar and matcher, when constrained
    spec_token_ids: list[int] = field(default_factory=list)   # drafts launched for verification, not read back
    # A KV transfer's word on it (minillm/kv_connector/pd_connector.py): on a prefill engine the
    # kv_transfer_params a decode engine needs; on a decode engine what loading its prompt took.
    kv_transfer_params: dict | None = None
    kv_transfer_stats: dict | None = None
    # Whether output_counts is kept: only a penalty reads it (the params never change in a sequence's life).
    counts_outputs: bool = field(default=False, init=False, repr=False)
    # Uniforms drawn ahead from its generator for next_uniform, the next one last (given back to the
    # generator before any other draw from it: see rng).
    uniforms_ahead: list[float] | tuple = field(default=(), init=False, repr=False)
    # The token count (prompt and output) from which the scheduler's update asks check_stop about every
    # token: its max_tokens; 0 (every token asked) for a sequence whose tokens need the per-token path
    # (bans, penalty counts, repetition detection) or that the scheduler did not add (Scheduler.add).
    stop_check_from: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.counts_outputs = self.params.needs_output_counts

    @property
    def rng(self) -> np.random.Generator:
        """Its random generator, built from its seed on first use (a greedy sequence never needs one,
        and building one costs a fifth of admitting a request), at the draws used so far: those
        next_uniform drew ahead are given back first (each uniform is one of the generator's
        64-bit outputs), so every draw from it continues the one stream."""
        if self.uniforms_ahead:
            self.rng_source.bit_generator.advance(-len(self.uniforms_ahead))
            self.uniforms_ahead = ()
        if not isinstance(self.rng_source, np.random.Generator):
            self.rng_source = np.random.default_rng(self.rng_source)
        return self.rng_source

    def next_uniform(self) -> float:
        """Its generator's next uniform in [0, 1), as rng.random() draws it, drawn UNIFORMS_AHEAD at
        a time (the sampling asks every seeded row for one every step)."""
        ahead = self.uniforms_ahead
        if not ahead:
            ahead = self.rng.random(UNIFORMS_AHEAD).tolist()
            ahead.reverse()
            self.uniforms_ahead = ahead
        return ahead.pop()

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens, counting those still on their way from the device."""
        return len(self.token_ids) + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens so far, counting those still on their way from the device."""
        return self.num_tokens - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated ids known on the host."""
        return self.token_ids[len(self.prompt_token_ids):]

    def output_token_ids_after(self, num_seen: int) -> list[int]:
        """The generated ids known on the host past the first num_seen (a copy of those alone)."""
        return self.token_ids[len(self.prompt_token_ids) + num_seen:]

    def output_tail(self, count: int) -> list[int]:
        """The last `count` generated ids known on the host (fewer while there are fewer)."""
        return self.token_ids[max(len(self.prompt_token_ids), len(self.token_ids) - count):]

    @property
    def is_finished(self) -> bool:
        """True once stopped, length-capped or aborted."""
        return self.status._finished

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values are known on the host."""
        return len(self.token_ids)

    @property
    def is_at_length_limit(self) -> bool:
        """True once max_tokens are generated (or launched): nothing more may be scheduled."""
        return self.num_output_tokens >= self.max_tokens

    def view(self, state: str) -> "SequenceView":
        """A frozen copy of what the stats show of this sequence: its outputs count a step in flight's
        sure token, not the drafts it verifies (those may be rejected)."""
        return SequenceView(self.request_id, self.index, self.params.n, state, self.num_prompt_tokens,
                            self.num_output_tokens - len(self.spec_token_ids), list(self.block_table),
                            self.num_computed_tokens, self.num_cached_tokens, self.structured_output is not None)


class SequenceView(NamedTuple):
    """One sequence as a stats snapshot sees it (no reference into the live sequence; a tuple,
    made for every sequence of each snapshot)."""

    request_id: str
    index: int
    n: int                           # completions in its request
    state: str                       # "running" | "waiting" | "preempted"
    num_prompt_tokens: int
    num_output_tokens: int
    block_table: list[int]
    num_computed_tokens: int
    num_cached_tokens: int
    is_structured: bool = False
