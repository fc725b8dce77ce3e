"""`minillm monitor URL` without a terminal: the /v1/stats address it points to instead is the server's."""
from __future__ import annotations

import pytest
from test_cli import run_main


@pytest.mark.parametrize("url, shown", [
    ("http://127.0.0.1:9/v1", "http://127.0.0.1:9/v1/stats"),           # was .../v1/v1/stats
    ("http://127.0.0.1:9/", "http://127.0.0.1:9/v1/stats"),             # was ...9//v1/stats
    ("localhost:9", "http://localhost:9/v1/stats"),
    ("http://user:secret@127.0.0.1:9", "http://user:***@127.0.0.1:9/v1/stats"),   # the password was printed
])
def test_the_snapshot_address_is_built_from_the_servers_base_url(capsys, monkeypatch, url, shown):
    monkeypatch.setattr("minillm.tui.app.run_monitor", lambda *args, **kwargs: pytest.fail("the monitor ran"))
    status, out, err = run_main(capsys, "monitor", url)    # capsys: neither stdout nor stderr is a terminal
    assert (status, out) == (1, "")
    assert err.strip().endswith(f"run it in a terminal, or read one snapshot of the stats as JSON from {shown}")
    assert "secret" not in err
