"""`minillm chat` fed as scripts and shells feed it: bytes that are not UTF-8 in --system or an
inline --chat-template, a script saved with Windows line endings (CRLF), and a max_tokens past the
model's context, which must not cost the conversation its history."""
from __future__ import annotations

import io

import pytest
from test_abuse23_cli import run_bytes
from test_abuse30_chat import _EchoBackend
from test_chat import STORIES, needs_stories, run_scripted, short_context_engine  # noqa: F401
from test_server_helpers import running_server

from minillm.chat import ChatSession, ChatSettings, EngineChatBackend


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


# ---- a max_tokens past the context ------------------------------------------------------------------------

EARLIER = [{"role": "user", "content": "Tom had a red ball."}, {"role": "assistant", "content": " He threw it."}]


@pytest.fixture(scope="module")
def engine(short_context_engine):
    return short_context_engine


def _session_with_history(backend, max_tokens: int, exchanges: int) -> tuple[ChatSession, io.StringIO]:
    out = io.StringIO()
    session = ChatSession(backend, ChatSettings(temperature=0, max_tokens=max_tokens), out=out)
    for _ in range(exchanges):
        session.conversation.turns += [dict(t) for t in EARLIER]
    return session, out


@needs_stories
def test_a_max_tokens_past_the_context_keeps_a_history_that_leaves_half_of_it(engine):
    # /set max_tokens 1000 on a 64-token model dropped every earlier exchange at every message, to
    # make room no prompt could leave: the chat forgot all it was told, saying "(dropped the 1 oldest
    # exchange(s) to fit the 64-token context)" of a conversation of 20 tokens.
    backend = EngineChatBackend(engine, "stories")
    session, out = _session_with_history(backend, 1000, exchanges=1)
    session.handle("He ran.")
    assert "dropped" not in out.getvalue()
    assert session.conversation.turns[:2] == EARLIER and len(session.conversation.turns) == 4
    assert backend.last_stats.max_tokens == 64 - backend.last_stats.prompt_tokens    # the rest of the context


@needs_stories
def test_a_max_tokens_past_the_context_drops_old_exchanges_until_half_of_it_is_left(engine):
    backend = EngineChatBackend(engine, "stories")
    session, out = _session_with_history(backend, 1000, exchanges=4)
    session.handle("He ran.")
    assert "(dropped the 3 oldest exchange(s) to fit the 64-token context)" in out.getvalue()
    assert backend.last_stats.prompt_tokens == 22 and len(session.conversation.turns) == 4


@needs_stories
def test_over_url_a_max_tokens_past_the_context_keeps_the_history_as_the_local_chat_does():
    from minillm.chat_client import HttpChatBackend
    with running_server(STORIES, max_model_len=64) as (url, _):
        for exchanges, dropped in ((1, None), (4, 3)):
            backend = HttpChatBackend(url)
            session, out = _session_with_history(backend, 1000, exchanges)
            session.handle("He ran.")
            notice = f"(dropped the {dropped} oldest exchange(s) to fit the 64-token context)"
            assert (notice in out.getvalue()) if dropped else ("dropped" not in out.getvalue()), out.getvalue()
            assert len(session.conversation.turns) == 2 * (exchanges - (dropped or 0)) + 2
            assert backend.last_stats.prompt_tokens == 22


# ---- /stats of a reply stopped over --url --------------------------------------------------------------------

@needs_stories
def test_stats_of_a_reply_stopped_over_url_do_not_say_the_prompt_was_0_tokens():
    # The server counts the prompt in the usage of the stream's last event, which a stopped reply
    # never reads: /stats said "prompt: 0 tokens" of a prompt of 5.
    from minillm.chat import Conversation
    from minillm.chat_client import HttpChatBackend
    with running_server(STORIES) as (url, _):
        backend = HttpChatBackend(url)
        backend.has_chat_template = False
        stopped = []
        stream = backend.stream_reply(Conversation(turns=[{"role": "user", "content": "Once upon a time"}]),
                                      ChatSettings(temperature=0, max_tokens=200), lambda: bool(stopped))
        for _ in stream:
            stopped.append(True)
        stats = backend.last_stats
    assert stats.finish_reason == "abort" and stats.prompt_tokens is None
    assert "prompt: not counted (the reply was stopped before the server counted it)" in stats.describe()
