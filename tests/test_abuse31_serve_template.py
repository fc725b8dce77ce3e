"""serve --chat-template given inline with bytes that are not UTF-8: refused before the model loads."""
from __future__ import annotations

from test_abuse23_cli import run_bytes
from test_chat import STORIES, needs_stories


@needs_stories
def test_serve_refuses_an_inline_template_that_is_not_utf8_before_it_loads():
    # Taken as given, the server started and every chat completion was a 500 "internal server error:
    # ValueError: text[0] is not valid Unicode", naming neither the option nor the byte.
    template = b"{{ '\xff' }}{% for m in messages %}{{ m.content }}{% endfor %}"
    result = run_bytes("serve", str(STORIES), "--device", "cpu", "--port", "9", "--chat-template", template)
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.splitlines() == ["minillm: error: --chat-template is not UTF-8 text: character 5 (byte 0xff)"]
