"""The help screen: what each panel shows and which keys do what."""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

from minillm.tui.client import FIRST_EVENT_S, SILENCE_RULE
from minillm.tui.render import (COLOR_CACHED, COLOR_DECODE, COLOR_FREE, COLOR_LEASED, COLOR_OVER, COLOR_PREFILL,
                                 REQUEST_COLORS)
from minillm.tui.request_table import FINISHED_SHOWN_S

KEYS = (
    ("q", "quit"),
    ("p", "pause / resume updates"),
    ("tab / shift+tab", "move focus between panels"),
    ("s", "sort the request table by the next column"),
    ("S", "reverse the sort order"),
    ("click a header", "sort by that column"),
    ("?", "show or close this help"),
)


def help_text() -> Text:
    """The body of the help screen."""
    text = Text()
    text.append("minillm monitor\n\n", style="bold")
    text.append("KV block pool  ", style="bold")
    text.append("each cell is one or more KV blocks: ")
    text.append("■", style=REQUEST_COLORS[0]).append("■", style=REQUEST_COLORS[1])
    text.append(" used (one colour per request)  ").append("■", style=COLOR_CACHED)
    text.append(" cached prefix, free but reusable  ").append("■", style=COLOR_FREE).append(" free  ")
    text.append("■", style=COLOR_LEASED).append(" leased to a decode server (--kv-role producer); the subtitle "
                                                "counts leases, or the KV a decode server loaded\n")
    text.append("batch per step  ", style="bold")
    text.append("one column per engine step: ")
    text.append("█", style=COLOR_DECODE).append(" decode tokens under ")
    text.append("█", style=COLOR_PREFILL).append(" prefill tokens; the top row is the token budget\n")
    text.append("step time  ", style="bold").append("with --max-step-ms or --max-step-factor, a strip under the "
                                                   "batch: each step's device time; its top row is the step "
                                                   "budget (with a factor, each step's own limit), ")
    text.append("█", style=COLOR_OVER).append(" a step over it\n")
    text.append("KV usage  ", style="bold").append("used blocks / all blocks; token util: tokens held / slots in used blocks\n")
    text.append("scheduler  ", style="bold").append("queues, preemptions, tok/s, TTFT and inter-token latency p50 / p99\n")
    text.append("requests  ", style="bold").append("◆ before an id: a structured output (JSON schema, regex, choice or grammar)\n")
    text.append("requests  ", style="bold").append("prompt and output in tokens; blocks and cached in KV blocks "
                                                  "(cached: reused from the prefix cache); a finished request "
                                                  f"stays {FINISHED_SHOWN_S:.0f} s, greyed\n")
    text.append("↻ counters reset  ", style="bold").append("the counters went back (a replay started its next "
                                                          "pass, or the server restarted): the charts start over\n")
    text.append("⚠ banner  ", style="bold").append(f"why no stats arrive. An open stream with no snapshot for "
                                                  f"{SILENCE_RULE}, or without its first for "
                                                  f"{FIRST_EVENT_S:g} s, is polled at /v1/stats instead (the "
                                                  "title says polling), or counts too where that fails\n\n")
    for key, action in KEYS:
        text.append(f"  {key:<16}", style="bold #5fafff").append(f"{action}\n")
    text.append("\npress ? or escape to close", style="#6c6c6c")
    return text


class HelpScreen(ModalScreen[None]):
    """A modal over the dashboard; the dashboard keeps updating beneath it."""

    BINDINGS = [
        Binding("escape", "dismiss", "close"),
        Binding("question_mark", "dismiss", "close"),
        Binding("q", "app.quit", "quit"),
    ]

    def compose(self) -> ComposeResult:
        with Vertical(id="help-box"):
            yield Static(help_text(), id="help-text")
