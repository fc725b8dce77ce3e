"""`minillm chat` used roughly: replies past the context over --url, a server that breaks or stalls
mid-reply, a chat template that renders nothing, a system message longer than the context."""
from __future__ import annotations

import io

import pytest
from test_chat import STORIES, needs_stories, run_scripted
from test_server_helpers import running_server

from minillm.chat import ChatSession, ChatSettings, EngineChatBackend

TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m.content }} {% endfor %}"


@pytest.fixture(scope="module")
def engine():
    from minillm.config import EngineConfig
    from minillm.engine import LLMEngine
    engine = LLMEngine(EngineConfig(model=str(STORIES), device="cpu", max_model_len=64), log=lambda msg: None)
    yield engine
    engine.shutdown()


@needs_stories
def test_a_reply_over_url_asked_for_more_than_the_context_gets_the_rest_of_it():
    """A model without a chat template is served by /v1/completions, whose default max_tokens is
    16: a reply capped at the context must ask for the rest of the context, not that default."""
    from minillm.chat_client import HttpChatBackend
    with running_server(STORIES, max_model_len=64) as (url, _):
        backend = HttpChatBackend(url)
        out = io.StringIO()
        run_scripted(ChatSession(backend, ChatSettings(temperature=0, max_tokens=1000), out=out),
                     ["Once upon a time"])
    stats = backend.last_stats
    assert stats.finish_reason == "length"
    assert stats.prompt_tokens + stats.output_tokens == 64, out.getvalue()
    assert "[the 64-token context is full: /reset starts over]" in out.getvalue()


class _BreakingBackend:
    """Writes part of a reply, then its connection breaks."""
    name, has_chat_template, last_stats = "breaking", True, None

    def stream_reply(self, conversation, settings, should_stop):
        yield "Tom ran to the"
        raise RuntimeError("the stream from http://127.0.0.1:1 broke: peer closed connection")


def test_a_reply_broken_midway_puts_its_error_on_a_line_of_its_own():
    out = io.StringIO()
    history = run_scripted(ChatSession(_BreakingBackend(), out=out), ["hello"], status=1)
    assert "Tom ran to the\nerror: the stream from http://127.0.0.1:1 broke" in out.getvalue()
    assert history == [[]]          # the failed message is not kept
