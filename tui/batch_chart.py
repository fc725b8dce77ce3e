"""Batch composition per engine step: decode and prefill tokens stacked against the token budget,
and, with a step-time budget (--max-step-ms or --max-step-factor), each step's device time against
the limit its prompt chunks were sized under."""
from __future__ import annotations

from rich.style import Style
from rich.text import Text

from minillm.stats import StepStats
from minillm.tui.panel import Panel
from minillm.tui.render import (COLOR_DECODE, COLOR_DIM, COLOR_OVER, COLOR_PREFILL, COLOR_SEQS, COLOR_STEP_TIME,
                                EIGHTHS, fmt_seconds, sparkline, spaced)

AXIS_WIDTH = 5      # "512┤" and friends
FOOTER_ROWS = 2     # the sequences sparkline and the legend


def _short(count: int) -> str:
    """A count in at most four characters: the axis label's room."""
    if count < 10_000:
        return str(count)
    amount = float(count)
    for suffix in "kMGTPE":
        amount /= 1000
        if amount < 999.5 or suffix == "E":
            return f"{amount:.0f}{suffix}"
    return str(count)


def axis_max(peak: int, budget: int) -> int:
    """The chart's top: the token budget (a step never exceeds it; the larger wins if one did)."""
    return max(budget, peak, 1)


def column_eighths(step: StepStats, scale: float, rows: int) -> tuple[int, int]:
    """(decode top, prefill top) of a step's column in eighths of a cell from the bottom."""
    height = rows * 8
    # A count below zero (no server's) draws nothing rather than a sliver.
    num_decode, num_prefill = max(step.num_decode_tokens, 0), max(step.num_prefill_tokens, 0)
    decode = num_decode / scale * height
    total = (num_decode + num_prefill) / scale * height
    # Any tokens at all show at least one eighth, so a lone decode token is not invisible.
    decode8 = max(round(decode), 1 if num_decode else 0)
    total8 = max(round(total), decode8 + (1 if num_prefill else 0))
    return min(decode8, height), min(total8, height)


def step_time_rows(rows: int) -> int:
    """Rows of the step-time strip in a chart of `rows` rows (the token columns keep the rest)."""
    return min(3, rows // 3)


def step_limit_s(step: StepStats, max_step_ms: float | None) -> float | None:
    """The limit a step's device time is drawn against: the one its prompt chunks were sized under,
    else the fixed step budget (a step with no decode rows is sized by the token budget alone)."""
    if step.step_limit_s is not None:
        return step.step_limit_s
    return None if max_step_ms is None else max_step_ms / 1e3


def time_eighths(step: StepStats, budget_s: float | None, rows: int) -> tuple[int, bool] | None:
    """(height in eighths, is over the budget) of a step's measured device time in a strip of
    `rows` rows whose top is the step budget; None when the step was not timed or had no limit."""
    if step.device_step_s is None or budget_s is None:
        return None
    height = rows * 8
    if step.device_step_s > budget_s:
        # Over: the strip's full height. (Dividing by a budget of zero, or one so small that the
        # ratio is infinite, is left out.)
        return height, True
    level = round(step.device_step_s / budget_s * height) if budget_s > 0 else 0
    return min(max(level, 1), height), False


def _ms_label(ms: float) -> str:
    """A budget in milliseconds in at most four characters."""
    size = abs(ms)
    text = f"{ms:.0f}" if 10 <= size < 1000 else f"{ms:.1f}" if 0.1 <= size < 10 or ms == 0 else f"{ms:.0e}"
    text = text.replace("e+0", "e").replace("e+", "e").replace("e-0", "e-")
    # One that does not fit is not cut to another number: the legend gives it whole.
    return text if len(text) <= AXIS_WIDTH - 1 else "…"


def _factor_label(factor: float) -> str:
    """A relative step budget ("1.3x") in at most four characters; "…" when none fits."""
    for text in (f"{factor:g}x", f"{factor:.1f}x", f"{factor:.0f}x"):
        if len(text) <= AXIS_WIDTH - 1:
            return text
    return "…"


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
    least one eighth of a cell, so a small decode batch under a large budget stays visible.

    With a step-time budget a strip below shows each step's measured device time; its top row is
    the step budget (dotted: --max-step-ms, or each step's own limit under --max-step-factor), and
    a step over it fills the strip in red."""

    PANEL_TITLE = "batch per step"

    def render(self) -> Text:
        if self.stats is None or self.history is None:
            return Text("waiting for stats…", style=COLOR_DIM)
        width, height = self.content_size
        columns = max(width - AXIS_WIDTH, 1)
        rows = max(height - FOOTER_ROWS, 1)
        has_step_budget = self.stats.max_step_ms is not None or self.stats.max_step_factor is not None
        time_rows = step_time_rows(rows) if has_step_budget else 0
        rows -= time_rows
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
        if time_rows:
            lines.extend(self._step_time_strip(steps, pad, time_rows))
        seqs = Text(f"{'seqs':>{AXIS_WIDTH - 1}}│", style=COLOR_DIM).append(pad)
        seqs.append_text(sparkline([s.num_seqs for s in steps], len(steps), self.stats.max_num_seqs, COLOR_SEQS))
        lines.append(seqs)
        lines.append(self._legend(steps[-1] if steps else None, budget, width))
        return Text("\n").join(lines)

    def _step_time_strip(self, steps: list[StepStats], pad: str, rows: int) -> list[Text]:
        """Rows of each step's device time against its step budget (the dotted top row): the fixed
        --max-step-ms, or under --max-step-factor each step's own limit (labelled with the factor)."""
        fixed_ms, factor = self.stats.max_step_ms, self.stats.max_step_factor
        tops = [time_eighths(s, step_limit_s(s, fixed_ms), rows) for s in steps]
        top_label = _ms_label(fixed_ms) if factor is None else _factor_label(factor)
        lines = []
        for row in reversed(range(rows)):
            is_budget_row = row == rows - 1
            label = top_label if is_budget_row else (("ms" if factor is None else "time") if row == 0 else "")
            line = spaced((f"{label:>{AXIS_WIDTH - 1}}{'┤' if is_budget_row else '│'}", COLOR_DIM))
            line.append(("┈" if is_budget_row else " ") * len(pad), style=COLOR_DIM)
            for top in tops:
                cell = 0 if top is None else min(max(top[0] - row * 8, 0), 8)
                if cell == 0:
                    line.append("┈" if is_budget_row else " ", style=COLOR_DIM if is_budget_row else "")
                else:
                    line.append(EIGHTHS[cell], style=COLOR_OVER if top[1] else COLOR_STEP_TIME)
            lines.append(line)
        return lines

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
        limits = ([f"{self.stats.max_step_ms:g} ms"] if self.stats.max_step_ms is not None else []) + \
            ([f"{self.stats.max_step_factor:g}x decode"] if self.stats.max_step_factor is not None else [])
        if limits:
            parts[-1] = [(f" · budget {budget} / {' / '.join(limits)}", COLOR_DIM)]
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
