"""Batch composition per engine step: decode and prefill tokens stacked against the token budget."""
from __future__ import annotations

from rich.style import Style
from rich.text import Text

from minillm.stats import StepStats
from minillm.tui.panel import Panel
from minillm.tui.render import COLOR_DECODE, COLOR_DIM, COLOR_PREFILL, COLOR_SEQS, EIGHTHS, fmt_seconds, sparkline, spaced

AXIS_WIDTH = 5      # "512┤" and friends
FOOTER_ROWS = 2     # the sequences sparkline and the legend


def _short(count: int) -> str:
    return f"{count / 1000:.0f}k" if count >= 10_000 else str(count)


def axis_max(peak: int, budget: int) -> int:
    """The chart's top: the token budget (a step never exceeds it; the larger wins if one did)."""
    return max(budget, peak, 1)


def column_eighths(step: StepStats, scale: float, rows: int) -> tuple[int, int]:
    """(decode top, prefill top) of a step's column in eighths of a cell from the bottom."""
    height = rows * 8
    decode = step.num_decode_tokens / scale * height
    total = (step.num_decode_tokens + step.num_prefill_tokens) / scale * height
    # Any tokens at all show at least one eighth, so a lone decode token is not invisible.
    decode8 = max(round(decode), 1 if step.num_decode_tokens else 0)
    total8 = max(round(total), decode8 + (1 if step.num_prefill_tokens else 0))
    return min(decode8, height), min(total8, height)


def _cell(decode8: int, total8: int, row: int, budget_row: bool) -> tuple[str, Style | str]:
    """The glyph and style of one chart cell `row` cells above the bottom."""
    dec = min(max(decode8 - row * 8, 0), 8)
    tot = min(max(total8 - row * 8, 0), 8)
    if tot == 0:
        return ("┈", COLOR_DIM) if budget_row else (" ", "")
    if dec == 8:
        return "█", COLOR_DECODE
    if dec == 0:
        return EIGHTHS[tot], COLOR_PREFILL
    if tot == 8:
        # Decode fills the lower part in the glyph colour, prefill the rest as background.
        return EIGHTHS[dec], Style(color=COLOR_DECODE, bgcolor=COLOR_PREFILL)
    return EIGHTHS[tot], COLOR_DECODE if dec * 2 >= tot else COLOR_PREFILL


class BatchChart(Panel):
    """One column per engine step, newest on the right; the top row is the token budget (dotted),
    so a column's height is the share of the budget the step used. Any tokens at all show at
    least one eighth of a cell, so a small decode batch under a large budget stays visible."""

    PANEL_TITLE = "batch per step"

    def render(self) -> Text:
        if self.stats is None or self.history is None:
            return Text("waiting for stats…", style=COLOR_DIM)
        width, height = self.content_size
        columns = max(width - AXIS_WIDTH, 1)
        rows = max(height - FOOTER_ROWS, 1)
        steps = list(self.history.steps)[-columns:]
        budget = max([self.stats.max_num_batched_tokens] + [s.token_budget for s in steps])
        scale = axis_max(max((s.num_prefill_tokens + s.num_decode_tokens for s in steps), default=0), budget)
        tops = [column_eighths(s, scale, rows) for s in steps]
        pad = " " * (columns - len(steps))
        lines = []
        for row in reversed(range(rows)):
            is_budget_row = row == rows - 1
            label = _short(scale) if row == rows - 1 else ("0" if row == 0 else "")
            line = spaced((f"{label:>{AXIS_WIDTH - 1}}{'┤' if label else '│'}", COLOR_DIM))
            line.append(("┈" if is_budget_row else " ") * len(pad), style=COLOR_DIM)
            for decode8, total8 in tops:
                line.append(*_cell(decode8, total8, row, is_budget_row))
            lines.append(line)
        seqs = Text(f"{'seqs':>{AXIS_WIDTH - 1}}│", style=COLOR_DIM).append(pad)
        seqs.append_text(sparkline([s.num_seqs for s in steps], len(steps), self.stats.max_num_seqs, COLOR_SEQS))
        lines.append(seqs)
        lines.append(self._legend(steps[-1] if steps else None, budget, width))
        return Text("\n").join(lines)

    def _legend(self, last: StepStats | None, budget: int, width: int) -> Text:
        """The newest step's figures; the least important parts go first when space runs out."""
        prefill = last.num_prefill_tokens if last else 0
        decode = last.num_decode_tokens if last else 0
        parts = [
            [("█", COLOR_PREFILL), (f" prefill {prefill} ", "")],
            [("█", COLOR_DECODE), (f" decode {decode} ", "")],
            [("▆", COLOR_SEQS), (f" seqs {last.num_seqs if last else 0}", "")],
            [(f" · budget {budget}", COLOR_DIM)],
        ]
        if last is not None:
            parts.append([(f" · {fmt_seconds(last.step_time_s)}/step", COLOR_DIM)])
        shown: list[tuple[str, str]] = []
        for part in parts:
            if sum(len(text) for text, _ in shown + part) > width:
                break
            shown += part
        legend = spaced(*shown)
        legend.no_wrap, legend.overflow = True, "crop"
        return legend
