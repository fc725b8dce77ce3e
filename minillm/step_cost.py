"""Step cost model: the device time of one step (forward pass and sampling) from its shape.

    t = a + m * mixed + b * tokens + c * attention + d * kv_read

    mixed      1 when a row runs more than one query token (the prefill path: on the GPU its
               kernels are launched one by one, a decode-only step replays a CUDA graph)
    tokens     query tokens in the step as the GEMMs see them: padded to the captured graph's size
               when the model is given the runner's padding (a step of 320 tokens replayed at 512
               pays for 512 rows)
    attention  sum over prefill rows of q * L (q: the row's query tokens, L: its context once
               they are in, num_computed_tokens + q): the matrix work of prefill attention
    kv_read    sum over all rows of L: each row reads its cached K/V at least once (what a decode
               row costs; a short prompt chunk over a long prefix is bound by it as well)

A decode row is one query token past the prompt; every other row is a prefill row (a prompt
chunk, a recompute after preemption, a row verifying draft tokens). The coefficients are fitted
by non-negative least squares on relative error (a 4 ms decode step matters as much as a 200 ms
prefill), first from a profiling pass at start-up (calibrate()), then again every REFIT_EVERY
steps from the measured device time of the last WINDOW steps, with the start-up samples kept as
anchors (at a quarter of a live step's weight each): a live window of decode steps alone says
nothing about the attention term, and the anchors keep it known. A refit rather than one scale
factor because the error depends on the shape: an eager step whose launches overlap its GPU work
costs less than the sum of its parts, and a single factor learned on decode steps would bend the
prefill terms the wrong way. A refit is Lawson-Hanson on 5 x 5 normal equations, about 0.2 ms
every 16 steps on the engine loop.
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from minillm.sampling_params import SamplingParams
from minillm.sequence import Sequence
from minillm.step import SchedulerOutput

FEATURE_NAMES = ("base", "mixed", "tokens", "attention", "kv_read")
NUM_FEATURES = len(FEATURE_NAMES)
BASE, MIXED, TOKENS, ATTENTION, KV_READ = range(NUM_FEATURES)
WINDOW = 256            # live samples kept for the refit
REFIT_EVERY = 16        # steps between refits
# A start-up sample weighs this much against a live step in a refit: enough to pin what the live
# window does not cover (the attention term while only decodes run), too little to outvote it.
ANCHOR_WEIGHT = 0.25
LONG_CONTEXT = 16_384   # the longest context calibrated (the model is linear beyond)
LIMIT_SLACK = 1e-9      # relative: a step estimated at exactly the limit fits, whatever the rounding


def is_decode_row(num_new_tokens: int, start: int, num_prompt_tokens: int) -> bool:
    """True for a row that computes one token past its prompt."""
    return num_new_tokens == 1 and start >= num_prompt_tokens


def add_row(features: np.ndarray, num_new_tokens: int, start: int, is_decode: bool) -> None:
    """Add one row (num_new_tokens query tokens after start computed ones) to features [5]."""
    context = start + num_new_tokens
    add_sums(features, num_new_tokens, 0 if is_decode else num_new_tokens * context, context, num_new_tokens > 1)


def add_sums(features: np.ndarray, num_tokens: int, attention: int, kv_read: int, mixed: bool) -> None:
    """Add rows given by their sums (query tokens, prefill q * L, contexts; any row of more than one
    token) to features [5]: what add_row over each of them adds."""
    features[BASE] = 1.0
    if mixed:
        features[MIXED] = 1.0
    features[TOKENS] += num_tokens
    features[ATTENTION] += attention
    features[KV_READ] += kv_read


def step_features(out: SchedulerOutput) -> np.ndarray:
    """features [5] of a scheduled step (plain Python over the rows: it runs every step)."""
    counts, starts = out.num_new_tokens, out.num_computed_tokens
    if not counts:
        return np.zeros(NUM_FEATURES)
    tokens = sum(counts)
    attention = sum(n * (start + n) for seq, start, n in zip(out.seqs, starts, counts)
                    if n != 1 or start < len(seq.prompt_token_ids))     # the prefill rows
    return np.array([1.0, float(max(counts) > 1), tokens, attention, sum(starts) + tokens])


def padded(features: np.ndarray, pad_tokens: Callable[[int, bool], int]) -> np.ndarray:
    """features [5] with TOKENS replaced by pad_tokens(tokens, is_mixed)."""
    tokens = int(features[TOKENS])
    rows = pad_tokens(tokens, bool(features[MIXED])) if tokens else 0
    if rows == tokens:
        return features
    out = features.copy()
    out[TOKENS] = rows
    return out


def fit_nonnegative(x: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Coefficients [k] >= 0 minimising sum(w * ((x @ theta - y) / y) ** 2); x: [n, k], y: [n] > 0,
    weights w: [n] (default 1). Lawson and Hanson's active-set method on the k x k normal
    equations (a fraction of a millisecond: it runs on the engine loop)."""
    w = np.ones(len(y)) if weights is None else np.sqrt(np.asarray(weights, np.float64))
    xw = x * (w / y)[:, None]                               # relative error: row i divided by y_i
    scale = np.sqrt((xw ** 2).mean(axis=0))                 # columns of ~unit size, for conditioning
    scale[scale == 0] = 1.0
    xs = xw / scale
    return nnls_normal(xs.T @ xs, xs.T @ w) / scale         # x^T x [k, k], x^T w [k]


def nnls_normal(gram: np.ndarray, rhs: np.ndarray, max_iter: int = 64) -> np.ndarray:
    """theta >= 0 minimising theta^T gram theta - 2 rhs^T theta (least squares given as its normal
    equations gram [k, k], rhs [k]): Lawson-Hanson."""
    k = len(rhs)
    theta = np.zeros(k)
    passive = np.zeros(k, dtype=bool)
    tol = 1e-10 * max(float(np.abs(rhs).max(initial=0.0)), 1e-300)
    for _ in range(max_iter):
        grad = rhs - gram @ theta                           # minus half the gradient
        candidates = np.where(~passive & (grad > tol), grad, -np.inf)
        if not np.isfinite(candidates.max()):
            break
        passive[int(np.argmax(candidates))] = True
        for _ in range(max_iter):
            idx = np.flatnonzero(passive)
            trial = np.zeros(k)
            trial[idx] = np.linalg.lstsq(gram[np.ix_(idx, idx)], rhs[idx], rcond=None)[0]
            if np.all(trial[idx] > 0):
                theta = trial
                break
            # Step from theta toward trial until the first passive coefficient reaches zero.
            shrinking = idx[trial[idx] <= 0]
            alpha = np.min(theta[shrinking] / (theta[shrinking] - trial[shrinking]))
            theta = theta + alpha * (trial - theta)
            passive &= theta > tol
            theta[~passive] = 0.0
    return theta


@dataclass(frozen=True)
class StepCostSnapshot:
    """The cost model as the stats see it."""

    coefficients: dict[str, float]        # feature name -> seconds per unit
    num_calibration_samples: int
    num_live_samples: int                 # in the refit window
    num_refits: int
    last_estimated_s: float | None        # the newest completed step: its estimate when scheduled
    last_measured_s: float | None         # and its measured device time
    relative_error_p50: float | None      # median |estimate - measured| / measured over the window


class StepCostModel:
    """Estimates a step's device time; refits itself from measured steps."""

    def __init__(self, coefficients, anchor_x: np.ndarray | None = None, anchor_y: np.ndarray | None = None,
                 window: int = WINDOW, refit_every: int = REFIT_EVERY,
                 pad_tokens: Callable[[int, bool], int] | None = None):
        self.coefficients = np.asarray(coefficients, np.float64)          # [5] seconds per unit
        assert self.coefficients.shape == (NUM_FEATURES,) and np.all(self.coefficients >= 0)
        # (tokens, is_mixed) -> the rows the step's GEMMs run (None: as many as its tokens).
        self.pad_tokens = pad_tokens
        # The start-up samples, kept in every refit: [n, 5] features, [n] seconds.
        self.anchor_x = np.zeros((0, NUM_FEATURES)) if anchor_x is None else np.asarray(anchor_x, np.float64)
        self.anchor_y = np.zeros(0) if anchor_y is None else np.asarray(anchor_y, np.float64)
        # The live window as a ring: [window, 5] features, [window] measured seconds.
        self.live_x, self.live_y = np.zeros((window, NUM_FEATURES)), np.zeros(window)
        self.num_live = 0                 # samples in the window
        self._next = 0                    # the ring slot the next sample goes to
        self.errors: deque[float] = deque(maxlen=window)
        self.refit_every = refit_every
        self.num_refits = 0
        self._since_refit = 0
        self.last_estimated_s: float | None = None
        self.last_measured_s: float | None = None

    @classmethod
    def fit(cls, x: np.ndarray, y: np.ndarray, pad_tokens: Callable[[int, bool], int] | None = None,
            **kw) -> "StepCostModel":
        """The model fitted on samples x [n, 5] (features), y [n] (seconds), kept as its anchors."""
        x = np.asarray(x, np.float64)
        if pad_tokens is not None:
            x = np.vstack([padded(row, pad_tokens) for row in x]) if len(x) else x
        return cls(fit_nonnegative(x, np.asarray(y, np.float64)), x, y, pad_tokens=pad_tokens, **kw)

    def padded(self, features: np.ndarray) -> np.ndarray:
        """features [5] with the tokens the GEMMs run (a copy where padding changes them)."""
        return features if self.pad_tokens is None else padded(features, self.pad_tokens)

    def estimate(self, features: np.ndarray) -> float:
        """Seconds a step of these features [5] takes."""
        return float(self.padded(features) @ self.coefficients)

    def observe(self, features: np.ndarray, measured_s: float, estimated_s: float | None = None) -> None:
        """Add a completed step's measured device time; refits every refit_every observations."""
        if not (measured_s > 0 and math.isfinite(measured_s)):
            return
        estimated = self.estimate(features) if estimated_s is None else estimated_s
        self.last_estimated_s, self.last_measured_s = estimated, measured_s
        self.errors.append(abs(estimated - measured_s) / measured_s)
        self.live_x[self._next], self.live_y[self._next] = self.padded(features), measured_s
        self._next = (self._next + 1) % len(self.live_y)
        self.num_live = min(self.num_live + 1, len(self.live_y))
        self._since_refit += 1
        if self._since_refit >= self.refit_every:
            self.refit()

    def refit(self) -> None:
        """Fit again on the start-up samples and the live window."""
        self._since_refit = 0
        if not self.num_live:
            return
        n = self.num_live
        x = np.concatenate([self.anchor_x, self.live_x[:n]])
        y = np.concatenate([self.anchor_y, self.live_y[:n]])
        weights = np.concatenate([np.full(len(self.anchor_y), ANCHOR_WEIGHT), np.ones(n)])
        self.coefficients = fit_nonnegative(x, y, weights)
        self.num_refits += 1

    def budget(self, limit_s: float) -> "StepTimeBudget":
        """An empty step to fill under limit_s seconds."""
        return StepTimeBudget(self, limit_s)

    def snapshot(self) -> StepCostSnapshot:
        """Copies of the coefficients and the newest figures."""
        errors = float(np.median(self.errors)) if self.errors else None
        return StepCostSnapshot(dict(zip(FEATURE_NAMES, map(float, self.coefficients))), len(self.anchor_y),
                                self.num_live, self.num_refits, self.last_estimated_s, self.last_measured_s, errors)


class StepTimeBudget:
    """The rows chosen so far in one step, and how many prompt tokens more fit under a time limit."""

    def __init__(self, model: StepCostModel, limit_s: float):
        self.model = model
        self.limit_s = limit_s * (1 + LIMIT_SLACK)
        self.features = np.zeros(NUM_FEATURES)

    def limit_to(self, limit_s: float) -> None:
        """Lower the limit to limit_s seconds (where it is higher)."""
        self.limit_s = min(self.limit_s, limit_s * (1 + LIMIT_SLACK))

    def add(self, num_new_tokens: int, start: int, is_decode: bool) -> None:
        """Count one row in the step."""
        add_row(self.features, num_new_tokens, start, is_decode)

    def add_sums(self, num_tokens: int, attention: int, kv_read: int, mixed: bool) -> None:
        """Count rows given by their sums (what add() would total over them)."""
        add_sums(self.features, num_tokens, attention, kv_read, mixed)

    def add_drafts(self, start: int, num_drafts: int) -> None:
        """A decode row counted with add() (one token after start) verifies num_drafts drafts too:
        it becomes a multi-token row."""
        f = self.features
        f[MIXED] = 1.0
        f[TOKENS] += num_drafts
        f[KV_READ] += num_drafts
        f[ATTENTION] += (1 + num_drafts) * (start + 1 + num_drafts)

    def max_drafts(self, start: int, upper: int) -> int:
        """The most drafts (<= upper) a counted decode row one token after start may verify within
        the limit (upper is the few a drafter proposes: a scan)."""
        for d in range(upper, 0, -1):
            trial = StepTimeBudget(self.model, 0.0)
            trial.features = self.features.copy()
            trial.add_drafts(start, d)
            if trial.estimate() <= self.limit_s:
                return d
        return 0

    def estimate(self) -> float:
        """Seconds the step takes so far."""
        return self.model.estimate(self.features)

    def max_prefill_tokens(self, start: int, upper: int) -> int:
        """The largest q <= upper whose prefill row (q tokens after start) keeps the step within the
        limit; 0 when not even one token fits. The estimate grows with q (padded tokens, attention
        and reads all do), so a bisection finds it; with padding, a chunk grows into the rows its
        graph runs anyway while the limit allows."""
        a, m, b, c, d = map(float, self.model.coefficients)
        f = [float(v) for v in self.features]
        pad = self.model.pad_tokens

        def estimate(q: int) -> float:                  # add_row(q, start, False), then the dot product
            mixed = 1.0 if q > 1 or f[MIXED] else 0.0
            tokens = int(f[TOKENS]) + q
            rows = pad(tokens, bool(mixed)) if pad is not None else tokens
            return a + m * mixed + b * rows + c * (f[ATTENTION] + q * (start + q)) + d * (f[KV_READ] + start + q)

        if upper < 1 or estimate(1) > self.limit_s:
            return 0
        if estimate(upper) <= self.limit_s:
            return upper
        lo, hi = 1, upper                               # estimate(lo) fits, estimate(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if estimate(mid) <= self.limit_s:
                lo = mid
            else:
                hi = mid
        return lo


# ---- calibration: a short profiling pass at start-up ------------------------------------------------

def calibration_shapes(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                       num_free_blocks: int, block_size: int) -> list[list[tuple[int, int, bool]]]:
    """The dummy steps of the profiling pass: rows (query tokens, context, is_decode) of each.

    Decode batches of 1, a quarter and all of max_num_seqs at a short and a long context;
    prompt chunks of 1/16, 1/4 and all of the token budget alone and over a long prefix; one
    mixed step. Each fits the free pool with rows of their own blocks (rows sharing blocks would
    read from cache and look cheaper than they are)."""
    shapes: list[list[tuple[int, int, bool]]] = []
    s, m, bs = max_num_seqs, max_model_len, block_size

    def fits(rows) -> bool:
        return sum(-(-ctx // bs) for _, ctx, _ in rows) <= num_free_blocks

    for batch in sorted({1, max(1, s // 4), s}):
        long_ctx = min(m, LONG_CONTEXT, (num_free_blocks // batch) * bs)
        if long_ctx < 2:
            continue
        for ctx in sorted({max(2, min(long_ctx // 8, 512)), long_ctx}):
            shapes.append([(1, ctx, True)] * batch)
    q_max = min(max_num_batched_tokens, m, num_free_blocks * bs)
    if q_max >= 2:
        longest = min(m, LONG_CONTEXT, num_free_blocks * bs)
        for q in sorted({max(2, q_max // 16), max(2, q_max // 4), q_max}):
            shapes.append([(q, q, False)])
            if longest - q >= q:
                shapes.append([(q, longest, False)])
        mixed = [(1, max(2, min(m, 512)), True)] * max(1, s // 4) + [(max(2, q_max // 4), max(2, q_max // 4), False)]
        if fits(mixed):
            shapes.append(mixed)
    return [rows for rows in shapes if fits(rows)]


def dummy_step(rows: list[tuple[int, int, bool]]) -> SchedulerOutput:
    """A SchedulerOutput of dummy sequences (token id 0) for rows (query tokens, context, is_decode);
    every row samples. The sequences hold no blocks yet."""
    seqs, counts, starts = [], [], []
    params = SamplingParams(max_tokens=1)
    for i, (q, ctx, decode) in enumerate(rows):
        prompt_len = ctx - 1 if decode else ctx       # a decode row computes its first output token
        seq = Sequence("step-cost-calibration", i, [0] * prompt_len, params, 0.0, np.random.default_rng(i), 1,
                       token_ids=[0] * ctx)
        seqs.append(seq)
        counts.append(q)
        starts.append(ctx - q)
    num_decode = sum(q for q, _, decode in rows if decode)
    return SchedulerOutput(seqs, counts, starts, list(range(len(rows))), sum(counts) - num_decode, num_decode)


def measured_seconds(timings: dict[str, float]) -> float | None:
    """A step's device time from the runner's timings (forward, plus sampling when it sampled)."""
    forward = timings.get("forward_device")
    return None if forward is None else forward + timings.get("sample_device", 0.0)


def calibrate(runner, block_manager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
              repeats: int = 2) -> tuple[StepCostModel, float]:
    """Run the calibration_shapes through the runner on KV blocks borrowed from the pool (freed
    after each step), timing each on the device; returns the fitted model and the seconds it took.

    Each shape runs once untimed first (kernels compile, cuBLAS picks its algorithms)."""
    started = time.perf_counter()
    shapes = calibration_shapes(max_num_seqs, max_num_batched_tokens, max_model_len,
                                block_manager.num_free_blocks, block_manager.block_size)
    xs, ys = [], []
    profile, runner.profile = runner.profile, True
    try:
        for rows in shapes:
            for rep in range(1 + repeats):
                out = dummy_step(rows)
                try:
                    for seq, start in zip(out.seqs, out.num_computed_tokens):
                        if not block_manager.append_slots(seq, seq.num_tokens):
                            raise RuntimeError("a step cost calibration step does not fit the KV pool")
                        seq.num_computed_tokens = start
                    step = runner.launch(out).wait()
                finally:
                    for seq in out.seqs:
                        block_manager.free(seq)
                seconds = measured_seconds(step.timings)
                if rep and seconds is not None and seconds > 0:
                    xs.append(step_features(out))
                    ys.append(seconds)
    finally:
        runner.profile = profile
        runner.reset_kv_scales()      # FP8 scales come from the first real prefill, not from dummy tokens
    if not ys:
        raise RuntimeError("the step cost calibration measured no step")
    return (StepCostModel.fit(np.vstack(xs), np.asarray(ys), pad_tokens=runner.padded_tokens),
            time.perf_counter() - started)
