"""Rolling counters and latency samples the engine keeps for its stats snapshots."""
from __future__ import annotations

from bisect import bisect_left
from collections import Counter, deque

import numpy as np

from minillm.step import SchedulerOutput
from minillm.stats import StepStats

THROUGHPUT_WINDOW_S = 5.0
# Where a prompt's tokens came from (vLLM's source label): computed here, the prefix cache, a KV connector.
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# Upper bounds of vLLM's iteration_tokens_total buckets (tokens a step computed); a last one, +Inf, follows.
ITERATION_TOKEN_BOUNDS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class MetricsTracker:
    """Step history, token totals, TTFT / inter-token latency samples, finish counts."""

    def __init__(self, max_steps: int = 128, max_samples: int = 4096, num_spec_tokens: int | None = None):
        self.num_steps = 0
        self.prefill_tokens_total = 0                # prompt tokens computed by steps (recomputed ones again)
        self.prompt_tokens_total = 0                 # each sequence's whole prompt, once, at its first token
        self.prompt_tokens_by_source = dict.fromkeys(PROMPT_TOKEN_SOURCES, 0)
        self.generation_tokens_total = 0
        # Steps by the tokens each computed (prompt and decode rows): a count per bucket of
        # ITERATION_TOKEN_BOUNDS and +Inf (not cumulative), and the tokens summed over steps.
        self.iteration_tokens_buckets = [0] * (len(ITERATION_TOKEN_BOUNDS) + 1)
        self.iteration_tokens_sum = 0
        self.recent_steps: deque[StepStats] = deque(maxlen=max_steps)
        # Launched steps whose device time is still to come (with a step-time budget): (out, its row).
        self._awaiting_device_time: deque[tuple[SchedulerOutput, StepStats]] = deque(maxlen=8)
        self._window: deque[tuple[float, float, int, int]] = deque()   # (start, end, prompt, gen)
        self.ttft: deque[float] = deque(maxlen=max_samples)
        self.itl: deque[float] = deque(maxlen=max_samples)
        self.finished: Counter[str] = Counter()
        self.timings: Counter[str] = Counter()       # phase -> seconds, summed over steps
        self.spec_decode = None                      # SpecDecodeStats, with speculative decoding only
        if num_spec_tokens is not None:
            from minillm.spec_decode.metrics import SpecDecodeStats
            self.spec_decode = SpecDecodeStats(num_spec_tokens)

    def record_step(self, out: SchedulerOutput, started: float, ended: float, budget: int) -> None:
        """Account one launched step's composition and prompt tokens."""
        self.num_steps += 1
        self.prefill_tokens_total += out.num_prefill_tokens
        self.iteration_tokens_buckets[bisect_left(ITERATION_TOKEN_BOUNDS, out.num_tokens)] += 1
        self.iteration_tokens_sum += out.num_tokens
        stats = StepStats(self.num_steps, ended, out.num_prefill_tokens, out.num_decode_tokens, len(out.seqs),
                          budget, ended - started, estimated_step_s=out.estimated_step_s,
                          step_limit_s=out.step_limit_s)
        self.recent_steps.append(stats)
        if out.estimated_step_s is not None:
            self._awaiting_device_time.append((out, stats))
        self._add_to_window(started, ended, out.num_prefill_tokens, 0)

    def record_device_step_time(self, out: SchedulerOutput, seconds: float) -> None:
        """The measured device time of a step recorded by record_step (matched by identity)."""
        for k, (pending, stats) in enumerate(self._awaiting_device_time):
            if pending is out:
                stats.device_step_s = seconds
                del self._awaiting_device_time[k]
                return

    def record_timings(self, timings: dict[str, float]) -> None:
        """Add one step's per-phase seconds (Counter.update's sums, without its Mapping check a call)."""
        totals = self.timings
        get = totals.get
        for phase, seconds in timings.items():
            totals[phase] = seconds + get(phase, 0)

    def step_time_breakdown(self) -> dict[str, float]:
        """Seconds per phase summed over every step so far."""
        return dict(self.timings)

    def record_spec_decode(self, drafts: dict[int, list[int]], num_accepted: dict[int, int]) -> None:
        """Count one step's verified drafts (seq_id -> draft ids; seq_id -> how many were accepted)."""
        for seq_id, ids in drafts.items():
            self.spec_decode.observe_draft(len(ids), num_accepted[seq_id])

    def record_generated(self, num_tokens: int, started: float, ended: float) -> None:
        """Account tokens read back from the device."""
        self.generation_tokens_total += num_tokens
        self._add_to_window(started, ended, 0, num_tokens)

    def _add_to_window(self, started: float, ended: float, prompt: int, generated: int) -> None:
        self._window.append((started, ended, prompt, generated))
        while self._window and self._window[0][1] < ended - THROUGHPUT_WINDOW_S:
            self._window.popleft()

    def record_prompt(self, num_tokens: int, num_cached: int, num_external: int) -> None:
        """Count one sequence's prompt at its first token, split by where its tokens came from."""
        self.prompt_tokens_total += num_tokens
        num_cached = min(num_cached, num_tokens)
        by_source = self.prompt_tokens_by_source
        by_source["external_kv_transfer"] += num_external
        by_source["local_cache_hit"] += num_cached - num_external
        by_source["local_compute"] += num_tokens - num_cached

    def record_ttft(self, seconds: float) -> None:
        """One time-to-first-token sample."""
        self.ttft.append(seconds)

    def record_itl(self, seconds: float) -> None:
        """One inter-token latency sample."""
        self.itl.append(seconds)

    def record_finish(self, reason: str | None) -> None:
        """Count one finished sequence by reason."""
        self.finished[reason or "unknown"] += 1

    def throughput(self, now: float) -> tuple[float, float]:
        """(prompt tok/s, generation tok/s) over the last few seconds."""
        recent = [w for w in self._window if w[1] >= now - THROUGHPUT_WINDOW_S]
        if not recent:
            return 0.0, 0.0
        span = max(now - min(w[0] for w in recent), 1e-3)
        return sum(w[2] for w in recent) / span, sum(w[3] for w in recent) / span


def percentile(samples, q: float) -> float | None:
    """The q-th percentile of the samples, or None when there are none."""
    return percentiles(samples, (q,))[0]


def percentiles(samples, qs: tuple[float, ...]) -> tuple[float | None, ...]:
    """The qs-th percentiles of the samples in one pass (Nones when there are none)."""
    if not samples:
        return (None,) * len(qs)
    return tuple(float(v) for v in np.percentile(np.fromiter(samples, float, len(samples)), qs))
