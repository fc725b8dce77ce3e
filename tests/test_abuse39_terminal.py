"""`minillm chat` and `minillm monitor` in a terminal as people end them and feed them: SIGTERM (kill,
`timeout`) puts the terminal back before the process ends by the signal, a memory figure no server
of ours sends (negative, huge) leaves the dashboard running, Ollama's /show, /load and /save answer
what they would do here, and monitor --interval sets how often the server sends its snapshots."""
from __future__ import annotations

import asyncio
import dataclasses
import io
import os
import signal
import sys
import termios
from pathlib import Path

import pytest
from test_cli import run_main
from test_tui import make_stats

from minillm.chat import ChatSession
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


# ---- Ollama's /show, /load and /save ----------------------------------------------------------------------------

def run_lines(session, lines: list[str]) -> str:
    """Run the chat over LINES, then end of input; what it printed."""
    pending = iter(lines)

    def read_line(prompt: str) -> str:
        try:
            return next(pending)
        except StopIteration:
            raise EOFError from None

    session.run(read_line)
    return session.out.getvalue()


@needs_stories
@pytest.mark.parametrize("template, shown", [
    (None, ["chat template: none (plain text)", "(none: the conversation runs as plain text)"]),
    ("{% for m in messages %}{{ m.content }}{% endfor %}",
     ["chat template: yes", "{% for m in messages %}{{ m.content }}{% endfor %}"]),
])
def test_show_says_what_the_chat_runs_with(llm, template, shown):
    """`ollama run`'s /show info, parameters, system and template each answered 'unknown command
    /show', though the help names Ollama's commands as working."""
    from minillm.chat import ChatSettings, EngineChatBackend
    session = ChatSession(EngineChatBackend(llm.engine, "stories", chat_template=template),
                          ChatSettings(temperature=0.5, max_tokens=9), system="Be brief.", out=io.StringIO())
    out = run_lines(session, ["/show info", "/show parameters", "/show system", "/show template"])
    said = out.splitlines()
    start = said.index("model: stories")
    assert said[start:start + 6] == ["model: stories", "context: 128 tokens", shown[0],
                                     "temperature=0.5 top_p=0.9 top_k=-1 max_tokens=9 seed=None", "Be brief.",
                                     shown[1]], out


class _Plain:
    """A backend with a name and nothing more (a server that lists no context)."""

    name = "plain"
    has_chat_template = True
    last_stats = None


@pytest.mark.parametrize("line, said", [
    ("/show", "usage: /show info | parameters | system | template"),
    ("/show license", "usage: /show info | parameters | system | template (got 'license')"),
    ("/show info now", "usage: /show info | parameters | system | template (got 'info now')"),
    ("/show info", "context: not listed by the server"),
    ("/show system", "(no system message)"),
    ("/show template", "(the server's own: it renders the messages, and /v1/models does not list it)"),
    ("/load llama3", "/load: minillm chat talks to the one model it started with; /bye, then `minillm chat MODEL` "
                     "for another"),
    ("/load", "/load: minillm chat talks to the one model it started with"),
    ("/save mine", "/save: minillm chat saves no session or model; /system and /set last as long as the chat"),
])
def test_show_load_and_save_with_bad_or_no_arguments(line, said):
    out = run_lines(ChatSession(_Plain(), out=io.StringIO()), [line])
    assert said in out and "unknown command" not in out, out


# ---- monitor --interval -----------------------------------------------------------------------------------------

class _App:
    """MonitorApp's stand-in: keeps the source it was given, runs nothing."""

    sources: list = []
    return_code = 0
    is_terminated = False

    def __init__(self, source, recorder=None) -> None:
        self.sources.append(source)

    def call_later(self, *args) -> None:
        pass

    def run(self) -> None:
        pass


@pytest.fixture
def monitor_sources(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setattr("minillm.tui.app.MonitorApp", _App)
    monkeypatch.setattr("minillm.cli.stream_not_a_terminal", lambda: None)
    monkeypatch.setattr(_App, "sources", [])
    return _App.sources


@pytest.mark.parametrize("args, interval_s", [([], 0.25), (["--interval", "2.5"], 2.5), (["--interval", "0.1"], 0.1),
                                              (["--interval", "60"], 60.0)])
def test_monitor_interval_is_how_often_the_server_sends_snapshots(capsys, monitor_sources, args, interval_s):
    """monitor had no --interval: a server was always read four times a second."""
    status, _, err = run_main(capsys, "monitor", "http://127.0.0.1:9", *args)
    assert (status, err) == (0, "")
    assert [s.interval_s for s in monitor_sources] == [interval_s]


@pytest.mark.parametrize("args, said", [
    (["--interval", "0.05"], "Invalid value for '--interval': must be 0.1 to 60 seconds, got 0.05"),
    (["--interval", "nan"], "Invalid value for '--interval': must be 0.1 to 60 seconds, got nan"),
    (["--interval", "1e9"], "Invalid value for '--interval': must be 0.1 to 60 seconds, got 1e+09"),
    (["--interval", "-1"], "Invalid value for '--interval': must be 0.1 to 60 seconds, got -1"),
    (["--demo", "--interval", "1"], "--interval and --demo cannot be combined: a recording plays at the pace it "
                                    "was recorded"),
])
def test_monitor_interval_out_of_bounds_or_with_a_recording_is_a_usage_error(capsys, monitor_sources, args, said):
    status, _, err = run_main(capsys, "monitor", *args)
    assert (status, monitor_sources) == (2, [])
    assert err.splitlines() == [f"minillm monitor: error: {said} (try 'minillm monitor --help')"]


def test_monitor_interval_bounds_are_the_servers():
    from minillm.server.app import MAX_STATS_INTERVAL_S, MIN_STATS_INTERVAL_S
    from minillm.tui.client import MAX_INTERVAL_S, MIN_INTERVAL_S
    assert (MIN_INTERVAL_S, MAX_INTERVAL_S) == (MIN_STATS_INTERVAL_S, MAX_STATS_INTERVAL_S)
