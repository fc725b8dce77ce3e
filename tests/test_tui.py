"""Monitor tests on a replayed recording: panels show the recorded values, keys work, snapshots hold."""
from __future__ import annotations

import asyncio
import math
import re
from collections import Counter

import pytest
from rich.console import Console
from rich.segment import Segment
from rich.text import Text

from minillm.stats import CELL_CACHED, CELL_FREE, EngineStats, MemoryStats, RequestStats, StepStats
from minillm.tui.app import MonitorApp, TitleBar
from minillm.tui.batch_chart import BatchChart
from minillm.tui.block_grid import BlockGrid
from minillm.tui.help_screen import HelpScreen
from minillm.tui.memory_panel import MemoryPanel
from minillm.tui.queue_panel import QueuePanel
from minillm.tui.recording import Recorder, ReplaySource
from minillm.tui.render import COLOR_CACHED, COLOR_FREE, COLOR_OVER, request_color
from minillm.tui.request_table import RequestTable
from minillm.tui.usage_panel import UsagePanel

NUM_BLOCKS = 96
BLOCK_SIZE = 16
NUM_CACHED = 8
NUM_FRAMES = 12
BUDGET = 256
STEPS_PER_FRAME = 4
STEPS_PER_SNAPSHOT = 8   # snapshots overlap by four steps, so the monitor must dedupe them

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def make_step(step: int) -> StepStats:
    """A step mixing decode tokens with a prompt chunk every few steps."""
    prefill = 200 if step % 7 == 0 else (64 if step % 3 == 0 else 0)
    decode = 4 + step % 3
    return StepStats(
        step=step, time=1000.0 + step * 0.01, num_prefill_tokens=prefill, num_decode_tokens=decode,
        num_seqs=decode + (1 if prefill else 0), token_budget=BUDGET, step_time_s=0.004,
    )


def make_requests(frame: int) -> list[RequestStats]:
    """Four running requests, one preempted, one waiting; outputs grow with the frame."""
    states = ["running"] * 4 + ["preempted", "waiting"]
    rows = []
    for i, state in enumerate(states):
        prompt = 40 + 13 * i
        output = 2 * frame + i if state == "running" else 0
        blocks = math.ceil((prompt + output) / BLOCK_SIZE) if state == "running" else 0
        rows.append(RequestStats(
            request_id=f"req-{i}", state=state, prompt_tokens=prompt, output_tokens=output,
            num_blocks=blocks, num_cached_tokens=16 * (i % 2), ttft_s=0.012 * (i + 1) if output else None,
        ))
    return rows


def make_stats(frame: int) -> EngineStats:
    """Snapshot number `frame` of a small loaded engine (block map at one block a cell)."""
    requests = make_requests(frame)
    block_map: list[int] = []
    for row, r in enumerate(requests):
        block_map += [row] * r.num_blocks
    used = len(block_map)
    block_map += [CELL_CACHED] * NUM_CACHED + [CELL_FREE] * (NUM_BLOCKS - used - NUM_CACHED)
    tokens = sum(r.prompt_tokens + r.output_tokens for r in requests if r.state == "running")
    last = frame * STEPS_PER_FRAME + STEPS_PER_SNAPSHOT
    return EngineStats(
        time=1000.0 + frame, model="stories260K", device="cpu", dtype="float32",
        num_running=4, num_waiting=2, num_preempted=1, num_preemptions=3 + frame,
        kv_num_blocks=NUM_BLOCKS, kv_num_used_blocks=used, kv_num_free_blocks=NUM_BLOCKS - used - NUM_CACHED,
        kv_num_cached_blocks=NUM_CACHED, kv_usage=used / NUM_BLOCKS,
        kv_token_utilization=tokens / (used * BLOCK_SIZE), block_size=BLOCK_SIZE, max_num_seqs=8,
        max_num_batched_tokens=BUDGET, max_model_len=256, prefix_cache_queries=400, prefix_cache_hits=100,
        num_steps=last, prompt_tokens_total=1200 + frame, generation_tokens_total=300 + 10 * frame,
        num_requests_finished={"length": 5, "stop": 2}, prompt_throughput=1234.5,
        generation_throughput=567.8 + frame, ttft_p50_s=0.012, ttft_p99_s=0.08,
        itl_p50_s=0.003, itl_p99_s=0.009,
        memory=MemoryStats(weights_bytes=1 << 20, kv_pool_bytes=6 << 20, other_bytes=1 << 20, total_bytes=16 << 20),
        block_map=block_map, block_map_blocks_per_cell=1,
        recent_steps=[make_step(s) for s in range(last - STEPS_PER_SNAPSHOT + 1, last + 1)],
        requests=requests,
    )


def write_recording(path, num_frames: int = NUM_FRAMES, dt: float = 0.05) -> list[EngineStats]:
    """Record `num_frames` snapshots `dt` seconds apart; returns them."""
    frames = [make_stats(k) for k in range(num_frames)]
    with Recorder(path) as recorder:
        for k, stats in enumerate(frames):
            recorder.write(stats.to_dict(), t=100.0 + k * dt)
    return frames


async def wait_for_frames(pilot, count: int) -> None:
    """Let the replay worker deliver `count` frames."""
    for _ in range(200):
        if pilot.app.frames_received >= count:
            break
        await pilot.pause(0.01)
    await pilot.pause()
    assert pilot.app.frames_received >= count


@pytest.fixture
def frozen_app(tmp_path):
    """An app replaying the whole recording at once, then holding the last frame."""
    path = tmp_path / "frozen.jsonl"
    write_recording(path)
    return MonitorApp(source=ReplaySource(path, loop=False, realtime=False))


async def wait_for_replay_end(pilot) -> None:
    """Wait until a non-looping replay has shown its last frame and said so."""
    await wait_for_frames(pilot, NUM_FRAMES)
    for _ in range(100):
        if "holding" in pilot.app.source_text:
            return
        await pilot.pause(0.01)
    raise AssertionError(f"replay did not end: {pilot.app.source_text!r}")


async def test_panels_show_recorded_values(frozen_app):
    last = make_stats(NUM_FRAMES - 1)
    async with frozen_app.run_test(size=(120, 40)) as pilot:
        await wait_for_replay_end(pilot)
        app = pilot.app
        usage = app.query_one(UsagePanel).render().plain
        assert f"{last.kv_usage * 100:.1f}%" in usage and f"{last.kv_num_used_blocks}/96 blocks" in usage
        assert f"{last.kv_token_utilization * 100:.1f}%" in usage and "8 cached" in usage
        queues = app.query_one(QueuePanel).render().plain
        for expected in ("running     4 / 8", "waiting     2", "preempted   1", f"preemptions {last.num_preemptions}",
                         "1234.5 tok/s", f"{last.generation_throughput:.1f} tok/s", "12.0 ms", "80.0 ms", "9.0 ms"):
            assert expected in queues
        memory = app.query_one(MemoryPanel).render().plain
        assert "weights 1.0 MiB" in memory and "KV pool 6.0 MiB" in memory and "free 8.0 MiB" in memory
        table = app.query_one(RequestTable)
        assert table.row_count == len(last.requests)
        for r in last.requests:
            cells = [c.plain for c in table.get_row(r.request_id)]
            assert cells[:6] == [f"■ {r.request_id}", r.state, str(r.prompt_tokens), str(r.output_tokens),
                                 str(r.num_blocks), str(r.num_cached_tokens // BLOCK_SIZE)]
        assert "stories260K · cpu · float32" in app.query_one(TitleBar).content.plain


async def test_block_grid_colours_blocks_by_owner(frozen_app):
    last = make_stats(NUM_FRAMES - 1)
    async with frozen_app.run_test(size=(120, 40)) as pilot:
        await wait_for_replay_end(pilot)
        grid = pilot.app.query_one(BlockGrid).render()
        legend_start = grid.plain.rindex("\n")
        # At one block a cell every cell is one styled glyph.
        colours = Counter(str(span.style) for span in grid.spans if span.end <= legend_start)
        assert sum(colours.values()) == NUM_BLOCKS
        for r in last.requests:
            if r.num_blocks:
                assert colours[request_color(r.request_id)] == r.num_blocks
        assert colours[COLOR_CACHED] == NUM_CACHED
        assert colours[COLOR_FREE] == last.kv_num_free_blocks


async def test_batch_history_dedupes_overlapping_steps(frozen_app):
    async with frozen_app.run_test(size=(120, 40)) as pilot:
        await wait_for_replay_end(pilot)
        steps = [s.step for s in pilot.app.history.steps]
        last_step = (NUM_FRAMES - 1) * STEPS_PER_FRAME + STEPS_PER_SNAPSHOT
        assert steps == list(range(1, last_step + 1))
        chart = pilot.app.query_one(BatchChart).render().plain
        assert f"budget {BUDGET}" in chart and f"decode {make_step(last_step).num_decode_tokens}" in chart


async def wait_until(pilot, condition, what: str, timeout: float = 30.0) -> None:
    """Let the app run until condition() holds (a generous bound, as a safety net)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, what
        await pilot.pause(0.01)


# Frames 0.1 s apart: after each key Pilot waits for the screen to settle, which takes seconds
# while frames arrive every few hundredths of a second.
LIVE_DT = 0.1


async def test_p_pauses_updates(tmp_path):
    path = tmp_path / "loop.jsonl"
    write_recording(path, dt=LIVE_DT)
    app = MonitorApp(source=ReplaySource(path, loop=True))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for_frames(pilot, 2)
        await pilot.press("p")
        assert app.paused and "PAUSED" in app.query_one(TitleBar).content.plain
        shown, received = app.frames_shown, app.frames_received
        await wait_until(pilot, lambda: app.frames_received > received + 2, "frames keep arriving while paused")
        assert app.frames_shown == shown, "but the panels do not change"
        pending = app.pending
        await pilot.press("p")
        assert not app.paused and "PAUSED" not in app.query_one(TitleBar).content.plain
        assert pending is not None and app.pending is None, "resuming shows the newest frame at once"
        assert app.frames_shown > shown


async def test_help_screen_opens_and_closes_while_frames_arrive(tmp_path):
    path = tmp_path / "loop.jsonl"
    write_recording(path, dt=LIVE_DT)
    app = MonitorApp(source=ReplaySource(path, loop=True))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for_frames(pilot, 1)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        assert "pause / resume updates" in app.screen.query_one("#help-text").content.plain
        shown = app.frames_shown
        await wait_until(pilot, lambda: app.frames_shown > shown, "the dashboard keeps updating under the help")
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("question_mark")
        await pilot.press("question_mark")
        assert not isinstance(app.screen, HelpScreen)


async def test_tab_moves_focus_between_panels(frozen_app):
    async with frozen_app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        seen = [pilot.app.focused.id]
        for _ in range(6):
            await pilot.press("tab")
            seen.append(pilot.app.focused.id)
        assert seen[0] == seen[-1] == "grid"
        assert sorted(seen[:-1]) == sorted(["grid", "usage", "memory", "batch", "queues", "requests"])


async def test_sort_keys_and_header_click(frozen_app):
    async with frozen_app.run_test(size=(120, 40)) as pilot:
        await wait_for_replay_end(pilot)
        table = pilot.app.query_one(RequestTable)

        def first_column(index: int) -> list[str]:
            return [table.get_row_at(i)[index].plain for i in range(table.row_count)]

        assert first_column(1)[:4] == ["running"] * 4       # default: by state
        await pilot.press("s")                              # next column: prompt, largest first
        assert first_column(2) == ["105", "92", "79", "66", "53", "40"]
        await pilot.press("S")                              # reversed
        assert first_column(2) == ["40", "53", "66", "79", "92", "105"]
        table.post_message(table.HeaderSelected(table, table.ordered_columns[3].key, 3, Text("output")))
        await pilot.pause()
        assert first_column(3) == ["25", "24", "23", "22", "0", "0"]
        assert "sort: output ▼" in str(table.border_subtitle)


async def test_q_quits(frozen_app):
    async with frozen_app.run_test(size=(120, 40)) as pilot:
        await pilot.press("q")
        await pilot.pause()
        assert not pilot.app.is_running


def runs_opening_with_spaces(text: Text) -> list[str]:
    """Styled runs of `text` that start with a space but hold more than spaces."""
    console = Console(width=200, color_system="truecolor")
    # Adjacent runs of one style merge on the way to the screen, as they do here.
    return [segment.text for segment in Segment.simplify(text.render(console))
            if segment.text.startswith(" ") and segment.text.strip() and "\n" not in segment.text]


@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
async def test_scheduler_columns_keep_their_gaps(frozen_app, size):
    # SVG renderers such as librsvg drop a run's leading spaces, so no run may open with the gap.
    async with frozen_app.run_test(size=size) as pilot:
        await wait_for_replay_end(pilot)
        for panel in (QueuePanel, UsagePanel, BatchChart, BlockGrid, MemoryPanel):
            text = pilot.app.query_one(panel).render()
            assert runs_opening_with_spaces(text) == [], panel.__name__
        lines = pilot.app.query_one(QueuePanel).render().plain.splitlines()
    if size == (120, 40):
        header = next(line for line in lines if "p50" in line)
        ttft = next(line for line in lines if "TTFT" in line)
        assert header.index("p50") + 3 == ttft.index("12.0 ms") + 7, "p50 sits over the right edge of its column"
        assert header.index("p99") + 3 == ttft.index("80.0 ms") + 7
        assert "running     4 / 8   prompt" in lines[0]
    else:
        assert lines[0] == "run 4/8  wait 2  pre 1"


# ---- the request table: one unit for blocks, finished requests stay a while ------------------------

def test_blocks_and_cached_are_both_counted_in_blocks():
    from minillm.tui.request_table import COLUMNS, row_cells
    r = RequestStats("r", "running", prompt_tokens=70, output_tokens=3, num_blocks=5, num_cached_tokens=64,
                     ttft_s=0.01)
    cells = dict(zip([c.key for c in COLUMNS], [c.plain for c in row_cells(r, 16)]))
    assert (cells["prompt"], cells["output"], cells["blocks"], cells["cached"]) == ("70", "3", "5", "4")
    assert int(cells["cached"]) <= int(cells["blocks"])          # the cached blocks are among those held
    assert "blocks and cached in KV blocks" in help_text_plain()


def help_text_plain() -> str:
    from minillm.tui.help_screen import help_text
    return " ".join(help_text().plain.split())


def frames_where_a_request_finishes() -> list[EngineStats]:
    """req-0 runs in the first two snapshots, is gone from the third (t+1 s) and the fourth (t+20 s)."""
    frames = []
    for k, t in enumerate((1000.0, 1000.5, 1001.0, 1020.0)):
        stats = make_stats(k)
        stats.time = t
        if k >= 2:
            stats.requests = [r for r in stats.requests if r.request_id != "req-0"]
        frames.append(stats)
    return frames


@pytest.mark.parametrize("num_frames, shown", [(2, "running"), (3, "finished"), (4, None)])
async def test_finished_requests_stay_a_while_marked_finished(tmp_path, num_frames, shown):
    path = tmp_path / "finish.jsonl"
    with Recorder(path) as recorder:
        for stats in frames_where_a_request_finishes():
            recorder.write(stats.to_dict(), t=stats.time)
    app = MonitorApp(source=ReplaySource(path, loop=False, realtime=False, num_frames=num_frames))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for_frames(pilot, num_frames)
        table = pilot.app.query_one(RequestTable)
        states = {table.get_row_at(i)[0].plain[2:]: table.get_row_at(i)[1].plain for i in range(table.row_count)}
        assert states.get("req-0") == shown
        if shown == "finished":                      # the last values it had, greyed, sorted last by state
            row = [c.plain for c in table.get_row("req-0")]
            assert row[3] == str(make_stats(1).requests[0].output_tokens)
            assert [table.get_row_at(i)[1].plain for i in range(table.row_count)][-1] == "finished"


# ---- the KV panel names what the pool stores ---------------------------------------------------------

async def test_kv_panel_title_names_the_kv_cache_dtype(tmp_path):
    path = tmp_path / "fp8.jsonl"
    with Recorder(path) as recorder:
        for k, kv_dtype in enumerate(("fp8_e4m3", "")):       # the second: a server that does not say
            stats = make_stats(k)
            stats.kv_cache_dtype = kv_dtype
            recorder.write(stats.to_dict(), t=100.0 + k)
    app = MonitorApp(source=ReplaySource(path, loop=False, realtime=False, num_frames=1))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for_frames(pilot, 1)
        assert pilot.app.query_one(UsagePanel).border_title == "KV usage · fp8_e4m3"
    app = MonitorApp(source=ReplaySource(path, loop=False, realtime=False))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for_frames(pilot, 2)
        assert pilot.app.query_one(UsagePanel).border_title == "KV usage"


# ---- the batch chart: the top row is the token budget -----------------------------------------------

async def test_batch_chart_top_is_the_token_budget_even_when_steps_are_small(tmp_path):
    path = tmp_path / "small.jsonl"
    with Recorder(path) as recorder:
        for k in range(3):
            stats = make_stats(k)
            stats.max_num_batched_tokens = 8192
            stats.recent_steps = [StepStats(step=k * 8 + j, time=1000.0 + k, num_prefill_tokens=0, num_decode_tokens=4,
                                            num_seqs=4, token_budget=8192, step_time_s=0.004) for j in range(1, 9)]
            recorder.write(stats.to_dict(), t=100.0 + k)
    app = MonitorApp(source=ReplaySource(path, loop=False, realtime=False))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for_frames(pilot, 3)
        lines = pilot.app.query_one(BatchChart).render().plain.splitlines()
        assert lines[0].startswith("8192┤") and "┈" in lines[0]        # the budget, dotted
        bottom = next(line for line in reversed(lines) if line.lstrip().startswith("0┤"))
        assert bottom.count("▁") == 24                                   # 24 small steps, each visible
        assert "top row is the token budget" in help_text_plain()


# ---- replays: the demo recording, and loops that say so ------------------------------------------------

async def test_the_demo_recording_plays():
    from minillm.tui.app import demo_recording
    from minillm.tui.recording import load_recording
    frames = load_recording(demo_recording())
    app = MonitorApp(source=ReplaySource(demo_recording(), loop=False, realtime=False))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for_frames(pilot, len(frames))
        assert "replay demo.jsonl.gz" in pilot.app.source_text
        assert pilot.app.stats.num_steps == frames[-1][1].stats.num_steps


class LoggingApp(MonitorApp):
    """Keeps what the title said each time a frame was shown."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.shown: list[tuple[int, str, int]] = []

    def show_stats(self, stats: EngineStats) -> None:
        super().show_stats(stats)
        oldest = min((s.step for s in self.history.steps), default=0)
        self.shown.append((stats.num_steps, self.title_bar.content.plain, oldest))


async def test_a_looping_replay_marks_every_pass_and_counters_never_go_back_unmarked(tmp_path):
    path = tmp_path / "loop.jsonl"
    write_recording(path, num_frames=4)
    app = LoggingApp(source=ReplaySource(path, loop=True, realtime=False))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for_frames(pilot, 4 * 3 + 1)
        assert re.search(r"\(4 frames, pass \d+\)", pilot.app.source_text)
    shown = app.shown
    resets = 0
    for (before, _, _), (after, title, oldest) in zip(shown, shown[1:]):
        if after < before:
            resets += 1
            assert f"↻ counters reset{'' if resets == 1 else f' ×{resets}'}" in title, title
            assert "pass" in title
            assert oldest > after - STEPS_PER_SNAPSHOT, "the batch chart starts over with the counters"
    assert resets >= 2
    assert "↻" not in shown[0][1]


def test_bad_recording_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    write_recording(path, num_frames=2)
    with path.open("a") as f:
        f.write('{"t": 1.0, "stats": {"time": 1.0}}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: .*missing field 'model'"):
        ReplaySource(path)


def test_snapshot_120x40(snap_compare, frozen_app):
    assert snap_compare(frozen_app, terminal_size=(120, 40), run_before=wait_for_replay_end)


def test_snapshot_80x24(snap_compare, frozen_app):
    assert snap_compare(frozen_app, terminal_size=(80, 24), run_before=wait_for_replay_end)


# ---- the step-time strip: with --max-step-ms, each step's device time under the step budget ----------

def write_step_budget_recording(path, max_step_ms):
    """Three frames of 8 steps each; every fourth step's device time is twice the budget."""
    with Recorder(path) as recorder:
        for k in range(3):
            stats = make_stats(k)
            stats.max_step_ms = max_step_ms
            stats.recent_steps = [
                StepStats(step=k * 8 + j, time=1000.0 + k, num_prefill_tokens=64 if j % 4 == 0 else 0,
                          num_decode_tokens=4, num_seqs=5, token_budget=BUDGET, step_time_s=0.001,
                          estimated_step_s=0.004,
                          device_step_s=(None if max_step_ms is None else
                                         max_step_ms * (2.0 if j % 4 == 0 else 0.5) / 1e3))
                for j in range(1, 9)]
            recorder.write(stats.to_dict(), t=100.0 + k)


@pytest.mark.parametrize("max_step_ms", [8.8, None])
async def test_batch_chart_draws_the_step_budget_line_when_set(tmp_path, max_step_ms):
    path = tmp_path / "step_budget.jsonl"
    write_step_budget_recording(path, max_step_ms)
    app = MonitorApp(source=ReplaySource(path, loop=False, realtime=False))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for_frames(pilot, 3)
        chart = pilot.app.query_one(BatchChart).render()
        lines = chart.plain.splitlines()
    budget_rows = [i for i, line in enumerate(lines) if line.startswith(" 8.8┤")]
    if max_step_ms is None:
        assert not budget_rows and "ms│" not in chart.plain and "budget 256 /" not in chart.plain
        return
    (top,) = budget_rows
    assert lines[0].startswith(f" {BUDGET}┤")                  # the token chart keeps the top
    assert "┈" in lines[top]                                  # the step budget, dotted
    assert lines[top + 1].startswith("  ms│")                 # a strip of two rows at this size
    # 24 steps: the 6 over the budget fill the strip to the top, the others reach half of it.
    assert lines[top].count("█") == 6
    assert lines[top + 1].count("█") == 24
    over = [span for span in chart.spans if str(span.style) == COLOR_OVER]
    assert over, "steps over the budget are drawn in the warning colour"
    assert "budget 256 / 8.8 ms" in chart.plain
    assert "top row is the step budget" in help_text_plain()


async def test_batch_chart_draws_each_steps_own_limit_under_a_relative_budget(tmp_path):
    """--max-step-factor: each step's device time against the limit it was sized under (which
    differs from step to step); a step sized by the token budget alone draws no bar."""
    path = tmp_path / "step_factor_strip.jsonl"
    with Recorder(path) as recorder:
        for k in range(3):
            stats = make_stats(k)
            stats.max_step_factor = 1.3
            steps = []
            for j in range(1, 9):
                limit = 0.002 * j                              # every step its own limit
                over = j % 4 == 0
                steps.append(StepStats(step=k * 8 + j, time=1000.0 + k, num_prefill_tokens=64, num_decode_tokens=4,
                                       num_seqs=5, token_budget=BUDGET, step_time_s=0.001, estimated_step_s=limit,
                                       device_step_s=limit * (2.0 if over else 0.5),
                                       step_limit_s=None if j == 1 else limit))
            stats.recent_steps = steps
            recorder.write(stats.to_dict(), t=100.0 + k)
    app = MonitorApp(source=ReplaySource(path, loop=False, realtime=False))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for_frames(pilot, 3)
        chart = pilot.app.query_one(BatchChart).render()
        lines = chart.plain.splitlines()
    (top,) = [i for i, line in enumerate(lines) if line.startswith("1.3x┤")]
    assert "┈" in lines[top] and lines[top + 1].startswith("time│")
    # 24 steps: 3 with no limit draw nothing, the 6 over their limit fill the strip, 15 reach half.
    assert lines[top].count("█") == 6
    assert lines[top + 1].count("█") == 21
    assert [span for span in chart.spans if str(span.style) == COLOR_OVER]
    assert "budget 256 / 1.3x decode" in chart.plain


async def test_batch_chart_names_a_relative_step_budget(tmp_path):
    path = tmp_path / "step_factor.jsonl"
    with Recorder(path) as recorder:
        stats = make_stats(0)
        stats.max_step_factor = 1.4
        recorder.write(stats.to_dict(), t=100.0)
    app = MonitorApp(source=ReplaySource(path, loop=False, realtime=False))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for_frames(pilot, 1)
        chart = pilot.app.query_one(BatchChart).render()
    assert f"budget {BUDGET} / 1.4x decode" in chart.plain


async def test_block_grid_shows_a_kv_transfers_leases_and_loads(tmp_path):
    """A prefill server's leased blocks are their own colour; the subtitle has either role's figures."""
    from minillm.stats import CELL_LEASED
    from minillm.tui.block_grid import transfer_summary
    from minillm.tui.render import COLOR_LEASED
    stats = make_stats(3)
    num_leased = 5
    free = [i for i, cell in enumerate(stats.block_map) if cell == CELL_FREE][:num_leased]
    for i in free:
        stats.block_map[i] = CELL_LEASED
    stats.kv_transfer_role, stats.kv_transfer_num_leases, stats.kv_transfer_num_leased_blocks = "kv_producer", 2, 5
    path = tmp_path / "producer.jsonl"
    with Recorder(path) as recorder:
        recorder.write(stats.to_dict(), t=100.0)
    app = MonitorApp(source=ReplaySource(path, loop=False, realtime=False))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for_frames(pilot, 1)
        grid = pilot.app.query_one(BlockGrid)
        text = grid.render()
        legend_start = text.plain.rindex("\n")
        colours = Counter(str(span.style) for span in text.spans if span.end <= legend_start)
        assert colours[COLOR_LEASED] == num_leased and "leased" in text.plain[legend_start:]
        assert "leased 5 blk (2 leases, 0 expired)" in grid.border_subtitle
    stats.kv_transfer_role, stats.kv_transfer_tokens, stats.kv_transfer_bytes_per_s = "kv_consumer", 4096, 3 * 2**20
    assert transfer_summary(stats) == " · KV in 4096 tok, 3.0 MiB/s"
    stats.kv_transfer_role = ""
    assert transfer_summary(stats) == ""
