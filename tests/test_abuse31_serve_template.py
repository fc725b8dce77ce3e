"""serve refusing what it is given, as generate does: an inline --chat-template that is not UTF-8, and a
value the engine refuses at start, named by its flag."""
from __future__ import annotations

import pytest
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


@needs_stories
@pytest.mark.parametrize("flag, value", [("--kv-offload-gib", "1e-7"), ("--kv-cache-memory-bytes", "10")])
def test_serve_names_the_flag_when_the_engine_refuses_its_value_at_start(flag, value):
    # generate said "Invalid value for '--kv-offload-gib'" (status 2); serve said "kv_offload_gib 1e-07
    # holds no KV block ...; raise kv_offload_gib" (status 1), naming the Python field, not the flag.
    result = run_bytes("serve", str(STORIES), "--device", "cpu", "--port", "0", flag, value)
    assert (result.returncode, result.stdout) == (2, "")
    assert f"Invalid value for '{flag}'" in result.stderr and "holds no KV block" in result.stderr
    assert "_gib" not in result.stderr.replace("--kv-offload-gib", "") and "_bytes" not in result.stderr
