"""`minillm chat` fed as scripts and shells feed it: bytes that are not UTF-8 in --system or an
inline --chat-template."""
from __future__ import annotations

import pytest
from test_abuse23_cli import run_bytes
from test_chat import STORIES, needs_stories


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
