"""Record the stats stream to JSON lines and play a recording back without a server."""
from __future__ import annotations

import asyncio
import gzip
import itertools
import json
import math
import time
import zlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from minillm import sse
from minillm.tui.client import SourceEvent, SourceStatus, StatsFormatError, StatsFrame, parse_stats

# One line per frame: {"t": <time.time() when received>, "stats": <EngineStats.to_dict()>}.
# A path ending in .gz is read and written gzip-compressed (recordings shrink about 15x).


def _open_text(path: Path, mode: str):
    if path.suffix == ".gz":
        return gzip.open(path, mode + "t", encoding="utf-8")
    return path.open(mode, encoding="utf-8")


class Recorder:
    """Appends every frame it is given to a JSON-lines file, flushed line by line."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = _open_text(self.path, "w")

    def write(self, stats: dict, t: float | None = None) -> None:
        """Record one stats dict with its receive time (now unless given)."""
        line = json.dumps({"t": time.time() if t is None else t, "stats": stats}, separators=(",", ":"))
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file; later writes are an error."""
        self._file.close()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_recording(path: str | Path) -> list[tuple[float, StatsFrame]]:
    """All (time, frame) pairs of a recording; raises ValueError naming the file (and the bad line)."""
    frames = []
    try:
        with _open_text(Path(path), "r") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    # sse.loads: JSON nested past the stack or with an integer past Python's limit on
                    # digits is a ValueError saying so (json.loads let out RecursionError).
                    record = sse.loads(line)
                    frames.append((_frame_time(record["t"]),
                                   StatsFrame(stats=parse_stats(record["stats"]), raw=record["stats"])))
                except (ValueError, KeyError, TypeError) as exc:      # StatsFormatError is a ValueError
                    raise ValueError(f"{path}:{number}: not a stats recording line ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: a recording is UTF-8 text, but this file is not ({exc.reason} at "
                         f"byte {exc.start})") from None
    # A .gz name over other data, or a cut-short or damaged one: gzip raises each of these, and
    # EOFError would otherwise read as Ctrl-D to the command line.
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise ValueError(f"{path}: not a readable gzip file ({exc})") from None
    if not frames:
        raise ValueError(f"{path}: the recording holds no frames")
    return frames


def _frame_time(t) -> float:
    """A line's receive time as a float; StatsFormatError unless it is a finite number (an infinite
    one would hold the replay on the frame before it for ever)."""
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        raise StatsFormatError("field 't' should be a number")
    try:
        seconds = float(t)
    except OverflowError:       # an integer past a float's range
        seconds = math.inf
    if not math.isfinite(seconds):
        raise StatsFormatError(f"field 't' should be a finite number, got {t!r:.40}")
    return seconds


class ReplaySource:
    """Plays a recording at its recorded pace (times `speed`), then loops or holds the last frame."""

    def __init__(self, path: str | Path, loop: bool = True, speed: float = 1.0, realtime: bool = True,
                 num_frames: int | None = None):
        self.path = Path(path)
        # num_frames keeps only the first frames, to stop (and hold) at a chosen moment.
        self.frames = load_recording(self.path)[:num_frames]
        if not self.frames:
            raise ValueError(f"num_frames must be at least 1, got {num_frames}")
        self.loop = loop
        self.speed = speed
        # realtime=False plays every frame at once (tests and screenshots want the final picture).
        self.realtime = realtime

    async def events(self, cells: Callable[[], int]) -> AsyncIterator[SourceEvent]:
        """Yield the recorded frames; a replay cannot re-sample the block map, so `cells` is unused."""
        total = len(self.frames)
        for number in itertools.count(1):
            # Each pass starts the recorded counters over; the title says which pass this is.
            yield SourceStatus(f"replay {self.path.name} ({total} frames" + (f", pass {number})" if number > 1 else ")"))
            previous_t = self.frames[0][0]
            for t, frame in self.frames:
                await asyncio.sleep(max(t - previous_t, 0.0) / self.speed if self.realtime else 0)
                previous_t = t
                yield frame
            if not self.loop:
                yield SourceStatus(f"replay {self.path.name} · holding frame {total}/{total}")
                return
