"""`minillm monitor` as an operator runs it: a busy server whose requests leave by the thousand keeps
the request table bounded, and a restarted server's table holds none of the old run's requests."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
from test_tui import make_stats

from minillm.stats import RequestStats
from minillm.tui.app import MonitorApp
from minillm.tui.client import StatsFrame
from minillm.tui.request_table import FINISHED_SHOWN_S, MAX_FINISHED_ROWS

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class _Frames:
    """Frames handed in by the test, one at a time (the source stays open)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    async def events(self, cells):
        while True:
            yield await self.queue.get()


def _request(request_id: str, state: str = "running") -> RequestStats:
    return RequestStats(request_id=request_id, state=state, prompt_tokens=5, output_tokens=3, num_blocks=1,
                        num_cached_tokens=0, ttft_s=0.01)


def _snapshot(frame: int, request_ids: list[str], time: float):
    """A snapshot `frame` frames into one run (its counters grow with frame) holding these requests."""
    base = make_stats(0)
    return dataclasses.replace(base, time=time, requests=[_request(rid) for rid in request_ids],
                               num_steps=base.num_steps + frame,
                               generation_tokens_total=base.generation_tokens_total + frame)


async def _show(pilot, source: _Frames, stats) -> None:
    """Hand the app one frame and wait until it is drawn."""
    shown = pilot.app.frames_shown
    source.queue.put_nowait(StatsFrame(stats=stats, raw={}))
    for _ in range(1000):
        if pilot.app.frames_shown > shown:
            return
        await pilot.pause(0.01)
    raise AssertionError("the frame was never shown")


async def test_requests_leaving_by_the_thousand_keep_the_table_bounded():
    # 400 requests leave between two snapshots a quarter second apart (a fast server with short
    # answers): within FINISHED_SHOWN_S the finished rows would reach 400 * 4 * 10.
    source = _Frames()
    app = MonitorApp(source=source)
    per_frame, num_frames = 400, 12
    async with app.run_test(size=(120, 40)) as pilot:
        for frame in range(num_frames):
            ids = [f"cmpl-{frame}-{i}" for i in range(per_frame)]
            await _show(pilot, source, _snapshot(frame, ids, 1000.0 + frame * 0.25))
        assert num_frames * 0.25 < FINISHED_SHOWN_S
        table = app.table
        finished = [r for r in table._requests if r.state == "finished"]
        assert len(finished) == MAX_FINISHED_ROWS < (num_frames - 1) * per_frame
        # The newest kept: the requests of the frame before the last, every one of them.
        assert {f"cmpl-{num_frames - 2}-{i}" for i in range(per_frame)} <= {r.request_id for r in finished}
        assert table.row_count == 100 and "of 1424" in str(table.border_subtitle)


async def test_a_restarted_server_shows_none_of_the_old_runs_requests():
    source = _Frames()
    app = MonitorApp(source=source)
    async with app.run_test(size=(120, 40)) as pilot:
        await _show(pilot, source, _snapshot(5, ["cmpl-old-1", "cmpl-old-2"], 1000.0))
        await _show(pilot, source, _snapshot(6, ["cmpl-old-1"], 1000.5))     # old-2 finished
        # The server restarts: its counters start over, and the old run's requests were cut off with it.
        await _show(pilot, source, _snapshot(0, ["cmpl-new"], 1001.0))
        assert app.num_restarts == 1
        assert [r.request_id for r in app.table._requests] == ["cmpl-new"]
        assert app.table.row_count == 1


async def test_a_waiting_request_pushed_past_the_listed_rows_is_not_shown_finished():
    # The engine lists the first MAX_WAITING_ROWS waiting requests; a preempted one goes back to the
    # front of the queue and pushes the last listed one out of the snapshot, still waiting.
    source = _Frames()
    app = MonitorApp(source=source)

    def snapshot(frame: int, rows: list[RequestStats], num_waiting: int):
        return dataclasses.replace(_snapshot(frame, [], 1000.0 + frame), requests=rows, num_waiting=num_waiting)

    async with app.run_test(size=(120, 40)) as pilot:
        running, queued = _request("cmpl-r"), [_request(f"cmpl-w{i}", "waiting") for i in range(3)]
        await _show(pilot, source, snapshot(0, [running, *queued], num_waiting=5))
        preempted = dataclasses.replace(running, state="preempted")
        await _show(pilot, source, snapshot(1, [preempted, *queued[:2]], num_waiting=6))
        states = {r.request_id: r.state for r in app.table._requests}
        assert states == {"cmpl-r": "preempted", "cmpl-w0": "waiting", "cmpl-w1": "waiting"}
        # With the whole queue listed, a request that leaves it did finish (a client's abort).
        await _show(pilot, source, snapshot(2, [preempted, queued[0]], num_waiting=2))
        states = {r.request_id: r.state for r in app.table._requests}
        assert states == {"cmpl-r": "preempted", "cmpl-w0": "waiting", "cmpl-w1": "finished"}
