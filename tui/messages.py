"""Messages the stats worker posts to the monitor app."""
from __future__ import annotations

from textual.message import Message

from minillm.stats import EngineStats


class StatsReceived(Message):
    """A new snapshot arrived."""

    def __init__(self, stats: EngineStats) -> None:
        super().__init__()
        self.stats = stats


class SourceProblemShown(Message):
    """The source failed; `message` says why, `retry_in_s` when it tries again (None: never)."""

    def __init__(self, message: str, retry_in_s: float | None) -> None:
        super().__init__()
        self.message = message
        self.retry_in_s = retry_in_s


class SourceStatusChanged(Message):
    """Where frames come from changed (connected, replaying, replay ended)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
