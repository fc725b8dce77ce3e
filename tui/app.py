"""`minillm monitor`: a live dashboard of KV memory and scheduling, fed by a stats source."""
from __future__ import annotations

import asyncio
import signal
from pathlib import Path, PurePath
from typing import Protocol

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.reactive import reactive
from textual.widgets import Footer, Static

from minillm.exit_signals import end_by_sigterm, on_sigterm
from minillm.stats import EngineStats
from minillm.tui.batch_chart import BatchChart
from minillm.tui.block_grid import BlockGrid
from minillm.tui.client import DEFAULT_INTERVAL_S, LiveSource, SourceEvent, SourceProblem, SourceStatus, StatsFrame
from minillm.tui.help_screen import HelpScreen
from minillm.tui.history import StatsHistory
from minillm.tui.memory_panel import MemoryPanel
from minillm.tui.messages import SourceProblemShown, SourceStatusChanged, StatsReceived
from minillm.tui.queue_panel import QueuePanel
from minillm.tui.recording import Recorder
from minillm.tui.render import printable
from minillm.tui.request_table import RequestTable
from minillm.tui.usage_panel import UsagePanel

DEFAULT_CELLS = 256


class StatsSource(Protocol):
    """Anything that yields stats events: the live client or a replay."""

    def events(self, cells) -> object: ...


def model_label(model: str) -> str:
    """A local model path shortened to its folder name; hub ids like org/name stay whole."""
    if model.startswith(("/", "./", "../", "~")) or "\\" in model:
        return PurePath(model.replace("\\", "/")).name or model
    return model


class TitleBar(Static):
    """The PAUSED marker, model, device and where frames come from; no clock, so frames are stable."""

    def show(self, stats: EngineStats | None, source_text: str, paused: bool, num_restarts: int = 0,
             warning: str = "") -> None:
        """Redraw the bar; num_restarts counts the times the counters went back to zero; warning: a
        problem that lasts (a recording that stopped)."""
        # Gaps get a style of their own: a gap inside the next run would be lost by SVG renderers
        # that drop a run's leading spaces (see render.spaced).
        text = Text().append(" ", style="on #5fafff").append("minillm monitor ", style="bold #000000 on #5fafff")
        # The markers come first and the bar wraps (monitor.tcss): at the end of one row, PAUSED and
        # the rest were cut off on terminals under about 100 columns.
        if paused:
            text.append("  ").append(" ", style="on #ffd75f").append("❚❚ PAUSED ", style="bold #000000 on #ffd75f")
        if num_restarts:
            times = f" ×{num_restarts}" if num_restarts > 1 else ""
            text.append("  ").append(f"↻ counters reset{times}", style="bold #ffd75f")
        if warning:
            text.append("  ").append(f"⚠ {printable(warning)}", style="bold #ff5f5f")
        if stats is not None:
            text.append("  ").append(printable(f"{model_label(stats.model)} · {stats.device} · {stats.dtype}"),
                                     style="bold")
        if source_text:
            text.append("  ").append(printable(source_text), style="#8a8a8a")
        self.update(text)


class MonitorApp(App[None]):
    """The dashboard; `source` is a LiveSource or a ReplaySource, `recorder` keeps what it sees."""

    CSS_PATH = Path(__file__).resolve().parent / "monitor.tcss"   # absolute: subclasses live elsewhere
    TITLE = "minillm monitor"
    ENABLE_COMMAND_PALETTE = False
    AUTO_FOCUS = "#grid"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (32, "-tall")]
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("p", "toggle_pause", "pause"),
        Binding("question_mark", "help", "help"),
        Binding("tab", "focus_next", "next panel"),
        Binding("s", "sort_next", "sort"),
        Binding("S", "sort_reverse", "reverse", show=False),
        # Ctrl-C leaves, as it leaves every other minillm command (Textual's own only says "press ctrl+q").
        Binding("ctrl+c", "interrupt", "quit", show=False, priority=True),
    ]

    paused: reactive[bool] = reactive(False)

    def __init__(self, source: StatsSource, recorder: Recorder | None = None) -> None:
        super().__init__()
        self.source = source
        self.recorder = recorder
        self.history = StatsHistory()
        self.stats: EngineStats | None = None
        self.pending: EngineStats | None = None   # the newest snapshot that arrived while paused
        self.problem: str | None = None
        self.source_text = ""
        self.cells = DEFAULT_CELLS
        self.frames_received = 0
        self.frames_shown = 0
        self.num_restarts = 0      # times the counters went back (a replay looped, a server restarted)
        self.recording_problem = ""   # why the recording stopped, when it did
        self.title_bar: TitleBar | None = None
        self.is_terminated = False    # SIGTERM ended the dashboard

    def compose(self) -> ComposeResult:
        # Kept as attributes: messages may arrive while the help screen is on top, where a query
        # of the active screen would not find the dashboard's widgets.
        self.title_bar = TitleBar(id="title")
        self.banner = Static(id="banner")
        self.grid = BlockGrid(id="grid")
        self.panels = [self.grid, UsagePanel(id="usage"), MemoryPanel(id="memory"),
                       BatchChart(id="batch"), QueuePanel(id="queues")]
        self.table = RequestTable(id="requests")
        yield self.title_bar
        yield self.banner
        # The panels scroll in what rows are left: on a short terminal the screen scrolled as a whole to the
        # focused grid, and the title and the banner (why no stats come) went off its top.
        with VerticalScroll(id="body", can_focus=False):
            with Horizontal(id="top"):
                yield self.grid
                with Vertical(id="side"):
                    yield self.panels[1]
                    yield self.panels[2]
            with Horizontal(id="middle"):
                yield self.panels[3]
                yield self.panels[4]
            yield self.table
        yield Footer()

    def on_mount(self) -> None:
        self.banner.display = False
        self._redraw_title()
        self.pump_stats()

    def on_unmount(self) -> None:
        if self.recorder is not None:
            try:
                self.recorder.close()
            except OSError:      # its last flush: the frames before it are on disk, and the dashboard is gone
                pass

    @work(exclusive=True, group="stats")
    async def pump_stats(self) -> None:
        """Read the source without blocking the UI; every event becomes a message."""
        async for event in self.source.events(lambda: self.cells):
            self.post_message(_as_message(event))
            if isinstance(event, StatsFrame) and self.recorder is not None:
                self.record(event.raw)

    def record(self, raw: dict) -> None:
        """Write a frame to the recording; one that fails (a full disk) ends the recording, not the dashboard."""
        try:
            self.recorder.write(raw)
        except OSError as exc:
            recorder, self.recorder = self.recorder, None
            try:
                recorder.close()
            except OSError:
                pass
            self.recording_problem = f"recording stopped: {exc.strerror or exc}"
            self._redraw_title()

    def on_stats_received(self, message: StatsReceived) -> None:
        self.frames_received += 1
        if self.problem is not None:
            self.problem = None
            self.banner.display = False
        if self.paused:
            self.pending = message.stats
            return
        self.show_stats(message.stats)

    def show_stats(self, stats: EngineStats) -> None:
        """Fold a snapshot into the history and redraw every panel."""
        if self.stats is not None and is_new_run(self.stats, stats):
            # Another run (a replay looped, a server restarted): start the series over and say so in the title.
            self.num_restarts += 1
            self.history = StatsHistory()
            self.table.forget_run()
        self.stats = stats
        self.history.add(stats)
        for panel in self.panels:
            panel.show(stats, self.history)
        self.table.show(stats)
        self.frames_shown += 1
        self._redraw_title()

    def on_source_problem_shown(self, message: SourceProblemShown) -> None:
        self.problem = message.message
        retry = f" · retrying in {message.retry_in_s:.1f} s" if message.retry_in_s is not None else ""
        self.banner.update(Text(f" ⚠ {printable(message.message)}{retry}", style="bold"))
        self.banner.display = True

    def on_source_status_changed(self, message: SourceStatusChanged) -> None:
        self.source_text = message.text
        self._redraw_title()

    def on_block_grid_cells_wanted(self, message: BlockGrid.CellsWanted) -> None:
        self.cells = message.cells

    def watch_paused(self, paused: bool) -> None:
        if not paused and self.pending is not None:
            pending, self.pending = self.pending, None
            self.show_stats(pending)
        self._redraw_title()

    def action_interrupt(self) -> None:
        """Quit with the exit status of an interrupted command (130)."""
        self.exit(return_code=130)

    def action_terminate(self) -> None:
        """Quit on SIGTERM, putting the terminal back; run_monitor then ends the process by the signal."""
        self.is_terminated = True
        self.exit(return_code=128 + signal.SIGTERM)

    def action_toggle_pause(self) -> None:
        """Freeze the panels (frames keep arriving and the newest is shown on resume)."""
        self.paused = not self.paused

    def action_help(self) -> None:
        """Open the help screen."""
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_sort_next(self) -> None:
        """Sort the request table by the next column."""
        self.table.cycle_sort()

    def action_sort_reverse(self) -> None:
        """Reverse the request table's order."""
        self.table.reverse_sort()

    def _redraw_title(self) -> None:
        if self.title_bar is not None:  # None until composed (a watcher may fire first)
            self.title_bar.show(self.stats, self.source_text, self.paused, self.num_restarts, self.recording_problem)


# What a running engine never changes: another value is another engine (a server restarted with other options).
_ENGINE_FIELDS = ("model", "device", "dtype", "kv_num_blocks", "block_size", "max_model_len")


def is_new_run(before: EngineStats, after: EngineStats) -> bool:
    """Whether AFTER comes from another run than BEFORE: its engine's run id is another, its counters
    went back, or its engine is another (a server restarted with another model or KV pool may count
    past the old run before the monitor reconnects; a replay that loops keeps its run id)."""
    if before.run_id and after.run_id and before.run_id != after.run_id:
        return True
    if after.num_steps < before.num_steps or after.prompt_tokens_total < before.prompt_tokens_total \
            or after.generation_tokens_total < before.generation_tokens_total:
        return True
    return any(getattr(before, name) != getattr(after, name) for name in _ENGINE_FIELDS)


def _as_message(event: SourceEvent):
    if isinstance(event, StatsFrame):
        return StatsReceived(event.stats)
    if isinstance(event, SourceProblem):
        return SourceProblemShown(event.message, event.retry_in_s)
    if isinstance(event, SourceStatus):
        return SourceStatusChanged(event.text)
    raise TypeError(f"unknown source event {event!r}")


def demo_recording() -> Path:
    """The recording shipped with minillm: a stories260K server on the CPU, 16 clients, 48 requests."""
    return Path(__file__).resolve().parent / "demo.jsonl.gz"


def run_monitor(
    url: str = "http://127.0.0.1:8000",
    api_key: str | None = None,
    source: StatsSource | None = None,
    recorder: Recorder | None = None,
    interval_s: float | None = None,
) -> int:
    """Run the dashboard against a server at `url`, or on `source` (a ReplaySource); `recorder` keeps the
    stream; interval_s: the seconds between a server's snapshots. The exit status: 0, or 130 when
    Ctrl-C ended it; SIGTERM ends the process by the signal once the terminal is put back."""
    live = None if source is not None else LiveSource(url, api_key, interval_s or DEFAULT_INTERVAL_S)
    app = MonitorApp(source=source or live, recorder=recorder)
    app.call_later(_quit_on_signals, app)
    app.run()
    if app.is_terminated:
        end_by_sigterm()
    return app.return_code or 0


def _quit_on_signals(app: MonitorApp) -> None:
    """A SIGINT from outside the terminal (kill -INT, a supervisor) quits as Ctrl-C does; Textual let
    it end the app with status 0. SIGTERM quits too: by default it ended the process with the
    terminal left in the alternate screen, mouse reporting on and echo off."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, app.action_interrupt)
    on_sigterm(loop.add_signal_handler, app.action_terminate)
