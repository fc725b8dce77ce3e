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


async def render_svg(recording: str | Path, frame: int, size: tuple[int, int] = (120, 40)) -> str:
    """The SVG of the dashboard after replaying frames 0..frame (history included)."""
    app = MonitorApp(source=ReplaySource(recording, loop=False, realtime=False, num_frames=frame + 1))
    async with app.run_test(size=size) as pilot:
        while app.frames_shown < frame + 1 or "holding" not in app.source_text:
            await pilot.pause(0.01)
        await pilot.pause()
        return app.export_screenshot(title="minillm monitor")


def main() -> None:
    """Command line: recording in, SVG out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recording")
    parser.add_argument("--out", default="screenshot.svg")
    parser.add_argument("--frame", type=int, default=None, help="frame index (default: the busiest)")
    parser.add_argument("--size", default="120x40", help="COLUMNSxROWS")
    args = parser.parse_args()
    columns, rows = (int(n) for n in args.size.lower().split("x"))
    frame = busiest_frame(args.recording) if args.frame is None else args.frame
    Path(args.out).write_text(asyncio.run(render_svg(args.recording, frame, (columns, rows))), encoding="utf-8")
    print(f"wrote {args.out} (frame {frame})")


if __name__ == "__main__":
    main()
