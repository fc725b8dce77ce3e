"""The NumPy sampler with top-k over a real vocabulary: the top k in order, without sorting the rest."""
import numpy as np
import pytest

from minillm.ops import numpy as npops


def full_sort_sample(row, temperature, top_k, top_p, min_p, u) -> int:
    """The rule of npops.sample's sorted path over the whole vocabulary in descending logit, then id order."""
    vocab = len(row)
    order = np.lexsort((np.arange(vocab), -row))
    x = row[order] / np.float32(temperature)
    p = np.exp(x - x[0]).astype(np.float64)          # the sampler sums in float64
    p /= p.sum()
    keep = np.ones(vocab, dtype=bool)
    if 0 < top_k < vocab:
        keep[top_k:] = False
    if min_p > 0.0:
        keep &= p >= min_p * p[0]
    if top_p < 1.0:
        keep &= np.cumsum(p) - p < top_p * p[keep].sum()
    keep[0] = True
    cdf = np.cumsum(np.where(keep, p, 0.0))
    idx = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), vocab - 1)
    return int(order[idx]) if keep[idx] else int(order[0])


def test_top_k_takes_the_lowest_ids_among_ties_at_the_kth_logit():
    row = np.array([1, 3, 2, 3, 2, 2, 0, 2, -np.inf, 3], np.float32)
    for k in range(1, len(row)):
        np.testing.assert_array_equal(npops._top_k_order(row, k), np.lexsort((np.arange(len(row)), -row))[:k])


@pytest.mark.parametrize("seed", range(6))
def test_top_k_picks_as_a_sort_of_the_whole_vocabulary(seed):
    rng = np.random.default_rng(seed)
    vocab = 5000
    logits = (rng.standard_normal((16, vocab)) * 3).astype(np.float32)
    logits[rng.random(logits.shape) < 0.3 * (seed % 2)] = -np.inf            # a grammar's mask on odd seeds
    logits[:, rng.integers(0, vocab, 40)] = logits[:, :1]                     # ties with a likely token
    for top_k in (1, 20, 50, vocab - 1):
        for top_p, min_p in ((1.0, 0.0), (0.95, 0.0), (0.8, 0.05)):
            temperature = rng.choice([0.6, 1.0]).astype(np.float32) * np.ones(16, np.float32)
            u = rng.random(16).astype(np.float32)
            got = npops.sample(logits, temperature, np.full(16, top_k, np.int32), np.full(16, top_p, np.float32),
                               np.full(16, min_p, np.float32), u)
            want = [full_sort_sample(logits[b], temperature[b], top_k, top_p, min_p, u[b]) for b in range(16)]
            assert got.tolist() == want, (top_k, top_p, min_p)


def test_top_k_does_not_sort_the_whole_vocabulary(monkeypatch):
    """Qwen3's generation_config asks for top_k 20, top_p 0.95: a sort of 151,936 logits took 18 ms a
    row, 147 ms of a batch of 8's step beside a forward pass of about 400 ms on the CPU."""
    sorted_sizes = []
    lexsort, argsort = np.lexsort, np.argsort
    monkeypatch.setattr(np, "lexsort", lambda keys, *a, **k: sorted_sizes.append(len(keys[0])) or lexsort(keys, *a, **k))
    monkeypatch.setattr(np, "argsort", lambda x, *a, **k: sorted_sizes.append(len(x)) or argsort(x, *a, **k))
    logits = np.random.default_rng(0).standard_normal((2, 151936)).astype(np.float32)
    ones = np.ones(2, np.float32)
    npops.sample(logits, ones * 0.6, np.full(2, 20, np.int32), ones * 0.95, ones * 0, ones * 0.5)
    assert sorted_sizes and max(sorted_sizes) <= 20
