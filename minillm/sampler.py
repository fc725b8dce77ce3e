"""Sampler: per-sequence sampling parameters -> arrays -> one op call per rule, nothing waits."""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np

from minillm.sequence import Sequence


@dataclass
class SamplerOutput:
    """A batch's sampled ids and log-probabilities, still on the device."""

    token_ids: object                # [B] int32
    logprobs: object | None          # [len(logprob_rows), V] float32, or None when nobody asked
    logprob_rows: list[int]          # batch rows that asked for log-probabilities


class Sampler:
    """Turns a batch of logits into next tokens (and log-probabilities when asked)."""

    def __init__(self, ops: ModuleType, eos_token_ids: list[int]):
        self.ops = ops
        self.eos_token_ids = list(eos_token_ids)

    def sample_no_sync(self, logits, seqs: list[Sequence], grammar_bitmask=None) -> SamplerOutput:
        """logits: [B, V] float32 (modified in place) -> the sampled ids, left on the device.

        Each sequence already counts the token being sampled among its outputs (a placeholder).
        grammar_bitmask (structured outputs' GrammarBitmask, on the host) masks its rows first.
        """
        ops = self.ops
        if grammar_bitmask is not None:
            self.apply_grammar_bitmask(logits, grammar_bitmask)   # before every other rule, as vLLM
        rows = [b for b, s in enumerate(seqs) if s.params.logprobs is not None]
        raw_logprobs = ops.log_softmax(logits[rows]) if rows else None   # before penalties, as vLLM
        self.apply_penalties_and_bans(logits, seqs)
        temperature = np.array([s.params.temperature for s in seqs], np.float32)
        top_k = np.array([max(s.params.top_k, 0) for s in seqs], np.int32)
        top_p = np.array([s.params.top_p for s in seqs], np.float32)
        min_p = np.array([s.params.min_p for s in seqs], np.float32)
        # One draw per non-greedy sequence from its own generator: results do not depend on the batch.
        uniforms = np.array([0.0 if s.params.is_greedy else s.rng.random() for s in seqs], np.float32)
        ids = ops.sample(logits, ops.asarray(temperature), ops.asarray(top_k), ops.asarray(top_p),
                         ops.asarray(min_p), ops.asarray(uniforms))
        return SamplerOutput(ids, raw_logprobs, rows)

    def apply_penalties_and_bans(self, logits, seqs) -> None:
        """logits: [B, V] float32, in place: repetition / presence / frequency penalties, and the
        min_tokens ban of EOS and stop tokens. seqs: one per row (a Sequence or a view with its
        params, prompt_token_ids, output_counts and num_output_tokens)."""
        self._apply_penalties(logits, seqs)
        self._block_early_stops(logits, seqs)

    def apply_grammar_bitmask(self, logits, mask) -> None:
        """Tokens a constrained row's grammar forbids get -inf: one upload of the filled rows,
        scattered into a [B, W] buffer whose other rows the kernel never reads."""
        ops = self.ops
        rows = ops.asarray(mask.rows)                                   # [N] int32
        bitmask = ops.xp.empty((logits.shape[0], mask.bitmask.shape[1]), dtype=np.int32)   # [B, W]
        bitmask[rows] = ops.asarray_async(mask.bitmask)          # ~1 MB a step: never wait for the stream
        ops.apply_token_bitmask(logits, bitmask, rows)

    def _apply_penalties(self, logits, seqs: list[Sequence]) -> None:
        rows, tokens, counts, in_prompt = [], [], [], []
        for b, s in enumerate(seqs):
            p = s.params
            if not p.needs_output_counts:
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
        vocab = logits.shape[1]
        for b, s in enumerate(seqs):
            if s.num_output_tokens - 1 < s.params.min_tokens:   # outputs before the one sampled now
                banned = set(s.params.stop_token_ids)
                if not s.params.ignore_eos:
                    banned |= set(self.eos_token_ids)
                banned = [t for t in banned if 0 <= t < vocab]
                rows.extend([b] * len(banned))
                tokens.extend(banned)
        if rows:
            logits[self.ops.asarray(np.array(rows, np.int32)), self.ops.asarray(np.array(tokens, np.int32))] = -np.inf

    @staticmethod
    def logprob_dicts(host: np.ndarray | None, rows: list[int], seqs: list[Sequence],
                      ids: list[int]) -> list[dict[int, float] | None]:
        """host: [len(rows), V] log-probabilities -> per sequence {sampled id and top-k ids: logprob}."""
        out: list[dict[int, float] | None] = [None] * len(seqs)
        if host is None:
            return out
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
