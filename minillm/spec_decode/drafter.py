"""The scheduler's side of speculation: which sequences propose, and how many drafts they may take.

A sequence proposes only when every one of its tokens is known on the host (the n-gram search
reads them); its drafts then ride on its next step as extra query tokens. While its drafts are
being verified its length is unknown, so nothing more is scheduled for it until the step is read
back; `needs_output_tokens` tells the engine when a step in flight must be read first.

Reading a step back before scheduling the next gives up the overlap of async scheduling, so after
a round of proposals that found nothing the engine keeps steps in flight for a while (1, 2, 4, 8
steps as such rounds repeat) before the sequences wait for their tokens to try again.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence as Seq

from minillm.sequence import Sequence
from minillm.spec_decode.config import SpeculativeConfig
from minillm.spec_decode.ngram import NgramProposer, TokenHistory

MAX_IDLE_STEPS = 8       # the longest run of steps kept in flight between proposal rounds


class Drafter:
    """Proposes drafts for running decoding sequences, within k, max_tokens and max_model_len."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = NgramProposer(config, max_model_len)
        # Each sequence's tokens as a NumPy array, appended to as it grows (gone with the sequence).
        self._histories: weakref.WeakKeyDictionary[Sequence, TokenHistory] = weakref.WeakKeyDictionary()
        self._idle_steps = 0     # steps left in which no sequence waits to propose
        self._backoff = 1        # the length of the next such run

    def is_enabled(self, num_running: int) -> bool:
        """False while more sequences run than disable_by_batch_size allows."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_running <= limit

    def max_num_drafts(self, seq: Sequence) -> int:
        """Drafts seq may take: k, less what max_tokens leaves after the token sampled with them."""
        return min(self.k, seq.max_tokens - seq.num_output_tokens - 1)

    def propose(self, seq: Sequence, max_num_tokens: int) -> list[int]:
        """Draft ids for a decoding sequence whose tokens are all known (at most max_num_tokens)."""
        limit = min(self.max_num_drafts(seq), max_num_tokens)
        if limit <= 0:
            return []
        history = self._histories.get(seq)
        if history is None:
            history = self._histories[seq] = TokenHistory(2 * len(seq.token_ids))
        return self.proposer.propose(history.sync(seq.token_ids), limit)

    def end_round(self, num_tried: int, num_proposed: int) -> None:
        """Count one schedule(): num_tried sequences looked for a proposal, num_proposed found one."""
        if self._idle_steps:
            self._idle_steps -= 1
        if num_proposed:
            self._backoff = 1
        elif num_tried:
            self._idle_steps = self._backoff
            self._backoff = min(2 * self._backoff, MAX_IDLE_STEPS)

    def needs_output_tokens(self, running: Seq[Sequence]) -> bool:
        """True when a running sequence has drafts in flight (its length is unknown until they are
        read back) or may propose once its token in flight is known (outside the idle runs)."""
        if any(s.spec_token_ids for s in running):
            return True
        if self._idle_steps or not self.is_enabled(len(running)):
            return False
        return any(s.num_output_placeholders and self.max_num_drafts(s) > 0 for s in running)
