"""The API server's side of the outputs: the core's token ids -> text, stop strings, RequestOutputs.

Each sequence has a mirror here holding what minillm.output_processor reads of an engine Sequence
(its tokens, status and stop reason), so the same detokenizer and stop-string code runs as in the
in-process engine. When a stop string ends a sequence, the tokens after it are dropped here and a
stop goes down to the core, which frees the sequence's blocks; a token or two may still arrive
for it meanwhile and are ignored.

Each request's outputs are of the kind its params ask (RequestOutputKind), made here as the
in-process engine makes them: the core reports every step's new tokens whatever the kind.

Finished requests are counted here by their final reason (a stop string is "stop" even when the
core had meanwhile reached max_tokens), as vLLM's frontend counts them, and reported to the core,
which adds up every API server's counts into the stats snapshots it hands out.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from minillm.engine_core import messages as m
from minillm.output_processor import (
    CompletionState, add_token, new_state, note_finishes, prompt_logprobs_context, prompt_logprobs_entry,
    request_output,
)
from minillm.outputs import RequestMetrics, RequestOutput
from minillm.sampling_params import RequestOutputKind, SamplingParams
from minillm.sequence import SequenceStatus
from minillm.tokenizer import Tokenizer


@dataclass(eq=False)
class SequenceMirror:
    """One engine sequence as the API server knows it: what output_processor reads of a Sequence."""

    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)    # output tokens only, up to a stop string
    status: SequenceStatus = SequenceStatus.RUNNING
    stop_reason: int | str | None = None
    core_finish_reason: str | None = None    # how the core ended it, once it says
    structured_output: GrammarState | None = None   # constrained: what the core says of its matcher
    num_cached_tokens: int = 0               # its prefix-cache count (the core sends it for n > 1)

    @property
    def output_token_ids(self) -> list[int]:
        """A copy of the output tokens (an output handed on must not grow with later steps)."""
        return list(self.token_ids)

    def output_tail(self, count: int) -> list[int]:
        """The last `count` output tokens (fewer while there are fewer)."""
        return self.token_ids[-count:] if count > 0 else []

    def output_token_ids_after(self, num_seen: int) -> list[int]:
        """A copy of the output tokens past the first num_seen."""
        return self.token_ids[num_seen:]

    @property
    def is_finished(self) -> bool:
        """True once the API server's view has it ended."""
        return self.status.is_finished

    @property
    def final_reason(self) -> str:
        """The reason it counts under: this side's verdict, else the core's, else an abort."""
        return self.status.finish_reason or self.core_finish_reason or "abort"


@dataclass(frozen=True)
class GrammarState:
    """What output_processor reads of a constrained sequence's matcher, as the core reported it."""

    is_terminated: bool


@dataclass(eq=False)
class FrontendRequest:
    """A request between its add and the core's last word on it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[SequenceMirror]
    states: list[CompletionState]
    metrics: RequestMetrics
    handle: Any                 # where its outputs go (the caller's stream); None once nobody follows it
    is_counted: bool = False    # its finish reasons are in the tally
    is_accepted: bool = False   # the core took its add (a refused one is never counted)
    kv_transfer_params: dict | None = None   # a KV transfer's word on it, as the core sent it
    kv_transfer_stats: dict | None = None
    prompt_logprobs: list | None = None      # with params.prompt_logprobs: the entries the core has sent
    final_only: bool = False                 # RequestOutputKind.FINAL_ONLY: one output, once finished
    is_delta: bool = False                   # RequestOutputKind.DELTA: each output only what is new
    is_prompt_logprobs_sent: bool = False    # a delta request's prompt_logprobs go out once, whole
    finish_order: dict[int, None] = field(default_factory=dict)   # n > 1: its sequences' indices as they finished

    @property
    def is_followed(self) -> bool:
        """True while its caller may still get outputs (its id is in use until then)."""
        return self.handle is not None and not self.is_counted

    @property
    def is_finished(self) -> bool:
        """True when every sequence has ended in this side's view."""
        for seq in self.seqs:
            if not seq.status.is_finished:
                return False
        return True


@dataclass
class ProcessedStep:
    """What one StepOutputs message gives the API server: outputs to hand on, stops to send down,
    and the ids of the requests the core has retired."""

    outputs: list[tuple[Any, RequestOutput]]
    stops: list[tuple[str, int, str]]
    retired: list[str] = field(default_factory=list)


class OutputProcessor:
    """Turns each step's token ids into RequestOutputs; not thread-safe (one caller at a time)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, FrontendRequest] = {}
        self.finished = Counter()       # finish reason -> sequences, over the server's life
        self.unreported = Counter()     # the part of `finished` not yet reported to the core
        self.num_dropped_tokens = 0     # tokens past a stop string found here, not yet reported

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            arrival_time: float, handle: Any) -> None:
        """Start following a request (before it is sent to the core)."""
        ids = list(prompt_token_ids)
        seqs = [SequenceMirror(i, ids, params) for i in range(params.n)]
        kind = params.output_kind
        final_only, is_delta = kind is RequestOutputKind.FINAL_ONLY, kind is RequestOutputKind.DELTA
        states = [new_state(self.tokenizer, s, incremental=not final_only, delta=is_delta) for s in seqs]
        self.requests[request_id] = FrontendRequest(request_id, prompt, ids, seqs, states,
                                                    RequestMetrics(arrival_time=arrival_time), handle,
                                                    prompt_logprobs=[] if params.prompt_logprobs is not None else None,
                                                    final_only=final_only, is_delta=is_delta)

    def remove(self, request_id: str) -> None:
        """Forget a request the core refused."""
        self.requests.pop(request_id, None)

    def accepted(self, request_id: str) -> None:
        """The core took the request's add: one its caller aborted meanwhile is counted now."""
        req = self.requests.get(request_id)
        if req is None:
            return
        req.is_accepted = True
        if req.handle is None and req.is_finished and not req.is_counted:
            self._count(req)

    def abandon(self, request_id: str) -> Any:
        """Nobody follows the request any more (client gone, or its step failed); returns its handle.

        It is kept until the core's last output for it, which says how its sequences ended."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        handle, req.handle = req.handle, None
        return handle

    def abort(self, request_id: str, now: float) -> tuple[Any, RequestOutput] | None:
        """Its caller aborted the request: its sequences still running end with "abort" here, and
        (its handle, its final output) comes back, None where nobody follows it or that output is
        out already. It is kept until the core's last output for it, as abandon() keeps it; while its
        add is on its way it is counted only once the core takes it (accepted())."""
        req = self.requests.get(request_id)
        handle = self.abandon(request_id)
        if handle is None or req.is_counted:
            return None
        for seq in req.seqs:
            if not seq.is_finished:
                seq.status = SequenceStatus.FINISHED_ABORTED
        if len(req.seqs) > 1:
            note_finishes(req)
        return handle, self._output(req, now, count=req.is_accepted)

    def process(self, step: m.StepOutputs, now: float) -> ProcessedStep:
        """Apply one step's outputs: detokenise, check stop strings, build the RequestOutputs."""
        done = ProcessedStep([], [])
        requests, outputs, stops = self.requests, done.outputs, done.stops
        for out in step.outputs:
            req = requests.get(out.request_id)
            if req is None:
                continue
            req.is_accepted = True      # the core reports only requests it took
            moved = False
            seqs = req.seqs
            if out.new_prompt_logprobs and req.prompt_logprobs is not None:
                first, params, prompt = len(req.prompt_logprobs), seqs[0].params, req.prompt_token_ids
                entries = m.with_prompt_token_ranks(out.new_prompt_logprobs, out.new_prompt_logprob_ranks,
                                                    prompt, first)
                req.prompt_logprobs.extend(prompt_logprobs_entry(entry, params, prompt[i], self.tokenizer,
                                                                 prompt_logprobs_context(prompt, i))
                                           for i, entry in enumerate(entries, start=first))
                moved = True    # a prefill chunk's step: reported as the engine reports it (_output decides)
            for seq_out in out.seqs:
                moved |= self._apply(req, seqs[seq_out.index], seq_out, stops)
            if len(seqs) > 1:
                note_finishes(req)
            metrics = req.metrics
            metrics.first_scheduled_time = out.first_scheduled_time
            metrics.first_token_time = out.first_token_time
            metrics.last_token_time = out.last_token_time
            metrics.num_cached_tokens = out.num_cached_tokens
            if req.handle is not None and not req.is_counted and (moved or req.is_finished):
                output = self._output(req, now)
                if output is not None:
                    outputs.append((req.handle, output))
            if out.finished:            # the core has retired it: nothing more will come
                if not req.is_counted:
                    self._count(req)
                del self.requests[out.request_id]
                done.retired.append(out.request_id)
        return done

    def _apply(self, req: FrontendRequest, seq: SequenceMirror, out: m.SeqOutput,
               stops: list[tuple[str, int, str]]) -> bool:
        """Feed a sequence its new tokens; True if its output moved. A stop string found here that the
        core has not acted on yet is added to `stops`."""
        if out.finish_reason is not None:
            seq.core_finish_reason = out.finish_reason
        if out.grammar_terminated is not None:
            seq.structured_output = GrammarState(out.grammar_terminated)
        if out.kv_transfer_params is not None:
            req.kv_transfer_params = out.kv_transfer_params
        if out.kv_transfer_stats is not None:
            req.kv_transfer_stats = out.kv_transfer_stats
        if out.num_cached_tokens is not None:
            seq.num_cached_tokens = out.num_cached_tokens
        if seq.is_finished:
            self.num_dropped_tokens += len(out.new_token_ids)  # the core ran on past a stop string
        if req.handle is None or seq.is_finished:
            return False
        tokens, rows = out.new_token_ids, out.new_logprobs
        state = req.states[seq.index]
        for i, token in enumerate(tokens):
            if i == len(tokens) - 1 and out.finish_reason is not None:
                # As in the engine: the stop rules have run before the token's text is added.
                seq.status, seq.stop_reason = SequenceStatus(out.finish_reason), out.stop_reason
            seq.token_ids.append(token)
            stop = add_token(state, seq, token, rows[i] if rows else None)
            if stop is not None:
                seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
                if out.finish_reason is None:
                    stops.append((req.request_id, seq.index, stop))
                self.num_dropped_tokens += len(tokens) - i - 1
                return True
        if not tokens and out.finish_reason is not None:
            seq.status, seq.stop_reason = SequenceStatus(out.finish_reason), out.stop_reason
        return bool(tokens) or out.finish_reason is not None

    def _output(self, req: FrontendRequest, now: float, count: bool = True) -> RequestOutput | None:
        """The request's output of its kind after a change; None where that kind reports nothing
        now (as LLMEngine._take_outputs decides). A finished one is counted, with count."""
        finished = req.is_finished
        if req.final_only and not finished:
            return None
        if finished:
            req.metrics.finished_time = now
            if count:
                self._count(req)
        return request_output(req, finished, req.kv_transfer_params, req.kv_transfer_stats)

    def _count(self, req: FrontendRequest) -> None:
        req.is_counted = True
        for seq in req.seqs:
            self.finished[seq.final_reason] += 1
            self.unreported[seq.final_reason] += 1

    def take_unreported(self) -> dict[str, int]:
        """Finish counts since the last call (for the core, which adds up every API server's)."""
        counts, self.unreported = dict(self.unreported), Counter()
        return counts

    def take_dropped_tokens(self) -> int:
        """Tokens dropped past stop strings since the last call (the core takes them out of its count)."""
        count, self.num_dropped_tokens = self.num_dropped_tokens, 0
        return count
