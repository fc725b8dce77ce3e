"""Queues, throughput and latency percentiles."""
from __future__ import annotations

from rich.cells import cell_len
from rich.text import Text

from minillm.stats import EngineStats
from minillm.tui.panel import Panel
from minillm.tui.render import (COLOR_DECODE, COLOR_DIM, COLOR_PREFILL, fmt_number, fmt_percent, fmt_rate, fmt_seconds,
                                printable, spaced)

COLOR_RUNNING = "#87d75f"
COLOR_WAITING = "#ffd75f"
COLOR_PREEMPTED = "#ff5f87"
WIDE_LAYOUT_COLUMNS = 50
COLUMN_GAP = 3
LABEL_WIDTH = 12
RATE_LABEL_WIDTH = 8
LATENCY_WIDTH = 9   # one percentile column, right-aligned: "  210.8 ms"

# A row is a list of (text, style) parts, joined by render.spaced().
Parts = list[tuple[str, str]]


class QueuePanel(Panel):
    """Who is running, who waits, how fast tokens flow, how long users wait."""

    PANEL_TITLE = "scheduler"

    def render(self) -> Text:
        stats = self.stats
        if stats is None:
            return Text("waiting for stats…", style=COLOR_DIM)
        width, height = self.content_size
        rows = _wide_rows(stats)
        if width < WIDE_LAYOUT_COLUMNS or height < len(rows):
            rows = _compact_rows(stats)
        return Text("\n", no_wrap=True, overflow="ellipsis").join(spaced(*row) for row in rows)


def _wide_rows(stats: EngineStats) -> list[Parts]:
    """Queue counts on the left, rates and latencies on the right, then the finish reasons."""
    left, right = _queue_lines(stats), _rate_lines(stats)
    # The gap follows the widest left cell, so every right-hand label starts in one column.
    column = max(_width(line) for line in left) + COLUMN_GAP
    rows = []
    for i in range(max(len(left), len(right))):
        row = list(left[i]) if i < len(left) else []
        if i < len(right):
            row += [(" " * (column - _width(row)), "")] + right[i]
        rows.append(row)
    rows.append([(_finished(stats) or "—", COLOR_DIM)])
    return rows


def _width(parts: Parts) -> int:
    return sum(cell_len(text) for text, _ in parts)


def _finished(stats: EngineStats) -> str:
    return " · ".join(f"{printable(reason)} {count}" for reason, count in sorted(stats.num_requests_finished.items()))


def _queue_lines(stats: EngineStats) -> list[Parts]:
    return [
        _pair("running", f"{stats.num_running} / {stats.max_num_seqs}", COLOR_RUNNING),
        _pair("waiting", str(stats.num_waiting), COLOR_WAITING),
        _pair("preempted", str(stats.num_preempted), COLOR_PREEMPTED),
        _pair("preemptions", str(stats.num_preemptions), COLOR_PREEMPTED),
        _pair("steps", str(stats.num_steps), ""),
        _pair("finished", str(sum(stats.num_requests_finished.values())), ""),
    ]


def _rate_lines(stats: EngineStats) -> list[Parts]:
    return [
        _pair("prompt", f"{fmt_rate(stats.prompt_throughput)} tok/s", COLOR_PREFILL, RATE_LABEL_WIDTH),
        _pair("output", f"{fmt_rate(stats.generation_throughput)} tok/s", COLOR_DECODE, RATE_LABEL_WIDTH),
        [(" " * RATE_LABEL_WIDTH, ""), (f"{'p50':>{LATENCY_WIDTH}}", COLOR_DIM),
         (f" {'p99':>{LATENCY_WIDTH}}", COLOR_DIM)],
        _latency("TTFT", stats.ttft_p50_s, stats.ttft_p99_s),
        _latency("ITL", stats.itl_p50_s, stats.itl_p99_s),
    ] + ([_spec_decode_line(stats.spec_decode)] if stats.spec_decode is not None else [])


def _spec_decode_line(spec) -> Parts:
    """Speculative decoding: share of draft tokens accepted, tokens a verifying step yields."""
    rate, length = spec.acceptance_rate, spec.mean_acceptance_length
    # A server's totals may not add up (draft tokens but no drafts): each figure stands alone.
    shown_length = "—" if length is None else fmt_number(length)
    value = "no drafts yet" if rate is None else f"accept {fmt_percent(rate, 0)} · len {shown_length}"
    return _pair("spec", value, COLOR_DECODE, RATE_LABEL_WIDTH)


def _compact_rows(stats: EngineStats) -> list[Parts]:
    """Five short rows for narrow or short panels."""
    finished = sum(stats.num_requests_finished.values())
    return [
        [("run ", ""), (f"{stats.num_running}/{stats.max_num_seqs}", f"bold {COLOR_RUNNING}"),
         ("  wait ", ""), (str(stats.num_waiting), f"bold {COLOR_WAITING}"),
         ("  pre ", ""), (str(stats.num_preempted), f"bold {COLOR_PREEMPTED}")],
        [("preemptions ", ""), (str(stats.num_preemptions), f"bold {COLOR_PREEMPTED}"),
         (f"  done {finished}", "")],
        [("tok/s in ", ""), (fmt_rate(stats.prompt_throughput), f"bold {COLOR_PREFILL}"),
         ("  out ", ""), (fmt_rate(stats.generation_throughput), f"bold {COLOR_DECODE}")],
        _compact_latency("TTFT", stats.ttft_p50_s, stats.ttft_p99_s),
        _compact_latency("ITL", stats.itl_p50_s, stats.itl_p99_s),
    ]


def _pair(label: str, value: str, style: str, label_width: int = LABEL_WIDTH) -> Parts:
    return [(f"{label:<{label_width}}", ""), (value, f"bold {style}".strip())]


def _latency(label: str, p50: float | None, p99: float | None) -> Parts:
    return [(f"{label:<{RATE_LABEL_WIDTH}}", ""), (f"{fmt_seconds(p50):>{LATENCY_WIDTH}}", "bold"),
            (f" {fmt_seconds(p99):>{LATENCY_WIDTH}}", "bold")]


def _compact_latency(label: str, p50: float | None, p99: float | None) -> Parts:
    return [(f"{label:<5}p50 ", COLOR_DIM), (f"{fmt_seconds(p50):>8}", "bold"),
            (" p99 ", COLOR_DIM), (f"{fmt_seconds(p99):>8}", "bold")]
