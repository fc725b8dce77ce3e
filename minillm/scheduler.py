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
from minillm.sequence import PLACEHOLDER, Sequence, SequenceStatus


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

    def advance(self, out: SchedulerOutput) -> list[Sequence]:
        """The step is launched: count its tokens computed; each sequence at its end gets a
        placeholder token (filled by resolve()). Returns the sampling sequences in batch order."""
        sampling = []
        for seq, n in zip(out.seqs, out.num_new_tokens):
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
            if seq.num_computed_tokens != seq.num_tokens:
                continue                 # a prompt chunk: nothing to sample yet
            seq.token_ids.append(PLACEHOLDER)
            seq.num_pending += 1
            sampling.append(seq)
            if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
                # Known now, before the token's value: its blocks can go back at once.
                self.finish(seq, SequenceStatus.FINISHED_LENGTH, keep_pending=True)
        return sampling

    def resolve(self, seqs: list[Sequence], tokens: list[int]) -> list[Sequence]:
        """Fill each sequence's oldest placeholder with its sampled token, apply the token stop
        rules, cache newly full blocks; returns the sequences that got a token."""
        touched = []
        for seq, token in zip(seqs, tokens):
            if seq.num_pending == 0:     # aborted or stopped since the step was launched
                continue
            at = len(seq.token_ids) - seq.num_pending
            seq.token_ids[at] = token
            seq.num_pending -= 1
            seq.output_counts[token] = seq.output_counts.get(token, 0) + 1
            touched.append(seq)
            self._check_token_stop(seq, token, at + 1 - seq.num_prompt_tokens)
            if not seq.is_finished:
                self.block_manager.cache_full_blocks(seq)
        return touched

    def update(self, out: SchedulerOutput, step: StepOutput) -> list[Sequence]:
        """advance() and resolve() at once, for a step whose tokens are already known."""
        sampling = self.advance(out)
        return self.resolve(sampling, [step.sampled[s.seq_id] for s in sampling])

    def _check_token_stop(self, seq: Sequence, token: int, num_outputs: int) -> None:
        params = seq.params
        if num_outputs < params.min_tokens:
            return
        stop = token in params.stop_token_ids
        if stop or (not params.ignore_eos and token in self.eos_token_ids):
            seq.stop_reason = token if stop else None
            if seq.status is SequenceStatus.FINISHED_LENGTH:   # the last token was a stop token
                seq.status = SequenceStatus.FINISHED_STOPPED
            else:
                self.finish(seq, SequenceStatus.FINISHED_STOPPED)

    def finish(self, seq: Sequence, status: SequenceStatus, keep_pending: bool = False) -> None:
        """End seq with a finished status and give its blocks back at once.

        Placeholders of steps still in flight are dropped unless keep_pending (their tokens are
        then filled by resolve() as usual).
        """
        if seq.is_finished:
            return
        if seq.num_pending and not keep_pending:
            del seq.token_ids[-seq.num_pending:]
            seq.num_pending = 0
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
