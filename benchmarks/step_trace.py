"""The engine's steps during a serving run, polled from the server's /v1/stats (`bench serving --step-trace`).

A snapshot carries the engine's last 32 steps (StepStats: when each was scheduled, its prompt and
decode tokens, its scheduling time and, with a step-time budget, its estimated and measured device
time and the limit it was sized under); under async scheduling a step is scheduled while the one
before it runs, so the times between steps are the engine's step intervals. Polled every
--step-trace-interval seconds, the snapshots overlap, so every step of the run is kept once as
long as fewer than 32 steps pass between two polls (at 0.15 s, a step every 4.7 ms or slower). Each poll builds a snapshot between two of the engine's
steps (about 1-3 ms with 256 requests running), so a traced run's latencies carry that cost: the
trace says where the time went, the untraced run gives the figures.
"""
from __future__ import annotations

import threading
import time

import httpx

class StepTracer:
    """Poll base_url's /v1/stats on a thread until stop(); steps() gives every step seen, once."""

    def __init__(self, base_url: str, interval_s: float, headers: dict[str, str | bytes] | None = None) -> None:
        self.url = base_url.rstrip("/") + "/v1/stats"
        self.interval_s = interval_s
        self.headers = headers or {}
        self.polls = 0
        self.errors: list[str] = []
        self._seen: dict[int, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="step-trace", daemon=True)

    def start(self) -> "StepTracer":
        """Begin polling."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Poll once more (the run's last steps), then end."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with httpx.Client(headers=self.headers, timeout=10.0) as client:
            while True:
                started = time.monotonic()
                self._poll(client)
                if self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started))):
                    self._poll(client)
                    return

    def _poll(self, client: httpx.Client) -> None:
        try:
            response = client.get(self.url, params={"cells": 1})
            response.raise_for_status()
            steps = response.json()["recent_steps"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
            return
        self.polls += 1
        for step in steps:
            self._seen.setdefault(step["step"], step)

    def steps(self, run_start_monotonic: float) -> list[dict]:
        """Every step seen, in order, each with t_ms: when it was scheduled, in ms from the run's start
        (time.monotonic() of this machine; the server's clock is time.time() on the same host)."""
        offset = time.time() - time.monotonic()
        out = []
        for number in sorted(self._seen):
            step = dict(self._seen[number])
            step["t_ms"] = 1000.0 * (step["time"] - offset - run_start_monotonic)
            out.append(step)
        return out

    def missed(self) -> int:
        """Steps the polls did not see (gaps in the step numbers between the first and the last)."""
        if not self._seen:
            return 0
        return max(self._seen) - min(self._seen) + 1 - len(self._seen)
