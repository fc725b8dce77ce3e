"""`minillm monitor` recording to a disk that fills up, and fed a block map of a million blocks by a
server that does not fold it into the cells asked for."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from test_abuse29_monitor import JsonSource, stats_dict, wait_until

from minillm.tui import block_grid
from minillm.tui.app import MonitorApp
from minillm.tui.block_grid import BlockGrid
from minillm.tui.client import SourceStatus, parse_frame
from minillm.tui.recording import Recorder

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a disk that is always full)")
async def test_a_recording_that_cannot_be_written_stops_and_the_dashboard_goes_on():
    """A full disk under --record ended the dashboard with the worker's traceback (OSError: No
    space left on device) at the first frame; the recording stops, the title says so, frames go on."""
    app = MonitorApp(JsonSource([stats_dict(1), stats_dict(2), stats_dict(3)]), recorder=Recorder("/dev/full"))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.frames_shown == 3)
        await pilot.pause()
        assert app.recorder is None
        title = app.title_bar.render().plain
        assert "recording stopped" in title and "No space left on device" in title, title
    assert app.return_code in (0, None)


class _ClosingFails(Recorder):
    """A recorder whose last flush fails (a gzip file on a disk that filled up meanwhile)."""

    def close(self) -> None:
        super().close()
        raise OSError(28, "No space left on device")


async def test_a_recording_whose_close_fails_does_not_end_the_monitor_with_a_traceback(tmp_path):
    app = MonitorApp(JsonSource([stats_dict(1)]), recorder=_ClosingFails(tmp_path / "rec.jsonl"))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.frames_shown == 1)
    assert app.return_code in (0, None)
    assert (tmp_path / "rec.jsonl").read_text().count("\n") == 1


class _UnfoldedSource:
    """A server that ignores the cells asked for and sends all of its million blocks, frame after frame."""

    def __init__(self, num_frames: int, num_blocks: int = 1_000_000):
        data = stats_dict(1, kv_num_blocks=num_blocks, block_map=[(i // 1000) % 6 - 2 for i in range(num_blocks)])
        self.text, self.num_frames = json.dumps(data), num_frames

    async def events(self, cells):
        yield SourceStatus("test source")
        for _ in range(self.num_frames):
            yield parse_frame(self.text)
            await asyncio.sleep(0)
        await asyncio.Event().wait()


async def test_a_million_blocks_are_folded_once_a_frame_not_at_every_redraw(monkeypatch):
    """The grid folded the server's whole block map (30 to 70 ms for a million blocks) for the
    subtitle and again for each render of the same frame."""
    folds = []
    merge = block_grid.merge_cells

    def counted(block_map, num_cells):
        folds.append((block_map, num_cells))
        return merge(block_map, num_cells)

    monkeypatch.setattr(block_grid, "merge_cells", counted)
    app = MonitorApp(_UnfoldedSource(3))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.frames_shown == 3)
        grid = app.query_one(BlockGrid)
        for _ in range(3):          # focus moves, a screenshot: redraws of the same frame
            await pilot.press("tab")
            app.export_screenshot()
        rendered = grid.render().plain
        assert "■" in rendered or "▆" in rendered
        assert grid.border_subtitle.startswith("1000000 blocks × 16 tok · ")
    distinct = [(m, n) for k, (m, n) in enumerate(folds)
                if not any(m is m2 and n == n2 for m2, n2 in folds[:k])]
    assert len(folds) == len(distinct), f"{len(folds)} folds of {len(distinct)} (block map, size) pairs"


def test_a_block_map_of_ints_is_checked_whole_and_a_bool_in_it_is_still_refused():
    data = stats_dict(1, block_map=[-1] * 1000 + [True])
    with pytest.raises(ValueError, match="'block_map' should be a list of ints"):
        parse_frame(json.dumps(data))
    assert parse_frame(json.dumps(stats_dict(1, block_map=[-1] * 1000 + [3]))).stats.block_map[-1] == 3



@pytest.mark.parametrize("block_map", [
    [(i // 1000) % 6 - 2 for i in range(1_000_000)],                # runs of a state, as requests hold blocks
    [(i * 7919) % 5 - 1 if i % 3 else 4 for i in range(300_001)],   # mixed, a third of them one request's
    [-1] * 70_000 + [2**70],                                        # a state past 64 bits
    list(range(70_000)),                                            # more states than are counted at once
])
def test_a_large_block_map_folds_to_each_groups_commonest_state(block_map):
    merged, group = block_grid.merge_cells(block_map, 300)
    expected = []
    for start in range(0, len(block_map), group):
        counts = {}
        for state in block_map[start:start + group]:
            counts[state] = counts.get(state, 0) + 1
        top = max(counts.values())
        expected.append(min(s for s, c in counts.items() if c == top))   # of those tied, the smallest
    assert len(merged) == len(expected) <= 300
    assert merged == expected
