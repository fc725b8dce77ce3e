"""The KV block pool as a grid of cells: free, cached-free prefix blocks, used (coloured by request);
with a host tier (--kv-offload-gib), its blocks as a second strip below; on a prefill server
(--kv-role producer), the blocks leased to decode servers. The subtitle carries the KV transfer's
figures: leases held, or prompt tokens loaded and the copy rate."""
from __future__ import annotations

import array
from collections import Counter
from dataclasses import dataclass

import numpy as np

from rich.text import Text
from textual.message import Message

from minillm.engine_stats import human_bytes
from minillm.stats import CELL_CACHED, CELL_FREE, CELL_LEASED
from minillm.tui.panel import Panel
from minillm.tui.render import COLOR_CACHED, COLOR_DIM, COLOR_FREE, COLOR_LEASED, REQUEST_COLORS, request_color

CELL_WIDTH = 2     # "■ ", the smallest tile: terminal cells are about twice as tall as wide
LEGEND_ROWS = 1
HOST_LABEL = "host "


# Past this many blocks a block map is folded with NumPy: a server that does not fold its map into
# the cells asked for may send a million blocks, which Counter folds at 70 to 170 ns a block and NumPy
# at 40 to 90 (most of it reading the list).
NUMPY_FOLD_FROM = 65536
MAX_FOLD_COUNTS = 1 << 22     # cells x distinct states counted at once (32 MiB)


def merge_cells(block_map: list[int], num_cells: int) -> tuple[list[int], int]:
    """Fold a block map into at most `num_cells` cells, each showing its group's commonest state."""
    if num_cells <= 0 or len(block_map) <= num_cells:
        return list(block_map), 1
    group = -(-len(block_map) // num_cells)
    merged = _commonest_by_group(block_map, group) if len(block_map) >= NUMPY_FOLD_FROM else None
    if merged is None:
        merged = [Counter(block_map[i : i + group]).most_common(1)[0][0] for i in range(0, len(block_map), group)]
    return merged, group


def _commonest_by_group(block_map: list[int], group: int) -> list[int] | None:
    """The commonest state of each run of `group` blocks (the smallest of those tied, as the server
    folds), counted by NumPy; None when the states do not fit that count (past 64 bits, or too many)."""
    try:
        states = np.frombuffer(array.array("q", block_map), dtype=np.int64)   # [num_blocks]
    except OverflowError:
        return None
    low = int(states.min())
    span = int(states.max()) - low + 1
    num_groups = -(-len(states) // group)
    if span * num_groups > MAX_FOLD_COUNTS:
        return None
    rows = np.arange(len(states)) // group
    # counts: [num_groups, span], how often each state occurs in each group
    counts = np.bincount(rows * span + (states - low), minlength=num_groups * span).reshape(num_groups, span)
    return (counts.argmax(axis=1) + low).tolist()


@dataclass(frozen=True)
class Tile:
    """How one cell is drawn: `lines` rows of glyphs, each followed by a one-column gap."""

    lines: tuple[str, ...]

    @property
    def width(self) -> int:
        return len(self.lines[0]) + 1


# Largest first: a small pool gets big tiles so it still fills the panel. The last row of a tall
# tile (or the top eighth of a short one) is left empty to separate the rows of cells.
TILES = (
    Tile(("█████", "█████", "▀▀▀▀▀")),
    Tile(("███", "▀▀▀")),
    Tile(("▆▆",)),
    Tile(("■",)),
)


def pick_tile(num_cells: int, width: int, rows: int) -> Tile:
    """The largest tile at which `num_cells` cells fit in width x rows."""
    for tile in TILES[:-1]:
        columns = width // tile.width
        if columns and -(-num_cells // columns) * len(tile.lines) <= rows:
            return tile
    return TILES[-1]


class BlockGrid(Panel):
    """Each cell covers block_map_blocks_per_cell blocks; the server downsamples to our cell count."""

    PANEL_TITLE = "KV block pool"
    _cells_asked = 0
    _folded: tuple[list[int], int, list[int], int] | None = None   # (the block map, cells, merged, group)

    class CellsWanted(Message):
        """The grid's room changed (a resize, the host strip coming or going): ask the source for this many cells."""

        def __init__(self, cells: int) -> None:
            super().__init__()
            self.cells = cells

    def grid_shape(self) -> tuple[int, int]:
        """(columns, rows) of cells that fit in the content area above the legend."""
        width, height = self.content_size
        host_rows = 1 if self.stats is not None and self.stats.kv_offload_num_blocks else 0
        return max(width // CELL_WIDTH, 1), max(height - LEGEND_ROWS - host_rows, 1)

    def capacity(self) -> int:
        """How many cells fit."""
        columns, rows = self.grid_shape()
        return columns * rows

    def on_resize(self) -> None:
        self._ask_for_cells()
        # The cells now fold another number of blocks, though no frame came (paused, or a replay held).
        self._update_subtitle()

    def show(self, stats, history) -> None:
        """Take a new snapshot; the subtitle says how many blocks one cell stands for."""
        super().show(stats, history)
        # The host tier's strip takes a row when it appears and gives it back when it goes.
        if self.capacity() != self._cells_asked:
            self._ask_for_cells()
        self._update_subtitle()

    def _ask_for_cells(self) -> None:
        self._cells_asked = self.capacity()
        self.post_message(self.CellsWanted(self._cells_asked))

    def _update_subtitle(self) -> None:
        stats = self.stats
        if stats is None:
            return
        _, group = self.folded_cells(stats.block_map, self.capacity())
        blocks_per_cell = stats.block_map_blocks_per_cell * group
        subtitle = f"{stats.kv_num_blocks} blocks × {stats.block_size} tok · {blocks_per_cell}/cell"
        if stats.kv_offload_num_blocks:
            subtitle += f" · host {stats.kv_offload_num_used_blocks}/{stats.kv_offload_num_blocks}"
        self.border_subtitle = subtitle + transfer_summary(stats)

    def render(self) -> Text:
        stats = self.stats
        if stats is None:
            return Text("waiting for stats…", style=COLOR_DIM)
        if not stats.block_map:
            return Text("the server sent no block map", style=COLOR_DIM)
        columns, rows = self.grid_shape()
        cells, _ = self.folded_cells(stats.block_map, columns * rows)
        tile = pick_tile(len(cells), self.content_size.width, rows)
        columns = max(self.content_size.width // tile.width, 1)
        colors = [request_color(r.request_id) for r in stats.requests]
        text = Text(no_wrap=True, overflow="crop")
        for start in range(0, len(cells), columns):
            styles = [_cell_color(cell, colors) for cell in cells[start : start + columns]]
            for glyphs in tile.lines:
                for style in styles:
                    text.append(glyphs, style=style).append(" ")
                text.append("\n")
        if stats.kv_offload_num_blocks:
            text.append_text(self._host_strip(stats)).append("\n")
        text.append_text(self._legend(stats.kv_transfer_role in ("kv_producer", "kv_both")))
        return text

    def folded_cells(self, block_map: list[int], num_cells: int) -> tuple[list[int], int]:
        """merge_cells of the snapshot's block map, folded once per snapshot and size: a server that
        sends every block (a million of them) is folded once a frame, not at every redraw."""
        folded = self._folded
        if folded is None or folded[0] is not block_map or folded[1] != num_cells:
            folded = self._folded = (block_map, num_cells, *merge_cells(block_map, num_cells))
        return folded[2], folded[3]

    def _host_strip(self, stats) -> Text:
        """The host tier in one row of the smallest tile: blocks holding a prefix block as cached."""
        columns = max((self.content_size.width - len(HOST_LABEL)) // CELL_WIDTH, 1)
        cells, _ = merge_cells(stats.kv_offload_block_map, columns)
        strip = Text(no_wrap=True, overflow="crop")
        strip.append(HOST_LABEL, style=COLOR_DIM)
        for cell in cells:
            strip.append(TILES[-1].lines[0], style=_cell_color(cell, [])).append(" ")
        return strip

    def _legend(self, leases: bool = False) -> Text:
        legend = Text(no_wrap=True, overflow="ellipsis")
        # Each gap ends the run before it (see render.spaced) so exported SVGs keep it.
        legend.append("■", style=REQUEST_COLORS[0]).append("■ ", style=REQUEST_COLORS[1])
        legend.append("used  ").append("■ ", style=COLOR_CACHED).append("cached  ")
        if leases:
            legend.append("■ ", style=COLOR_LEASED).append("leased  ")
        legend.append("■ ", style=COLOR_FREE).append("free")
        return legend


def transfer_summary(stats) -> str:
    """The KV transfer's figures for the subtitle: a prefill server's leases, a decode server's loads."""
    parts = []
    if stats.kv_transfer_role in ("kv_producer", "kv_both"):
        parts.append(f"leased {stats.kv_transfer_num_leased_blocks} blk ({stats.kv_transfer_num_leases} leases, "
                     f"{stats.kv_transfer_leases_expired} expired)")
    if stats.kv_transfer_role in ("kv_consumer", "kv_both"):
        parts.append(f"KV in {stats.kv_transfer_tokens} tok, {human_bytes(stats.kv_transfer_bytes_per_s)}/s")
    return "".join(f" · {p}" for p in parts)


def _cell_color(cell: int, colors: list[str]) -> str:
    """The colour of one cell's state."""
    if cell == CELL_FREE:
        return COLOR_FREE
    if cell == CELL_CACHED:
        return COLOR_CACHED
    if cell == CELL_LEASED:
        return COLOR_LEASED
    if 0 <= cell < len(colors):
        return colors[cell]
    return "#ffffff"  # a used block whose owner row was not sent
