"""Prompt log-probabilities (vLLM's SamplingParams.prompt_logprobs): each prompt token's
log-probability given the tokens before it, its rank, and the top-k alternatives, from a
prefill's hidden states. Only requests that ask pay for it: the rows of their prompt chunks go
through the LM head once more, beside the step's sampling rows.

    plan = plan_prompt_logprobs(out, query_start_loc)     # None when no row of the step asks
    pending = compute_prompt_logprobs(plan, hidden, model, ops, device)   # queued on the device
    entries = pending.result()                             # seq_id -> (first index, [dict, ...])

Prompt token i (i >= 1) is scored by the logits at position i - 1, so a chunk over positions
[s, e) gives the entries s + 1 .. min(e, P - 1) of a P-token prompt; entry 0 has none (None in
the request's list). A request with prompt_logprobs takes no cached prefix (the scheduler computes
its whole prompt), and a prompt computed again after a preemption gives entries already recorded,
which the engine drops.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minillm.outputs import Logprob

ROWS_PER_SLICE = 64      # rows of [rows, vocab] logits alive at once (151,936 x 64 x 4 B = 39 MB each)


@dataclass
class PromptLogprobsPlan:
    """The token rows of one step whose logits score prompt tokens, grouped by sequence."""

    seq_ids: list[int]           # one per group
    first_index: list[int]       # the prompt index the group's first row scores (>= 1)
    counts: list[int]            # rows of each group
    num_top: list[int]           # each group's top-k (its prompt_logprobs)
    rows: np.ndarray             # [R] int32 token rows of the step, groups in order
    next_tokens: np.ndarray      # [R] int32 the prompt token each row scores

    @property
    def max_top(self) -> int:
        """The largest top-k of the groups (one top-k pass serves them all; each keeps its own k)."""
        return max(self.num_top)


def plan_prompt_logprobs(out, query_start_loc: np.ndarray) -> PromptLogprobsPlan | None:
    """The step's rows that score prompt tokens (out: SchedulerOutput; query_start_loc [B+1] on the host)."""
    seq_ids, first, counts, tops, rows, nxt = [], [], [], [], [], []
    for b, seq in enumerate(out.seqs):
        k = seq.params.prompt_logprobs
        if k is None:
            continue
        start = out.num_computed_tokens[b]
        end = min(start + out.num_new_tokens[b], seq.num_prompt_tokens - 1)
        if end <= start:
            continue
        row0 = int(query_start_loc[b])
        seq_ids.append(seq.seq_id)
        first.append(start + 1)
        counts.append(end - start)
        tops.append(k)
        rows.extend(range(row0, row0 + end - start))
        nxt.extend(seq.token_ids[start + 1:end + 1])
    if not seq_ids:
        return None
    return PromptLogprobsPlan(seq_ids, first, counts, tops, np.asarray(rows, np.int32), np.asarray(nxt, np.int32))


class PendingPromptLogprobs:
    """A plan's log-probabilities on their way to the host."""

    def __init__(self, plan: PromptLogprobsPlan, token_lp, token_rank, top_ids, top_lp):
        self.plan = plan
        self._token_lp, self._token_rank = token_lp, token_rank                    # host futures
        self._top_ids, self._top_lp = top_ids, top_lp

    def result(self) -> dict[int, tuple[int, list[dict[int, float]]]]:
        """seq_id -> (first prompt index, one {token id: logprob} per scored token: the token itself,
        a Logprob with its rank, and its top num_top alternatives)."""
        token_lp = self._token_lp.result()                               # [R]
        token_rank = self._token_rank.result()                           # [R]
        top_ids = self._top_ids.result() if self._top_ids is not None else None   # [R, K]
        top_lp = self._top_lp.result() if self._top_lp is not None else None
        p, out, r = self.plan, {}, 0
        tokens = p.next_tokens.tolist()
        for seq_id, first, count, k in zip(p.seq_ids, p.first_index, p.counts, p.num_top):
            entries = []
            for i in range(r, r + count):
                entry = {}
                if k:
                    entry = dict(zip(top_ids[i, :k].tolist(), top_lp[i, :k].tolist()))
                entry[tokens[i]] = Logprob(float(token_lp[i]), int(token_rank[i]))
                entries.append(entry)
            out[seq_id] = (first, entries)
            r += count
        return out


def compute_prompt_logprobs(plan: PromptLogprobsPlan, hidden, model, ops, device) -> PendingPromptLogprobs:
    """Queue the LM head, log-softmax, the tokens' ranks and top-k over the plan's rows of hidden
    [T, D] (on the device), in slices of ROWS_PER_SLICE rows; the results go to the host
    asynchronously. One expression over xp serves NumPy and CuPy alike."""
    xp = ops.xp
    rows, nxt = ops.asarray(plan.rows), ops.asarray(plan.next_tokens)
    k = plan.max_top
    token_parts, rank_parts, id_parts, lp_parts = [], [], [], []
    for i in range(0, len(plan.rows), ROWS_PER_SLICE):
        j = min(i + ROWS_PER_SLICE, len(plan.rows))
        logprobs = ops.log_softmax(model.compute_logits(hidden[rows[i:j]]))      # [r, V] float32
        token = xp.take_along_axis(logprobs, nxt[i:j, None].astype(xp.int64), axis=1)     # [r, 1]
        token_parts.append(token[:, 0])
        # rank: the entries at least as likely as the token, itself included (as the sampler's token_rank)
        rank_parts.append((logprobs >= token).sum(axis=1, dtype=xp.int32))         # [r]
        if k:
            top = xp.argpartition(-logprobs, k - 1, axis=1)[:, :k]                # [r, k], unordered
            id_parts.append(top.astype(xp.int32))
            lp_parts.append(xp.take_along_axis(logprobs, top, axis=1))
    token_lp = device.to_host_async(xp.concatenate(token_parts))
    token_rank = device.to_host_async(xp.concatenate(rank_parts))
    top_ids = device.to_host_async(xp.concatenate(id_parts)) if k else None
    top_lp = device.to_host_async(xp.concatenate(lp_parts)) if k else None
    return PendingPromptLogprobs(plan, token_lp, token_rank, top_ids, top_lp)
