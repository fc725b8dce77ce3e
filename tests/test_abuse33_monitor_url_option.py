"""`minillm monitor --url URL`, as `minillm chat --url URL` names the server: it was a usage error
offering --replay in its place."""
from __future__ import annotations

import pytest
from test_cli import run_main


@pytest.fixture
def monitored(monkeypatch):
    seen = {}

    def run_monitor(url, **kwargs) -> int:
        seen["url"] = url
        return 0

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setattr("minillm.tui.app.run_monitor", run_monitor)
    monkeypatch.setattr("minillm.cli.stream_not_a_terminal", lambda: None)
    return seen


@pytest.mark.parametrize("args, url", [
    (["--url", "http://127.0.0.1:9"], "http://127.0.0.1:9"),
    (["http://127.0.0.1:9"], "http://127.0.0.1:9"),
    ([], "http://127.0.0.1:8000"),
])
def test_the_server_is_named_by_url_or_by_the_argument(capsys, monitored, args, url):
    status, _, err = run_main(capsys, "monitor", *args)
    assert (status, err) == (0, "")
    assert monitored == {"url": url}


def test_url_and_the_argument_together_are_a_usage_error(capsys, monitored):
    status, out, err = run_main(capsys, "monitor", "http://127.0.0.1:9", "--url", "http://127.0.0.1:10")
    assert (status, out, monitored) == (2, "", {})
    assert err.splitlines() == ["minillm monitor: error: the server is named twice (URL and --url): give one "
                                "(try 'minillm monitor --help')"]


def test_a_bad_url_option_is_named(capsys, monitored):
    status, _, err = run_main(capsys, "monitor", "--url", "http://127.0.0.1:99999")
    assert (status, monitored) == (2, {})
    assert "'--url'" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("args, named", [([""], "'URL'"), (["--url", ""], "'--url'")])
def test_an_empty_url_is_named_not_read_as_the_default(capsys, monitored, args, named):
    status, _, err = run_main(capsys, "monitor", *args)
    assert (status, monitored) == (2, {})
    assert named in err and len(err.splitlines()) == 1
