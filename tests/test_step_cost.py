"""The step cost model: the fit recovers known coefficients, the chunk size is the largest that
fits, the online refit follows measured steps, and calibration runs on the CPU at start-up."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.step_cost import (ATTENTION, FEATURE_NAMES, KV_READ, MIXED, NUM_FEATURES, TOKENS, StepCostModel,
                               add_row, calibration_shapes, dummy_step, fit_nonnegative, is_decode_row, padded,
                               step_features)

# seconds: 2 ms a step, 1.5 ms more for the eager path, 20 us a token, 0.5 ns per query x key,
# 30 ns per key read
TRUE = np.array([2e-3, 1.5e-3, 20e-6, 0.5e-9, 30e-9])


def synthetic_steps(rng, n):
    """n random steps' features [n, 5]: decode batches, prompt chunks at various contexts, mixes."""
    x = np.zeros((n, NUM_FEATURES))
    for i in range(n):
        for _ in range(rng.integers(0, 64)):
            add_row(x[i], 1, int(rng.integers(1, 8192)), True)
        for _ in range(rng.integers(0 if x[i, TOKENS] else 1, 3)):
            add_row(x[i], int(rng.integers(2, 4096)), int(rng.integers(0, 16384)), False)
    return x


def test_fit_recovers_known_coefficients_exactly_without_noise():
    rng = np.random.default_rng(0)
    x = synthetic_steps(rng, 40)
    theta = fit_nonnegative(x, x @ TRUE)
    np.testing.assert_allclose(theta, TRUE, rtol=1e-6)


def test_fit_recovers_known_coefficients_under_measurement_noise():
    rng = np.random.default_rng(1)
    x = synthetic_steps(rng, 400)
    y = x @ TRUE * rng.lognormal(0.0, 0.05, len(x))      # 5 % multiplicative noise
    theta = fit_nonnegative(x, y)
    np.testing.assert_allclose(theta, TRUE, rtol=0.1)


def test_fit_clamps_a_coefficient_the_data_would_make_negative():
    rng = np.random.default_rng(2)
    x = synthetic_steps(rng, 60)
    signed = TRUE.copy()
    signed[MIXED] = -1e-3                                  # the eager path "saves" time: not physical
    y = x @ signed
    y = np.where(y > 0, y, 1e-4)
    theta = fit_nonnegative(x, y)
    assert np.all(theta >= 0) and theta[MIXED] == 0
    # Optimality (KKT) of the weighted problem: zero gradient on the free coefficients, a gradient
    # that would push the clamped ones below zero.
    xw = x / y[:, None]
    grad = xw.T @ (xw @ theta - 1.0)
    scale = np.abs(xw).sum(axis=0) * len(y)
    for k in range(NUM_FEATURES):
        if theta[k] > 0:
            assert abs(grad[k]) <= 1e-6 * scale[k]
        else:
            assert grad[k] >= -1e-6 * scale[k]


def test_fit_matches_the_best_support_by_brute_force():
    rng = np.random.default_rng(3)
    x = rng.uniform(0, 1, (30, 3))
    y = x @ np.array([1.0, -0.5, 0.2]) + 1.0
    theta = fit_nonnegative(x, y)
    best = None
    for size in range(1, 4):                               # every support, solved directly
        for support in itertools.combinations(range(3), size):
            cols = list(support)
            sol = np.linalg.lstsq(x[:, cols] / y[:, None], np.ones(len(y)), rcond=None)[0]
            if np.all(sol >= 0):
                full = np.zeros(3)
                full[cols] = sol
                loss = float((((x @ full) - y) / y) @ (((x @ full) - y) / y))
                best = min(best or (loss, full), (loss, full), key=lambda t: t[0])
    np.testing.assert_allclose(theta, best[1], atol=1e-9)


def test_features_of_a_step_count_decode_and_prefill_rows():
    rows = [(1, 100, True), (1, 200, True), (64, 1000, False), (16, 16, False)]
    out = dummy_step(rows)
    f = step_features(out)
    assert f[MIXED] == 1 and f[TOKENS] == 1 + 1 + 64 + 16
    assert f[ATTENTION] == 64 * 1000 + 16 * 16              # prefill rows: q x context
    assert f[KV_READ] == 100 + 200 + 1000 + 16              # every row reads its context
    assert [is_decode_row(q, s, seq.num_prompt_tokens)
            for q, s, seq in zip(out.num_new_tokens, out.num_computed_tokens, out.seqs)] == [True, True, False, False]
    decode_only = step_features(dummy_step([(1, 10, True)] * 3))
    assert decode_only[MIXED] == 0 and decode_only[ATTENTION] == 0 and decode_only[KV_READ] == 30


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 20_000), max_size=20), st.integers(0, 20_000), st.integers(0, 4096),
       st.floats(1e-3, 0.2), st.sampled_from([TRUE, TRUE * [1, 0, 1, 1, 1], TRUE * [1, 1, 1, 0, 1],
                                               TRUE * [1, 1, 0, 0, 0], TRUE * [1, 0, 0, 1, 0]]))
def test_max_prefill_tokens_is_the_largest_chunk_that_fits(decode_contexts, start, upper, limit_s, coefs):
    check_largest_chunk(StepCostModel(coefs), decode_contexts, start, upper, limit_s)


def check_largest_chunk(model: StepCostModel, decode_contexts, start: int, upper: int, limit_s: float) -> None:
    """max_prefill_tokens beside these decode rows fits the limit and one token more would not."""
    budget = model.budget(limit_s)
    for ctx in decode_contexts:
        budget.add(1, ctx - 1, True)
    q = budget.max_prefill_tokens(start, upper)

    def fits(n):
        f = budget.features.copy()
        add_row(f, n, start, False)
        return model.estimate(f) <= limit_s * (1 + 1e-9)

    assert 0 <= q <= upper
    if q:
        assert fits(q)
    if q < upper:
        assert not fits(q + 1)


def pad_to_sizes(tokens: int, is_mixed: bool) -> int:
    """Captured sizes: decode batches of 8, 16, 32; mixed steps of 64, 128, 256 tokens."""
    sizes = (64, 128, 256) if is_mixed else (8, 16, 32)
    return next((s for s in sizes if s >= tokens), tokens)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 2_000), min_size=1, max_size=20), st.integers(0, 2_000), st.integers(1, 400),
       st.floats(1e-3, 0.05))
def test_with_padding_the_chunk_is_the_largest_whose_padded_step_fits(decode_contexts, start, upper, limit_s):
    check_largest_chunk(StepCostModel(TRUE, pad_tokens=pad_to_sizes), decode_contexts, start, upper, limit_s)


def test_rows_added_by_their_sums_count_as_rows_added_one_by_one():
    rows = [(1, 40, True), (1, 7, True), (3, 100, False), (1, 0, True)]
    one, summed = StepCostModel(TRUE).budget(1.0), StepCostModel(TRUE).budget(1.0)
    for n, start, is_decode in rows:
        one.add(n, start, is_decode)
    summed.add_sums(sum(n for n, _, _ in rows), sum(n * (s + n) for n, s, d in rows if not d),
                    sum(s + n for n, s, _ in rows), any(n > 1 for n, _, _ in rows))
    np.testing.assert_array_equal(one.features, summed.features)


def test_padding_counts_the_rows_a_graph_runs():
    coefs = np.array([1e-3, 0.0, 1e-5, 0.0, 0.0])              # 1 ms a step, 10 us a row
    model = StepCostModel(coefs, pad_tokens=pad_to_sizes)
    f = step_features(dummy_step([(1, 10, True)] * 3 + [(70, 70, False)]))
    assert f[TOKENS] == 73 and model.estimate(f) == pytest.approx(1e-3 + 128 * 1e-5)   # 73 rows run as 128
    assert step_features(dummy_step([(1, 10, True)] * 9)) @ coefs == pytest.approx(1e-3 + 9e-5)
    assert model.estimate(step_features(dummy_step([(1, 10, True)] * 9))) == pytest.approx(1e-3 + 16e-5)
    # Under a limit of 2.28 ms, 3 decodes leave room for 128 rows: the chunk fills the padding.
    budget = model.budget(2.28e-3)
    for _ in range(3):
        budget.add(1, 9, True)
    assert budget.max_prefill_tokens(0, 500) == 125
    # A fit on padded samples recovers coefficients the raw token counts would not.
    rng = np.random.default_rng(2)
    rows = [[(1, 50, True)] * int(b) + [(int(q), int(q), False)] for b, q in rng.integers(1, 60, (40, 2))]
    x = np.vstack([step_features(dummy_step(r)) for r in rows])
    y = np.array([coefs @ padded(row, pad_to_sizes) for row in x])
    np.testing.assert_allclose(StepCostModel.fit(x, y, pad_tokens=pad_to_sizes).coefficients, coefs, atol=1e-9)


@pytest.mark.parametrize("coefs", [TRUE, TRUE * [1, 1, 1, 0, 1], TRUE * [1, 1, 1e-30, 0, 0]])
@pytest.mark.parametrize("limit_s", [1.7e305, 1e297])
def test_a_limit_past_any_step_gives_the_whole_chunk_without_overflow(coefs, limit_s):
    # max_step_ms is any finite number: the closed form's q went to infinity and int() raised inside
    # the scheduler (OverflowError), or numpy warned of an overflow.
    import warnings
    budget = StepCostModel(coefs).budget(limit_s)
    budget.add(1, 100, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert budget.max_prefill_tokens(50, 4096) == 4096


def test_refit_follows_measured_steps_and_keeps_the_anchors():
    rng = np.random.default_rng(4)
    x = synthetic_steps(rng, 30)
    model = StepCostModel.fit(x, x @ TRUE, refit_every=16)
    np.testing.assert_allclose(model.coefficients, TRUE, rtol=1e-6)
    slower = TRUE * [1.0, 1.0, 2.0, 1.0, 1.0]              # the GEMMs run at half the calibrated rate
    live = synthetic_steps(rng, 320)
    for k, f in enumerate(live):
        model.observe(f, float(f @ slower))
        assert model.num_refits == (k + 1) // 16
    # A full window of live steps (256) outweighs the 30 start-up samples.
    assert model.coefficients[TOKENS] > 1.8 * TRUE[TOKENS]
    errors = list(model.errors)
    assert np.median(errors[-16:]) < 0.5 * np.median(errors[:16])   # estimates got closer
    snap = model.snapshot()
    assert snap.num_live_samples == 256 and snap.num_calibration_samples == 30 and snap.num_refits == 20
    assert snap.last_measured_s == pytest.approx(float(live[-1] @ slower))
    assert list(snap.coefficients) == list(FEATURE_NAMES)


def test_observe_ignores_steps_without_a_time():
    model = StepCostModel(TRUE)
    f = np.zeros(NUM_FEATURES)
    add_row(f, 1, 10, True)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        model.observe(f, bad)
    assert model.num_live == 0 and model.last_measured_s is None


@pytest.mark.parametrize("max_num_seqs,budget,max_model_len,num_blocks,block_size", [
    (256, 8192, 40960, 70_000, 16),     # the GPU: Qwen3-0.6B pool
    (8, 64, 512, 256, 16),              # a small CPU engine
    (4, 16, 64, 6, 4),                  # a pool smaller than one long context
    (1, 1, 2, 1, 16),
])
def test_calibration_shapes_fit_the_pool(max_num_seqs, budget, max_model_len, num_blocks, block_size):
    shapes = calibration_shapes(max_num_seqs, budget, max_model_len, num_blocks, block_size)
    assert shapes
    for rows in shapes:
        assert sum(-(-ctx // block_size) for _, ctx, _ in rows) <= num_blocks
        assert len(rows) <= max_num_seqs or any(not d for _, _, d in rows)
        for q, ctx, decode in rows:
            assert 1 <= q <= ctx <= max_model_len and (q == 1) == decode
            assert q <= budget or decode
    x = np.vstack([step_features(dummy_step(rows)) for rows in shapes])
    if max_num_seqs >= 4:                 # enough shapes to tell every feature apart
        assert np.linalg.matrix_rank(x) == NUM_FEATURES


def test_calibration_borrows_blocks_and_gives_them_back(stories_path):
    from minillm.config import EngineConfig
    from minillm.engine import LLMEngine
    engine = LLMEngine(EngineConfig(model=str(stories_path), device="cpu", max_num_seqs=8,
                                    max_num_batched_tokens=64, max_step_ms=50.0), log=lambda msg: None)
    model = engine.scheduler.step_cost
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.num_cached_free_blocks == 0
    assert bm.prefix_cache_queries == 0                    # the dummy steps are not prefix-cache traffic
    assert len(model.anchor_y) >= 2 * 8 and np.all(model.anchor_y > 0)
    # Positive coefficients: a fixed cost a step, and some cost that grows with the work.
    assert np.all(model.coefficients >= 0) and model.coefficients[0] > 0
    assert model.coefficients[TOKENS] + model.coefficients[ATTENTION] + model.coefficients[KV_READ] > 0
    assert all(model.estimate(f) > 0 for f in model.anchor_x)
    assert engine.runner.profile                           # each step timed on the device from now on
    engine.shutdown()
