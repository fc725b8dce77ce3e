"""minillm chat reading a script whose bytes are not UTF-8 from a strict stdin; minillm run-batch fed
the files users have: a byte order mark, U+2028 inside a JSON string, a line that is not UTF-8, one
nested past the JSON reader's depth, NaN in a body, a few hundred requests among them; and an output
file that cannot take the answers."""
from __future__ import annotations

import codecs
import io
import json
import os
import subprocess
import sys

import pytest

from minillm.chat import ChatSession
from minillm.run_batch import input_lines, parse_line

MODEL = "stories"


def line(custom_id: str, prompt: str, **fields) -> str:
    """One /v1/completions batch line, written as json.dumps writes it without ASCII escapes."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, **fields}
    request = {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}
    return json.dumps(request, ensure_ascii=False)


def minillm(*args: str) -> subprocess.CompletedProcess:
    """minillm ARGS in a subprocess."""
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True, timeout=240)


# ---- chat: a piped script with bytes that are not UTF-8 -------------------------------------------------

class _EchoBackend:
    """Replies with the user's last message, as it reached the backend."""
    name, has_chat_template, last_stats = "echo", True, None

    def stream_reply(self, conversation, settings, should_stop):
        yield "got " + conversation.turns[-1]["content"]


def test_a_strict_stdin_with_bytes_that_are_not_utf8_goes_on_to_the_next_line(monkeypatch):
    # Python's stdin under a UTF-8 locale: strict; the bad line ended the chat with a decode error.
    stdin = io.TextIOWrapper(io.BytesIO(b"Tom \xff\xfe ball\nhello\n"), encoding="utf-8", errors="strict")
    monkeypatch.setattr("sys.stdin", stdin)
    out = io.StringIO()
    session = ChatSession(_EchoBackend(), out=out)
    assert session.run() == 0
    assert "got Tom \ufffd\ufffd ball" in out.getvalue() and "got hello" in out.getvalue()
    assert stdin.errors == "strict"          # put back as it was


# ---- reading the file: lines split at newlines only, a BOM dropped, bad bytes kept for their line ------

def test_a_json_string_holding_line_separators_stays_one_line():
    text = line("sep", "Once\u2028upon\u2029a\x85time\x0c\x1c")
    assert input_lines(text.encode() + b"\r\n\n  \n") == [text]
    assert parse_line(0, text).error is None


def test_a_byte_order_mark_is_not_part_of_the_first_request():
    text = line("bom", "Once")
    [first] = input_lines(codecs.BOM_UTF8 + text.encode() + b"\n")
    assert parse_line(0, first).error is None and parse_line(0, first).custom_id == "bom"


def test_a_line_that_is_not_utf8_is_that_lines_error_only():
    lines = input_lines(b'{"custom_id": "x\xff"}\n' + line("ok", "Once").encode() + b"\n")
    assert len(lines) == 2
    assert parse_line(0, lines[0]).error == "Invalid JSON: the line is not UTF-8 text (byte 0xff at character 16)"
    assert parse_line(1, lines[1]).error is None


def test_a_line_nested_too_deeply_is_that_lines_error():
    assert parse_line(0, "[" * 100_000).error == "Invalid JSON: arrays or objects are nested too deeply"


# ---- a whole run --------------------------------------------------------------------------------------

NUM_REQUESTS = 300
ODD_LINES = {      # index among the requests -> (raw line, what its output's error starts with; None: answered)
    0: (codecs.BOM_UTF8 + line("r0", "Once").encode(), None),
    5: (line("r5", "Once\u2028upon a time").encode(), None),
    9: (b'{"custom_id": "r9", "method": "POST", "url": "/v1/completions", "body": {"prompt": "\xc3("}}',
        "Invalid JSON: the line is not UTF-8 text"),
    17: (b"[" * 50_000, "Invalid JSON: arrays or objects are nested too deeply"),
    40: (line("r40", "Once", temperature=float("nan")).encode(), "temperature"),
    41: (line("r41", "Once", top_p=float("-inf")).encode(), "top_p"),
    123: (line("r122", "Once").encode(), None),           # a custom_id used twice is answered twice
}


@pytest.fixture(scope="module")
def batch(stories_path, tmp_path_factory):
    """(output lines, the run) of one run-batch over NUM_REQUESTS lines, ODD_LINES among them."""
    folder = tmp_path_factory.mktemp("batch41")
    raw = [ODD_LINES[i][0] if i in ODD_LINES else line(f"r{i}", "Once upon a time", max_tokens=1 + i % 3).encode()
           for i in range(NUM_REQUESTS)]
    (folder / "in.jsonl").write_bytes(b"\n\n".join(raw) + b"\n")
    run = minillm("run-batch", "-i", str(folder / "in.jsonl"), "-o", str(folder / "out.jsonl"), str(stories_path),
                  "--served-model-name", MODEL, "--device", "cpu", "--max-model-len", "128")
    assert run.returncode == 0, run.stderr
    text = (folder / "out.jsonl").read_text(encoding="utf-8")
    return [json.loads(out) for out in text.split("\n")[:-1]], run


def test_every_request_is_answered_in_input_order(batch):
    outputs, run = batch
    assert len(outputs) == NUM_REQUESTS
    expected = [None if i in (9, 17) else "r122" if i == 123 else f"r{i}" for i in range(NUM_REQUESTS)]
    assert [out["custom_id"] for out in outputs] == expected
    assert f"{NUM_REQUESTS} requests, {NUM_REQUESTS - 4} succeeded, 4 failed" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("index", sorted(ODD_LINES))
def test_an_odd_line_is_answered_or_gets_its_own_error(batch, index):
    out = batch[0][index]
    error = ODD_LINES[index][1]
    if error is None:
        assert out["error"] is None and out["response"]["status_code"] == 200
        assert out["response"]["body"]["usage"]["completion_tokens"] >= 1
    elif isinstance(out["error"], str):
        assert out["error"].startswith(error) and out["response"]["status_code"] == 400
    else:      # the server's own answer: NaN reaches its checks, which name the field
        assert out["response"]["status_code"] == 400 and out["error"]["error"]["param"] == error


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_an_output_file_that_cannot_be_written_is_named_in_one_line(stories_path, tmp_path):
    (tmp_path / "in.jsonl").write_text(line("a", "Once") + "\n", encoding="utf-8")
    run = minillm("run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", "/dev/full", str(stories_path),
                  "--served-model-name", MODEL, "--device", "cpu", "--max-model-len", "128")
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == "minillm: error: --output-file /dev/full: No space left on device"
    assert "Traceback" not in run.stderr
