"""The data that crosses the step seam: SchedulerOutput down to the runner, StepOutput back up.

    out = scheduler.schedule()              # SchedulerOutput: which sequences, how many tokens
    in_flight = runner.launch(out)          # InFlightStep: queued on the device, nothing waits
    step = in_flight.wait()                 # StepOutput: the sampled tokens, read back
    scheduler.update_from_output(out, step) # append tokens, check_stop, free blocks
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minillm.sequence import Sequence


@dataclass
class SchedulerOutput:
    """What to run this step: sequences in batch order with their token counts."""

    seqs: list["Sequence"]
    num_new_tokens: list[int]        # query tokens of each sequence this step
    num_computed_tokens: list[int]   # each sequence's computed tokens before this step (its first position)
    sampling_rows: list[int]         # batch rows that sample a token (their known tokens all computed)
    num_prefill_tokens: int
    num_decode_tokens: int               # decode and draft-verification tokens
    preempted: list["Sequence"] = field(default_factory=list)
    # seq_id -> draft ids verified this step, for the sequences with drafts (empty: no speculation).
    # A sequence with d drafts runs [its last token] + drafts and may get up to d + 1 tokens back.
    scheduled_spec_decode_tokens: dict[int, list[int]] = field(default_factory=dict)
    kv_connector_metadata: object | None = None   # the KV connector's transfers for this step, when one is on
    # seq_id -> the first token the KV connector loads for it this step (sequences admitted with a load)
    loaded_from: dict[int, int] = field(default_factory=dict)
    estimated_step_s: float | None = None         # the step cost model's estimate (with max_step_ms only)
    step_limit_s: float | None = None             # the step-time limit its prompt chunks were sized under

    @property
    def num_tokens(self) -> int:
        """Tokens in the forward pass."""
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        """True when nothing was scheduled."""
        return not self.seqs

    @cached_property
    def sampling_seqs(self) -> list["Sequence"]:
        """The sequences that sample a token, in batch order (built once a step: the engine, the
        runner and the scheduler each walk it)."""
        return [self.seqs[b] for b in self.sampling_rows]

    @cached_property
    def structured_rows(self) -> list[tuple[int, "Sequence"]]:
        """(index into sampling_seqs, sequence) of the sampling sequences under a grammar, in batch
        order: what the structured-output glue walks each step instead of the whole batch."""
        return [(i, seq) for i, seq in enumerate(self.sampling_seqs) if seq.structured_output is not None]


@dataclass
class StepOutput:
    """What one launched step produced, read back to the host."""

    sampled: dict[int, list[int]]    # seq_id -> its new token ids (one, or accepted drafts + one)
    # seq_id -> one {token id: logprob} per new token, for the sequences that asked
    logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)             # phase -> seconds (this step)
    num_accepted_tokens: dict[int, int] = field(default_factory=dict)   # seq_id -> drafts accepted
    # seq_id -> (first prompt index, one {token id: logprob} per prompt token scored this step)
    prompt_logprobs: dict[int, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)
