"""KV usage and token utilisation of used blocks, each with a bar and a history sparkline."""
from __future__ import annotations

from rich.text import Text

from minillm.tui.panel import Panel
from minillm.tui.render import COLOR_CACHED, COLOR_DIM, fmt_percent, hbar, printable, sparkline, spaced

COLOR_USAGE = "#5fafff"
COLOR_UTIL = "#d787ff"
FULL_LAYOUT_ROWS = 7


class UsagePanel(Panel):
    """How full the pool is (blocks) and how full the used blocks are (token slots)."""

    PANEL_TITLE = "KV usage"

    def show(self, stats, history) -> None:
        """Take a new snapshot; the title names what the pool stores (e.g. fp8_e4m3) when reported."""
        # A Text, not a str: Textual reads a str title as markup, and the dtype's name is the server's.
        self.border_title = Text(printable(f"{self.PANEL_TITLE} · {stats.kv_cache_dtype}" if stats.kv_cache_dtype
                                           else self.PANEL_TITLE))
        super().show(stats, history)

    def render(self) -> Text:
        stats, history = self.stats, self.history
        if stats is None or history is None:
            return Text("waiting for stats…", style=COLOR_DIM)
        width, height = self.content_size
        blocks = f"{stats.kv_num_used_blocks}/{stats.kv_num_blocks} blocks"
        hits = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
        footer = spaced((f"{stats.kv_num_cached_blocks} cached", COLOR_CACHED),
                        (f" · prefix hits {fmt_percent(hits)}", COLOR_DIM))
        lines: list[Text] = []
        if height >= FULL_LAYOUT_ROWS:
            lines += _full_rows("KV usage", stats.kv_usage, blocks, history.kv_usage, width, COLOR_USAGE)
            lines += _full_rows(
                "token util", stats.kv_token_utilization, "of used slots", history.token_utilization, width, COLOR_UTIL
            )
        else:
            lines.append(_compact_row("KV", stats.kv_usage, history.kv_usage, width, COLOR_USAGE))
            lines.append(_compact_row("tok", stats.kv_token_utilization, history.token_utilization, width, COLOR_UTIL))
            # Two-space gaps instead of " · " keep the hit rate inside a 32-column panel.
            footer = spaced((f"{stats.kv_num_used_blocks}/{stats.kv_num_blocks} blk", COLOR_DIM),
                            (f"  {stats.kv_num_cached_blocks} cached", COLOR_CACHED),
                            (f"  hits {fmt_percent(hits, 0)}", COLOR_DIM))
        lines.append(footer)
        return Text("\n").join(lines)


def _full_rows(label: str, value: float, detail: str, series, width: int, color: str) -> list[Text]:
    """A heading with the value, a bar and the history sparkline on a fixed 0-100% scale."""
    head = spaced((f"{label:<11}", "bold"), (f"{fmt_percent(value):>6}", f"bold {color}"), (f"  {detail}", COLOR_DIM))
    return [head, hbar(value, width, color), sparkline(series, width, 1.0, color)]


def _compact_row(label: str, value: float, series, width: int, color: str) -> Text:
    """Label, value and sparkline on one line for short terminals."""
    row = spaced((f"{label:<4}", "bold"), (f"{fmt_percent(value):>6} ", f"bold {color}"))
    return row.append_text(sparkline(series, max(width - len(row), 0), 1.0, color))
