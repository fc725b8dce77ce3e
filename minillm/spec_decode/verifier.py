"""The runner's side of speculation: which logits rows a step computes, the per-row sampling rules,
rejection sampling at launch, and acceptance once the sampled ids are read back.

A step with drafts runs each verifying sequence's [last token] + drafts as one query chunk through
the paged prefill path. Every sampling sequence gets d + 1 logits rows (d = 0 for the others,
which then sample exactly as the plain sampler does).
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from types import ModuleType

import numpy as np

from minillm.sampler import Sampler, SamplerOutput
from minillm.spec_decode.rejection import RejectionSampler, SpecDecodeMetadata
from minillm.spec_decode.rows import draft_row_views
from minillm.step import SchedulerOutput


class DraftVerifier:
    """Verifies the drafts of a launched step with the target model's own logits."""

    def __init__(self, ops: ModuleType, sampler: Sampler):
        self.ops = ops
        self.sampler = sampler
        self.rejection_sampler = RejectionSampler(ops)

    @staticmethod
    def metadata(out: SchedulerOutput, query_start_loc: np.ndarray) -> SpecDecodeMetadata:
        """Drafts and logits rows of out's sampling sequences (query_start_loc: [B+1] of the step)."""
        spec = out.scheduled_spec_decode_tokens
        drafts = [spec.get(out.seqs[b].seq_id, []) for b in out.sampling_rows]
        return SpecDecodeMetadata.from_query_ends(drafts, query_start_loc[np.asarray(out.sampling_rows) + 1])

    def sample_no_sync(self, logits, meta: SpecDecodeMetadata, seqs: Seq) -> SamplerOutput:
        """logits: [N, V] float32 (modified in place) -> every row's sample [N], left on the device.

        Each row's penalties and min_tokens ban are those of its sequence with the drafts before
        the row appended; log-probabilities (before penalties, as the plain path) come back for
        every row of the sequences that asked.
        """
        views = draft_row_views(seqs, meta.draft_lists)
        rows = [r for r, v in enumerate(views) if v.params.logprobs is not None]
        raw_logprobs = self.ops.log_softmax(logits[rows]) if rows else None
        self.sampler.apply_penalties_and_bans(logits, views)
        ids = self.rejection_sampler.sample_no_sync(logits, meta, seqs)
        return SamplerOutput(ids, raw_logprobs, rows)

    def accept(self, sampled: np.ndarray, logprobs: np.ndarray | None, logprob_rows: list[int],
               meta: SpecDecodeMetadata, seqs: Seq):
        """sampled: [N] ids on the host -> (seq_id -> new ids, seq_id -> one logprob dict per new
        id, seq_id -> drafts accepted) for the sequences of the step."""
        outputs, num_accepted = self.rejection_sampler.accept(sampled, meta, seqs)
        new_ids = {s.seq_id: ids for s, ids in zip(seqs, outputs)}
        accepted = {s.seq_id: int(a) for s, a, d in zip(seqs, num_accepted, meta.num_draft_tokens) if d}
        if logprobs is None:
            return new_ids, {}, accepted
        # Row s_b + i gave sequence b its i-th new token; the rows after its last were not used.
        starts = meta.row_starts.tolist()
        row_ids = np.zeros(meta.num_rows, dtype=np.int64)
        for start, ids in zip(starts, outputs):
            row_ids[start:start + len(ids)] = ids
        row_seqs = [s for s, d in zip(seqs, meta.num_draft_tokens.tolist()) for _ in range(d + 1)]
        dicts = Sampler.logprob_dicts(logprobs, logprob_rows, row_seqs, row_ids.tolist())
        per_seq = {s.seq_id: dicts[start:start + len(ids)]
                   for s, start, ids in zip(seqs, starts, outputs) if s.params.logprobs is not None}
        return new_ids, per_seq, accepted
