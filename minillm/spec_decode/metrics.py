"""SpecDecodeStats: drafts proposed and accepted, with vLLM's spec_decode counter names."""
from __future__ import annotations

from dataclasses import dataclass, field

# Prometheus counters under minillm:, as vLLM names them under vllm: (name, help, attribute).
COUNTERS = (
    ("minillm:spec_decode_num_drafts", "Number of spec decoding drafts.", "num_drafts"),
    ("minillm:spec_decode_num_draft_tokens", "Number of draft tokens.", "num_draft_tokens"),
    ("minillm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "num_accepted_tokens"),
)
# One counter per draft position, labelled position="0".."k-1".
PER_POSITION_COUNTER = ("minillm:spec_decode_num_accepted_tokens_per_pos",
                        "Accepted tokens per draft position.", "position")


@dataclass
class SpecDecodeStats:
    """Running totals of speculation: a draft is one sequence's proposal verified in one step."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)   # [num_spec_tokens]

    def __post_init__(self) -> None:
        if self.num_spec_tokens < 1:
            raise ValueError(f"num_spec_tokens must be >= 1, got {self.num_spec_tokens}")
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens
        elif len(self.num_accepted_tokens_per_pos) != self.num_spec_tokens:
            raise ValueError(f"num_accepted_tokens_per_pos must have {self.num_spec_tokens} entries, "
                             f"got {len(self.num_accepted_tokens_per_pos)}")

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one verified draft: its length and how many of its leading tokens were accepted."""
        if not 0 < num_draft_tokens <= self.num_spec_tokens:
            raise ValueError(f"num_draft_tokens must be in [1, {self.num_spec_tokens}], got {num_draft_tokens}")
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(f"num_accepted_tokens must be in [0, {num_draft_tokens}], got {num_accepted_tokens}")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1

    def merge(self, other: "SpecDecodeStats") -> None:
        """Add another set of totals (of the same k) into this one."""
        if other.num_spec_tokens != self.num_spec_tokens:
            raise ValueError(f"cannot merge stats of k={other.num_spec_tokens} into k={self.num_spec_tokens}")
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for pos, n in enumerate(other.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[pos] += n

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens / draft tokens; None before any draft."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a draft step yields on average, the recovered or bonus token included (vLLM's figure)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def acceptance_rate_per_pos(self) -> list[float] | None:
        """Per position j: drafts whose token j was accepted / drafts (vLLM's denominator)."""
        if not self.num_drafts:
            return None
        return [n / self.num_drafts for n in self.num_accepted_tokens_per_pos]

    def to_dict(self) -> dict:
        """JSON-ready totals and derived figures (for /v1/stats and the monitor)."""
        return {"num_spec_tokens": self.num_spec_tokens, "num_drafts": self.num_drafts,
                "num_draft_tokens": self.num_draft_tokens, "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
                "acceptance_rate": self.acceptance_rate, "mean_acceptance_length": self.mean_acceptance_length,
                "acceptance_rate_per_pos": self.acceptance_rate_per_pos}


def interval_log_line(now: SpecDecodeStats | None, last: SpecDecodeStats | None, elapsed_s: float) -> str | None:
    """vLLM's "SpecDecoding metrics:" log line for the drafts verified since `last` (None before the
    first interval); None when no draft was verified in it or speculation is off."""
    if now is None:
        return None
    drafts = now.num_drafts - (last.num_drafts if last else 0)
    if drafts <= 0:
        return None
    drafted = now.num_draft_tokens - (last.num_draft_tokens if last else 0)
    accepted = now.num_accepted_tokens - (last.num_accepted_tokens if last else 0)
    per_pos = [n - (last.num_accepted_tokens_per_pos[i] if last else 0)
               for i, n in enumerate(now.num_accepted_tokens_per_pos)]
    elapsed_s = max(elapsed_s, 1e-9)
    return (f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
            f"Accepted throughput: {accepted / elapsed_s:.2f} tokens/s, "
            f"Drafted throughput: {drafted / elapsed_s:.2f} tokens/s, "
            f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
            f"Per-position acceptance rate: {', '.join(f'{n / drafts:.3f}' for n in per_pos)}, "
            f"Avg Draft acceptance rate: {100 * accepted / drafted:.1f}%")
