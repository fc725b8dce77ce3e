"""`minillm chat` and `minillm monitor` in a terminal as people end them and feed them: SIGTERM (kill,
`timeout`) puts the terminal back before the process ends by the signal, and a memory figure no
server of ours sends (negative, huge) leaves the dashboard running."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
import termios
from pathlib import Path

import pytest
from test_tui import make_stats

from minillm.tui.app import MonitorApp
from minillm.tui.client import StatsFrame
from minillm.tui.memory_panel import MemoryPanel, split_widths

REPO = Path(__file__).resolve().parents[1]
STORIES = Path(os.environ.get("MINILLM_TEST_MODEL", REPO.parent / "shared" / "models" / "stories260K"))
needs_stories = pytest.mark.skipif(not (STORIES / "config.json").is_file(),
                                   reason=f"stories260K not found at {STORIES}; set MINILLM_TEST_MODEL")
PROMPT = ">>> "
LEAVE_ALTERNATE_SCREEN = "\x1b[?1049l"


def spawn(*args: str, term: str = "dumb"):
    """`minillm ARGS` on a pseudo-terminal of 24x80."""
    pexpect = pytest.importorskip("pexpect")
    env = {**os.environ, "TERM": term, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    return pexpect.spawn(sys.executable, ["-m", "minillm.cli", *args], cwd=str(REPO), env=env, encoding="utf-8",
                         codec_errors="replace", timeout=60, dimensions=(24, 80))


def line_modes(child) -> tuple[bool, bool]:
    """Whether the pseudo-terminal echoes and reads whole lines (a shell's prompt needs both)."""
    lflag = termios.tcgetattr(child.child_fd)[3]
    return bool(lflag & termios.ECHO), bool(lflag & termios.ICANON)


def terminate(child) -> str:
    """SIGTERM to the child; what it wrote until it ended."""
    pexpect = pytest.importorskip("pexpect")
    child.kill(signal.SIGTERM)
    child.expect(pexpect.EOF)
    return child.before


@needs_stories
@pytest.mark.parametrize("when", ["at the prompt", "while a reply streams"])
def test_sigterm_to_the_chat_puts_the_terminal_back_and_ends_it_by_the_signal(when):
    """The line editor (at the prompt) and a streaming reply (no echo, key at a time) each change the
    terminal's modes; SIGTERM ended the chat with them still changed (no echo at the shell after
    `timeout --foreground`, which exits normally), as Ctrl-D and /exit never do."""
    child = spawn("chat", str(STORIES), "--device", "cpu", "--temperature", "0", "--max-tokens", "100000")
    assert line_modes(child) == (True, True)
    child.expect_exact(PROMPT)
    if when == "while a reply streams":
        child.sendline("Once upon a time")
        child.expect_exact("Once upon a time\r\n")
        child.expect(r"\w+")        # the reply has begun (512 tokens of context leave it running)
    terminate(child)
    assert line_modes(child) == (True, True)
    child.close()
    assert child.signalstatus == signal.SIGTERM


def test_sigterm_to_the_monitor_leaves_the_alternate_screen_and_ends_it_by_the_signal():
    """Textual puts the terminal back only when the app exits: SIGTERM ended the monitor with the
    alternate screen kept, mouse reporting on (every mouse move typed escape sequences at the
    shell) and echo off."""
    child = spawn("monitor", "--demo", term="xterm-256color")
    child.expect_exact("KV block pool")
    written = terminate(child)
    assert LEAVE_ALTERNATE_SCREEN in written
    assert line_modes(child) == (True, True)
    child.close()
    assert child.signalstatus == signal.SIGTERM


@pytest.mark.parametrize("parts, total", [
    ([1 << 30, 2 << 30, -(1 << 62), 5 << 30], 8 << 30),     # a negative figure
    ([30, 30, 0, 0], 10),                                    # parts past the total
])
def test_memory_bar_widths_fit_the_bar(parts, total):
    widths = split_widths(parts, total, 40)
    assert sum(widths) <= 40 and min(widths) >= 0
    assert [w > 0 for w in widths] == [p > 0 for p in parts]


class _Frames:
    """The given snapshots, then nothing (the source stays open)."""

    def __init__(self, *snapshots) -> None:
        self.snapshots = snapshots

    async def events(self, cells):
        for stats in self.snapshots:
            yield StatsFrame(stats=stats, raw={})
        await asyncio.Event().wait()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_memory_figure_of_minus_two_to_the_62_leaves_the_dashboard_running(anyio_backend):
    """The memory bar drew each part as its share of the total in cells: a negative 'other' of
    -2**62 bytes asked for a bar of trillions of cells, and MemoryError ended the monitor."""
    stats = make_stats(0)
    bogus = dataclasses.replace(stats, memory=dataclasses.replace(stats.memory, other_bytes=-(1 << 62)))
    app = MonitorApp(source=_Frames(bogus))
    async with app.run_test(size=(120, 40)) as pilot:
        while app.frames_shown < 1:
            await pilot.pause(0.01)
        await pilot.pause()
        panel = app.query_one(MemoryPanel)
        bar = panel.render().plain.split("\n")[0]
        assert 0 < len(bar) <= panel.content_size.width
        assert app.is_running
