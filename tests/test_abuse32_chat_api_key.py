"""`minillm chat --url` sends $OPENAI_API_KEY when --api-key is left out, as `vllm chat` does (the
openai client it runs reads the variable); --api-key goes over it. It was ignored: a 401."""
from __future__ import annotations

from test_chat import STORIES, needs_stories
from test_cli import minillm
from test_server_helpers import running_server


@needs_stories
def test_openai_api_key_is_the_default_key():
    with running_server(STORIES, api_key="sekrit") as (url, _):
        ask = ("chat", "--url", url, "--max-tokens", "3", "-q", "Once")
        result = minillm(*ask, env={"OPENAI_API_KEY": "sekrit"})
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip()
        refused = minillm(*ask, "--api-key", "wrong", env={"OPENAI_API_KEY": "sekrit"})
        assert refused.returncode == 1 and "refused the API key (401)" in refused.stderr
        result = minillm(*ask, "--api-key", "sekrit", env={"OPENAI_API_KEY": "wrong"})
        assert result.returncode == 0, result.stderr


def test_a_variable_no_header_can_carry_is_named():
    result = minillm("chat", "--url", "http://127.0.0.1:9", "-q", "hi", env={"OPENAI_API_KEY": "a key "})
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.splitlines() == ["minillm: error: $OPENAI_API_KEY starts or ends with a space, which an "
                                          "HTTP header cannot carry; give the key without it"]
