"""`minillm chat` used as Ollama's chat is: a triple-quoted message that starts with a slash (a path,
a shell line) is sent, not read as a command; a pasted message too long for the context after a
long conversation is refused without encoding it once per earlier exchange."""
from __future__ import annotations

import io

import pytest
from test_chat import STORIES, needs_stories, run_scripted, short_context_engine  # noqa: F401
from test_server_helpers import running_server

from minillm.chat import ChatSession, ChatSettings, EngineChatBackend


@pytest.fixture(scope="module")
def engine(short_context_engine):
    return short_context_engine


class _EchoBackend:
    """Replies with the user's last message; remembers every message it was sent."""
    name, has_chat_template, last_stats = "echo", True, None

    def __init__(self) -> None:
        self.sent: list[str] = []

    def stream_reply(self, conversation, settings, should_stop):
        self.sent.append(conversation.turns[-1]["content"])
        yield "ok"


@pytest.mark.parametrize("lines, sent", [
    (['"""/usr/bin is on my PATH', 'what else is?"""'], "/usr/bin is on my PATH\nwhat else is?"),
    (['"""/help"""'], "/help"),
    (['"""', "/exit", '"""'], "/exit"),
])
def test_a_triple_quoted_message_that_starts_with_a_slash_is_sent(lines, sent):
    """Ollama sends a \"\"\" block as it is; the chat read its first word as a command ("unknown
    command /usr/bin"), so no message starting with a slash could be sent at all."""
    backend, out = _EchoBackend(), io.StringIO()
    session = ChatSession(backend, out=out)
    run_scripted(session, [*lines, "/stats"])
    assert backend.sent == [sent], out.getvalue()
    assert "unknown command" not in out.getvalue()
    assert "(no reply yet)" in out.getvalue()     # a plain /command after it still runs


def test_a_slash_block_cut_by_the_end_of_input_is_sent_as_a_message():
    backend, out = _EchoBackend(), io.StringIO()
    run_scripted(ChatSession(backend, out=out), ['"""/etc/hosts holds', "these lines"])
    assert backend.sent == ["/etc/hosts holds\nthese lines"]


def test_a_plain_line_that_starts_with_a_slash_is_still_a_command():
    backend, out = _EchoBackend(), io.StringIO()
    run_scripted(ChatSession(backend, out=out), ["/usr/bin"])
    assert backend.sent == [] and "unknown command /usr/bin (try /help)" in out.getvalue()


@needs_stories
def test_a_message_too_long_alone_is_encoded_a_few_times_not_once_per_exchange(engine, monkeypatch):
    """A long paste after a long conversation: each earlier exchange was dropped and the whole
    prompt encoded again before the message was found too long alone (a megabyte after eight
    exchanges took 14 s instead of 2)."""
    import minillm.chat as chat
    calls = []
    encode = chat.conversation_prompt_ids

    def counted(tokenizer, conversation, chat_template=None):
        calls.append(len(conversation.turns))
        return encode(tokenizer, conversation, chat_template)

    monkeypatch.setattr(chat, "conversation_prompt_ids", counted)
    out = io.StringIO()
    session = ChatSession(EngineChatBackend(engine, "stories"), ChatSettings(temperature=0, max_tokens=4), out=out)
    for _ in range(8):
        session.conversation.turns += [{"role": "user", "content": "Tom"}, {"role": "assistant", "content": " ran."}]
    earlier = list(session.conversation.turns)
    session.handle("Tom had a ball. " * 40)
    assert "error: message too long: the prompt is" in out.getvalue()
    assert session.conversation.turns == earlier
    assert len(calls) <= 3, calls


@needs_stories
def test_over_url_a_message_too_long_alone_costs_one_count_not_a_request_per_exchange(monkeypatch):
    """Over --url each exchange dropped was another request carrying the whole paste; the newest
    message alone is counted once with the server's /tokenize instead."""
    from minillm.chat_client import HttpChatBackend
    with running_server(STORIES, max_model_len=64) as (url, _):
        backend = HttpChatBackend(url)
        opened = []
        open_request = backend._open

        def counted(conversation, settings, max_tokens):
            opened.append(len(conversation.turns))
            return open_request(conversation, settings, max_tokens)

        monkeypatch.setattr(backend, "_open", counted)
        out = io.StringIO()
        session = ChatSession(backend, ChatSettings(temperature=0, max_tokens=4), out=out)
        for _ in range(8):
            session.conversation.turns += [{"role": "user", "content": "Tom"},
                                           {"role": "assistant", "content": " ran."}]
        earlier = list(session.conversation.turns)
        session.handle("Tom had a ball. " * 40)
        assert "error: server answered 400: This model's maximum context length is 64 tokens" in out.getvalue()
        assert session.conversation.turns == earlier
        assert opened == [17, 17]     # the chat completion stories260K has no template for, then the completion

        # An exchange too many still drops the oldest ones, as before.
        out = session.out = io.StringIO()
        session.handle("Tom had a ball. " * 8)
        assert "(dropped the" in out.getvalue() and "oldest exchange(s) to fit the 64-token context)" in out.getvalue()
