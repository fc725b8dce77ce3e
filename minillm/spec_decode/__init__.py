"""Speculative decoding: n-gram (prompt-lookup) proposals verified by the target model in one step.

    drafter.py   the scheduler's side: which sequences propose, their drafts (Drafter)
    verifier.py  the runner's side: logits rows, per-row rules, rejection sampling (DraftVerifier)
    rejection.py, rows.py, ngram.py, config.py, metrics.py: the parts they are built from

The Drafter and the DraftVerifier are imported and built only when `speculative_config` is given;
an engine without it never calls in here (SpecDecodeStats is only the type of EngineStats' field).
"""
from minillm.spec_decode.config import SpeculativeConfig
from minillm.spec_decode.metrics import SpecDecodeStats
from minillm.spec_decode.ngram import NgramProposer, TokenHistory
from minillm.spec_decode.rejection import RejectionSampler, SpecDecodeMetadata, rejection_sample
from minillm.spec_decode.rows import DraftRowView, draft_row_views

__all__ = ["DraftRowView", "NgramProposer", "RejectionSampler", "SpecDecodeMetadata", "SpecDecodeStats",
           "SpeculativeConfig", "TokenHistory", "draft_row_views", "rejection_sample"]
