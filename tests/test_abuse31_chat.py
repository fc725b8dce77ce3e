"""`minillm chat` fed as scripts and shells feed it: bytes that are not UTF-8 in --system or an
inline --chat-template, and a script saved with Windows line endings (CRLF)."""
from __future__ import annotations

import io

import pytest
from test_abuse23_cli import run_bytes
from test_chat import STORIES, needs_stories, run_scripted

from minillm.chat import ChatSession


class _EchoBackend:
    """Replies "ok"; remembers every message it was sent."""
    name, has_chat_template, last_stats = "echo", True, None

    def __init__(self) -> None:
        self.sent: list[str] = []

    def stream_reply(self, conversation, settings, should_stop):
        self.sent.append(conversation.turns[-1]["content"])
        yield "ok"


# ---- bytes that are not UTF-8 in the chat's text options --------------------------------------------------

@needs_stories
@pytest.mark.parametrize("args, message", [
    ([b"--system", b"You are \xff kind"], "--system is not UTF-8 text: character 9 (byte 0xff)"),
    ([b"--chat-template", b"{{ '\xfe' }}"], "--chat-template is not UTF-8 text: character 5 (byte 0xfe)"),
])
def test_option_text_that_is_not_utf8_is_refused_before_the_model_loads(args, message):
    # Taken as given, every message of the chat failed with "text is not valid Unicode: a lone
    # surrogate at index 0", naming neither the option nor the byte, and the chat could not be used.
    result = run_bytes("chat", str(STORIES), "--device", "cpu", *args, stdin=b"hello\n")
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.splitlines() == [f"minillm: error: {message}"]


def test_system_option_that_is_not_utf8_is_refused_with_url_too():
    # No server needed: the option is checked before the chat connects.
    result = run_bytes("chat", "--url", "http://127.0.0.1:9", "--system", b"\xffhi", stdin=b"hello\n")
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.splitlines() == ["minillm: error: --system is not UTF-8 text: character 1 (byte 0xff)"]


# ---- a script with CRLF line endings -------------------------------------------------------------------------

def test_lines_ending_in_crlf_are_read_as_lines_ending_in_lf():
    # A script saved on Windows: the "\r" before each line break stayed in the message sent to the
    # model, and a line ending in a backslash did not continue (it ended in "\\\r"): the two halves
    # of the message went as two messages.
    backend, out = _EchoBackend(), io.StringIO()
    run_scripted(ChatSession(backend, out=out), ["Tom had \\\r", "a ball\r", "Lily\r", '"""\r', "a\r", 'b"""\r'])
    assert backend.sent == ["Tom had \na ball", "Lily", "a\nb"]
