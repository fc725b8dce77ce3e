"""The command-line tools run as users run them: Ctrl-C at start-up and twice over, a prompt from stdin
(`--prompt -`) or with bytes that are not UTF-8, a piped chat interrupted, and the monitor against a web
server that is no minillm server, quit by Ctrl-C or by SIGINT."""
from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import threading

import pytest
from test_cli import REPO, STORIES, minillm, needs_stories, run_main

ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def read_until(process: subprocess.Popen, stream, needle: bytes, seen: bytes = b"", timeout: float = 120) -> bytes:
    """What STREAM of PROCESS printed up to NEEDLE (the test fails if it never comes)."""
    selector, deadline = selectors.DefaultSelector(), time.monotonic() + timeout
    selector.register(stream, selectors.EVENT_READ)
    while needle not in seen and time.monotonic() < deadline:
        if selector.select(timeout=1):
            chunk = os.read(stream.fileno(), 65536)
            if not chunk:
                break
            seen += chunk
    selector.close()
    assert needle in seen, seen.decode(errors="replace")
    return seen


def start_long_generate(tmp_path) -> subprocess.Popen:
    """`minillm generate` of a batch that runs far longer than any test waits (64 prompts, 400 tokens
    each), its stdout and stderr piped."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n" * 64)
    return subprocess.Popen(
        [sys.executable, "-m", "minillm.cli", "generate", str(STORIES), "--device", "cpu", "--prompts-file",
         str(prompts), "--max-tokens", "400", "--ignore-eos"],
        cwd=REPO, env=ENV, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def run_bytes(*args: bytes | str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter with bytes in (arguments and stdin), text out."""
    result = subprocess.run([sys.executable, "-m", "minillm.cli", *args], cwd=REPO, env=ENV, input=stdin,
                            capture_output=True, timeout=120)
    return subprocess.CompletedProcess(result.args, result.returncode, result.stdout.decode(errors="replace"),
                                       result.stderr.decode(errors="replace"))


# ---- Ctrl-C at start-up and during shutdown -------------------------------------------------------------

@needs_stories
def test_a_second_ctrl_c_while_generate_winds_down_prints_no_traceback(tmp_path):
    # The second Ctrl-C landed in Python's shutdown (a KV pool to free, threads to join) and printed
    # "Exception ignored in: <module 'threading'>" and a traceback under "minillm: interrupted".
    process = start_long_generate(tmp_path)
    seen = read_until(process, process.stderr, b"req/s]")
    process.send_signal(signal.SIGINT)
    seen = read_until(process, process.stderr, b"minillm: interrupted", seen)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    stderr = (seen + err).decode()
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    assert stderr.rstrip().endswith("minillm: interrupted")
    assert process.returncode in (130, -signal.SIGINT) and out == b""


# ---- generate: the prompt from stdin, bytes that are not UTF-8 -------------------------------------------

@needs_stories
def test_prompt_dash_reads_all_of_stdin_as_one_prompt():
    # `--prompt -` generated from the one-character prompt "-" and left stdin unread.
    result = minillm("generate", str(STORIES), "--device", "cpu", "-p", "-", "--temperature", "0", "--max-tokens",
                     "2", "--json", stdin="Once upon\na time\n")
    assert result.returncode == 0, result.stderr
    import json
    [record] = [json.loads(line) for line in result.stdout.splitlines()]
    assert record["prompt"] == "Once upon\na time"
    # Beside other prompts, it is one of the batch, in its place.
    result = minillm("generate", str(STORIES), "--device", "cpu", "-p", "Lily", "-p", "-", "--temperature", "0",
                     "--max-tokens", "1", "--json", stdin="Tom\n")
    assert [json.loads(line)["prompt"] for line in result.stdout.splitlines()] == ["Lily", "Tom"]


@pytest.mark.parametrize("args, stdin, status, message", [
    (["-p", "-", "-p", "-"], "Once\n", 2, "minillm generate: error: Invalid value for '--prompt': '-' reads stdin, "
     "which holds one prompt: give '-' once (try 'minillm generate --help')"),
    (["-p", "-"], "\n \n", 1, "minillm: error: --prompt -: stdin holds no prompt"),
])
def test_prompt_dash_that_cannot_be_one_prompt_is_one_line(args, stdin, status, message):
    result = minillm("generate", str(STORIES), "--device", "cpu", *args, stdin=stdin)
    assert (result.returncode, result.stdout) == (status, "")
    assert result.stderr.splitlines() == [message]


@pytest.mark.parametrize("args, stdin, message", [
    ([b"-p", b"Once\xff upon"], b"", "--prompt is not UTF-8 text: character 5 (byte 0xff)"),
    ([b"-p", b"-"], b"Once\nup\xfeon\n", "--prompt - (stdin) is not UTF-8 text: line 2 (byte 0xfe)"),
    ([b"--prompts-file", b"-"], b"Once\nLily\xff\n", "--prompts-file - is not UTF-8 text: line 2 (byte 0xff)"),
])
def test_a_prompt_with_bytes_that_are_not_utf8_is_refused_before_the_model_loads(args, stdin, message):
    # It was refused after the model had loaded, as "prompt is not valid Unicode: a lone surrogate at
    # index 4", which named neither the option nor the byte.
    result = run_bytes("generate", str(STORIES), "--device", "cpu", *args, stdin=stdin)
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.splitlines() == [f"minillm: error: {message}"]


# ---- chat with piped input ------------------------------------------------------------------------------

@needs_stories
def test_ctrl_c_ends_a_chat_that_reads_a_pipe_with_status_130():
    # With messages piped in, Ctrl-C printed "(Ctrl-D or /exit quits)" and went on waiting for the pipe.
    read_end, write_end = os.pipe()
    process = subprocess.Popen([sys.executable, "-m", "minillm.cli", "chat", str(STORIES), "--device", "cpu"],
                               cwd=REPO, env=ENV, stdin=read_end, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    os.close(read_end)
    try:
        os.write(write_end, b"/help\n")
        seen = read_until(process, process.stdout, b"what you type while a reply is written")
        seen = read_until(process, process.stdout, b">>> ", seen.split(b"what you type")[-1])   # the next prompt
        # A SIGINT that lands between the prompt being printed and the read of the pipe starting waits in
        # Python until the read returns (no EINTR): a user's next Ctrl-C, as here, takes both.
        for _ in range(10):
            process.send_signal(signal.SIGINT)
            try:
                out, err = process.communicate(timeout=5)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            process.kill()
            pytest.fail("Ctrl-C did not end a chat that reads a pipe")
    finally:
        os.close(write_end)
    assert process.returncode in (130, -signal.SIGINT), err
    assert "Traceback" not in err.decode() and err.decode().splitlines()[-1] == "minillm: interrupted"
    assert (seen + out).decode().endswith(">>> \n")     # the prompt's line ended before the error's


# ---- monitor: a server that is no minillm server, Ctrl-C, SIGINT ---------------------------------------

class _WebPage(BaseHTTPRequestHandler):
    """A web server that answers every path with a page, as many on port 8000 do."""

    def do_GET(self) -> None:
        body = b"<html><body>hello</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def web_page():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _WebPage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_monitor_names_a_web_server_that_is_no_minillm_server(web_page, monkeypatch, anyio_backend):
    # Its page holds no stats event: the monitor showed "waiting for stats…" without end and no problem.
    import minillm.tui.client as client
    from minillm.tui.client import LiveSource, SourceProblem
    from test_tui_client import collect
    monkeypatch.setattr(client, "BACKOFF_START_S", 0.01)
    events = await collect(LiveSource(web_page), 3)
    problems = [e.message for e in events if isinstance(e, SourceProblem)]
    assert problems and problems[0] == (f"bad stats from {web_page}: /v1/stats/stream answered text/html, not a "
                                        "stream of stats events: is this a minillm server?")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_ctrl_c_quits_the_monitor_with_status_130(anyio_backend, tmp_path):
    # Textual only said "Press ctrl+q to quit the app"; every other minillm command ends on Ctrl-C.
    from minillm.tui.app import MonitorApp, demo_recording
    from minillm.tui.recording import ReplaySource
    app = MonitorApp(source=ReplaySource(demo_recording()))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("ctrl+c")
        await pilot.pause()
    assert app.return_code == 130 and not app.is_running


def test_the_monitor_quit_by_ctrl_c_says_interrupted_and_exits_130(capsys, monkeypatch):
    monkeypatch.setattr("minillm.chat_terminal.is_terminal", lambda stream: True)
    monkeypatch.setattr("minillm.tui.app.run_monitor", lambda url, api_key=None, source=None, recorder=None, interval_s=None: 130)
    status, out, err = run_main(capsys, "monitor", "--demo")
    assert (status, out, err) == (130, "", "minillm: interrupted\n")
    monkeypatch.setattr("minillm.tui.app.run_monitor", lambda url, api_key=None, source=None, recorder=None, interval_s=None: 0)
    assert run_main(capsys, "monitor", "--demo") == (0, "", "")


@pytest.mark.parametrize("how", ["key", "signal"])
def test_the_monitor_in_a_terminal_ends_on_ctrl_c_and_on_sigint_with_status_130(how):
    # A SIGINT from outside the terminal (kill -INT) ended the monitor with status 0 and no word.
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(sys.executable, ["-m", "minillm.cli", "monitor", "--demo"], cwd=str(REPO), env=ENV,
                          dimensions=(40, 120), encoding="utf-8", timeout=60)
    child.expect_exact("sort")          # the dashboard is drawn
    if how == "key":
        child.sendcontrol("c")
    else:
        child.kill(signal.SIGINT)
    child.expect_exact("minillm: interrupted")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130 and "Traceback" not in child.before
