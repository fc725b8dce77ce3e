"""The request table: one row per request, sortable by any column."""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from rich.cells import cell_len, set_cell_size
from rich.text import Text
from textual.widgets import DataTable

from minillm.stats import EngineStats, RequestStats
from minillm.tui.render import fmt_seconds, printable, request_color

ID_WIDTH = 18
MAX_ROWS = 100   # DataTable re-measures every row on change; the rest are summarised in the subtitle
FINISHED_SHOWN_S = 10.0   # a request that left the engine stays this long (snapshot time), marked finished
# The most finished rows kept, the newest: a server that ends thousands of requests within FINISHED_SHOWN_S
# would have every frame sort them all (a quarter of a second a frame at 20,000).
MAX_FINISHED_ROWS = 1024
STATE_ORDER = {"running": 0, "preempted": 1, "waiting": 2, "finished": 3}
STATE_COLORS = {"running": "#87d75f", "preempted": "#ff5f87", "waiting": "#ffd75f", "finished": "#6c6c6c"}


def natural_key(text: str) -> tuple:
    """Sort key that orders "req-2" before "req-10"."""
    # The split alternates text and runs of digits: odd parts are the digits. (str.isdigit() is also
    # true of "²", which int() refuses.)
    return tuple(int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", text)))


@dataclass(frozen=True)
class Column:
    """A table column: its label, how to sort by it, whether larger-first is the natural order."""

    key: str
    label: str
    sort_key: Callable[[RequestStats], object]
    descending: bool


def _ttft_key(r: RequestStats) -> tuple:
    return (r.ttft_s is None, r.ttft_s or 0.0)


COLUMNS = (
    Column("id", "request", lambda r: natural_key(r.request_id), False),
    Column("state", "state", lambda r: (STATE_ORDER.get(r.state, 9), natural_key(r.request_id)), False),
    Column("prompt", "prompt", lambda r: r.prompt_tokens, True),
    Column("output", "output", lambda r: r.output_tokens, True),
    Column("blocks", "blocks", lambda r: r.num_blocks, True),
    Column("cached", "cached", lambda r: r.num_cached_tokens, True),   # shown in blocks, as "blocks" is
    Column("ttft", "TTFT", _ttft_key, False),
)


def short_id(request_id: str, width: int = ID_WIDTH) -> str:
    """A request id cut to `width` terminal cells (server ids carry 32 hex digits), as it may be drawn."""
    shown = printable(request_id)
    return shown if cell_len(shown) <= width else set_cell_size(shown, width - 1) + "…"


def row_cells(r: RequestStats, block_size: int) -> tuple:
    """The displayed cells of one request: tokens for prompt and output, KV blocks for blocks and cached."""
    finished = r.state == "finished"
    marker = "◆ " if r.is_structured else "■ "         # ◆: its output is held to a grammar
    name = Text(marker, style=STATE_COLORS["finished"] if finished else request_color(r.request_id))
    name.append(short_id(r.request_id), style=STATE_COLORS["finished"] if finished else "")
    state = Text(printable(r.state), style=STATE_COLORS.get(r.state, ""))
    # Only full blocks are shared, so cached tokens are always a whole number of blocks.
    numbers = (r.prompt_tokens, r.output_tokens, r.num_blocks, r.num_cached_tokens // max(block_size, 1))
    style = STATE_COLORS["finished"] if finished else ""
    return (name, state, *(Text(str(n), justify="right", style=style) for n in numbers),
            Text(fmt_seconds(r.ttft_s), justify="right", style=style))


def is_queue_cut(stats: EngineStats) -> bool:
    """Whether the snapshot lists only the head of the waiting queue (the engine lists at most a few
    hundred): a request put back at its front (a preempted one) then pushes the last listed past it."""
    return sum(1 for r in stats.requests if r.state in ("waiting", "preempted")) < stats.num_waiting


class RequestTable(DataTable):
    """Sorted by one column at a time: `s` cycles the column, `S` flips the order, headers click.

    A request that leaves the engine's snapshot stays for FINISHED_SHOWN_S more, marked finished,
    so a short one can be seen at all (the newest MAX_FINISHED_ROWS of them).
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=True, cursor_foreground_priority="renderable")
        self.sort_index = 1
        self.sort_descending = COLUMNS[1].descending
        self.border_title = "requests"
        self._rows: dict[str, tuple] = {}
        self._order: list[str] = []
        self._requests: list[RequestStats] = []
        self._block_size = 1
        self._finished: dict[str, tuple[RequestStats, float]] = {}   # id -> (last row, when it left)

    def on_mount(self) -> None:
        for column in COLUMNS:
            self.add_column(column.label, key=column.key)
        self._update_subtitle()

    def show(self, stats: EngineStats) -> None:
        """Show the snapshot's requests, and those that left it lately, in the current sort order."""
        current = {r.request_id: r for r in stats.requests}
        # A waiting row missing from a cut queue may still wait: it is dropped, not shown finished.
        unlisted = ("finished", "waiting", "preempted") if is_queue_cut(stats) else ("finished",)
        for r in self._requests:
            if r.request_id not in current and r.state not in unlisted:
                self._finished[r.request_id] = (replace(r, state="finished"), stats.time)
        recent = [(rid, (r, left)) for rid, (r, left) in self._finished.items()
                  if rid not in current and 0 <= stats.time - left <= FINISHED_SHOWN_S]
        self._finished = dict(recent[-MAX_FINISHED_ROWS:])   # in the order they left: the newest last
        self._requests = list(stats.requests) + [r for r, _ in self._finished.values()]
        self._block_size = stats.block_size
        self._redraw()

    def forget_run(self) -> None:
        """Drop every row (the counters started over: they belong to another run, whose open requests
        ended with it and must not be shown as finished in the new one)."""
        self._finished.clear()
        self._requests = []

    def cycle_sort(self) -> None:
        """Sort by the next column, in that column's natural direction."""
        self.sort_by((self.sort_index + 1) % len(COLUMNS))

    def reverse_sort(self) -> None:
        """Flip the sort direction."""
        self.sort_descending = not self.sort_descending
        self._redraw()

    def sort_by(self, index: int) -> None:
        """Sort by column `index`; choosing the current column again flips the direction."""
        if index == self.sort_index:
            self.reverse_sort()
            return
        self.sort_index = index
        self.sort_descending = COLUMNS[index].descending
        self._redraw()

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        self.sort_by(event.column_index)

    def _update_subtitle(self) -> None:
        arrow = "▼" if self.sort_descending else "▲"
        shown = f"top {MAX_ROWS} of {len(self._requests)} · " if len(self._requests) > MAX_ROWS else ""
        self.border_subtitle = f"{shown}sort: {COLUMNS[self.sort_index].label} {arrow} · s/S"

    def _redraw(self) -> None:
        column = COLUMNS[self.sort_index]
        ordered = sorted(self._requests, key=column.sort_key, reverse=self.sort_descending)[:MAX_ROWS]
        self._update_subtitle()
        rows = {r.request_id: row_cells(r, self._block_size) for r in ordered}
        order = list(rows)  # a repeated id must not reach DataTable twice
        if order == self._order:
            for key, cells in rows.items():
                for column_def, old, new in zip(COLUMNS, self._rows[key], cells):
                    if old != new:
                        self.update_cell(key, column_def.key, new)
        else:
            self._rebuild(order, rows)
        self._rows, self._order = rows, order

    def _rebuild(self, order: list[str], rows: dict[str, tuple]) -> None:
        """Replace all rows, keeping the cursor on the same request when it is still there."""
        current = self._order[self.cursor_row] if 0 <= self.cursor_row < len(self._order) else None
        self.clear()
        for key in order:
            self.add_row(*rows[key], key=key)
        if current in rows:
            self.move_cursor(row=order.index(current), animate=False, scroll=False)
