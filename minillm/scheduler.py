"""Scheduler: which sequences run in the next forward pass, and how many tokens each.

There is no prefill phase and no decode phase: each sequence has a counter
`num_computed_tokens` against `num_tokens`, and every step gives each chosen sequence
`num_new_tokens` under one token budget. Running sequences go first (decodes and unfinished
prompt chunks, in admission order), then waiting ones (FCFS) while the budget, max_num_seqs and
the block pool allow. When the pool runs dry the latest admitted sequence is preempted by
recompute: its blocks are freed and it goes back to the front of the waiting queue.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minillm.block_manager import BlockManager
from minillm.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """What to run this step: sequences in batch order with their token counts."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    num_prefill_tokens: int
    num_decode_tokens: int
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens in the forward pass."""
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        """True when nothing was scheduled."""
        return not self.seqs


@dataclass
class StepOutput:
    """What the model runner produced: one sampled token per sequence that reached its end."""

    sampled: dict[int, int]                       # seq_id -> token id
    logprobs: dict[int, dict[int, float]] = field(default_factory=dict)   # seq_id -> {id: lp}


class Scheduler:
    """Owns the waiting and running queues and the per-step token budget."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, eos_token_ids: list[int]):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back."""
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Choose this step's sequences and token counts under the budget."""
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.append_slots(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                seqs.append(seq)
                counts.append(n)
                budget -= n
                i += 1
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.block_manager.find_cached_blocks(seq)
            num_computed = len(cached) * self.block_manager.block_size
            n = min(seq.num_tokens - num_computed, budget)
            if not self.block_manager.allocate(seq, cached, n):
                break
            self.waiting.popleft()
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_computed
            seq.num_computed_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        num_decode = sum(1 for s, n in zip(seqs, counts) if n == 1 and s.num_tokens - s.num_computed_tokens == 1
                         and s.num_output_tokens > 0)
        return SchedulerOutput(seqs, counts, sum(counts) - num_decode, num_decode, preempted)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update(self, out: SchedulerOutput, step: StepOutput) -> list[Sequence]:
        """Advance counters, append sampled tokens, apply token stop rules; returns touched seqs."""
        touched = []
        for seq, n in zip(out.seqs, out.num_new_tokens):
            if seq.is_finished:          # aborted while the step ran
                continue
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
            token = step.sampled.get(seq.seq_id)
            if token is None:
                continue
            seq.append_token(token)
            touched.append(seq)
            self._check_token_stop(seq, token)
        return touched

    def _check_token_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens:
            if token in params.stop_token_ids:
                seq.stop_reason = token
                return self.finish(seq, SequenceStatus.FINISHED_STOPPED)
            if not params.ignore_eos and token in self.eos_token_ids:
                return self.finish(seq, SequenceStatus.FINISHED_STOPPED)
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            self.finish(seq, SequenceStatus.FINISHED_LENGTH)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End seq with a finished status and give its blocks back at once."""
        if seq.is_finished:
            return
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
