"""Verifying draft tokens so that the output keeps the target model's distribution exactly.

For a one-hot proposal (an n-gram draft x), rejection sampling accepts x with probability p(x) and
on rejection draws from p with x removed and renormalised, p being the processed distribution
(temperature, then top-k / top-p / min-p, renormalised) the normal sampler draws from. Drawing
t ~ p with the normal sampler and accepting x exactly when t == x has that law: P(accept) = p(x),
and given a rejection t is distributed as p restricted to tokens other than x. So every verified
row is sampled by `ops.sample` (one uniform per row, the kernel and NumPy rule the plain path
uses), a sequence keeps its drafts up to the first row whose sample differs from the draft, and
that row's sample is the recovered token (or, when every draft matched, the bonus row's sample is
the bonus token). Greedy rows are the argmax, so a draft is accepted only when it is the argmax.

Rows of one step, sequence by sequence: for sequence b its num_draft_tokens[b] draft rows (the
logits that verify draft j) and then its bonus row (the logits after its last draft).
Penalties, min_tokens bans and grammar masks are applied to each row's logits by the caller, as
if the drafts before it were accepted (that row is only read when they are; rows.py builds the
per-row views the sampler's rules take), so this op only sees processed logits. Logprobs of a
sequence's i-th output token this step come from its row s_b + i, as the plain path takes them
from its one row.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from minillm.sampling_metadata import sampler_temperature, sampler_top_k, sampler_uniforms


@dataclass(frozen=True)
class SpecDecodeMetadata:
    """One step's draft tokens and which rows of its hidden states carry the logits to verify them."""

    draft_token_ids: np.ndarray      # [D] int32, sequence by sequence
    num_draft_tokens: np.ndarray     # [B] int32
    logits_indices: np.ndarray       # [N] int32, N = D + B: token rows whose logits are computed

    @property
    def num_rows(self) -> int:
        """Logits rows of the step: one per draft plus one per sequence."""
        return int(self.logits_indices.shape[0])

    @property
    def row_starts(self) -> np.ndarray:
        """[B] int64: each sequence's first logits row."""
        return np.cumsum(self.num_draft_tokens + 1) - (self.num_draft_tokens + 1)

    @property
    def draft_lists(self) -> list[list[int]]:
        """Each sequence's draft ids, in order."""
        ends = np.cumsum(self.num_draft_tokens).tolist()
        flat = self.draft_token_ids.tolist()
        return [flat[e - d:e] for e, d in zip(ends, self.num_draft_tokens.tolist())]

    @classmethod
    def make(cls, draft_token_ids: Seq[Seq[int]], num_scheduled_tokens: Seq[int]) -> "SpecDecodeMetadata":
        """Drafts per sequence and each sequence's query length this step (in the step's token order).

        A sequence with d drafts is verified by the last d + 1 tokens of its query chunk (its last
        sampled token and the drafts), so its logits rows are those tokens' positions.
        """
        if len(draft_token_ids) != len(num_scheduled_tokens):
            raise ValueError(f"{len(draft_token_ids)} draft lists for {len(num_scheduled_tokens)} sequences")
        num_drafts = np.array([len(d) for d in draft_token_ids], dtype=np.int64)      # [B]
        num_sched = np.asarray(num_scheduled_tokens, dtype=np.int64)                  # [B]
        if np.any(num_sched < num_drafts + 1):
            b = int(np.argmax(num_sched < num_drafts + 1))
            raise ValueError(f"sequence {b} schedules {num_sched[b]} tokens for {num_drafts[b]} drafts; "
                             f"it needs at least {num_drafts[b] + 1}")
        return cls.from_query_ends(draft_token_ids, np.cumsum(num_sched))

    @classmethod
    def from_query_ends(cls, draft_token_ids: Seq[Seq[int]], query_ends) -> "SpecDecodeMetadata":
        """Drafts per sampling sequence and where each one's query chunk ends in the step's tokens
        (query_ends: [B], one past its last token), for steps where other rows sit between them."""
        num_drafts = np.array([len(d) for d in draft_token_ids], dtype=np.int32)       # [B]
        rows = num_drafts.astype(np.int64) + 1
        owner, offset = _segments(rows)
        # Row r of sequence b sits at (end of b's chunk) - rows[b] + r.
        logits_indices = ((np.asarray(query_ends, dtype=np.int64) - rows)[owner] + offset).astype(np.int32)
        flat = [t for d in draft_token_ids for t in d]
        return cls(np.asarray(flat, dtype=np.int32).reshape(-1), num_drafts, logits_indices)


def num_accepted_drafts(sampled: np.ndarray, draft_token_ids: np.ndarray,
                        num_draft_tokens: np.ndarray) -> np.ndarray:
    """sampled: [N], draft_token_ids: [D], num_draft_tokens: [B] -> drafts kept per sequence [B] int32.

    A sequence keeps its drafts up to (not including) the first whose row sampled another token.
    """
    rows = num_draft_tokens.astype(np.int64) + 1
    starts = np.cumsum(rows) - rows                                       # [B] first row of each sequence
    draft_seq, draft_pos = _segments(num_draft_tokens)                    # [D] sequence and j of each draft
    mismatch = sampled[starts[draft_seq] + draft_pos] != draft_token_ids  # [D]
    # First mismatch per sequence, or d when there is none.
    first = np.array(num_draft_tokens, dtype=np.int64)
    np.minimum.at(first, draft_seq[mismatch], draft_pos[mismatch])
    return first.astype(np.int32)


def rejection_sample(ops: ModuleType, logits, draft_token_ids: np.ndarray, num_draft_tokens: np.ndarray,
                     temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
                     uniforms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Verify drafts; returns (sampled [N] int32, num_accepted [B] int32) on the host.

    logits: [N, V] float32 on the backend, N = D + B rows as the module docstring lays out.
    draft_token_ids: [D]; num_draft_tokens: [B]; temperature, top_k, top_p, min_p: [B] per sequence;
    uniforms: [N] one per row (greedy rows ignore theirs). Sequence b outputs its first
    num_accepted[b] drafts and then sampled[s_b + num_accepted[b]] (s_b its first row), the
    recovered or bonus token; split_outputs makes the lists.
    """
    num_draft_tokens = np.asarray(num_draft_tokens, dtype=np.int32)
    if len(draft_token_ids) != int(num_draft_tokens.sum()):
        raise ValueError(f"draft_token_ids has {len(draft_token_ids)} ids for {int(num_draft_tokens.sum())} drafts")
    sampled = sample_rows_no_sync(ops, logits, num_draft_tokens, temperature, top_k, top_p, min_p, uniforms)
    sampled = ops.to_numpy(sampled).astype(np.int32)                      # [N]
    num_accepted = num_accepted_drafts(sampled, np.asarray(draft_token_ids), num_draft_tokens)
    return sampled, num_accepted


def sample_rows_no_sync(ops: ModuleType, logits, num_draft_tokens: np.ndarray, temperature: np.ndarray,
                        top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray, uniforms: np.ndarray):
    """Every row's sample under its sequence's parameters: ids [N] int32, left on the device.

    The arguments are those of rejection_sample; comparing the ids with the drafts is left to the
    host once they are read back (num_accepted_drafts).
    """
    num_draft_tokens = np.asarray(num_draft_tokens, dtype=np.int32)
    rows = num_draft_tokens + 1                                            # [B]
    num_rows = int(rows.sum())
    if logits.shape[0] != num_rows or len(uniforms) != num_rows:
        raise ValueError(f"{len(rows)} sequences with {int(num_draft_tokens.sum())} drafts need {num_rows} "
                         f"logits rows and uniforms, got {logits.shape[0]} and {len(uniforms)}")
    per_row = lambda a, dt: ops.asarray(np.repeat(np.asarray(a, dtype=dt), rows))  # noqa: E731
    return ops.sample(logits, per_row(temperature, np.float32), per_row(top_k, np.int32),
                      per_row(top_p, np.float32), per_row(min_p, np.float32),
                      ops.asarray(np.asarray(uniforms, dtype=np.float32)))


def _segments(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """counts: [B] -> (owner [sum], index within the owner [sum]) of the flattened segments."""
    counts = np.asarray(counts, dtype=np.int64)
    owner = np.repeat(np.arange(counts.shape[0]), counts)
    return owner, np.arange(owner.shape[0]) - (np.cumsum(counts) - counts)[owner]


def split_outputs(sampled: np.ndarray, draft_token_ids: np.ndarray, num_draft_tokens: np.ndarray,
                  num_accepted: np.ndarray) -> list[list[int]]:
    """Each sequence's output ids this step: its accepted drafts, then the sample of the row after
    them (the recovered or bonus token); 1..d+1 ids."""
    num_draft_tokens = np.asarray(num_draft_tokens, dtype=np.int64)
    row_starts = (np.cumsum(num_draft_tokens + 1) - (num_draft_tokens + 1)).tolist()
    draft_starts = (np.cumsum(num_draft_tokens) - num_draft_tokens).tolist()
    drafts, rows = np.asarray(draft_token_ids).tolist(), sampled.tolist()
    return [drafts[d:d + a] + [rows[r + a]]
            for r, d, a in zip(row_starts, draft_starts, np.asarray(num_accepted).tolist())]


class RejectionSampler:
    """Verifies a step's drafts for sequences with `params` (SamplingParams) and `rng` (PCG64 Generator).

    Every non-greedy sequence draws one uniform per row from its own generator, so results do not
    depend on the batch; draws for rows past the first rejection were never looked at and are given
    back (the generator is moved back), so the n-th output token of a sequence always uses the n-th
    uniform of its stream, with or without speculation.

    The engine splits the work at the device boundary: sample_no_sync() at launch, accept() once
    the ids are on the host (nothing else draws from these sequences' generators in between).
    """

    def __init__(self, ops: ModuleType):
        self.ops = ops

    def __call__(self, logits, metadata: SpecDecodeMetadata, seqs: Seq) -> list[list[int]]:
        """logits: [N, V] float32 (penalties applied) -> output ids per sequence (1..d+1 each)."""
        sampled = self.ops.to_numpy(self.sample_no_sync(logits, metadata, seqs)).astype(np.int32)
        return self.accept(sampled, metadata, seqs)[0]

    def sample_no_sync(self, logits, metadata: SpecDecodeMetadata, seqs: Seq):
        """logits: [N, V] float32 (penalties applied) -> every row's sample, ids [N] on the device."""
        num_drafts = metadata.num_draft_tokens
        if len(seqs) != len(num_drafts):
            raise ValueError(f"{len(seqs)} sequences for metadata of {len(num_drafts)}")
        params = [s.params for s in seqs]
        uniforms = np.zeros(metadata.num_rows, dtype=np.float32)          # [N]
        starts = metadata.row_starts.tolist()
        for b, s in enumerate(seqs):
            if not s.params.is_greedy:
                d = int(num_drafts[b])
                uniforms[starts[b]:starts[b] + d + 1] = sampler_uniforms(s.rng.random(d + 1))
        return sample_rows_no_sync(
            self.ops, logits, num_drafts, np.array([sampler_temperature(p) for p in params], np.float32),
            np.array([sampler_top_k(p, logits.shape[1]) for p in params], np.int32),
            np.array([p.top_p for p in params], np.float32),
            np.array([p.min_p for p in params], np.float32), uniforms)

    def accept(self, sampled: np.ndarray, metadata: SpecDecodeMetadata,
               seqs: Seq) -> tuple[list[list[int]], np.ndarray]:
        """sampled: [N] ids on the host -> (output ids per sequence, drafts accepted [B]); gives
        back each sequence's draws for the rows past its first rejection."""
        num_drafts = metadata.num_draft_tokens
        num_accepted = num_accepted_drafts(sampled, metadata.draft_token_ids, num_drafts)
        for b, s in enumerate(seqs):
            unused = int(num_drafts[b] - num_accepted[b])
            if unused and not s.params.is_greedy:
                s.rng.bit_generator.advance(-unused)
        return split_outputs(sampled, metadata.draft_token_ids, num_drafts, num_accepted), num_accepted
