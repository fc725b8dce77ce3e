"""allowed_token_ids (vLLM's): a row samples only from these tokens.

The sampler keeps a row's allowed logits, fills the row with -inf and writes them back, before
every other rule (vLLM masks them first too): three indexing operations over entries packed with
the other per-row inputs, the same on NumPy and CuPy arrays, with no kernel of its own. A request
without the option adds no entry. EOS ends a sequence only when sampled, so a set without it runs
to max_tokens.
"""
from __future__ import annotations

import numpy as np


def allowed_entries(seqs, rows) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(rows [A], tokens [A]) int32 with one entry per allowed token of the rows, and the rows once
    each (the rows to mask). seqs: one per row (a Sequence or a view with params)."""
    ids = [seqs[b].params._allowed_entries for b in rows]          # each [n_b] int32, distinct
    out_rows = np.repeat(np.asarray(rows, np.int32), [len(a) for a in ids])
    return out_rows, np.concatenate(ids), list(rows)


def keep_only_allowed(logits, rows, tokens, masked_rows) -> None:
    """logits: [B, V] float32, in place: -inf across masked_rows [R] except at (rows [A], tokens [A])."""
    kept = logits[rows, tokens]                   # [A]
    logits[masked_rows] = -np.inf                 # [R, V]
    logits[rows, tokens] = kept
