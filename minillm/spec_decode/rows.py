"""The rows of a verify step as the sampler's per-row rules see them.

Row j of a sequence with drafts verifies draft j, and it is only read when drafts 0..j-1 were
accepted; so penalties, bad words and the min_tokens ban of that row are those of the sequence
with drafts[:j] appended. A DraftRowView carries what Sampler's per-row rules read (params, the
prompt, output counts, the last output ids, the number of outputs), which lets them run unchanged
over the N rows of a step.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class DraftRowView:
    """A sequence as seen by the row verifying its draft j (its tokens plus drafts[:j]); read-only."""

    params: Any                       # SamplingParams
    rng: np.random.Generator          # the sequence's own generator
    prompt_token_ids: list[int]
    output_counts: dict[int, int]     # token id -> times generated, drafts[:j] included
    num_output_tokens: int            # outputs before this row, plus the one it samples (the sampler's rule)
    # the last outputs known before this row, drafts[:j] included: as many as bad words read, else none
    recent_output_ids: Seq[int] = ()

    def output_tail(self, count: int) -> list[int]:
        """The last `count` outputs before this row (at most those recent_output_ids holds)."""
        recent = self.recent_output_ids
        return list(recent[max(len(recent) - count, 0):]) if count else []


def _has_penalties(params) -> bool:
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


def _bad_word_prefix_len(params) -> int:
    """The most earlier outputs params' bad words look at (0: none, or no bad words)."""
    ids = params._bad_word_ids
    return 0 if ids is None else ids.max_prefix_len


def draft_row_views(seqs: Seq, draft_token_ids: Seq[Seq[int]]) -> list[DraftRowView]:
    """One view per logits row of the step, in row order: d + 1 for a sequence with d drafts.

    Called at launch, when a sequence with d drafts already counts d + 1 output placeholders (the
    most tokens the step can give it). The sampler's min_tokens rule counts the token being sampled,
    so row j's view counts num_output_tokens - d + j: the outputs before row j, plus its own.
    """
    if len(seqs) != len(draft_token_ids):
        raise ValueError(f"{len(draft_token_ids)} draft lists for {len(seqs)} sequences")
    views = []
    for seq, drafts in zip(seqs, draft_token_ids):
        counts = seq.output_counts
        first = seq.num_output_tokens - len(drafts)
        # Bad words read the last outputs: the known ones, then the drafts before the row.
        keep = _bad_word_prefix_len(seq.params)
        outputs = seq.output_tail(keep) + list(drafts) if keep else None
        for j in range(len(drafts) + 1):
            end = 0 if outputs is None else len(outputs) - len(drafts) + j
            views.append(DraftRowView(seq.params, seq.rng, seq.prompt_token_ids, counts, first + j,
                                      () if outputs is None else outputs[max(end - keep, 0):end]))
            if j < len(drafts) and _has_penalties(seq.params):
                # Copied only where penalties read them; the sequence's own dict is never written.
                counts = dict(counts)
                counts[drafts[j]] = counts.get(drafts[j], 0) + 1
    return views
