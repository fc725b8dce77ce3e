"""Sampler: per-sequence sampling parameters -> arrays -> one op call per rule."""
from __future__ import annotations

from types import ModuleType

import numpy as np

from minillm.sequence import Sequence


class Sampler:
    """Turns a batch of logits into next tokens (and log-probabilities when asked)."""

    def __init__(self, ops: ModuleType, eos_token_ids: list[int]):
        self.ops = ops
        self.eos_token_ids = list(eos_token_ids)

    def __call__(self, logits, seqs: list[Sequence]) -> tuple[list[int], list[dict[int, float] | None]]:
        """logits: [B, V] float32 on the backend; one sampled id (and logprobs dict or None) per seq."""
        ops = self.ops
        logprob_rows = [b for b, s in enumerate(seqs) if s.params.logprobs is not None]
        raw_logprobs = ops.log_softmax(logits[logprob_rows]) if logprob_rows else None
        ids = ops.to_numpy(self.sample_no_sync(logits, seqs)).astype(np.int64).tolist()
        return ids, self._logprob_dicts(raw_logprobs, logprob_rows, seqs, ids)

    def sample_no_sync(self, logits, seqs: list[Sequence]):
        """The sampled ids [B] int32, left on the device (logits are modified in place)."""
        ops = self.ops
        self._apply_penalties(logits, seqs)
        self._block_early_stops(logits, seqs)
        temperature = np.array([s.params.temperature for s in seqs], np.float32)
        top_k = np.array([max(s.params.top_k, 0) for s in seqs], np.int32)
        top_p = np.array([s.params.top_p for s in seqs], np.float32)
        min_p = np.array([s.params.min_p for s in seqs], np.float32)
        # One draw per non-greedy sequence from its own generator: results do not depend on the batch.
        uniforms = np.array([0.0 if s.params.is_greedy else s.rng.random() for s in seqs], np.float32)
        return ops.sample(logits, ops.asarray(temperature), ops.asarray(top_k), ops.asarray(top_p),
                          ops.asarray(min_p), ops.asarray(uniforms))

    def _apply_penalties(self, logits, seqs: list[Sequence]) -> None:
        rows, tokens, counts, in_prompt = [], [], [], []
        for b, s in enumerate(seqs):
            p = s.params
            if p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0:
                continue
            prompt = set(s.prompt_token_ids) if p.repetition_penalty != 1.0 else set()
            for t in prompt | set(s.output_counts):
                rows.append(b)
                tokens.append(t)
                counts.append(s.output_counts.get(t, 0))
                in_prompt.append(1 if t in prompt else 0)
        if not rows:
            return
        ops = self.ops
        per_seq = lambda f: ops.asarray(np.array([f(s.params) for s in seqs], np.float32))  # noqa: E731
        ops.apply_penalties(logits, ops.asarray(np.array(rows, np.int32)), ops.asarray(np.array(tokens, np.int32)),
                            ops.asarray(np.array(counts, np.int32)), ops.asarray(np.array(in_prompt, np.int32)),
                            per_seq(lambda p: p.repetition_penalty), per_seq(lambda p: p.presence_penalty),
                            per_seq(lambda p: p.frequency_penalty))

    def _block_early_stops(self, logits, seqs: list[Sequence]) -> None:
        """Below min_tokens, EOS and stop tokens cannot be sampled."""
        rows, tokens = [], []
        for b, s in enumerate(seqs):
            if s.num_output_tokens < s.params.min_tokens:
                banned = set(s.params.stop_token_ids)
                if not s.params.ignore_eos:
                    banned |= set(self.eos_token_ids)
                rows.extend([b] * len(banned))
                tokens.extend(banned)
        if rows:
            logits[self.ops.asarray(np.array(rows, np.int32)), self.ops.asarray(np.array(tokens, np.int32))] = -np.inf

    def _logprob_dicts(self, raw, rows: list[int], seqs: list[Sequence], ids: list[int]):
        out: list[dict[int, float] | None] = [None] * len(seqs)
        if raw is None:
            return out
        host = self.ops.to_numpy(raw)                    # [len(rows), V]
        for r, b in enumerate(rows):
            k = seqs[b].params.logprobs
            row = host[r]
            d = {int(ids[b]): float(row[ids[b]])}
            if k:
                top = np.argpartition(-row, k - 1)[:k]
                for t in top[np.argsort(-row[top], kind="stable")]:
                    d.setdefault(int(t), float(row[t]))
            out[b] = d
        return out
