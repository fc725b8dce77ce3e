"""`minillm monitor` fed figures no server of ours sends: a negative or huge memory figure leaves the
dashboard running."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
from test_tui import make_stats

from minillm.tui.app import MonitorApp
from minillm.tui.client import StatsFrame
from minillm.tui.memory_panel import MemoryPanel, split_widths


@pytest.mark.parametrize("parts, total", [
    ([1 << 30, 2 << 30, -(1 << 62), 5 << 30], 8 << 30),     # a negative figure
    ([30, 30, 0, 0], 10),                                    # parts past the total
])
def test_memory_bar_widths_fit_the_bar(parts, total):
    widths = split_widths(parts, total, 40)
    assert sum(widths) <= 40 and min(widths) >= 0
    assert [w > 0 for w in widths] == [p > 0 for p in parts]


class _Frames:
    """The given snapshots, then nothing (the source stays open)."""

    def __init__(self, *snapshots) -> None:
        self.snapshots = snapshots

    async def events(self, cells):
        for stats in self.snapshots:
            yield StatsFrame(stats=stats, raw={})
        await asyncio.Event().wait()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_memory_figure_of_minus_two_to_the_62_leaves_the_dashboard_running(anyio_backend):
    """The memory bar drew each part as its share of the total in cells: a negative 'other' of
    -2**62 bytes asked for a bar of trillions of cells, and MemoryError ended the monitor."""
    stats = make_stats(0)
    bogus = dataclasses.replace(stats, memory=dataclasses.replace(stats.memory, other_bytes=-(1 << 62)))
    app = MonitorApp(source=_Frames(bogus))
    async with app.run_test(size=(120, 40)) as pilot:
        while app.frames_shown < 1:
            await pilot.pause(0.01)
        await pilot.pause()
        panel = app.query_one(MemoryPanel)
        bar = panel.render().plain.split("\n")[0]
        assert 0 < len(bar) <= panel.content_size.width
        assert app.is_running
