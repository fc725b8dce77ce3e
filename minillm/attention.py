"""AttentionMetadata: where each sequence's history lives and where new K/V go, for one step."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class AttentionMetadata:
    """Ragged batch description passed explicitly to every attention and KV-append op.

    Arrays live on the backend's device (numpy on the CPU, cupy on the GPU).
    """

    query_start_loc: np.ndarray   # [B+1] int32: query tokens of seq b are rows qsl[b]:qsl[b+1]
    seq_lens: np.ndarray          # [B] int32: context length of seq b after this step's tokens
    block_tables: np.ndarray      # [B, max_blocks] int32: physical block ids, padded with 0
    slot_mapping: np.ndarray      # [T] int32: block * block_size + offset per new token; -1 skips
    max_query_len: int
    max_seq_len: int
    is_decode_only: bool          # every sequence has exactly one query token
    # The first num_decode_seqs sequences have one query token each (the scheduler puts them first):
    # on the GPU a mixed step runs them through the decode kernel and the rest through the prefill
    # kernel, whose tiles would spend most of their work on a one-token chunk.
    num_decode_seqs: int = 0
    # Key splits of the GPU's prefill kernel (None: chosen from the grid and the chunks' longest
    # context; 1: none). Captured graphs replaying shorter contexts than their capture's set 1.
    prefill_kv_splits: int | None = None
    # The longest context among the chunks (the sequences after the decode rows); 0: max_seq_len.
    # A fresh prompt's chunk beside long-running decodes splits no keys.
    prefill_max_seq_len: int = 0
