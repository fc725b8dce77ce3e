"""serve's start-up values that ServerOptions checks, named as the flags they came from; an empty
served_model_name in the LLM API; an arrival_time of 0 in the async engines."""
from __future__ import annotations

import pytest

from test_cli import STORIES, needs_stories, run_main


def one_line(err: str) -> str:
    """The single line a failed command printed (asserting there is one, and no traceback)."""
    assert "Traceback" not in err, err
    [line] = err.strip().splitlines()
    return line


@pytest.fixture
def started(monkeypatch):
    """serve's run_server stubbed: what it was started with, once main() returns."""
    seen: dict = {}

    def fake_run_server(config, host="127.0.0.1", port=8000, options=None, monitor=False, core_hook=None):
        seen.update(config=config, options=options)
        return 0

    monkeypatch.setattr("minillm.server.app.run_server", fake_run_server)
    return seen


# ---- serve's start-up values ---------------------------------------------------------------------------

@needs_stories
@pytest.mark.parametrize("flags, flag", [
    (("--served-model-name", ""), "--served-model-name"),
    (("--served-model-name", "a", "--served-model-name", " "), "--served-model-name"),
    (("--root-path", "llm"), "--root-path"),
    (("--response-role", " "), "--response-role"),
    (("--api-key", ""), "--api-key"),
    (("--timeout-graceful-shutdown", "nan"), "--timeout-graceful-shutdown"),
    (("--timeout-graceful-shutdown", "0"), "--timeout-graceful-shutdown"),
    (("--timeout-graceful-shutdown", "inf"), "--timeout-graceful-shutdown"),
])
def test_serve_values_server_options_refuses_are_usage_errors_naming_the_flag(capsys, started, flags, flag):
    # They exited 1 naming the Python field (served_model_name must be ...), where every other bad
    # flag is a usage error (status 2) naming the flag as typed.
    status, out, err = run_main(capsys, "serve", str(STORIES), "--device", "cpu", "--port", "0", *flags)
    assert (status, out, started) == (2, "", {})
    line = one_line(err)
    assert f"Invalid value for '{flag}'" in line, line
    assert flag.lstrip("-").replace("-", "_") not in line, line


# ---- LLM(served_model_name=...) ------------------------------------------------------------------------

@pytest.mark.parametrize("names", ["", " ", ["stories", ""], ["\t"]])
def test_an_empty_served_model_name_is_a_value_error_as_the_server_makes_it(stories_path, names):
    # LLM(served_model_name="") was taken (as the model's name) where ServerOptions refuses it.
    from minillm import LLM
    from minillm.server.app import ServerOptions
    with pytest.raises(ValueError, match="served_model_name"):
        ServerOptions(served_model_name=names)
    with pytest.raises(ValueError) as info:
        LLM(str(stories_path), device="cpu", served_model_name=names)
    assert str(info.value).startswith("served_model_name must be"), info.value
    assert repr(names) in str(info.value), info.value
