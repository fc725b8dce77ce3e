"""`minillm monitor --replay` and the screenshot tool asked for what a recording does not hold: a line
whose time is past a float, infinite, NaN or a bool, JSON past what Python reads, a frame past the
end or before the start, a size that is no COLUMNSxROWS."""
from __future__ import annotations

import asyncio
import json

import pytest
from test_abuse29_monitor import stats_dict
from test_tui import make_stats, write_recording

from minillm.tui.recording import load_recording

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


# ---- recordings and screenshots ---------------------------------------------------------------------------

GOOD_LINE = json.dumps({"t": 1.0, "stats": make_stats(1).to_dict()})


@pytest.mark.parametrize("line, named", [
    (GOOD_LINE.replace('"t": 1.0', '"t": 1' + "0" * 400), "'t' should be a finite number"),
    (GOOD_LINE.replace('"t": 1.0', '"t": Infinity'), "'t' should be a finite number"),
    (GOOD_LINE.replace('"t": 1.0', '"t": NaN'), "'t' should be a finite number"),
    (GOOD_LINE.replace('"t": 1.0', '"t": true'), "'t' should be a number"),
    (GOOD_LINE.replace('"t": 1.0', '"t": 1' + "0" * 5000), "integer too long"),
    ("[" * 100_000, "nested too deeply"),
    (json.dumps({"t": 1.0, "stats": stats_dict(1, spec_decode={"num_spec_tokens": 0})}), "spec_decode"),
], ids=["t-past-float", "t-infinite", "t-nan", "t-bool", "integer-digits", "nested", "spec-decode"])
def test_a_recording_line_past_what_python_reads_is_named_with_its_file_and_line(tmp_path, line, named):
    """OverflowError and RecursionError went past load_recording (a traceback from `monitor --replay`);
    an Infinity time made the replay wait for ever on the frame before it."""
    path = tmp_path / "odd.jsonl"
    path.write_text(GOOD_LINE + "\n" + line + "\n")
    with pytest.raises(ValueError, match=rf"odd\.jsonl:2: not a stats recording line \(.*{named}"):
        load_recording(path)


@pytest.mark.parametrize("frame", [5, -1])
async def test_a_screenshot_of_a_frame_the_recording_lacks_is_refused_not_waited_for(tmp_path, frame):
    """--frame past the end waited for ever; a negative one drew another frame than it named."""
    from minillm.tui.screenshot import render_svg
    path = tmp_path / "short.jsonl"
    write_recording(path, num_frames=3)
    with pytest.raises(ValueError, match=rf"frame {frame}: the recording has frames 0 to 2"):
        await asyncio.wait_for(render_svg(path, frame), 60)


@pytest.mark.parametrize("argv, named", [(["--size", "abc"], "--size"), (["--size", "0x5"], "--size"),
                                         (["--frame", "7"], "--frame")])
def test_the_screenshot_command_names_a_bad_option(tmp_path, monkeypatch, capsys, argv, named):
    from minillm.tui import screenshot
    path = tmp_path / "short.jsonl"
    write_recording(path, num_frames=3)
    monkeypatch.setattr("sys.argv", ["screenshot", str(path), "--out", str(tmp_path / "s.svg"), *argv])
    with pytest.raises(SystemExit) as exc:
        screenshot.main()
    assert exc.value.code == 2 and named in capsys.readouterr().err
