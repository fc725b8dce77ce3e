"""`ollama run`'s chat commands in `minillm chat`: /bye, /clear, /?, /set parameter KEY VALUE and
/set system TEXT; each was 'unknown command' or 'unknown setting'."""
from __future__ import annotations

import io

from test_abuse30_chat import _EchoBackend

from minillm.chat import ChatSession, ChatSettings


def _session() -> tuple[ChatSession, io.StringIO]:
    out = io.StringIO()
    return ChatSession(_EchoBackend(), ChatSettings(), out=out), out


def test_set_parameter_and_set_system_change_what_set_and_system_change():
    session, out = _session()
    for line in ("/set parameter num_predict 7", "/set parameter temperature 0.2", "/set parameter top_k 5",
                 "/set parameter seed 3", "/set system You are kind."):
        session.handle(line)
    assert (session.settings.max_tokens, session.settings.temperature, session.settings.top_k,
            session.settings.seed) == (7, 0.2, 5, 3)
    assert session.conversation.system == "You are kind."
    session.handle("/set parameter repeat_penalty 1.1")      # not a setting of this chat: said so
    assert "error: unknown setting 'repeat_penalty'" in out.getvalue()
    assert "unknown command" not in out.getvalue()


def test_bye_clear_and_question_mark():
    session, out = _session()
    session.handle("hello")
    session.handle("/clear")
    assert session.conversation.turns == [] and "(conversation cleared)" in out.getvalue()
    session.handle("/?")
    assert "/set KEY VALUE" in out.getvalue()
    session.handle("/bye now")
    assert session.is_running and "usage: /bye (it takes no arguments, got 'now')" in out.getvalue()
    session.handle("/bye")
    assert not session.is_running
