"""Per-completion output state: incremental text, stop strings, log-probabilities."""
from __future__ import annotations

from dataclasses import dataclass, field

from minillm.outputs import CompletionOutput, Logprob, RequestOutput, reported_prompt_logprobs
from minillm.sampling_params import RequestOutputKind, SamplingParams
from minillm.sequence import Sequence, SequenceStatus
from minillm.tokenizer import (
    MAX_CONTINUATION_TOKENS, MAX_LOGPROB_CONTEXT_TOKENS, PROMPT_CONTEXT_TOKENS, REPLACEMENT_CHAR,
    IncrementalDetokenizer, Tokenizer, context_start,
)


@dataclass
class CompletionState:
    """The text side of one sequence: detokenizer, text so far, log-probabilities."""

    detokenizer: IncrementalDetokenizer
    stop: list[str]
    include_stop: bool
    want_logprobs: bool
    incremental: bool                # text every step (streaming, stop strings) or once at the end
    min_tokens: int = 0              # stop strings are looked for only past this many output tokens
    detokenize: bool = True          # False: the text stays "" (SamplingParams.detokenize)
    text: str = ""
    num_text_tokens: int = 0         # output tokens that belong in the text
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # DELTA output kind: each report carries only what the ones before did not (cumulative_logprob aside)
    delta: bool = False
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    is_finish_sent: bool = False

    @property
    def holdback(self) -> int:
        """Characters kept back while a stop string that is to be cut out could still be forming (one
        kept in the output cuts nothing already sent: vLLM's stop_buffer_length)."""
        if self.include_stop:
            return 0
        return max((len(s) for s in self.stop), default=1) - 1


def _prompt_tail(seq: Sequence) -> list[int]:
    """The prompt's last ids, from which the decode window before the output is chosen
    (tokenizer.context_start)."""
    return seq.prompt_token_ids[-(PROMPT_CONTEXT_TOKENS + MAX_CONTINUATION_TOKENS):]


def new_state(tokenizer: Tokenizer, seq: Sequence, incremental: bool = True, delta: bool = False) -> CompletionState:
    """Fresh output state for a sequence; delta: its reports carry only what is new."""
    p = seq.params
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=p.skip_special_tokens,
                                   prompt_token_ids=_prompt_tail(seq),
                                   spaces_between_special_tokens=p.spaces_between_special_tokens)
    return CompletionState(detok, list(p.stop_strings), p.include_stop_str_in_output,
                           p.logprobs is not None, p.detokenize and (incremental or bool(p.stop_strings)),
                           p.min_tokens, p.detokenize, delta=delta)


def add_token(state: CompletionState, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> str | None:
    """Feed the newest token; returns the stop string it completed, if any."""
    if state.want_logprobs and logprobs is not None:
        # vLLM reads a token that ends inside a character after the output's tokens before it
        context = seq.output_tail(MAX_LOGPROB_CONTEXT_TOKENS + 1)[:-1]
        state.logprobs.append(ranked_logprobs(logprobs, seq.params.logprobs,
                                              state.detokenizer.tok if state.detokenize else None, token, context))
        state.cumulative_logprob += logprobs.get(token, 0.0)
    is_text = not (seq.status is SequenceStatus.FINISHED_STOPPED and _ended_by_stop_token(seq, token)
                   and not state.include_stop)
    if is_text:
        state.num_text_tokens += 1
    if not state.incremental:
        return None
    delta = state.detokenizer.add(token) if is_text else ""
    if seq.is_finished:
        # The text held back while a character was in progress is the output's last: a stop string may end in it.
        delta += state.detokenizer.flush()
    if not delta or not state.stop or state.num_text_tokens <= state.min_tokens:   # vLLM: min_tokens holds stops off
        state.text += delta
        return None
    before = len(state.text)
    state.text += delta
    stop, at = _first_completed_stop(state.text, before, state.stop)
    if stop is not None:
        state.text = state.text[:at + len(stop)] if state.include_stop else state.text[:at]
    return stop


def _first_completed_stop(text: str, before: int, stops: list[str]) -> tuple[str | None, int]:
    """(the stop string that completes first in text past its first BEFORE characters, where it
    starts); (None, -1) for none. A token's text may complete several (one "▁the" ends both " th"
    and "e"): the one that ends first wins, the stop list's order breaking ties, as vLLM's
    check_stop_strings picks it. Only a match that ends in the new text counts: one that lies
    wholly in the text of the first min_tokens tokens, where stops were held off, ends nothing."""
    best, best_at, best_end = None, -1, len(text) + 1
    for s in stops:
        at = text.find(s, max(before - len(s) + 1, 0))
        if at != -1 and at + len(s) < best_end:
            best, best_at, best_end = s, at, at + len(s)
    return best, best_at


def prompt_logprobs_entry(entry: dict[int, float] | None, params: SamplingParams, token: int,
                          tokenizer: Tokenizer, context: list[int] = ()) -> dict[int, Logprob] | None:
    """One prompt position's entry (None for the first) as vLLM's Logprobs, the prompt token first;
    context: the prompt's tokens before it (prompt_logprobs_context)."""
    if entry is None:
        return None
    return ranked_logprobs(entry, params.prompt_logprobs, tokenizer if params.detokenize else None, token, context)


def prompt_logprobs_context(prompt_token_ids: list[int], index: int) -> list[int]:
    """The prompt tokens vLLM reads the INDEX-th one's logprob tokens after: those before it that have
    entries of their own (the first has none), the last MAX_LOGPROB_CONTEXT_TOKENS."""
    return prompt_token_ids[max(1, index - MAX_LOGPROB_CONTEXT_TOKENS):index]


def ranked_logprobs(logprobs: dict[int, float], num_top: int, tokenizer: Tokenizer | None,
                    first: int | None = None, context: list[int] = ()) -> dict[int, Logprob]:
    """A token's {id: logprob} as vLLM's Logprobs: the top num_top ranked 1.. in order; the sampled
    (or prompt) token, when it falls below them, keeps the rank its Logprob carries from the sampler.
    first, that sampled (or prompt) token, leads the dict, as in vLLM's. decoded_token is the
    tokenizer's logprob_token_text, read after CONTEXT (the sequence's tokens before this position);
    without a tokenizer (detokenize=False) it stays None."""
    order = sorted(logprobs, key=logprobs.__getitem__, reverse=True)
    ranks = {tid: i + 1 for i, tid in enumerate(order[:num_top])}
    if first in logprobs and order[0] != first:
        order.remove(first)
        order.insert(0, first)
    return {tid: Logprob(logprobs[tid], ranks[tid] if tid in ranks else getattr(logprobs[tid], "rank", None),
                         None if tokenizer is None else tokenizer.logprob_token_text(tid, context))
            for tid in order}


def _ended_by_stop_token(seq: Sequence, token: int) -> bool:
    """Whether token is what stopped seq (its status FINISHED_STOPPED, as the caller checked)."""
    if seq.stop_reason is None and seq.structured_output is not None:
        return seq.structured_output.is_terminated    # a complete grammar's last token is text; its EOS is not
    return seq.stop_reason == token or seq.stop_reason is None


def _final_text(state: CompletionState, seq: Sequence) -> str:
    """Decode the whole output once, with the same prompt context the incremental path uses."""
    det = state.detokenizer
    skip = det.skip_special_tokens
    tail = _prompt_tail(seq)
    context = tail[context_start(det.tok, tail):]
    out = seq.output_token_ids[:state.num_text_tokens]
    head = det.tok.decode_raw(context, skip)
    text = det.tok.decode_raw(context + out, skip)[len(head):]
    if REPLACEMENT_CHAR not in text and not head.endswith(REPLACEMENT_CHAR) and det.spaces_between_special_tokens:
        return text
    # Bytes that are not UTF-8 (or a prompt that ends inside a character): a byte-fallback decoder
    # replaces every byte of a broken run, while the incremental path has already emitted the
    # valid ones before the run broke. Replay that path, so a request reads the same whether it
    # was streamed or not (and so that added tokens lose the spaces between them as they do there).
    replay = IncrementalDetokenizer(det.tok, skip_special_tokens=skip, prompt_token_ids=tail,
                                    spaces_between_special_tokens=det.spaces_between_special_tokens)
    return "".join([replay.add(t) for t in out] + [replay.flush()])


def completion_output(state: CompletionState, seq: Sequence) -> CompletionOutput:
    """The caller-facing view: while running, text withholds a possible partial stop string."""
    done = seq.is_finished
    if not state.incremental:
        if done and not state.text and state.detokenize:
            state.text = _final_text(state, seq)
    elif done:
        if not isinstance(seq.stop_reason, str):      # a stop string already cut the text
            state.text += state.detokenizer.flush()
    end = len(state.text)
    if not done and state.stop and state.holdback:
        end = max(end - state.holdback, 0)
    if state.delta:
        return _delta_output(state, seq, end, done)
    text = state.text if end == len(state.text) else state.text[:end]
    if not state.want_logprobs:     # positional: this runs for every sequence of every step
        if not done:
            return CompletionOutput(seq.index, text, seq.output_token_ids)
        return CompletionOutput(seq.index, text, seq.output_token_ids, None, None, seq.status.finish_reason,
                                seq.stop_reason)
    return CompletionOutput(
        index=seq.index, text=text, token_ids=seq.output_token_ids,
        finish_reason=seq.status.finish_reason if done else None, stop_reason=seq.stop_reason if done else None,
        cumulative_logprob=state.cumulative_logprob, logprobs=list(state.logprobs))


def _delta_output(state: CompletionState, seq: Sequence, end: int, done: bool) -> CompletionOutput:
    """The report of the DELTA output kind: the token ids, text (up to end, past which it is held back
    for a stop string) and log-probabilities not reported before; the finish reason once. Each report
    copies only what is new, so a long output costs the same per token throughout."""
    new_ids = seq.output_token_ids_after(state.num_sent_tokens)
    new_logprobs = state.logprobs[state.num_sent_tokens:]
    new_text = state.text[state.num_sent_chars:end]
    state.num_sent_tokens += len(new_ids)
    state.num_sent_chars = max(end, state.num_sent_chars)
    is_new_finish, state.is_finish_sent = done and not state.is_finish_sent, done
    return CompletionOutput(
        index=seq.index, text=new_text, token_ids=new_ids,
        finish_reason=seq.status.finish_reason if is_new_finish else None,
        stop_reason=seq.stop_reason if is_new_finish else None,
        cumulative_logprob=state.cumulative_logprob if state.want_logprobs else None,
        logprobs=list(new_logprobs) if state.want_logprobs else None)


class TextOutputs:
    """The engine's own output processing: text, stop strings and log-probabilities per sequence.

    An engine core hands out token ids instead (minillm/engine_core/core.py: TokenOutputs) and
    leaves this work to the API server, which runs these same functions there.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def new_state(self, seq: Sequence, incremental: bool) -> CompletionState:
        """Fresh output state for a sequence (its reports deltas where its params' output_kind asks)."""
        return new_state(self.tokenizer, seq, incremental, seq.params.output_kind is RequestOutputKind.DELTA)

    def add_token(self, state: CompletionState, seq: Sequence, token: int,
                  logprobs: dict[int, float] | None) -> str | None:
        """Feed the newest token; returns the stop string it completed, if any."""
        return add_token(state, seq, token, logprobs)

    def prompt_logprobs_entry(self, entry: dict[int, float] | None, params: SamplingParams,
                              token: int, context: list[int] = ()) -> dict[int, Logprob] | None:
        """One prompt position's {id: logprob} (token: the prompt's own; context: prompt_logprobs_context)
        as vLLM's Logprobs."""
        return prompt_logprobs_entry(entry, params, token, self.tokenizer, context)

    def request_output(self, req, finished: bool) -> RequestOutput | None:
        """req's report after a step (req: the engine's Request); None for a delta request with nothing new."""
        return request_output(req, finished, req.seqs[0].kv_transfer_params, req.seqs[0].kv_transfer_stats)


def request_output(req, finished: bool, kv_transfer_params: dict | None,
                   kv_transfer_stats: dict | None) -> RequestOutput | None:
    """A request's RequestOutput of its kind after a change (req: the engine's Request or an API
    server's, with states and seqs); None for a delta request with nothing new to report."""
    completions = [completion_output(st, s) for st, s in zip(req.states, req.seqs)]
    prompt_logprobs = reported_prompt_logprobs(req)
    if req.is_delta:      # only the completions with news; a report only when there is some
        completions = [c for c in completions if c.token_ids or c.text or c.finish_reason is not None]
        if not completions and prompt_logprobs is None and not finished:
            return None
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, prompt_logprobs, completions, finished,
                         req.metrics, num_cached_tokens=reported_num_cached_tokens(req, finished),
                         kv_transfer_params=kv_transfer_params, kv_transfer_stats=kv_transfer_stats)


def note_finishes(req) -> None:
    """Add the sequences of req (one with n > 1, called after each step) that finished since the last
    call to req.finish_order, in index order (the order of vLLM's children's outputs within a step)."""
    order = req.finish_order
    if len(order) == len(req.seqs):
        return
    for seq in req.seqs:
        if seq.is_finished and seq.index not in order:
            order[seq.index] = None


def reported_num_cached_tokens(req, finished: bool) -> int:
    """The prefix-cache count of req's output, as vLLM's parent request of n children reports it: its
    final output is made by the last child to finish (ParentRequest.get_outputs) and carries that
    child's count; an earlier one the first scheduled child's (the first output, read by vLLM's streams)."""
    if not finished or len(req.seqs) == 1 or not req.finish_order:
        return req.metrics.num_cached_tokens
    return req.seqs[next(reversed(req.finish_order))].num_cached_tokens
