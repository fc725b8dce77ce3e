"""Speculative decoding: n-gram (prompt-lookup) proposals verified by the target model in one step.

Built only when `speculative_config` is given; nothing here is imported by requests that do not use it.
"""
from minillm.spec_decode.config import SpeculativeConfig
from minillm.spec_decode.metrics import SpecDecodeStats
from minillm.spec_decode.ngram import NgramProposer, TokenHistory
from minillm.spec_decode.rejection import RejectionSampler, SpecDecodeMetadata, rejection_sample
from minillm.spec_decode.rows import DraftRowView, draft_row_views

__all__ = ["DraftRowView", "NgramProposer", "RejectionSampler", "SpecDecodeMetadata", "SpecDecodeStats",
           "SpeculativeConfig", "TokenHistory", "draft_row_views", "rejection_sample"]
