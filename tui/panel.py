"""The base of every dashboard panel: a focusable bordered widget redrawn from the latest snapshot."""
from __future__ import annotations

from textual.widget import Widget

from minillm.stats import EngineStats
from minillm.tui.history import StatsHistory


class Panel(Widget, can_focus=True):
    """Holds the latest snapshot and history; subclasses render them."""

    PANEL_TITLE = ""

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.stats: EngineStats | None = None
        self.history: StatsHistory | None = None
        self.border_title = self.PANEL_TITLE

    def show(self, stats: EngineStats, history: StatsHistory) -> None:
        """Take a new snapshot and redraw."""
        self.stats = stats
        self.history = history
        self.refresh()
