"""vLLM's API and command-line shapes taken as vLLM takes them, and options refused in one line where
they would fail later or never end: served names, the monitor without a terminal, the bench
commands' bounds, add_request's prompt forms, LLM.chat's content format, served_model_name."""
from __future__ import annotations

import pytest
from test_cli import STORIES, needs_stories, run_main


# ---- serve --served-model-name ------------------------------------------------------------------------

@pytest.fixture
def started(monkeypatch):
    """serve's run_server stubbed: what it was started with ({"config", "options"}) once main() returns."""
    seen: dict = {}

    def fake_run_server(config, host="127.0.0.1", port=8000, options=None, monitor=False, core_hook=None):
        seen.update(config=config, options=options)
        return 0

    monkeypatch.setattr("minillm.server.app.run_server", fake_run_server)
    return seen


@needs_stories
def test_a_served_name_that_starts_with_an_unknown_tilde_user_is_a_name(capsys, started, monkeypatch, tmp_path):
    # With MODEL left out, each name was tried as a model directory through Path.expanduser, which
    # raised RuntimeError "Could not determine home directory." for ~nouser: serve failed on a name.
    monkeypatch.setenv("MINILLM_MODEL", str(STORIES))
    status, _, err = run_main(capsys, "serve", "--device", "cpu", "--served-model-name", "~nouser-22", "x" * 300)
    assert (status, err) == (0, "")
    assert started["options"].served_model_name == ("~nouser-22", "x" * 300)
    # The case the check is for still holds: a model directory (here under ~) written after the option.
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    started.clear()
    status, _, err = run_main(capsys, "serve", "--device", "cpu", "--served-model-name", "~/model")
    assert status == 1 and not started
    assert err.strip().startswith("minillm: error: --served-model-name took ~/model as a name")
