"""Chat templates and messages whose text no tokenizer takes, refused where the conversation is rendered
and naming what holds it; and a route's unexpected error answered with the connection kept open."""
from __future__ import annotations

import re

import httpx
import pytest
from test_server_helpers import running_server

from minillm.server.app import ServerOptions
from minillm.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]

# Templates that write a lone surrogate: a Jinja string escape, and a %c of its code point.
SURROGATE_TEMPLATES = [
    "{{ '\\ud800' }}{{ messages[0].content }}",
    "{{ messages[0].content }}{{ '%c' | format(55296) }}",
]


@pytest.fixture(scope="module")
def tok(stories_path) -> Tokenizer:
    """stories260K's tokenizer."""
    return Tokenizer.from_pretrained(stories_path)


@pytest.mark.parametrize("template", SURROGATE_TEMPLATES)
def test_a_template_that_writes_a_lone_surrogate_is_a_template_error(tok, template):
    """render_chat returned the text, and encoding it failed later naming 'text[0]', not the template."""
    with pytest.raises(ValueError, match="chat template failed: the rendered prompt is not valid Unicode"):
        tok.render_chat(MESSAGES, template=template)


def test_the_server_answers_400_naming_the_template_and_keeps_the_connection(stories_path):
    """The encoding error escaped the chat route: logged as an unhandled exception, answered with no
    param, and the next request on the same connection was reset."""
    options = ServerOptions(trust_request_chat_template=True)
    with running_server(stories_path, max_model_len=256, options=options) as (url, _), \
            httpx.Client(base_url=url, timeout=120) as http:
        for template in SURROGATE_TEMPLATES:
            for path, extra in [("/v1/chat/completions", {"max_tokens": 1}),
                                ("/v1/chat/completions", {"max_tokens": 1, "stream": True}),
                                ("/tokenize", {})]:
                r = http.post(path, json={"model": "stories", "messages": MESSAGES, "chat_template": template,
                                          **extra})
                assert r.status_code == 400, (path, extra, r.text)
                error = r.json()["error"]
                assert error["param"] == "chat_template"
                assert error["message"].startswith("chat template failed: the rendered prompt is not valid Unicode")
        ok = http.post("/v1/chat/completions", json={"model": "stories", "messages": MESSAGES, "max_tokens": 1,
                                                     "chat_template": SURROGATE_TEMPLATES[0].replace("\\ud800", "x")})
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("exc, status", [(ValueError("bad value"), 400), (KeyError("x"), 500)])
def test_an_unexpected_error_answers_and_keeps_the_connection(stories_path, exc, status):
    """The catch-all handler ran in Starlette's outermost middleware, which re-raises after answering:
    uvicorn logged 'Exception in ASGI application' and dropped the connection, so the client's next
    request on it was reset."""
    async def fail():
        raise exc

    with running_server(stories_path, max_model_len=256) as running, \
            httpx.Client(base_url=running[0], timeout=120) as http:
        running.http.server.config.app.router.add_api_route("/fail", fail)
        r = http.get("/fail")
        assert r.status_code == status and r.json()["error"]["message"] == str(exc)
        assert http.get("/v1/models").status_code == 200


@pytest.mark.parametrize("content, field", [
    ("a\ud800", "messages[0]['content']"),
    ([{"type": "text", "text": "b"}, {"type": "text", "text": "\udc00"}], "messages[0]['content'][1]['text']"),
])
def test_a_message_holding_a_lone_surrogate_is_named(tok, content, field):
    """A message's own lone surrogate was blamed on the template (or on 'text[0]' once encoded)."""
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ValueError, match=rf"^{re.escape(field)} is not valid Unicode: a lone surrogate"):
        tok.render_chat([{"role": "user", "content": content}], template=template)
