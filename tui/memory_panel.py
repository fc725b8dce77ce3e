"""Device memory split: weights, KV pool, the rest, as one stacked bar."""
from __future__ import annotations

from rich.text import Text

from minillm.tui.panel import Panel
from minillm.tui.render import COLOR_DIM, COLOR_FREE, fmt_bytes, printable

COLOR_WEIGHTS = "#ffaf5f"
COLOR_KV = "#5fafff"
COLOR_OTHER = "#af87d7"


def split_widths(parts: list[int], total: int, width: int) -> list[int]:
    """Integer widths for parts of `total` across `width` columns (largest remainder; small parts stay visible)."""
    # A negative figure (another server's, a damaged recording's) draws nothing, and parts past the
    # total share the width: a part of -2**62 bytes made the bar trillions of cells long (MemoryError).
    parts = [max(part, 0) for part in parts]
    total = max(total, sum(parts))
    if total <= 0 or width <= 0:
        return [0] * len(parts)
    exact = [p / total * width for p in parts]
    widths = [int(e) for e in exact]
    for i in sorted(range(len(parts)), key=lambda i: exact[i] - widths[i], reverse=True):
        if sum(widths) >= width:
            break
        widths[i] += 1
    # A non-empty part keeps one column so it never vanishes from the bar.
    for i, part in enumerate(parts):
        if part > 0 and widths[i] == 0 and max(widths) > 1:
            widths[widths.index(max(widths))] -= 1
            widths[i] = 1
    return widths


class MemoryPanel(Panel):
    """Where the device memory went."""

    PANEL_TITLE = "memory"

    def show(self, stats, history) -> None:
        """Take a new snapshot; the subtitle names the total and the device."""
        memory = stats.memory
        used = memory.weights_bytes + memory.kv_pool_bytes + memory.other_bytes
        # A Text, not a str: Textual reads a str title as markup, and the device name is the server's.
        self.border_subtitle = Text(printable(f"{fmt_bytes(max(memory.total_bytes, used))} {stats.device}"))
        super().show(stats, history)

    def render(self) -> Text:
        stats = self.stats
        if stats is None:
            return Text("waiting for stats…", style=COLOR_DIM)
        memory = stats.memory
        used = memory.weights_bytes + memory.kv_pool_bytes + memory.other_bytes
        total = max(memory.total_bytes, used)
        parts = [
            ("weights", memory.weights_bytes, COLOR_WEIGHTS),
            ("KV pool", memory.kv_pool_bytes, COLOR_KV),
            ("other", memory.other_bytes, COLOR_OTHER),
            ("free", total - used, COLOR_FREE),
        ]
        width, height = self.content_size
        bar = Text(no_wrap=True)
        widths = split_widths([value for _, value, _ in parts], total, width)
        for part_width, (_, _, color) in zip(widths, parts):
            bar.append("█" * part_width, style=color)
        if height < 3:
            # One legend row: a shorter KV label so weights and KV fit 32 columns.
            parts[1] = ("KV", memory.kv_pool_bytes, COLOR_KV)
            rows = [parts]
        else:
            rows = [parts[:2], parts[2:]]
        return Text("\n").join([bar] + [_legend(row, width) for row in rows])


def _legend(parts: list[tuple[str, int, str]], width: int) -> Text:
    """Legend entries of one row; an entry that does not fit whole is left out rather than cut."""
    line = Text(no_wrap=True, overflow="crop")
    for name, value, color in parts:
        if name == "free" and value == 0:
            continue  # the host backend reports no headroom
        entry = Text().append("■ ", style=color).append(f"{name} ").append(fmt_bytes(value), style="bold")
        if len(line) + len(entry) > width:
            break
        line.append_text(entry).append("  ")
    return line
