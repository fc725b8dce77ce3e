"""Prompt-lookup proposals: continue the sequence as it continued after an earlier copy of its tail.

The rule is vLLM's NgramProposer's: among the suffix n-grams of the tokens (prompt + output) with
prompt_lookup_min <= n <= prompt_lookup_max, take the longest one that also occurs earlier in the
tokens (an earlier copy may overlap the suffix), and propose up to k tokens that followed its
earliest occurrence. The earliest copy is the one with the most tokens after it, so a sequence that
repeats a short loop still gets k proposals, not one loop's worth.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from minillm.spec_decode.config import SpeculativeConfig


def find_ngram_proposal(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """tokens: [T] int -> up to k proposed ids (a slice of tokens; empty when nothing matches).

    alive[e] says that the suffix's last n tokens also end at position e < T-1; raising n by one
    is one vectorised compare of the tokens shifted by n against the suffix's next token back, so a
    call costs at most max_n passes over the tokens, whatever the tokens are, and one when the last
    token never occurred before.
    """
    total = tokens.shape[0]
    last = total - 1
    if k <= 0 or total < max(min_n, 2):
        return tokens[:0]
    alive = tokens[:last] == tokens[last]               # [T-1] copies of the 1-gram suffix end here
    if not alive.any():
        return tokens[:0]
    longest = 1
    for n in range(2, min(max_n, last) + 1):
        # A copy of the n-gram ends at e >= n-1 when the (n-1)-gram does and tokens[e-n+1] matches.
        longer = alive[n - 1:] & (tokens[:last - n + 1] == tokens[last - n + 1])
        if not longer.any():
            break
        alive[:n - 1] = False
        alive[n - 1:] = longer
        longest = n
    if longest < min_n:
        return tokens[:0]
    start = int(np.argmax(alive)) + 1                   # after the earliest copy of the longest n-gram
    return tokens[start:start + k]


class NgramProposer:
    """Proposes draft tokens for one sequence at a time from its own tokens."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int | None = None):
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, token_ids: np.ndarray | Sequence[int], max_num_tokens: int | None = None) -> list[int]:
        """Draft ids for the tokens so far (prompt + output): at most k, max_num_tokens and what
        max_model_len leaves after the verified token; [] when no n-gram matches.

        Pass a NumPy array (a TokenHistory view) for long contexts: a list is converted every call.
        """
        tokens = (token_ids if isinstance(token_ids, np.ndarray)
                  else np.fromiter(token_ids, dtype=np.int64, count=len(token_ids)))
        limit = self.k
        if max_num_tokens is not None:
            limit = min(limit, max_num_tokens)
        if self.max_model_len is not None:
            # The step also samples one token past the drafts, and that one must fit too.
            limit = min(limit, self.max_model_len - tokens.shape[0] - 1)
        return find_ngram_proposal(tokens, self.min_n, self.max_n, limit).tolist()


class TokenHistory:
    """A sequence's tokens as a growable NumPy array, synced from its token list by appending."""

    def __init__(self, capacity: int = 256):
        self._buf = np.empty(max(capacity, 1), dtype=np.int32)   # [capacity]
        self._len = 0

    def __len__(self) -> int:
        return self._len

    @property
    def tokens(self) -> np.ndarray:
        """The synced tokens: [len] int32, a view valid until the next sync."""
        return self._buf[:self._len]

    def sync(self, token_ids: Sequence[int], num_tokens: int | None = None) -> np.ndarray:
        """Bring the array up to token_ids[:num_tokens] (default all) and return it.

        Appends what is new; a shorter or rewritten list (checked at its last synced token) is
        copied again in full.
        """
        n = len(token_ids) if num_tokens is None else num_tokens
        have = self._len
        if have > n or (have and token_ids[have - 1] != self._buf[have - 1]):
            have = 0
        if n > self._buf.shape[0]:
            grown = np.empty(max(n, 2 * self._buf.shape[0]), dtype=np.int32)
            grown[:have] = self._buf[:have]
            self._buf = grown
        if n > have:
            self._buf[have:n] = token_ids[have:n]
        self._len = n
        return self._buf[:n]
