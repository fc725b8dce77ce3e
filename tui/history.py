"""Rolling history built from successive snapshots: usage series and steps deduplicated by number."""
from __future__ import annotations

from collections import deque

from minillm.stats import EngineStats, StepStats

HISTORY_LEN = 240   # samples kept for the sparklines (a minute at four frames a second)
STEPS_LEN = 400     # engine steps kept for the batch chart


class StatsHistory:
    """Series the panels draw; snapshots overlap in recent_steps, so steps are keyed by number."""

    def __init__(self, maxlen: int = HISTORY_LEN, max_steps: int = STEPS_LEN):
        self.kv_usage: deque[float] = deque(maxlen=maxlen)
        self.token_utilization: deque[float | None] = deque(maxlen=maxlen)   # None: not reported (a summary)
        self.prompt_throughput: deque[float] = deque(maxlen=maxlen)
        self.generation_throughput: deque[float] = deque(maxlen=maxlen)
        self.steps: deque[StepStats] = deque(maxlen=max_steps)
        self.num_frames = 0

    @property
    def last_step(self) -> int:
        """The number of the newest step seen, -1 before any."""
        return self.steps[-1].step if self.steps else -1

    def add(self, stats: EngineStats) -> None:
        """Fold one snapshot into the series."""
        if stats.recent_steps and max(s.step for s in stats.recent_steps) < self.last_step:
            # Step numbers went backwards: the server restarted or a replay looped.
            self.steps.clear()
        self.num_frames += 1
        self.kv_usage.append(stats.kv_usage)
        self.token_utilization.append(stats.kv_token_utilization)
        self.prompt_throughput.append(stats.prompt_throughput)
        self.generation_throughput.append(stats.generation_throughput)
        last = self.last_step
        for step in sorted(stats.recent_steps, key=lambda s: s.step):
            if step.step > last:
                self.steps.append(step)
                last = step.step
