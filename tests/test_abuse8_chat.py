"""`minillm chat` given a top_k past the vocabulary (all of it, as in vLLM), and a refused message
leaves the conversation as it was."""
from __future__ import annotations

import io

import pytest
from test_chat import STORIES, needs_stories, run_scripted, short_context_engine  # noqa: F401
from test_cli import minillm


@pytest.fixture(scope="module")
def engine(short_context_engine):
    return short_context_engine


@needs_stories
def test_set_top_k_past_the_vocabulary_is_the_whole_vocabulary(engine):
    # It was refused ("top_k must be at most the vocabulary size 512"); vLLM samples from all of it.
    from minillm.chat import ChatSession, ChatSettings, EngineChatBackend
    out = io.StringIO()
    session = ChatSession(EngineChatBackend(engine, "stories"), ChatSettings(temperature=0, max_tokens=4), out=out)
    history = run_scripted(session, ["/set top_k 99999", "Tom had a ball."])
    text = out.getvalue()
    assert "(top_k = 99999)" in text and "error" not in text
    assert session.settings.top_k == 99999
    assert len(history) == 1 and len(history[0]) == 2        # the message after it was answered


@needs_stories
def test_a_refused_message_keeps_the_exchanges_it_would_have_dropped(engine, monkeypatch):
    from minillm.chat import ChatSession, ChatSettings, EngineChatBackend
    out = io.StringIO()
    # The engine refuses the request only after the oldest exchange was dropped to make room for 40 tokens.
    def refuse(*args, **kwargs):
        raise ValueError("the engine refused it")
    monkeypatch.setattr(engine, "add_request", refuse)
    session = ChatSession(EngineChatBackend(engine, "stories"), ChatSettings(max_tokens=40), out=out)
    earlier = [{"role": "user", "content": "Tom had a red ball. " * 3},
               {"role": "assistant", "content": " He threw it to his dog every day."}]
    session.conversation.turns.extend(dict(t) for t in earlier)
    session.handle("Then what?")
    text = out.getvalue()
    assert "error: the engine refused it" in text
    assert "dropped" not in text
    assert session.conversation.turns == earlier
    assert not engine.has_unfinished_requests() and engine.block_manager.num_used_blocks == 0


@needs_stories
def test_chat_with_top_k_past_the_vocabulary_replies():
    result = minillm("chat", str(STORIES), "--device", "cpu", "--top-k", "99999", "--max-tokens", "4", stdin="hello\n")
    assert result.returncode == 0 and "Traceback" not in result.stderr and "error" not in result.stderr, result.stderr
    assert ">>>" in result.stdout
