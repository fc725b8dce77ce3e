"""Queues, throughput and latency percentiles."""
from __future__ import annotations

from rich.text import Text

from minillm.stats import EngineStats
from tui.panel import Panel
from tui.render import COLOR_DECODE, COLOR_DIM, COLOR_PREFILL, fmt_rate, fmt_seconds

COLOR_RUNNING = "#87d75f"
COLOR_WAITING = "#ffd75f"
COLOR_PREEMPTED = "#ff5f87"
WIDE_LAYOUT_COLUMNS = 50


class QueuePanel(Panel):
    """Who is running, who waits, how fast tokens flow, how long users wait."""

    PANEL_TITLE = "scheduler"

    def render(self) -> Text:
        stats = self.stats
        if stats is None:
            return Text("waiting for stats…", style=COLOR_DIM)
        if self.content_size.width >= WIDE_LAYOUT_COLUMNS:
            left, right = _queue_lines(stats), _rate_lines(stats)
            width = max(len(line) for line in left) + 3
            rows = []
            for i in range(max(len(left), len(right))):
                row = left[i].copy() if i < len(left) else Text()
                row.pad_right(width - len(row))
                rows.append(row.append_text(right[i] if i < len(right) else Text()))
            return Text("\n").join(rows)
        return Text("\n").join(_compact_lines(stats))


def _finished(stats: EngineStats) -> str:
    return " ".join(f"{reason} {count}" for reason, count in sorted(stats.num_requests_finished.items()))


def _queue_lines(stats: EngineStats) -> list[Text]:
    finished = sum(stats.num_requests_finished.values())
    return [
        _pair("running", f"{stats.num_running} / {stats.max_num_seqs}", COLOR_RUNNING),
        _pair("waiting", str(stats.num_waiting), COLOR_WAITING),
        _pair("preempted", str(stats.num_preempted), COLOR_PREEMPTED),
        _pair("preemptions", str(stats.num_preemptions), COLOR_PREEMPTED),
        _pair("finished", str(finished), "bold"),
        Text(_finished(stats) or " ", style=COLOR_DIM),
    ]


def _rate_lines(stats: EngineStats) -> list[Text]:
    return [
        _pair("prompt", f"{fmt_rate(stats.prompt_throughput)} tok/s", COLOR_PREFILL, 8),
        _pair("output", f"{fmt_rate(stats.generation_throughput)} tok/s", COLOR_DECODE, 8),
        Text(f"{'':8}{'p50':>9} {'p99':>9}", style=COLOR_DIM),
        _latency("TTFT", stats.ttft_p50_s, stats.ttft_p99_s),
        _latency("ITL", stats.itl_p50_s, stats.itl_p99_s),
        _pair("steps", str(stats.num_steps), "", 8),
    ]


def _compact_lines(stats: EngineStats) -> list[Text]:
    queues = Text("run ").append(f"{stats.num_running}/{stats.max_num_seqs}", style=f"bold {COLOR_RUNNING}")
    queues.append("  wait ").append(str(stats.num_waiting), style=f"bold {COLOR_WAITING}")
    queues.append("  pre ").append(str(stats.num_preempted), style=f"bold {COLOR_PREEMPTED}")
    finished = sum(stats.num_requests_finished.values())
    counts = Text("preemptions ").append(str(stats.num_preemptions), style=f"bold {COLOR_PREEMPTED}")
    counts.append(f" · done {finished}")
    rates = Text("tok/s in ").append(fmt_rate(stats.prompt_throughput), style=f"bold {COLOR_PREFILL}")
    rates.append(" out ").append(fmt_rate(stats.generation_throughput), style=f"bold {COLOR_DECODE}")
    return [
        queues,
        counts,
        rates,
        _compact_latency("TTFT", stats.ttft_p50_s, stats.ttft_p99_s),
        _compact_latency("ITL", stats.itl_p50_s, stats.itl_p99_s),
    ]


def _pair(label: str, value: str, style: str, label_width: int = 12) -> Text:
    return Text(f"{label:<{label_width}}").append(value, style=f"bold {style}".strip())


def _latency(label: str, p50: float | None, p99: float | None, label_width: int = 8) -> Text:
    row = Text(f"{label:<{label_width}}")
    row.append(f"{fmt_seconds(p50):>9}", style="bold").append(f" {fmt_seconds(p99):>9}", style="bold")
    return row


def _compact_latency(label: str, p50: float | None, p99: float | None) -> Text:
    row = Text(f"{label:<5}p50 ", style=COLOR_DIM).append(f"{fmt_seconds(p50):>8}", style="bold")
    return row.append(" p99 ", style=COLOR_DIM).append(f"{fmt_seconds(p99):>8}", style="bold")
