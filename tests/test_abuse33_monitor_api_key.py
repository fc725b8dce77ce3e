"""`minillm monitor` against a server that wants a key: $OPENAI_API_KEY is sent as `chat --url` sends
it, and a 401 to a request that carried no key says how to give one (it said the server refused the
key, though none was sent)."""
from __future__ import annotations

import pytest
import test_tui_client
from test_cli import run_main
from test_tui_client import API_KEY, collect

from minillm.tui.client import LiveSource, SourceProblem

pytestmark = pytest.mark.anyio
fake_server, fast_backoff = test_tui_client.fake_server, test_tui_client.fast_backoff


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.parametrize("api_key, said", [
    (None, "asks for an API key (401): pass --api-key KEY or set $OPENAI_API_KEY"),
    ("wrong", "refused the API key (401): pass the server's key with --api-key"),
])
async def test_a_401_says_whether_a_key_was_sent(fake_server, fast_backoff, api_key, said):
    url, _ = fake_server
    events = await collect(LiveSource(f"{url}/auth", api_key=api_key), 2)
    assert isinstance(events[1], SourceProblem)
    assert events[1].message == f"{url}/auth {said}"


@pytest.mark.parametrize("args, sent", [([], API_KEY), (["--api-key", "given"], "given")])
def test_the_monitor_sends_openai_api_key_unless_api_key_is_given(capsys, monkeypatch, args, sent):
    seen = {}

    def run_monitor(url, api_key=None, **kwargs) -> int:
        seen["api_key"] = api_key
        return 0

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    monkeypatch.setattr("minillm.tui.app.run_monitor", run_monitor)
    monkeypatch.setattr("minillm.cli.stream_not_a_terminal", lambda: None)
    status, _, err = run_main(capsys, "monitor", "http://127.0.0.1:9", *args)
    assert (status, err) == (0, "")
    assert seen == {"api_key": sent}


def test_an_openai_api_key_no_header_can_carry_is_named(capsys, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "two\nlines")
    monkeypatch.setattr("minillm.tui.app.run_monitor", lambda *a, **k: pytest.fail("the monitor ran"))
    status, out, err = run_main(capsys, "monitor", "http://127.0.0.1:9")
    assert (status, out) == (1, "")
    assert err.startswith("minillm: error: $OPENAI_API_KEY") and len(err.splitlines()) == 1
