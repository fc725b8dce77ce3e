"""`minillm monitor` over a server restarted with other options (another model or KV pool) that counted
past the old run before the monitor reconnected: a new run all the same, its series started over and
marked, as when the counters go back; it was folded into the old run's history unmarked."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
from test_tui import make_stats, wait_for_frames

from minillm.tui.app import MonitorApp, is_new_run
from minillm.tui.client import SourceProblem, StatsFrame


@pytest.fixture
def anyio_backend():
    return "asyncio"


class _Events:
    """The given events, then nothing (the source stays open)."""

    def __init__(self, events: list) -> None:
        self._events = events

    async def events(self, cells):
        for event in self._events:
            yield event
        await asyncio.Event().wait()


def _frame(stats) -> StatsFrame:
    return StatsFrame(stats=stats, raw={})


def test_a_changed_engine_is_a_new_run_even_when_its_counters_are_ahead():
    before, after = make_stats(2), make_stats(5)
    assert not is_new_run(before, after)
    assert is_new_run(after, before)                         # the counters went back
    for change in ({"model": "Qwen/Qwen3-0.6B"}, {"kv_num_blocks": before.kv_num_blocks * 2},
                   {"max_model_len": before.max_model_len // 2}, {"dtype": "bfloat16"}):
        assert is_new_run(before, dataclasses.replace(after, **change)), change


@pytest.mark.anyio
async def test_the_monitor_starts_the_series_over_for_a_restarted_server():
    restarted = dataclasses.replace(make_stats(5), model="Qwen/Qwen3-0.6B")
    events = [_frame(make_stats(k)) for k in range(3)]
    events += [SourceProblem("cannot connect to http://127.0.0.1:8000", 0.5), _frame(restarted)]
    app = MonitorApp(source=_Events(events))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for_frames(pilot, 4)
        assert pilot.app.num_restarts == 1
        assert "↻ counters reset" in pilot.app.title_bar.content.plain
        assert pilot.app.history.num_frames == 1
        assert min(s.step for s in pilot.app.history.steps) == restarted.recent_steps[0].step
