"""Sampler: per-sequence sampling parameters -> one packed upload -> one op call per rule, nothing waits."""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np

from minillm.allowed_tokens import allowed_entries, keep_only_allowed
from minillm.bad_words import bad_word_entries
from minillm.outputs import Logprob
from minillm.sampling_metadata import (SamplingInputBuffer, SamplingMetadata, banned_entries, bias_entries,
                                       penalty_entries)
from minillm.sequence import Sequence


@dataclass
class SamplerOutput:
    """A batch's sampled ids and log-probabilities, still on the device."""

    token_ids: object                # [B] int32
    logprobs: object | None          # [len(logprob_rows), V] float32, or None when nobody asked
    logprob_rows: list[int]          # batch rows that asked for log-probabilities


class Sampler:
    """Turns a batch of logits into next tokens (and log-probabilities when asked).

    device: the backend's device object (pinned staging and the upload of the packed parameters);
    max_num_seqs: rows the packed buffer holds before it grows.
    """

    def __init__(self, ops: ModuleType, eos_token_ids: list[int], device=None, max_num_seqs: int = 256):
        self.ops = ops
        self.eos_token_ids = list(eos_token_ids)
        if device is None:
            from minillm.device import make_device
            device = make_device(ops.name)
        self.device = device
        self.inputs = SamplingInputBuffer(ops, device, max_num_seqs, self.eos_token_ids)
        self._bitmask = None                 # [cap, W] int32 on the device: a step's masks
        self._bitmask_rows = None            # [cap] int32 on the device: the logits row of each mask
        # (N, W) -> the first N rows of both, sliced once (a steady batch masks the same number of rows
        # each step; a CuPy slice costs microseconds)
        self._bitmask_views: dict[tuple[int, int], tuple] = {}

    def sample_no_sync(self, logits, seqs: list[Sequence], grammar_bitmask=None) -> SamplerOutput:
        """logits: [B, V] float32 (modified in place) -> the sampled ids, left on the device.

        Each sequence already counts the token being sampled among its outputs (a placeholder).
        grammar_bitmask (structured outputs' GrammarBitmask, on the host) masks its rows first.
        """
        ops = self.ops
        meta = self.inputs.prepare(seqs, logits.shape[1])
        if grammar_bitmask is not None:
            self.apply_grammar_bitmask(logits, grammar_bitmask)   # before every other rule, as vLLM
        rows = meta.logprob_rows
        raw_logprobs = ops.log_softmax(logits[meta.logprob_rows_device]) if rows else None   # before penalties
        self.apply_metadata_penalties(logits, meta)
        ids = ops.sample(logits, meta.temperature, meta.top_k, meta.top_p, meta.min_p, meta.uniforms)
        return SamplerOutput(ids, raw_logprobs, rows)

    def apply_metadata_penalties(self, logits, meta: SamplingMetadata) -> None:
        """logits: [B, V] float32, in place: the allowed_token_ids masks, logit biases, penalties and
        bans (min_tokens', bad words') packed in meta (masks first, then biases, as vLLM's sampler
        orders them)."""
        if meta.allowed is not None:
            keep_only_allowed(logits, *meta.allowed)
        if meta.logit_bias is not None:
            rows, tokens, bias = meta.logit_bias
            logits[rows, tokens] += bias                  # one entry per (row, token): no repeats
        if meta.penalty_entries is not None:
            self.ops.apply_penalties(logits, *meta.penalty_entries, meta.repetition_penalty,
                                     meta.presence_penalty, meta.frequency_penalty)
        if meta.banned is not None:
            logits[meta.banned[0], meta.banned[1]] = -np.inf

    def apply_penalties_and_bans(self, logits, seqs) -> None:
        """logits: [B, V] float32, in place: repetition / presence / frequency penalties, the
        min_tokens ban of EOS and stop tokens, and bad words' bans. seqs: one per row (a Sequence or
        a view with its params, prompt_token_ids, output_counts, output_tail and
        num_output_tokens). The rows of a step verifying drafts come here (one upload per array);
        plain steps take the packed path above. The allowed_token_ids masks and then the logit
        biases go first, as there."""
        self._keep_only_allowed(logits, seqs)
        self._apply_logit_bias(logits, seqs)
        self._apply_penalties(logits, seqs)
        self._block_early_stops(logits, seqs)
        self._ban_bad_words(logits, seqs)

    def apply_grammar_bitmask(self, logits, mask) -> None:
        """Tokens a constrained row's grammar forbids get -inf. On a device the masks go up in one
        async copy (mask.bitmask is page-locked: nothing is staged on the host) into a buffer kept
        from step to step (on one stream a step's copy runs after the last step's kernels have
        read it), and the kernel reads mask i for logits row rows[i]."""
        ops = self.ops
        if ops.xp is np:                                   # the CPU backend: no upload
            ops.apply_token_bitmask(logits, mask.bitmask, mask.rows)
            return
        num_rows, num_words = mask.bitmask.shape
        views = self._bitmask_views.get((num_rows, num_words))
        if views is None:
            kept = self._bitmask
            if kept is None or kept.shape[0] < num_rows or kept.shape[1] != num_words:
                cap = max(num_rows, self.inputs.cap)
                self._bitmask = kept = ops.xp.empty((cap, num_words), dtype=np.int32)
                self._bitmask_rows = ops.xp.empty((cap,), dtype=np.int32)
                self._bitmask_views = {}
            views = self._bitmask_views[num_rows, num_words] = (kept[:num_rows], self._bitmask_rows[:num_rows])
        kept, rows = views
        # No events: a mask buffer is filled again two steps later, after this step was read back.
        self.device.copy_to_device_async(kept, np.ascontiguousarray(mask.bitmask), event=False)   # [N, W]
        self.device.copy_to_device_async(rows, np.ascontiguousarray(mask.rows, dtype=np.int32), event=False)  # [N]
        ops.apply_token_bitmask(logits, kept, rows)

    def _keep_only_allowed(self, logits, seqs) -> None:
        masked = [b for b, s in enumerate(seqs) if s.params._allowed_entries is not None]
        if masked:
            rows, tokens, _ = allowed_entries(seqs, masked)
            a = self.ops.asarray
            keep_only_allowed(logits, a(rows), a(tokens), a(np.array(masked, np.int32)))

    def _apply_logit_bias(self, logits, seqs) -> None:
        rows, tokens, bits = bias_entries(seqs, [b for b, s in enumerate(seqs) if s.params.logit_bias])
        if rows:
            a = self.ops.asarray
            logits[a(np.array(rows, np.int32)), a(np.array(tokens, np.int32))] += \
                a(np.array(bits, np.int32).view(np.float32))

    def _apply_penalties(self, logits, seqs) -> None:
        rows, tokens, counts, in_prompt = penalty_entries(
            seqs, [b for b, s in enumerate(seqs) if s.params.needs_output_counts])
        if not rows:
            return
        ops = self.ops
        per_seq = lambda f: ops.asarray(np.array([f(s.params) for s in seqs], np.float32))  # noqa: E731
        ops.apply_penalties(logits, ops.asarray(np.array(rows, np.int32)), ops.asarray(np.array(tokens, np.int32)),
                            ops.asarray(np.array(counts, np.int32)), ops.asarray(np.array(in_prompt, np.int32)),
                            per_seq(lambda p: p.repetition_penalty), per_seq(lambda p: p.presence_penalty),
                            per_seq(lambda p: p.frequency_penalty))

    def _block_early_stops(self, logits, seqs) -> None:
        """Below min_tokens, EOS and stop tokens cannot be sampled."""
        rows, tokens = banned_entries(seqs, range(len(seqs)), self.eos_token_ids, logits.shape[1])
        if rows:
            logits[self.ops.asarray(np.array(rows, np.int32)), self.ops.asarray(np.array(tokens, np.int32))] = -np.inf

    def _ban_bad_words(self, logits, seqs) -> None:
        """A token that would complete a bad word cannot be sampled."""
        rows, tokens = bad_word_entries(seqs, [b for b, s in enumerate(seqs) if s.params._bad_word_ids])
        if rows:
            logits[self.ops.asarray(np.array(rows, np.int32)), self.ops.asarray(np.array(tokens, np.int32))] = -np.inf

    @staticmethod
    def logprob_dicts(host: np.ndarray | None, rows: list[int], seqs: list[Sequence],
                      ids: list[int]) -> list[dict[int, float] | None]:
        """host: [len(rows), V] log-probabilities -> per sequence {sampled id and top-k ids: logprob};
        the sampled id's value is a Logprob with its rank in the row."""
        out: list[dict[int, float] | None] = [None] * len(seqs)
        if host is None:
            return out
        for r, b in enumerate(rows):
            k = seqs[b].params.logprobs
            row = host[r]                                      # [V]
            token = int(ids[b])
            d = {token: Logprob(float(row[token]), token_rank(row, row[token]))}
            if k:
                top = np.argpartition(-row, k - 1)[:k]
                for t in top[np.argsort(-row[top], kind="stable")]:
                    d.setdefault(int(t), float(row[t]))
            out[b] = d
        return out


def token_rank(row: np.ndarray, value: float) -> int:
    """A token's rank in its row of log-probabilities: the entries at least as likely, itself
    included (vLLM's batched_count_greater_than), so 1 for the likeliest."""
    return int(np.count_nonzero(row >= value))
