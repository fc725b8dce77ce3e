"""Scheduler: which sequences run in the next forward pass, and how many tokens each.

There is no prefill phase and no decode phase: each sequence has a counter
`num_computed_tokens` against `num_tokens`, and every step gives each chosen sequence
`num_new_tokens` under one token budget. Running sequences go first (decodes and unfinished
prompt chunks, in admission order), then waiting ones (FCFS) while the budget, max_num_seqs and
the block pool allow. When the pool runs dry the latest admitted sequence is preempted by
recompute: its blocks are freed and it goes back to the front of the waiting queue.

With enable_chunked_prefill False (vLLM's --no-enable-chunked-prefill) a waiting sequence is
admitted only with all its tokens in one step: the first one that does not fit the budget left
ends admission for the step, as in vLLM.

With scheduling_policy "priority" (vLLM's; minillm/request_queue.py) the waiting queue is ordered
by (priority, arrival_time), lower first; the sequence preempted when the pool runs dry is the
running one with the largest (priority, arrival_time), its tokens taken back out of the step if it
was already scheduled; and a waiting sequence that max_num_seqs or the pool keeps out preempts
running ones of a strictly lower priority (a larger value) to get in.

The scheduler is the one writer of a sequence's status. schedule() counts the scheduled tokens as
computed at once and gives each sampling sequence an output placeholder (its token is on the
device until update_from_output() reads it), so the next step can be scheduled while this one
runs. Every stop rule goes through check_stop().

With speculative decoding configured, a decoding sequence whose tokens are all known may carry d
draft tokens (minillm/spec_decode/drafter.py): it is scheduled for 1 + d tokens and counts d + 1
placeholders; update_from_output() appends what was accepted and moves num_computed_tokens back
over the rejected drafts (their blocks stay with the sequence for its next tokens, and go back
with the rest when it finishes or is preempted). Drafts only take the budget and blocks left once
every running sequence has its token: nobody is preempted to make room for them. A constrained
sequence's drafts are cut before the first token its grammar refuses (vLLM's validate_tokens; the
matcher takes nothing), the constrained sequences of a step asked at once.

With a step-time budget (max_step_ms, and a StepCostModel from minillm/step_cost.py), a step
in which decode rows run sizes its prompt chunks so that the estimated step time stays within the
budget: each prefill row gets the largest chunk whose estimate fits (a bisection), and
the oldest prefill row at least one KV block of tokens whatever the estimate says, so a long
prompt always advances. A step with nothing decoding has only the token budget. With
max_step_factor the limit is that many times the estimated step of the batch's decode rows, the
prompts still to join the batch counted as the rows they become. Under either budget a step with
decode rows holds no more tokens than the runner's largest whole mixed graph (max_mixed_tokens),
where the cost model's estimates hold. Drafts take what both budgets leave once every running
sequence has its tokens.
"""
from __future__ import annotations

import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter, itemgetter

import numpy as np

from minillm.allowed_tokens import masked_out_error
from minillm.block_manager import BlockManager
from minillm.repetition import STOP_REASON as REPETITION_STOP_REASON, ends_in_repetition
from minillm.request_queue import PriorityWaitingQueue, lowest_priority_index
from minillm.sequence import Sequence, SequenceStatus, SequenceView
from minillm.step import SchedulerOutput, StepOutput
from minillm.step_cost import TOKENS, StepCostModel, StepCostSnapshot, StepTimeBudget, is_decode_row, step_features

__all__ = ["Scheduler", "SchedulerOutput", "SchedulerSnapshot", "StepOutput", "check_stop"]


@dataclass(frozen=True)
class SchedulerSnapshot:
    """The queues as the stats see them (copies, in queue order)."""

    running: list[SequenceView]      # [] in a summary (Scheduler.snapshot with views=False)
    waiting: list[SequenceView]
    num_running: int
    num_waiting: int
    num_preempted_waiting: int       # waiting sequences that were preempted and will resume
    num_preemptions: int             # total so far
    max_step_ms: float | None = None           # the step-time budget (None: the token budget only)
    step_cost: StepCostSnapshot | None = None  # the step cost model, with a step-time budget
    max_step_factor: float | None = None       # the budget relative to the decode rows' step (None: off)


def check_stop(seq: Sequence, eos_token_ids: set[int],
               stop_string: str | None = None) -> tuple[SequenceStatus, int | str | None] | None:
    """(finish status, stop reason) that seq's newest known token (or a stop string its text
    completed) gives it, or None while it goes on. The one place every stop rule lives."""
    if stop_string is not None:
        return SequenceStatus.FINISHED_STOPPED, stop_string
    params, token_ids, grammar = seq.params, seq.token_ids, seq.structured_output
    num_outputs = len(token_ids) - len(seq.prompt_token_ids)
    if num_outputs >= params.min_tokens and num_outputs > 0:
        token = token_ids[-1]
        if params.stop_token_ids and token in params.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED, token
        if not params.ignore_eos and token in eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED, None
    if grammar is not None and grammar.is_complete:
        return SequenceStatus.FINISHED_STOPPED, None   # the grammar allows only EOS: done, whatever min_tokens says
    if num_outputs >= seq.max_tokens:
        return SequenceStatus.FINISHED_LENGTH, None
    if params.repetition_detection is not None and num_outputs >= params.min_tokens \
            and ends_in_repetition(seq.token_ids, num_outputs, params.repetition_detection):
        return SequenceStatus.FINISHED_REPETITION, REPETITION_STOP_REASON
    return None


def _settled_first(out: SchedulerOutput) -> list[Sequence]:
    """out's sampling sequences with the constrained ones whose grammar process has not answered
    yet moved last (each part in batch order), so the update reads the others while those answers come."""
    seqs = out.sampling_seqs
    waiting = [b for b, seq in out.structured_rows if not seq.structured_output.is_settled]
    if not waiting:
        return seqs
    settled, start = [], 0
    for b in waiting:                     # the runs of rows between them, copied whole
        settled += seqs[start:b]
        start = b + 1
    settled += seqs[start:]
    return settled + [seqs[b] for b in waiting]


# What the update reads of every row (C-level getters: no Python frame a row).
_seq_id, _token_ids, _spec_token_ids = attrgetter("seq_id"), attrgetter("token_ids"), attrgetter("spec_token_ids")
_stop_check_from, _first = attrgetter("stop_check_from"), itemgetter(0)


def _may_draft(seq: Sequence, num_new_tokens: int) -> bool:
    """Whether a scheduled sequence may take drafts: it decodes one token and all its tokens are known
    (the n-gram search reads them; a constrained one's matcher has taken them)."""
    return (num_new_tokens == 1 and seq.num_computed_tokens + 1 == seq.num_tokens
            and not seq.num_output_placeholders and seq.num_output_tokens > 0)


def _unschedule(seq: Sequence, seqs: list[Sequence], counts: list[int], spec: dict[int, list[int]]) -> int:
    """Take seq out of the step being built (its row, its drafts); returns the tokens it had, 0 if
    it was not in it. Under a step-time budget its row stays counted in the step's estimate: the
    prompt chunks sized after it are only the smaller for it."""
    for b, scheduled in enumerate(seqs):
        if scheduled is seq:
            del seqs[b]
            spec.pop(seq.seq_id, None)
            return counts.pop(b)
    return 0


class WaitingQueue:
    """The waiting sequences in FCFS order, with a deque's methods where the scheduler uses them,
    and removal from anywhere in O(1): a burst of aborts (clients gone) among thousands of waiting
    requests cost a scan of the queue each with a deque."""

    def __init__(self) -> None:
        self._seqs: OrderedDict[Sequence, None] = OrderedDict()

    def append(self, seq: Sequence) -> None:
        """Queue seq at the back."""
        self._seqs[seq] = None

    def appendleft(self, seq: Sequence) -> None:
        """Queue seq at the front."""
        self._seqs[seq] = None
        self._seqs.move_to_end(seq, last=False)

    def extendleft(self, seqs) -> None:
        """appendleft each of seqs in turn (so the last ends up first, as with a deque)."""
        for seq in seqs:
            self.appendleft(seq)

    def popleft(self) -> Sequence:
        """Take the front sequence."""
        return self._seqs.popitem(last=False)[0]

    def remove(self, seq: Sequence) -> None:
        """Take seq out, wherever it is."""
        del self._seqs[seq]

    def __getitem__(self, index: int) -> Sequence:
        if index != 0:
            raise IndexError("only the front of the waiting queue can be read")
        return next(iter(self._seqs))

    def __contains__(self, seq: object) -> bool:
        return seq in self._seqs

    def __iter__(self):
        return iter(self._seqs)

    def __len__(self) -> int:
        return len(self._seqs)


class Scheduler:
    """Owns the waiting and running queues, the per-step token budget and the step-time budget."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, eos_token_ids: list[int],
                 kv_connector=None, speculative_config=None, step_cost: StepCostModel | None = None,
                 max_step_ms: float | None = None, max_step_factor: float | None = None,
                 max_mixed_tokens: int | None = None, scheduling_policy: str = "fcfs",
                 enable_chunked_prefill: bool = True):
        if (max_step_ms is not None or max_step_factor is not None) and step_cost is None:
            raise ValueError("max_step_ms and max_step_factor need a step cost model")
        self.block_manager = block_manager
        self.kv_connector = kv_connector     # scheduler side of a KV connector, or None
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill   # False: a prompt runs whole in one step
        self.eos_token_ids = set(eos_token_ids)
        # EOS and every stop_token_ids added, as a table by token id whose last entry is never one (a
        # larger id is looked up there): a decode step's token outside them (and short of its
        # sequence's max_tokens) stops nothing, which the update decides for the whole batch at once.
        self._is_stop_id = np.zeros(1, bool)
        self._mark_stop_ids(self.eos_token_ids)
        self.by_priority = scheduling_policy == "priority"
        if self.by_priority:
            self.waiting = PriorityWaitingQueue()
        elif scheduling_policy == "fcfs":
            self.waiting = WaitingQueue()
        else:
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {scheduling_policy!r}")
        self.running: list[Sequence] = []
        # The sequences the last schedule() took off the waiting queue, in that order (the engine
        # looks among these alone for requests scheduled the first time).
        self.admitted: list[Sequence] = []
        # The sequences added whose sampling reads their earlier output tokens (params.needs_output_tokens,
        # fixed for a sequence's life), each dropped when it finishes: needs_output_tokens walks these
        # each step, not every running sequence.
        self._output_readers: list[Sequence] = []
        self.num_preemptions = 0
        # Sequences update_from_output finished without appending a token: the row sampled for them
        # had every logit -inf (masked_out_error), or their grammar refused the token. The engine
        # reports them and empties the list.
        self.masked_out: list[Sequence] = []
        self.step_cost = step_cost           # estimates step times (with max_step_ms), or None
        self.max_step_ms = max_step_ms
        self.max_step_factor = max_step_factor
        # Under a step budget, the most tokens a step with decode rows may hold: the largest mixed
        # step the runner replays as one captured graph (None: no such bound). Past it a step runs
        # piecewise, at a fixed cost the cost model, fitted mostly on whole-graph steps, does not see.
        self.max_mixed_tokens = max_mixed_tokens
        # Features of launched steps until their device time comes back (a few at most: one step
        # is in flight; a step that failed to launch drops off the end).
        self._launched_features: deque[tuple[SchedulerOutput, object]] = deque(maxlen=8)
        self.drafter = None              # proposes draft tokens (only with speculative decoding)
        if speculative_config is not None:
            from minillm.spec_decode.drafter import Drafter
            self.drafter = Drafter(speculative_config, max_model_len)

    # ---- questions -------------------------------------------------------------------------
    @property
    def has_step_budget(self) -> bool:
        """True when prompt chunks are sized by a step-time budget (max_step_ms or max_step_factor)."""
        return self.max_step_ms is not None or self.max_step_factor is not None

    def has_unfinished(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        """Sequences holding blocks and being computed."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Sequences queued for admission (new or preempted)."""
        return len(self.waiting)

    def needs_output_tokens(self) -> bool:
        """True when the step in flight must be read back before the next is scheduled: a running
        sequence samples from its earlier tokens (penalties' counts, a bad word's first tokens) and
        one of those tokens is still on the device, or speculation needs a sequence's tokens (see
        Drafter)."""
        if any(s.num_output_placeholders and s.status is SequenceStatus.RUNNING for s in self._output_readers):
            return True
        return self.drafter is not None and self.drafter.needs_output_tokens(self.running)

    def snapshot(self, max_waiting_rows: int, views: bool = True) -> SchedulerSnapshot:
        """Copies of the queues for stats (at most max_waiting_rows waiting rows); without views,
        the counts alone."""
        running = [s.view("running") for s in self.running] if views else []
        waiting = [s.view("preempted" if s.num_preemptions else "waiting")
                   for s, _ in zip(self.waiting, range(max_waiting_rows if views else 0))]
        return SchedulerSnapshot(running, waiting, num_running=len(self.running), num_waiting=len(self.waiting),
                                 num_preempted_waiting=sum(1 for s in self.waiting if s.num_preemptions),
                                 num_preemptions=self.num_preemptions, max_step_ms=self.max_step_ms,
                                 step_cost=self.step_cost.snapshot() if self.step_cost else None,
                                 max_step_factor=self.max_step_factor)

    # ---- the step --------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back."""
        self.waiting.append(seq)
        params = seq.params
        if params.needs_output_tokens:
            self._output_readers.append(seq)
        if params.stop_token_ids:
            self._mark_stop_ids(params.stop_token_ids)
        per_token = params._masked_row_check is not None or seq.counts_outputs or params.repetition_detection is not None
        seq.stop_check_from = 0 if per_token else len(seq.prompt_token_ids) + seq.max_tokens

    def _mark_stop_ids(self, ids) -> None:
        """Set ids (token ids the engine checked against the vocabulary) in the stop-id table, growing it
        so that its last entry stays none."""
        ids = list(ids)
        if not ids:
            return
        top = max(ids)
        if top + 1 >= len(self._is_stop_id):
            grown = np.zeros(top + 2, bool)
            grown[:len(self._is_stop_id)] = self._is_stop_id
            self._is_stop_id = grown
        self._is_stop_id[ids] = True

    def schedule(self) -> SchedulerOutput:
        """Choose this step's sequences and token counts under the budget, and count them launched."""
        if self.kv_connector is not None:
            self.kv_connector.process_pending()     # blocks it gave back since the last step are free now
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        preempted: list[Sequence] = []
        spec: dict[int, list[int]] = {}
        chunks = _PrefillChunks(self, spec) if self.has_step_budget else None
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            # At its length limit its last token is on the device: nothing left to compute. With
            # drafts in flight its length is unknown until they are read back. (Sequence's
            # properties spelled out: this loop runs for every running sequence every step.)
            num_tokens = len(seq.token_ids) + seq.num_output_placeholders
            if num_tokens - len(seq.prompt_token_ids) >= seq.max_tokens or seq.spec_token_ids:
                i += 1
                continue
            remaining = num_tokens - seq.num_computed_tokens
            n = remaining if remaining < budget else budget
            if chunks is not None and not is_decode_row(remaining, seq.num_computed_tokens, len(seq.prompt_token_ids)):
                n = chunks.size(seq.num_computed_tokens, n)
                if n == 0:                   # over the step budget this step: it waits for the next
                    i += 1
                    continue
            while not self.block_manager.append_slots(seq, n):
                if self.by_priority:
                    k = lowest_priority_index(self.running)
                    victim = self.running.pop(k)
                    if k < i:                # visited this step: its tokens, if scheduled, come back out
                        i -= 1
                        budget += _unschedule(victim, seqs, counts, spec)
                else:
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
        if self.drafter is not None:
            budget = self._add_drafts(seqs, counts, budget, spec, bool(preempted), chunks)
        skipped: list[Sequence] = []
        admitted: list[Sequence] = []
        loaded_from: dict[int, int] = {}
        is_short = bool(preempted)           # the running sequences alone outgrew the pool: admit none
        by_priority = self.by_priority
        while self.waiting and budget > 0 and not is_short and (by_priority or len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            if seq.num_output_placeholders:   # preempted with a token in flight: wait for it
                break
            if seq.structured_output is not None and not seq.structured_output.is_ready:
                skipped.append(self.waiting.popleft())   # its grammar still compiles: let the next by
                continue
            if by_priority and len(self.running) >= self.max_num_seqs:
                refund = self._preempt_for(seq, seqs, counts, spec, preempted)
                if refund is None:
                    break
                budget += refund
            # Prompt log-probabilities need every prompt token's logits: no cached or loaded prefix.
            scores_prompt = seq.params.prompt_logprobs is not None
            cached = self.block_manager.find_cached_blocks(seq) if not scores_prompt else []
            num_computed = len(cached) * self.block_manager.block_size
            num_external = self.kv_connector.get_num_new_matched_tokens(seq, num_computed) \
                if self.kv_connector and not scores_prompt else 0
            n = seq.num_tokens - num_computed - num_external
            if n > budget and not self.enable_chunked_prefill:
                break                        # vLLM's: it waits for a step with room for all of it
            n = min(n, budget)
            if chunks is not None:
                start = num_computed + num_external
                if is_decode_row(n, start, seq.num_prompt_tokens):    # resumed, cached to its last token
                    if not chunks.admit_decode_row(start):
                        break
                else:
                    n = chunks.size(start, n)
                    if n == 0:
                        break
            is_allocated = self.block_manager.allocate(seq, cached, num_external + n, not scores_prompt)
            while not is_allocated and by_priority:
                refund = self._preempt_for(seq, seqs, counts, spec, preempted)
                if refund is None:
                    break
                budget += refund
                is_allocated = self.block_manager.allocate(seq, cached, num_external + n, not scores_prompt)
            if not is_allocated:
                break
            if num_external:                 # loaded before the step's forward: computed, and shared at once
                self.kv_connector.update_state_after_alloc(seq, num_external)
                loaded_from[seq.seq_id] = num_computed
                num_computed += num_external
                seq.num_computed_tokens = num_computed
                self.block_manager.cache_full_blocks(seq)
            self.waiting.popleft()
            if seq.num_preemptions == 0:
                seq.num_cached_tokens, seq.num_external_tokens = num_computed, num_external
            seq.num_computed_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            # The blocks this step fills are shared from now on: a later admission in the same step
            # (a sibling of an n > 1 request, the same prompt twice) reads them in this forward
            # pass, whose layers append every row's K/V before any row attends. Nothing after this
            # in schedule() frees blocks, so none is left cached without its K/V.
            self.block_manager.cache_full_blocks(seq, num_computed + n)
            self.running.append(seq)
            admitted.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        self.admitted = admitted
        out = self._launch(seqs, counts, preempted, spec)
        out.loaded_from = loaded_from
        if chunks is not None:
            out.step_limit_s = chunks.limit_s()
        return out

    def _add_drafts(self, seqs: list[Sequence], counts: list[int], budget: int,
                    spec: dict[int, list[int]], preempted: bool, chunks: "_PrefillChunks | None") -> int:
        """Give decoding sequences whose tokens are all known their drafts, within the budget and
        the free blocks left (where the pool is short, only what fits its own blocks; none in a
        step that preempts); returns the budget left."""
        num_tried = 0
        enabled = not preempted and self.drafter.is_enabled(len(self.running))
        valid: dict[int, int] | None = None      # seq_id -> drafts its grammar takes (constrained ones)
        for b, seq in enumerate(seqs if enabled else ()):
            if budget <= 0:
                break
            if not _may_draft(seq, counts[b]):
                continue
            num_tried += 1
            drafts = self.drafter.propose(seq, budget)
            if drafts and seq.structured_output is not None:
                if valid is None:
                    valid = self._valid_draft_lengths(seqs[b:], counts[b:])
                drafts = drafts[:valid.get(seq.seq_id, 0)]
            if drafts and chunks is not None:
                drafts = drafts[:chunks.max_drafts(seq, len(drafts))]
            if drafts and not self.block_manager.append_slots(seq, 1 + len(drafts)):
                # The pool is short: keep the drafts that fit the blocks seq already holds.
                room = len(seq.block_table) * self.block_manager.block_size - seq.num_computed_tokens - 1
                drafts = drafts[:max(room, 0)]
            if drafts:
                spec[seq.seq_id] = drafts
                counts[b] += len(drafts)
                budget -= len(drafts)
                if chunks is not None:
                    chunks.note_drafts(seq, len(drafts))
        self.drafter.end_round(num_tried, len(spec))
        return budget

    def _valid_draft_lengths(self, seqs: list[Sequence], counts: list[int]) -> dict[int, int]:
        """seq_id -> how many of its drafts a constrained sequence's grammar takes, for those of seqs
        that may draft, asked at once (a grammar process answers in one round trip). A proposal under
        a smaller budget is a prefix of the one asked about here, so the count holds for it too."""
        from minillm.structured_output import validate_drafts
        proposals = [(seq, self.drafter.propose(seq, self.drafter.k)) for seq, n in zip(seqs, counts)
                     if seq.structured_output is not None and _may_draft(seq, n)]
        constrained = [(seq, drafts) for seq, drafts in proposals if drafts]
        valid = validate_drafts([seq.structured_output for seq, _ in constrained], [d for _, d in constrained])
        return {seq.seq_id: len(v) for (seq, _), v in zip(constrained, valid)}

    def _launch(self, seqs: list[Sequence], counts: list[int], preempted: list[Sequence],
                spec: dict[int, list[int]]) -> SchedulerOutput:
        """Count the scheduled tokens computed; each sequence at its end gets an output placeholder
        (d + 1 for one verifying d drafts: the most tokens the step can give it). One-token
        sequences go first, in their order (AttentionMetadata.num_decode_seqs)."""
        if 1 in counts and any(n != 1 for n in counts):
            order = sorted(range(len(seqs)), key=lambda b: counts[b] != 1)
            seqs, counts = [seqs[b] for b in order], [counts[b] for b in order]
        starts = [s.num_computed_tokens for s in seqs]
        rows, num_decode = [], 0
        cache_full_blocks, block_size = self.block_manager.cache_full_blocks, self.block_manager.block_size
        for b, (seq, n) in enumerate(zip(seqs, counts)):
            drafts = spec.get(seq.seq_id) if spec else None
            num_drafts = len(drafts) if drafts else 0
            num_tokens = len(seq.token_ids) + seq.num_output_placeholders     # Sequence.num_tokens, spelled out
            seq.num_computed_tokens += n
            if seq.num_computed_tokens >= (len(seq.block_hashes) + 1) * block_size:   # a block may have filled
                cache_full_blocks(seq)
            if seq.num_computed_tokens - num_drafts == num_tokens:          # at its end: it samples
                rows.append(b)
                if n - num_drafts == 1 and num_tokens > len(seq.prompt_token_ids):
                    num_decode += n
                seq.num_output_placeholders += 1 + num_drafts
            if drafts:
                seq.spec_token_ids = drafts
        out = SchedulerOutput(seqs, counts, starts, rows, sum(counts) - num_decode, num_decode, preempted,
                              scheduled_spec_decode_tokens=spec)
        if self.step_cost is not None and seqs:
            features = step_features(out)
            out.estimated_step_s = self.step_cost.estimate(features)
            self._launched_features.append((out, features))
        if self.kv_connector is not None:
            out.kv_connector_metadata = self.kv_connector.build_connector_meta(out)
        return out

    def record_step_time(self, out: SchedulerOutput, seconds: float) -> None:
        """A completed step's measured device time, for the step cost model's online correction."""
        for k, (launched, features) in enumerate(self._launched_features):
            if launched is out:
                del self._launched_features[k]
                self.step_cost.observe(features, seconds, out.estimated_step_s)
                return

    def forget_step_blocks(self, out: SchedulerOutput) -> None:
        """out failed before its K/V were surely written: the blocks it was to fill or load into,
        registered in the prefix cache when it was scheduled, must not serve later prompts."""
        if self.kv_connector is not None:
            self.kv_connector.step_failed(out)
        for seq, start in zip(out.seqs, out.num_computed_tokens):
            start = out.loaded_from.get(seq.seq_id, start)     # a load's blocks were registered at admission
            self.block_manager.uncache_blocks(seq, start // self.block_manager.block_size)

    def _preempt_for(self, seq: Sequence, seqs: list[Sequence], counts: list[int], spec: dict[int, list[int]],
                     preempted: list[Sequence]) -> int | None:
        """Priority policy: preempt the running sequence of the largest (priority, arrival_time) so that
        the waiting seq gets in, if seq's priority is strictly higher (a lower value: equal ones never
        displace each other); None when none may go, else the tokens it had been scheduled this step,
        which go back to the budget. Nothing it was scheduled this step was registered in the prefix
        cache yet: a sequence admitted this step came before seq in the queue and is never the victim."""
        if not self.running:
            return None
        k = lowest_priority_index(self.running)
        victim = self.running[k]
        if not seq.priority < victim.priority:
            return None
        del self.running[k]
        refund = _unschedule(victim, seqs, counts, spec)
        self._preempt(victim)
        preempted.append(victim)
        return refund

    def preempt_running(self) -> None:
        """Preempt every running sequence, the latest admitted first, so that they wait at the front of
        the queue in admission order (vLLM's reset_prefix_cache with reset_running_requests)."""
        while self.running:
            self._preempt(self.running.pop())

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update_from_output(self, out: SchedulerOutput, step: StepOutput,
                           on_token: Callable[[Sequence, int], str | None] | None = None,
                           answers_pending: bool = False) -> list[tuple[Sequence, int]]:
        """Read a finished step's tokens into its sequences: placeholders become tokens, appended
        one at a time through the stop rules (a sequence's later tokens are dropped once it stops),
        rejected drafts are forgotten, newly full blocks are cached. on_token(seq, i) is called
        after seq's i-th new token of the step is appended and may return a stop string it
        completed. A token the sequence's own bans forbid (masked_out_error: its row had every
        logit -inf), or that its grammar refuses, is not appended: the sequence ends there with an
        error and joins masked_out.
        Returns (sequence, token) in batch order for the tokens appended (sequences
        finished since the launch get none), except that, with answers_pending (the grammar
        process has not answered for some constrained tokens yet), a constrained sequence whose
        matcher's answer is out is read after the others."""
        if self.kv_connector is not None:
            self.kv_connector.update_connector_output(out)
        appended = []
        if not out.scheduled_spec_decode_tokens and not any(map(_spec_token_ids, out.sampling_seqs)) \
                and self._update_one_token_rows(out, step, on_token, answers_pending, appended):
            return appended
        sampled = step.sampled
        seqs = _settled_first(out) if answers_pending else out.sampling_seqs
        for seq in seqs:
            if seq.num_output_placeholders:     # else finished (aborted, stopped) since the launch
                self._append_tokens(seq, sampled[seq.seq_id], on_token, appended)
        return appended

    def _update_one_token_rows(self, out: SchedulerOutput, step: StepOutput,
                               on_token: Callable[[Sequence, int], str | None] | None, answers_pending: bool,
                               appended: list[tuple[Sequence, int]]) -> bool:
        """update_from_output of a step without drafts (each row one token). Which rows' tokens may stop
        them is decided for the batch at once: a token in none of the stop ids (EOS, stop_token_ids),
        short of its sequence's max_tokens (Sequence.stop_check_from), of a sequence with no per-token
        rule, and, under a grammar, taken on the grammar process's clean answer (settled for all such
        rows in one call), stops nothing; the other rows go through _append_tokens and check_stop. False
        (nothing read) when a row has no token: rows finished since the launch (a failed step's) are read
        one by one."""
        seqs = out.sampling_seqs
        n = len(seqs)
        try:
            tokens = list(map(_first, map(step.sampled.__getitem__, map(_seq_id, seqs))))
        except (KeyError, IndexError):
            return False
        lengths = np.fromiter(map(len, map(_token_ids, seqs)), np.int64, n)        # [n] before the token
        goes_on = lengths < np.fromiter(map(_stop_check_from, seqs), np.int64, n) - 1
        table = self._is_stop_id
        goes_on &= ~table[np.minimum(np.array(tokens, np.int64), len(table) - 1)]
        plain = goes_on.tolist()      # [n] rows whose token stops nothing (a stop string aside)
        structured = out.structured_rows
        waiting = [b for b, seq in structured if not seq.structured_output.is_settled] if answers_pending else []
        if not waiting:
            self._settle_rows([b for b, _ in structured], seqs, tokens, plain)
            self._read_rows(zip(seqs, tokens, plain), appended, on_token)
            return True
        # The rows whose answers are in first (in batch order), then the waiting ones: their answer (one
        # for the step's advance) is read once, and its clean rows settle in one call.
        late = set(waiting)
        self._settle_rows([b for b, _ in structured if b not in late], seqs, tokens, plain)
        self._read_rows([(seqs[b], tokens[b], plain[b]) for b in range(n) if b not in late], appended, on_token)
        self._settle_rows(waiting, seqs, tokens, plain, wait=True)
        self._read_rows([(seqs[b], tokens[b], plain[b]) for b in waiting], appended, on_token)
        return True

    @staticmethod
    def _settle_rows(rows: list[int], seqs, tokens: list[int], plain: list[bool], wait: bool = False) -> None:
        """Settle the constrained rows among `rows` whose token stops nothing on a clean answer of the
        grammar process (wait: read an answer still on its way first); the rest are marked for the
        per-row path (plain False: accept_token and check_stop read their matcher's answer)."""
        rows = [b for b in rows if plain[b] and seqs[b].num_output_placeholders]
        if not rows:
            return
        from minillm.structured_output import StructuredOutputRequest   # (llguidance: only when constrained)
        settled = StructuredOutputRequest.settle_clean([seqs[b].structured_output for b in rows],
                                                       [tokens[b] for b in rows], wait=wait)
        for b in rows:
            if seqs[b].structured_output not in settled:
                plain[b] = False

    def _read_rows(self, rows, appended: list[tuple[Sequence, int]],
                   on_token: Callable[[Sequence, int], str | None] | None) -> None:
        """Read (seq, token, goes on) rows into their sequences: a row that goes on appends its token
        with no stop rule; the others go through _append_tokens."""
        append, block_size, block_manager = appended.append, self.block_manager.block_size, self.block_manager
        for seq, token, goes in rows:
            if seq.num_output_placeholders == 0:    # finished (aborted, stopped) since the launch
                continue
            if not goes:
                self._append_tokens(seq, (token,), on_token, appended)
                continue
            seq.num_output_placeholders -= 1
            seq.token_ids.append(token)
            append((seq, token))
            if on_token is not None and (stop_string := on_token(seq, 0)) is not None:
                self.stop(seq, stop_string)
            elif seq.num_computed_tokens >= (len(seq.block_hashes) + 1) * block_size:   # a block may have filled
                block_manager.cache_full_blocks(seq)

    def _append_tokens(self, seq: Sequence, tokens, on_token: Callable[[Sequence, int], str | None] | None,
                       appended: list[tuple[Sequence, int]]) -> None:
        """Read a row's new tokens (one, or accepted drafts + one) into seq, each through the stop rules."""
        num_drafts = len(seq.spec_token_ids)
        seq.num_output_placeholders -= 1 + num_drafts
        if num_drafts:
            seq.spec_token_ids = []
            if seq.status is SequenceStatus.RUNNING:
                # The rejected drafts' K/V stay in their slots until later tokens overwrite them;
                # their blocks stay with the sequence for those tokens.
                seq.num_computed_tokens -= num_drafts + 1 - len(tokens)
        params, grammar, token_ids = seq.params, seq.structured_output, seq.token_ids
        for i, token in enumerate(tokens):
            # A token the sequence's own bans forbid (a row of -inf) or its grammar refuses (no token
            # the grammar allows was left, or the grammar process failed) is no sample: the output
            # stops before it.
            error = masked_out_error(params, seq.output_token_ids, token) \
                if params._masked_row_check is not None else None
            if error is None and grammar is not None and not grammar.accept_token(token):
                error = grammar.rejection(token)
            if error is not None:
                self.finish(seq, SequenceStatus.FINISHED_ERROR, error)
                self.masked_out.append(seq)
                return
            token_ids.append(token)
            if seq.counts_outputs:
                seq.output_counts[token] = seq.output_counts.get(token, 0) + 1
            appended.append((seq, token))
            if (stop := check_stop(seq, self.eos_token_ids)) is not None:
                self.finish(seq, *stop)
            if on_token is not None and (stop_string := on_token(seq, i)) is not None:
                self.stop(seq, stop_string)
            if seq.status._finished:
                return
        block_manager = self.block_manager
        if seq.num_computed_tokens >= (len(seq.block_hashes) + 1) * block_manager.block_size:   # a block may have filled
            block_manager.cache_full_blocks(seq)

    def stop(self, seq: Sequence, stop_string: str) -> None:
        """The output processor found a stop string in seq's text: finish it with that reason.

        A sequence that the same token already finished (by length, a stop token, a repetition or a
        grammar it completed) reports the stop string instead, as vLLM's output processor does."""
        status, reason = check_stop(seq, self.eos_token_ids, stop_string)
        if seq.status in (SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_STOPPED,
                          SequenceStatus.FINISHED_REPETITION):
            seq.status, seq.stop_reason = status, reason
        else:
            self.finish(seq, status, reason)

    def finish(self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None = None) -> None:
        """End seq with a finished status and give its blocks back at once; tokens still on the
        device for it are dropped when they arrive."""
        if seq.is_finished:
            return
        seq.num_output_placeholders = 0
        seq.spec_token_ids = []
        seq.status, seq.stop_reason = status, stop_reason
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
        if seq.params.needs_output_tokens and seq in self._output_readers:
            self._output_readers.remove(seq)
        if self.kv_connector is not None:
            self.kv_connector.request_finished(seq)   # may keep its blocks (a KV transfer's lease)
        self.block_manager.free(seq)


class _PrefillChunks:
    """Sizes one step's prefill rows under the step-time budget while decode rows run in it.

    Built on the first prefill row of the step (a step of decodes alone never pays for it): the
    step's decode rows are counted then, every running sequence one token past its prompt,
    wherever it sits in the queue (drafts already chosen count as the rows they have become).
    The first prefill row sized (the oldest: running sequences are in admission order, then the
    head of the waiting queue) gets at least min_tokens, one KV block, so it cannot starve."""

    def __init__(self, scheduler: Scheduler, spec: dict[int, list[int]]):
        self.scheduler, self.spec = scheduler, spec
        self.min_tokens = scheduler.block_manager.block_size
        self.budget: StepTimeBudget | None = None
        self.is_built = self.is_capping = self.has_progress = False

    def _build(self) -> None:
        self.is_built = True
        sched = self.scheduler
        budget = sched.step_cost.budget(sched.max_step_ms / 1e3 if sched.max_step_ms is not None else math.inf)
        # The decode rows' sums, as add_row would make them one row at a time (plain Python: every
        # running sequence is visited on each step that sizes a prompt chunk), and the rows the
        # running sequences still in their prompt will decode as (for a relative budget).
        tokens = attention = kv_read = 0
        joining = joining_kv_read = 0
        mixed, spec = False, self.spec
        for seq in sched.running:
            start = seq.num_computed_tokens
            if seq.spec_token_ids:
                continue
            if not is_decode_row(seq.num_tokens - start, start, seq.num_prompt_tokens):
                joining += 1
                joining_kv_read += seq.num_tokens + 1
                continue
            n = 1 + (len(spec.get(seq.seq_id, ())) if spec else 0)
            tokens += n
            kv_read += start + n
            if n > 1:                    # a row verifying drafts: the prefill path
                mixed = True
                attention += n * (start + n)
        if tokens:
            budget.add_sums(tokens, attention, kv_read, mixed)
            self.is_capping = True
        if sched.max_step_factor is not None and self.is_capping:
            for seq in itertools.islice(sched.waiting, max(0, sched.max_num_seqs - len(sched.running))):
                joining += 1
                joining_kv_read += seq.num_tokens + 1
            budget.limit_to(sched.max_step_factor * _batch_decode_estimate(budget, joining, joining_kv_read))
        self.budget = budget

    def size(self, start: int, n: int) -> int:
        """Tokens a prefill row of up to n tokens after `start` computed ones gets this step."""
        if not self.is_built:
            self._build()
        if not self.is_capping:          # nothing decodes: the token budget alone
            return n
        cap = self.scheduler.max_mixed_tokens
        room = n if cap is None else min(n, max(0, cap - int(self.budget.features[TOKENS])))
        q = self.budget.max_prefill_tokens(start, room) if room else 0
        if not self.has_progress:        # the floor holds past the cap too: a prompt always advances
            q = max(q, min(n, self.min_tokens))
        if q:
            self.has_progress = True
            self.budget.add(q, start, is_decode=False)
        return q

    def limit_s(self) -> float | None:
        """The step-time limit the step's prompt chunks were sized under (None: no chunk was sized
        against decode rows, or no limit applied)."""
        if not self.is_capping or not math.isfinite(self.budget.limit_s):
            return None
        return self.budget.limit_s

    def admit_decode_row(self, start: int) -> bool:
        """Count a sequence that joins from the waiting queue as a decode row (preempted, its
        prefix cached up to its last token); False when it must wait for the next step: this one
        was sized with nothing decoding and already holds prompt chunks the token budget alone
        sized. Not built yet: it is running when the step is built, and counted there."""
        if not self.is_built:
            return True
        if not self.is_capping:
            return False
        self.budget.add(1, start, is_decode=True)
        return True

    def max_drafts(self, seq: Sequence, n: int) -> int:
        """How many of n drafts the decode row of seq may verify within the step budget."""
        if not self.is_built:
            self._build()
        if not self.is_capping:
            return n
        return self.budget.max_drafts(seq.num_computed_tokens, n)

    def note_drafts(self, seq: Sequence, num_drafts: int) -> None:
        """A decode row now verifies num_drafts drafts as well (counted here once built)."""
        if self.budget is not None:
            self.budget.add_drafts(seq.num_computed_tokens, num_drafts)


def _batch_decode_estimate(decodes: StepTimeBudget, joining: int, joining_kv_read: int) -> float:
    """The estimated step of the batch's decode rows once the sequences still in their prompt join
    them (joining rows reading joining_kv_read tokens of context in all: the running ones and the
    waiting ones up to max_num_seqs, each at its prompt's length). The relative budget is a
    multiple of it, so a few early decoders do not hold a queue of prompts to the chunk their own
    small step leaves room for (the mixed step's fixed cost alone is more than that room); with no
    prompt waiting it is the step of the decode rows alone."""
    if not joining:
        return decodes.estimate()
    batch = StepTimeBudget(decodes.model, math.inf)
    batch.features = decodes.features.copy()
    batch.add_sums(joining, 0, joining_kv_read, False)
    return batch.estimate()
