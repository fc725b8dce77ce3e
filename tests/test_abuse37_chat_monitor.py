"""Using chat and monitor as people do: what a reply or a server's error holds must not act on the terminal."""
from __future__ import annotations

import io

from test_chat import run_scripted

from minillm.chat import ChatSession

# What a reply sampled at a high temperature can hold: byte tokens such as ESC (stories260K at
# temperature 3, seed 12, wrote "rain bar\x1bt had"); ESC c resets the terminal, ESC ] sets its title.
RAW_REPLY = "Once\x1bc upon\x1b]0;owned\x07 a \x9b2Jtime\tthere\r\nwas"


class _TerminalOut(io.StringIO):
    """A StringIO that says it is a terminal, as sys.stdout is in an interactive chat."""

    def isatty(self) -> bool:
        return True


class _RawBackend:
    """Replies with RAW_REPLY; a message holding "fail" gets a server error that quotes it."""

    name, has_chat_template, last_stats = "raw", True, None

    def stream_reply(self, conversation, settings, should_stop):
        text = conversation.turns[-1]["content"]
        if "fail" in text:
            raise ValueError(f"server answered 400: unknown model '\x1b[31m{text}'")
        return (delta for delta in (RAW_REPLY[:5], RAW_REPLY[5:]))


def test_a_reply_and_an_error_write_no_control_character_to_a_terminal():
    out = _TerminalOut()
    history = run_scripted(ChatSession(_RawBackend(), out=out), ["hello", "fail"], status=1)
    shown = out.getvalue()
    assert "Once\\x1bc upon\\x1b]0;owned\\x07 a \\x9b2Jtime\tthere\r\nwas" in shown
    assert "unknown model '\\x1b[31mfail'" in shown
    assert not {"\x1b", "\x07", "\x9b"} & set(shown)
    assert history[0] == ["hello", RAW_REPLY]       # the conversation keeps the reply as the model wrote it


def test_a_reply_to_a_file_or_a_pipe_is_written_as_it_came():
    out = io.StringIO()
    run_scripted(ChatSession(_RawBackend(), out=out), ["hello"])
    assert RAW_REPLY in out.getvalue()
