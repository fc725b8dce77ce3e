"""The monitor against a real `minillm` server on stories260K under streaming load."""
from __future__ import annotations

import os
import shutil
import threading

import httpx
import pytest

from minillm.stats import CELL_CACHED, CELL_FREE
from test_server_helpers import running_server
from minillm.tui.app import MonitorApp
from minillm.tui.client import LiveSource
from minillm.tui.recording import Recorder, load_recording
from minillm.tui.request_table import RequestTable

pytestmark = pytest.mark.anyio

API_KEY = "monitor-key"
NUM_REQUESTS = 8
MAX_TOKENS = 160
# A pool too small for all requests at once, so the scheduler preempts while the monitor watches.
ENGINE = dict(num_kv_blocks=48, block_size=16, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512)


@pytest.fixture
def anyio_backend():
    return "asyncio"


def stream_completion(url: str, index: int, errors: list) -> None:
    """One streaming completion that runs to max_tokens."""
    body = {"model": "stories", "prompt": f"Once upon a time, a cat named {index}", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True, "temperature": 0}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as response:
            response.raise_for_status()
            for _ in response.iter_lines():
                pass
    except Exception as exc:  # reported by the test, not lost in a thread
        errors.append(exc)


async def wait_until(pilot, predicate, timeout: float = 30.0) -> bool:
    """Pump the app until predicate() holds."""
    for _ in range(int(timeout / 0.05)):
        if predicate():
            return True
        await pilot.pause(0.05)
    return predicate()


async def test_monitor_follows_a_loaded_server(stories_path, tmp_path):
    recording = tmp_path / "loaded.jsonl"
    with running_server(stories_path, api_key=API_KEY, **ENGINE) as (url, _engine):
        app = MonitorApp(source=LiveSource(url, api_key=API_KEY, interval_s=0.1), recorder=Recorder(recording))
        async with app.run_test(size=(120, 40)) as pilot:
            assert await wait_until(pilot, lambda: app.stats is not None), "no stats from the server"
            assert app.stats.kv_num_blocks == ENGINE["num_kv_blocks"]
            errors: list = []
            threads = [threading.Thread(target=stream_completion, args=(url, i, errors)) for i in range(NUM_REQUESTS)]
            for thread in threads:
                thread.start()
            seen = {"running": 0, "usage": 0.0, "rows": 0}

            def observe() -> bool:
                stats = app.stats
                seen["running"] = max(seen["running"], stats.num_running)
                seen["usage"] = max(seen["usage"], stats.kv_usage)
                rows = app.query_one(RequestTable).row_count
                seen["rows"] = max(seen["rows"], rows)
                return stats.num_running > 0 and stats.kv_usage > 0 and rows > 0

            assert await wait_until(pilot, observe), f"the monitor never saw the load: {seen}"
            assert any(c >= 0 for c in app.stats.block_map), "the grid shows no used block"
            await wait_until(pilot, lambda: not any(t.is_alive() for t in threads), timeout=60)
            assert not errors, errors

            def drained() -> bool:
                stats = app.stats
                return (stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_num_used_blocks == 0
                        and stats.kv_usage == 0 and all(c in (CELL_FREE, CELL_CACHED) for c in stats.block_map))

            assert await wait_until(pilot, drained, timeout=10), "blocks still in use after the load"
            assert app.stats.kv_num_free_blocks + app.stats.kv_num_cached_blocks == ENGINE["num_kv_blocks"]
            assert not app.query_one("#banner").display
        frames = [frame.stats for _, frame in load_recording(recording)]
        assert any(s.num_running > 0 for s in frames) and frames[-1].num_running == 0
        if os.environ.get("MINILLM_TUI_RECORDING"):
            shutil.copyfile(recording, os.environ["MINILLM_TUI_RECORDING"])  # keep it for screenshots

        wrong = MonitorApp(source=LiveSource(url, api_key="not-the-key"))
        async with wrong.run_test(size=(80, 24)) as pilot:
            assert await wait_until(pilot, lambda: wrong.query_one("#banner").display, timeout=10)
            assert "refused the API key (401)" in wrong.query_one("#banner").content.plain
            assert wrong.is_running


def test_monitor_demo_runs_from_the_command_line_and_help_names_it():
    """`minillm monitor --demo` replays the shipped recording in a terminal; --help says so."""
    import subprocess
    import sys
    from pathlib import Path

    pexpect = pytest.importorskip("pexpect")
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo), "TERM": "xterm-256color"}
    help_text = subprocess.run([sys.executable, "-m", "minillm.cli", "monitor", "--help"], cwd=repo, env=env,
                               capture_output=True, text=True, timeout=60).stdout
    assert "--demo" in help_text and "minillm monitor --demo" in " ".join(help_text.split())
    assert "minillm monitor --demo" in (repo / "README.md").read_text()
    child = pexpect.spawn(sys.executable, ["-m", "minillm.cli", "monitor", "--demo"], cwd=str(repo), env=env,
                          encoding="utf-8", timeout=60, dimensions=(40, 120))
    child.expect_exact("replay demo.jsonl.gz")
    child.expect_exact("KV block pool")
    child.send("q")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
