"""Export an SVG of the dashboard at one frame of a recording (the README picture).

    python -m minillm.tui.screenshot loaded.jsonl --out tui/screenshot.svg [--frame N] [--size 120x40]
"""
from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from minillm.tui.app import MonitorApp
from minillm.tui.recording import ReplaySource, load_recording


def busiest_frame(recording: str | Path) -> int:
    """The frame that shows the most: preempted requests resuming, a nearly full pool, many requests."""
    frames = [frame.stats for _, frame in load_recording(recording)]

    def interest(s) -> tuple:
        resuming = any(step.num_prefill_tokens > 0 for step in s.recent_steps)
        return (s.num_preempted > 0 and resuming, s.kv_usage >= 0.9, s.num_running + s.num_waiting, s.kv_usage)

    return max(range(len(frames)), key=lambda i: interest(frames[i]))


def check_frame(frame: int, num_frames: int) -> None:
    """ValueError unless `frame` is an index of a recording of num_frames frames (counted from 0)."""
    if not 0 <= frame < num_frames:
        # Past the end the replay would never show it; below zero a slice would pick another frame.
        raise ValueError(f"frame {frame}: the recording has frames 0 to {num_frames - 1}")


async def render_svg(recording: str | Path, frame: int, size: tuple[int, int] = (120, 40)) -> str:
    """The SVG of the dashboard after replaying frames 0..frame (history included)."""
    source = ReplaySource(recording, loop=False, realtime=False)
    check_frame(frame, len(source.frames))
    source.frames = source.frames[: frame + 1]
    app = MonitorApp(source=source)
    async with app.run_test(size=size) as pilot:
        while app.is_running and (app.frames_shown < frame + 1 or "holding" not in app.source_text):
            await pilot.pause(0.01)
        await pilot.pause()
        return app.export_screenshot(title="minillm monitor")


def parse_size(text: str) -> tuple[int, int] | None:
    """(columns, rows) from "COLUMNSxROWS"; None unless both are positive integers."""
    columns, x, rows = text.lower().partition("x")
    if not (x and columns.isdecimal() and rows.isdecimal() and int(columns) > 0 and int(rows) > 0):
        return None
    return int(columns), int(rows)


def main() -> None:
    """Command line: recording in, SVG out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recording")
    parser.add_argument("--out", default="screenshot.svg")
    parser.add_argument("--frame", type=int, default=None, help="frame index (default: the busiest)")
    parser.add_argument("--size", default="120x40", help="COLUMNSxROWS")
    args = parser.parse_args()
    size = parse_size(args.size)
    if size is None:
        parser.error(f"--size wants COLUMNSxROWS of positive integers (like 120x40), got {args.size!r}")
    try:
        num_frames = len(load_recording(args.recording))
    except ValueError as exc:       # names the file, and the line where there is one
        parser.error(str(exc))
    except OSError as exc:
        parser.error(f"cannot read {args.recording}: {exc.strerror or exc}")
    if args.frame is not None and not 0 <= args.frame < num_frames:
        parser.error(f"--frame {args.frame}: the recording has frames 0 to {num_frames - 1}")
    frame = busiest_frame(args.recording) if args.frame is None else args.frame
    Path(args.out).write_text(asyncio.run(render_svg(args.recording, frame, size)), encoding="utf-8")
    print(f"wrote {args.out} (frame {frame})")


if __name__ == "__main__":
    main()
