"""A bad server URL, API key or `--prompt -` given twice is a usage error (status 2) naming its flag, as
other bad flag values are; they were one-line errors of status 1, the status of a failure that is no
flag's fault (a server that does not answer, a model that does not load)."""
from __future__ import annotations

import io

import pytest
from test_abuse29b_cli import one_line
from test_cli import STORIES, run_main


@pytest.mark.parametrize("args, flag, reason", [
    (["chat", "--url", "http://x:99999", "m"], "--url", "not a server URL: 'http://x:99999' (Port out of range"),
    (["chat", "--url", "", "m"], "--url", "not a server URL: '' (give http://host:port)"),
    (["chat", "--url", "http://127.0.0.1:9", "--api-key", "a\nb", "m"], "--api-key",
     "holds a control character ('\\n')"),
    (["chat", "--url", "http://127.0.0.1:9", "--api-key", " a", "m"], "--api-key", "starts or ends with a space"),
    (["router", "--prefill", "http://x:99999", "--decode", "http://y:1"], "--prefill",
     "not a server URL: 'http://x:99999' (Port out of range"),
    (["router", "--prefill", "", "--decode", "http://y:1"], "--prefill", "not a server URL: ''"),
    (["router", "--prefill", "http://x:1", "--decode", "http://[::1"], "--decode", "not a server URL"),
    (["monitor", "http://x:99999"], "URL", "not a server URL: 'http://x:99999' (Port out of range"),
    (["monitor", "http://127.0.0.1:9", "--api-key", "a\rb"], "--api-key", "holds a control character ('\\r')"),
])
def test_a_bad_url_or_key_is_a_usage_error_naming_it(capsys, monkeypatch, args, flag, reason):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    status, out, err = run_main(capsys, *args)
    line = one_line(err)
    command = f"minillm {args[0]}"
    assert (status, out) == (2, ""), line
    assert line.startswith(f"{command}: error: Invalid value for '{flag}': {reason}"), line
    assert line.endswith(f"(try '{command} --help')"), line


def test_prompt_dash_twice_is_a_usage_error_naming_the_flag(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Once\n"))
    status, out, err = run_main(capsys, "generate", str(STORIES), "--device", "cpu", "-p", "-", "-p", "-")
    assert (status, out) == (2, "")
    assert one_line(err) == ("minillm generate: error: Invalid value for '--prompt': '-' reads stdin, which holds "
                             "one prompt: give '-' once (try 'minillm generate --help')")
