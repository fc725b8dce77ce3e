"""`minillm monitor` fed stats no minillm server sends but JSON carries: a summary without token
utilisation, text with markup, terminal control sequences or lone surrogates, numbers of 300 digits,
a step budget of zero, speculative decoding totals that do not add up, request ids of superscript
digits; a grid resized while paused; keys pressed fast at the smallest and largest sizes."""
from __future__ import annotations

import asyncio
import json
import re
import time
from contextlib import asynccontextmanager

import pytest
from rich.cells import cell_len
from test_tui import make_stats
from textual.content import Content

from minillm.tui.app import MonitorApp
from minillm.tui.batch_chart import AXIS_WIDTH, BatchChart
from minillm.tui.block_grid import BlockGrid, merge_cells
from minillm.tui.client import SourceProblem, SourceStatus, StatsFormatError, parse_frame
from minillm.tui.memory_panel import MemoryPanel
from minillm.tui.queue_panel import QueuePanel
from minillm.tui.request_table import ID_WIDTH, RequestTable
from minillm.tui.usage_panel import UsagePanel

pytestmark = pytest.mark.anyio
PANELS = (BlockGrid, UsagePanel, MemoryPanel, BatchChart, QueuePanel)


@pytest.fixture
def anyio_backend():
    return "asyncio"


class JsonSource:
    """Each dict goes through the client's parser as a server's JSON text would; then silence."""

    def __init__(self, frames: list[dict], problem: str | None = None):
        self.frames = frames
        self.problem = problem

    async def events(self, cells):
        yield SourceStatus("test source")
        for data in self.frames:
            yield parse_frame(json.dumps(data))
        if self.problem is not None:
            yield SourceProblem(self.problem, 0.5)
        await asyncio.Event().wait()


def stats_dict(frame: int = 1, **fields) -> dict:
    """make_stats(frame) as the JSON dict a server sends, with `fields` replaced."""
    data = make_stats(frame).to_dict()
    data.update(fields)
    return data


async def wait_until(pilot, condition, limit_s: float = 30.0) -> None:
    """Let the app run until condition() holds; fail when the app stopped or limit_s passed."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert pilot.app.is_running and time.monotonic() < deadline, "the app stopped or the condition never held"
        await pilot.pause(0.01)


@asynccontextmanager
async def monitor(frames: list[dict], size=(120, 40), problem: str | None = None):
    """The app once it has shown every frame (and the problem, if any) and drawn the whole screen."""
    app = MonitorApp(JsonSource(frames, problem))
    async with app.run_test(size=size) as pilot:
        await wait_until(pilot, lambda: app.frames_shown == len(frames) and (problem is None or app.banner.display))
        await pilot.pause()
        app.export_screenshot()           # draws every widget, border titles included
        yield app, pilot


def shown_text(app) -> list[str]:
    """Every piece of text the dashboard shows."""
    texts = [app.title_bar.content.plain, app.banner.content.plain]
    for panel in PANELS:
        widget = app.query_one(panel)
        texts.append(widget.render().plain)
        texts += [Content.from_markup(t).plain for t in (widget.border_title, widget.border_subtitle) if t]
    table = app.query_one(RequestTable)
    texts += [cell.plain for i in range(table.row_count) for cell in table.get_row_at(i)]
    return texts


# ---- a summary snapshot: no token utilisation -------------------------------------------------------

@pytest.mark.parametrize("size", [(120, 40), (80, 24)], ids=["full", "compact"])
async def test_a_snapshot_without_token_utilisation_shows_a_dash(size):
    """kv_token_utilization is None in a summary (the type allows it): the KV panel did None * 100."""
    frames = [stats_dict(0), stats_dict(1, kv_token_utilization=None), stats_dict(2)]
    async with monitor(frames, size) as (app, _):
        usage = app.query_one(UsagePanel).render().plain
        assert re.search(r"(token util|tok)\s+\d", usage), usage          # the last frame's figure is back
    async with monitor(frames[:2], size) as (app, _):
        usage = app.query_one(UsagePanel).render().plain
        assert re.search(r"(token util|tok)\s+—", usage), usage


# ---- text from the server is text: never markup, never terminal control ------------------------------

MARKUP = {"device": "[bold]gpu[/]", "kv_cache_dtype": "[/]", "model": "[red]m[/red]"}


async def test_markup_in_the_servers_text_is_shown_as_it_is():
    """The memory subtitle (device) and the KV title (kv_cache_dtype) were parsed as markup: "[/]"
    raised MarkupError and ended the dashboard."""
    data = stats_dict(1, **MARKUP, num_requests_finished={"[b]stop": 1})
    data["requests"][0]["request_id"], data["requests"][0]["state"] = "[i]req[/i]", "[@click=app.quit]x"
    async with monitor([data]) as (app, _):
        usage = app.query_one(UsagePanel)
        assert Content.from_markup(usage.border_title).plain == "KV usage · [/]"
        assert Content.from_markup(app.query_one(MemoryPanel).border_subtitle).plain.endswith(" [bold]gpu[/]")
        assert "[red]m[/red] · [bold]gpu[/]" in app.title_bar.content.plain
        assert "[b]stop 1" in app.query_one(QueuePanel).render().plain
        row = [cell.plain for cell in app.query_one(RequestTable).get_row("[i]req[/i]")]
        assert row[:2] == ["■ [i]req[/i]", "[@click=app.quit]x"]


CONTROL = {"model": "M\x1b[5mBLINK", "device": "cpu\n2", "dtype": "\u202efloat", "kv_cache_dtype": "fp8\x07"}


async def test_control_characters_from_the_server_are_shown_escaped_not_sent_to_the_terminal():
    """A request id "\\x1b]0;title\\x07" set the terminal's title; "\\x1b[5m" made it blink; a lone
    surrogate raised UnicodeEncodeError in the request colour and ended the dashboard."""
    data = stats_dict(1, **CONTROL, num_requests_finished={"\x1b[2J": 1})
    data["requests"][0]["request_id"] = "A\x1b]0;X\x07"
    data["requests"][1]["request_id"] = "b\ud800"
    data["requests"][2]["state"] = "\x9b31m"
    async with monitor([data], problem="the server reported: \x1b[31mboom\r") as (app, _):
        texts = shown_text(app)
        bad = [t for t in texts if re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202e\ud800-\udfff]", t)]
        assert not bad, bad
        joined = "\n".join(texts)
        for escaped in ("M\\x1b[5mBLINK", "cpu\\n2", "\\u202efloat", "fp8\\x07", "A\\x1b]0;X\\x07",
                        "b\\ud800", "\\x9b31m", "\\x1b[2J 1", "\\x1b[31mboom\\r"):
            assert escaped in joined, escaped


# ---- numbers no panel was sized for --------------------------------------------------------------------

async def test_numbers_of_hundreds_of_digits_are_shown_short():
    """1e300 tok/s printed 300 digits, cut by the panel edge to what read like an ordinary figure;
    a token budget of 2**62 pushed the batch chart's axis out of line."""
    step = dict(make_stats(1).to_dict()["recent_steps"][0], num_prefill_tokens=2**62, num_decode_tokens=2**61,
                num_seqs=2**62, token_budget=2**62, step_time_s=1e300)
    data = stats_dict(1, prompt_throughput=1e300, generation_throughput=-1e300, ttft_p50_s=1e300, itl_p99_s=-1e300,
                      kv_usage=1e300, kv_token_utilization=-1e300, recent_steps=[step],
                      memory={"weights_bytes": 2**62, "kv_pool_bytes": 2**61, "other_bytes": 0,
                              "total_bytes": 2**63 - 1})
    async with monitor([data]) as (app, _):
        for panel in PANELS:
            widget = app.query_one(panel)
            for line in widget.render().plain.splitlines():
                assert cell_len(line) <= widget.content_size.width and not re.search(r"\d{20}", line), line
        chart = app.query_one(BatchChart).render().plain.splitlines()
        assert all(line[AXIS_WIDTH - 1] in "┤│" for line in chart[:-1]), chart
        queues = app.query_one(QueuePanel).render().plain
        assert "1e+297k tok/s" in queues and "-1e+297k tok/s" in queues, queues
        assert "1e+300 s" in queues and "-1e+300 s" in queues, queues
        assert "8.0 EiB" in app.query_one(MemoryPanel).border_subtitle


@pytest.mark.parametrize("size", [(120, 40), (80, 24)], ids=["full", "compact"])
async def test_ratios_of_counts_that_do_not_add_up_are_shown_short(size):
    """Prefix hits over queries and accepted draft tokens over drafts were printed in full: 21 digits."""
    spec = {"num_spec_tokens": 2, "num_drafts": 1, "num_draft_tokens": 1, "num_accepted_tokens": 2**62,
            "num_accepted_tokens_per_pos": [0, 0]}
    data = stats_dict(1, prefix_cache_hits=2**62, prefix_cache_queries=1, spec_decode=spec)
    async with monitor([data], size) as (app, _):
        texts = [app.query_one(panel).render().plain for panel in (UsagePanel, QueuePanel)]
        assert not re.search(r"\d{8}", "\n".join(texts)), texts
        assert "hits 5e+20%" in texts[0] or "prefix hits 5e+20%" in texts[0], texts[0]


async def test_negative_token_counts_draw_no_bar():
    steps = [dict(make_stats(1).to_dict()["recent_steps"][0], step=i, num_prefill_tokens=-50, num_decode_tokens=-3)
             for i in range(1, 6)]
    async with monitor([stats_dict(1, recent_steps=steps)]) as (app, _):
        chart = app.query_one(BatchChart).render().plain.splitlines()
        assert not any(set(line[AXIS_WIDTH:]) & set("▁▂▃▄▅▆▇█") for line in chart[:-2]), chart


@pytest.mark.parametrize("fields, limit_s", [
    ({"max_step_ms": 0.0}, None),
    ({"max_step_factor": 1.2}, 0.0),
    ({"max_step_factor": 1.2}, 5e-324),      # 1 ms / 5e-324 s is infinite: round() raised OverflowError
    ({"max_step_ms": -5.0}, None),
], ids=["zero-ms", "zero-limit", "tiniest-limit", "negative-ms"])
async def test_a_step_budget_of_zero_or_next_to_it_fills_the_strip_as_over(fields, limit_s):
    """device_step_s / budget raised ZeroDivisionError and ended the dashboard."""
    step = dict(make_stats(1).to_dict()["recent_steps"][0], device_step_s=0.001, step_limit_s=limit_s)
    async with monitor([stats_dict(1, **fields, recent_steps=[step])]) as (app, _):
        chart = app.query_one(BatchChart).render()
        strip = [line for line in chart.plain.splitlines() if re.match(r"\s*(ms|time)│", line)]
        assert strip and strip[0].rstrip().endswith("█"), chart.plain


# ---- speculative decoding totals that do not add up -------------------------------------------------------

async def test_spec_decode_totals_without_drafts_show_no_length():
    """draft tokens counted but no drafts: the acceptance rate is known, the length is not
    (f"{None:.2f}" ended the dashboard)."""
    spec = {"num_spec_tokens": 2, "num_drafts": 0, "num_draft_tokens": 5, "num_accepted_tokens": 3}
    async with monitor([stats_dict(1, spec_decode=spec)]) as (app, _):
        assert "accept 60% · len —" in app.query_one(QueuePanel).render().plain


@pytest.mark.parametrize("spec, named", [
    ({"num_spec_tokens": 0}, "num_spec_tokens must be >= 1"),
    ({"num_spec_tokens": 2, "num_accepted_tokens_per_pos": [1]}, "must have 2 entries"),
])
def test_spec_decode_totals_the_dataclass_refuses_are_bad_stats_naming_the_field(spec, named):
    """A bare ValueError: "lost URL: ValueError" in the banner; from a recording, an error without its file."""
    with pytest.raises(StatsFormatError, match=f"field 'spec_decode': .*{named}"):
        parse_frame(json.dumps(stats_dict(1, spec_decode=spec)))


# ---- request ids -------------------------------------------------------------------------------------------

async def test_request_ids_of_digits_int_cannot_read_sort_and_wide_ids_are_cut_to_the_column():
    """"²".isdigit() is True but int("²") raises: sorting the table ended the dashboard."""
    data = stats_dict(1)
    for row, rid in zip(data["requests"], ("²", "req-①", "٣", "req-10", "🦙" * 40, "req-2")):
        row["request_id"], row["state"] = rid, "running"
    async with monitor([data]) as (app, pilot):
        table = app.query_one(RequestTable)
        for _ in range(7):                       # every column, the request column among them
            await pilot.press("s")
        while table.sort_index != 0:
            await pilot.press("s")
        ids = [table.get_row_at(i)[0].plain[2:] for i in range(table.row_count)]
        assert ids.index("req-2") < ids.index("req-10") and ids.index("٣") < ids.index("req-2"), ids
        assert all(cell_len(rid) <= ID_WIDTH for rid in ids), ids


# ---- the grid's subtitle follows the grid ---------------------------------------------------------------

def blocks_per_cell(grid: BlockGrid) -> int:
    return int(re.search(r"(\d+)/cell", grid.border_subtitle).group(1))


async def test_the_blocks_per_cell_follow_a_resize_while_paused():
    """The subtitle was worked out when a frame came: after a resize (paused, or a replay holding its
    last frame) it named a blocks-per-cell the grid no longer drew."""
    async with monitor([stats_dict(1)], size=(120, 40)) as (app, pilot):
        grid = app.query_one(BlockGrid)
        assert blocks_per_cell(grid) == 1
        await pilot.press("p")
        await pilot.resize_terminal(50, 12)
        await wait_until(pilot, lambda: grid.capacity() < len(make_stats(1).block_map))
        await pilot.pause()
        _, group = merge_cells(make_stats(1).block_map, grid.capacity())
        assert group > 1 and blocks_per_cell(grid) == group


async def test_every_key_in_every_screen_at_the_smallest_and_largest_size():
    """Keys pressed fast on the dashboard and the help screen, with resizes between them."""
    frames = [stats_dict(0), stats_dict(1, kv_token_utilization=None, **MARKUP)]
    help_key = "question_mark"
    async with monitor(frames, size=(20, 5)) as (app, pilot):
        for size in ((20, 5), (400, 120)):
            await pilot.resize_terminal(*size)
            await pilot.press(help_key, *"psS", "tab", "shift+tab", help_key, help_key, "escape", "escape",
                              *"pp", help_key, *"sSp", "escape")
            app.export_screenshot()
        assert app.is_running and app.frames_shown == 2


class FoldingSource:
    """A server that folds its block map into the cells asked for; its host tier appears at frame 3."""

    async def events(self, cells):
        yield SourceStatus("test source")
        for k in range(1_000_000):
            data = stats_dict(k % 10)
            data["block_map"] = [k % 4 - 2] * cells()
            if k >= 3:
                data["kv_offload_num_blocks"], data["kv_offload_block_map"] = 64, [-2] * 32 + [-1] * 32
            yield parse_frame(json.dumps(data))
            await asyncio.sleep(0.01)


async def test_the_grid_asks_for_fewer_cells_when_the_host_tier_takes_a_row():
    """The host strip took a row from the grid, but the monitor went on asking for the old count: the
    grid folded the server's cells two to one and drew half the panel empty, until a resize."""
    app = MonitorApp(FoldingSource())
    async with app.run_test(size=(120, 40)) as pilot:
        grid = app.query_one(BlockGrid)
        await wait_until(pilot, lambda: app.stats is not None and app.stats.kv_offload_num_blocks > 0)
        await wait_until(pilot, lambda: len(app.stats.block_map) == grid.capacity(), limit_s=10)
        assert blocks_per_cell(grid) == 1
