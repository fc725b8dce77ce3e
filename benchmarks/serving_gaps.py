"""Where a serving run's long inter-token gaps sit: read a `bench serving --save-detailed` result.

    python3 -m minillm.benchmarks.serving_gaps RESULT.json [--level 256] [--factor 1.5]

Each request's token arrival times are rebuilt from its start, TTFT and ITLs. A gap is an ITL over
--factor times the run's ITL p50. For each gap it counts the other streams in a gap at the same
moment, in the same client process and in the others: most streams of every client at once is a
stall upstream of the clients (the engine or every API server), most of one client's streams is
that client, a part of every client is one API server's share, and a lone gap is one stream's.
Gaps are grouped into windows (midpoints within --window-ms of each other) and each window is
printed with the requests that started and ended in it and, when the run was traced
(`--step-trace`), the engine's steps in it: their intervals, prompt and decode tokens, and device
time where a step-time budget measured it. A window whose engine steps are as long as the gaps
is the engine's; one where the engine kept its pace lost the time after it.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from minillm.benchmarks.cli_args import BenchError, BenchParser, run_main


@dataclass
class Gap:
    """One long inter-token gap: [start_ms, end_ms] of one stream, its token's index in the request."""

    start_ms: float
    end_ms: float
    client: int
    request: int
    token_index: int
    same_client_share: float = 0.0     # the rest of its client's streams in a gap at its midpoint
    other_clients_share: float = 0.0   # the other clients' streams likewise

    @property
    def mid_ms(self) -> float:
        return 0.5 * (self.start_ms + self.end_ms)

    @property
    def kind(self) -> str:
        """Where the stall was, by who else saw it."""
        s, o = self.same_client_share, self.other_clients_share
        if s >= 0.5 and o >= 0.5:
            return "upstream"
        if s >= 0.5 and o < 0.2:
            return "one client"
        if s < 0.1 and o < 0.1:
            return "alone"
        if s < 0.5 and o < 0.5:
            return "part of every client"
        return "mixed"


@dataclass
class Window:
    """Gaps whose midpoints lie close together, with what else happened then."""

    start_ms: float
    end_ms: float
    gaps: list[Gap]
    started: int = 0                   # requests sent in the window
    ended: int = 0                     # requests that ended in it
    steps: list[dict] = field(default_factory=list)   # the engine's steps in it (traced runs)


@dataclass
class GapReport:
    """A run's ITL tail: the gaps, where they sit and who saw them."""

    level: int | None
    num_requests: int
    num_itls: int
    itl_p50_ms: float
    itl_p99_ms: float
    threshold_ms: float
    gaps: list[Gap]
    windows: list[Window]
    steps_traced: int


def arrival_times(request: dict) -> np.ndarray:
    """[T] ms from the run's start at which the request's chunks arrived."""
    first = request["start_ms"] + request["ttft_ms"]
    return first + np.concatenate([[0.0], np.cumsum(request["itl_ms"])])


def _kind_shares(gaps: list[Gap], streams: list[tuple[int, np.ndarray]]) -> None:
    starts = np.array([g.start_ms for g in gaps])                         # [G]
    ends = np.array([g.end_ms for g in gaps])                             # [G]
    clients = np.array([g.client for g in gaps])                          # [G]
    owners = np.array([g.request for g in gaps])                          # [G]
    first = np.array([t[0] for _, t in streams])                          # [R]
    last = np.array([t[-1] for _, t in streams])                          # [R]
    stream_clients = np.array([c for c, _ in streams])                    # [R]
    for g in gaps:
        m = g.mid_ms
        covering = (starts <= m) & (ends >= m) & (owners != g.request)
        active = (first <= m) & (last >= m)
        active_same = int((active & (stream_clients == g.client)).sum()) - 1
        active_other = int((active & (stream_clients != g.client)).sum())
        g.same_client_share = int((covering & (clients == g.client)).sum()) / max(active_same, 1)
        g.other_clients_share = int((covering & (clients != g.client)).sum()) / max(active_other, 1)


def analyze(result: dict, level: int | None = None, factor: float = 1.5, window_ms: float = 20.0) -> GapReport:
    """The gaps of one run (a BenchmarkResult as saved, with its requests)."""
    if not result.get("requests"):
        raise BenchError("the result holds no requests: run bench serving with --save-detailed")
    requests = [r for r in result["requests"] if r.get("ttft_ms") is not None]
    streams = [(r.get("client", 0), arrival_times(r)) for r in requests]
    itls = np.concatenate([np.asarray(r["itl_ms"], dtype=np.float64) for r in requests] or [np.zeros(0)])
    if itls.size == 0:
        raise BenchError("no request streamed more than one chunk: no inter-token latency to place")
    p50, p99 = float(np.percentile(itls, 50)), float(np.percentile(itls, 99))
    if not p50 > 0:
        raise BenchError("the median inter-token latency is 0 ms: no gap can be measured against it")
    threshold = factor * p50
    gaps = [Gap(t[k], t[k + 1], client, i, k + 1)
            for i, (client, t) in enumerate(streams) for k in np.flatnonzero(np.diff(t) > threshold)]
    if gaps:
        _kind_shares(gaps, streams)
    windows: list[Window] = []
    for g in sorted(gaps, key=lambda g: g.mid_ms):
        if windows and g.mid_ms - windows[-1].end_ms <= window_ms:
            windows[-1].end_ms = max(windows[-1].end_ms, g.mid_ms)
            windows[-1].gaps.append(g)
        else:
            windows.append(Window(g.mid_ms, g.mid_ms, [g]))
    steps = result.get("steps") or []
    for w in windows:
        lo, hi = w.start_ms - window_ms, w.end_ms + window_ms
        w.started = sum(1 for r in result["requests"] if lo <= r["start_ms"] <= hi)
        w.ended = sum(1 for r in result["requests"] if lo <= r["end_ms"] <= hi)
        w.steps = [s for s in steps if lo <= s["t_ms"] <= hi]
    return GapReport(level, len(requests), int(itls.size), p50, p99, threshold, gaps, windows, len(steps))


def _step_intervals(steps: list[dict], all_steps: dict[int, dict]) -> list[float]:
    """ms since the step before each (the one before the window's first too, where traced); none where that
    step came before the run began (a snapshot's last steps reach back into what the engine did before,
    and the time since them is the engine's idle time, not an interval of the run)."""
    out = []
    for s in steps:
        before = all_steps.get(s["step"] - 1)
        out.append(s["t_ms"] - before["t_ms"] if before is not None and before["t_ms"] >= 0 else float("nan"))
    return out


def format_report(report: GapReport, steps: list[dict] | None = None, max_windows: int = 12) -> str:
    """The report as text."""
    gaps = report.gaps
    head = f"level {report.level}: " if report.level is not None else ""
    lines = [f"{head}{report.num_requests} requests, {report.num_itls} ITLs, p50 {report.itl_p50_ms:.2f} ms, "
             f"p99 {report.itl_p99_ms:.2f} ms ({report.itl_p99_ms / report.itl_p50_ms:.2f}x); "
             f"over {report.threshold_ms:.2f} ms: {len(gaps)} ({100 * len(gaps) / report.num_itls:.2f} %)"]
    if not gaps:
        return lines[0]
    kinds = Counter(g.kind for g in gaps)
    lines.append("who else saw them: " + ", ".join(f"{k} {n}" for k, n in kinds.most_common()))
    index = Counter("1-4" if g.token_index < 5 else "5-31" if g.token_index < 32 else "32+" for g in gaps)
    lines.append("token index: " + ", ".join(f"{k}: {index[k]}" for k in ("1-4", "5-31", "32+")))
    lines.append(f"windows ({len(report.windows)}; the {min(max_windows, len(report.windows))} with most gaps):")
    by_step = {s["step"]: s for s in (steps or [])}
    for w in sorted(report.windows, key=lambda w: -len(w.gaps))[:max_windows]:
        lengths = [g.end_ms - g.start_ms for g in w.gaps]
        line = (f"  {w.start_ms:8.1f}-{w.end_ms:8.1f} ms: {len(w.gaps)} gaps (median {np.median(lengths):.1f} ms), "
                f"{w.started} requests sent, {w.ended} ended")
        if w.steps:
            iv = [v for v in _step_intervals(w.steps, by_step) if not np.isnan(v)]
            intervals = f"interval median {np.median(iv):.1f} max {max(iv):.1f} ms" if iv else "no interval traced"
            prompt = sum(s["num_prefill_tokens"] for s in w.steps)
            device = [s["device_step_s"] for s in w.steps if s.get("device_step_s") is not None]
            line += f"; engine: {len(w.steps)} steps, {intervals}, {prompt} prompt tokens"
            if device:
                line += f", device max {1e3 * max(device):.1f} ms"
        elif report.steps_traced:
            line += "; engine: no step traced here"
        lines.append(line)
    return "\n".join(lines)


def _levels(doc) -> list[tuple[int | None, dict]]:
    try:
        if "sweep" in doc:
            return [(level["max_concurrency"], level["result"]) for level in doc["sweep"]]
        if "results" in doc:
            return [(None, r) for r in doc["results"]]
    except (KeyError, TypeError) as exc:
        raise BenchError(f"not a bench serving result file ({type(exc).__name__}: {exc})") from None
    raise BenchError("not a bench serving result file (no 'sweep' or 'results')")


def parse_args(argv: list[str] | None):
    """Command-line options."""
    p = BenchParser("minillm bench serving_gaps", __doc__.split("\n\n")[0])
    p.add_argument("result_file", help="A bench serving --result-file written with --save-detailed.")
    p.add_argument("--level", type=int, default=None, help="Only this --concurrency-sweep level.")
    p.add_argument("--factor", type=float, default=1.5, help="A gap is an ITL over this many times the p50.")
    p.add_argument("--window-ms", type=float, default=20.0, help="Gaps this close (midpoints) share a window.")
    args = p.parse_args(argv)
    if not args.factor > 1 or not args.window_ms > 0:
        p.error("--factor must be > 1 and --window-ms > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Print the report of each run in the file."""
    args = parse_args(argv)
    try:
        with open(args.result_file, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise BenchError(f"cannot read {args.result_file}: {exc}") from None
    levels = [(lv, r) for lv, r in _levels(doc) if args.level is None or lv == args.level]
    if not levels:
        raise BenchError(f"no run at level {args.level} in {args.result_file}")
    for level, result in levels:
        try:
            report = analyze(result, level, args.factor, args.window_ms)
            text = format_report(report, result.get("steps"))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:   # a file edited or of another shape
            raise BenchError(f"{args.result_file} is not a bench serving result as saved: "
                             f"{type(exc).__name__}: {exc}") from None
        print(text)
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(run_main(main, "minillm bench serving_gaps"))
