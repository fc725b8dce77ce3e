"""The NumPy sampler's top-p without top-k: only the tokens that can be in the nucleus are sorted, and
each token is picked for the same share of uniforms as by a sort of the whole vocabulary (the same
distribution; the uniforms at the very ends of a share may go to its neighbour, as float32 sums of
the sort's rule put them)."""
import numpy as np
import pytest

from minillm.ops import numpy as npops


def reference_shares(row, temperature, top_p, min_p) -> tuple[np.ndarray, np.ndarray]:
    """(the ids a sort of the whole vocabulary keeps, in its order; the upper end of each one's share
    of [0, 1)): the uniforms a token is picked for by full_sort_sample's rule, summed in float64 (in
    float32 a nucleus of thousands of tokens drifts by more than a token's share)."""
    order = np.lexsort((np.arange(len(row)), -row))
    x = row[order] / np.float32(temperature)
    p = np.exp(x - x[0]).astype(np.float64)
    p /= p.sum()
    keep = np.ones(len(row), dtype=bool)
    if min_p > 0.0:
        keep &= p >= np.float32(min_p) * p[0]
    keep &= np.cumsum(p) - p < float(np.float32(top_p)) * p[keep].sum()
    keep[0] = True
    cdf = np.cumsum(np.where(keep, p, 0.0))
    return order[keep], cdf[keep] / cdf[-1]


def sample_rows(row, temperature, top_k, top_p, min_p, uniforms) -> list[int]:
    n = len(uniforms)
    return npops.sample(np.repeat(row[None], n, axis=0), np.full(n, temperature, np.float32),
                        np.full(n, top_k, np.int32), np.full(n, top_p, np.float32), np.full(n, min_p, np.float32),
                        np.asarray(uniforms, np.float32)).tolist()


def rows(seed: int, vocab: int) -> np.ndarray:
    """Logits as a model's: a few likely tokens over a long tail; a grammar's mask and ties on some;
    and a row of equal logits, whose nucleus is as wide as top_p makes it."""
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((4, vocab)) * 2.5).astype(np.float32)
    logits[1, rng.random(vocab) < 0.4] = -np.inf
    logits[2, rng.integers(0, vocab, 50)] = logits[2].max()                 # 50 ties with the likeliest
    logits[3] = 0.0
    return logits


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("temperature, top_p, min_p, top_k", [
    (0.7, 0.9, 0.0, 0), (1.0, 0.95, 0.0, 0), (1.6, 0.99, 0.0, 0), (1.0, 0.8, 0.01, 0), (1.3, 0.97, 0.0, 9973),
    (1.0, 0.5, 0.0, -1),
])
def test_each_kept_token_is_picked_for_its_share_as_by_a_sort_of_the_whole_vocabulary(seed, temperature, top_p,
                                                                                     min_p, top_k):
    vocab = 9973            # no top_p here lands the nucleus of the equal logits on a whole token
    for row in rows(seed, vocab):
        ids, upper = reference_shares(row, temperature, top_p, min_p)
        lower = np.concatenate([[0.0], upper[:-1]])
        # The middle of each share wide enough to stand clear of float rounding at its ends (at most
        # 120 of them, the first and last kept among them), then uniforms drawn at random.
        wide = np.flatnonzero(upper - lower > 1e-5)
        chosen = np.unique(np.concatenate([wide[np.linspace(0, len(wide) - 1, min(len(wide), 120)).astype(int)],
                                           [wide[0], wide[-1]]]))
        middles = (lower[chosen] + upper[chosen]) / 2
        assert sample_rows(row, temperature, top_k, top_p, min_p, middles) == ids[chosen].tolist()


def test_top_p_alone_does_not_sort_the_whole_vocabulary(monkeypatch):
    """vLLM's default top_p with no top_k sorted all 151,936 logits of Qwen3's vocabulary a row: 443 ms
    of sampling for a batch of 8 on a 2-core CPU (18 ms with neither, 35 ms with top_k 50)."""
    sorted_sizes = []
    lexsort, argsort = np.lexsort, np.argsort
    monkeypatch.setattr(np, "lexsort", lambda keys, *a, **k: sorted_sizes.append(len(keys[0])) or lexsort(keys, *a, **k))
    monkeypatch.setattr(np, "argsort", lambda x, *a, **k: sorted_sizes.append(len(x)) or argsort(x, *a, **k))
    vocab = 151936
    logits = (np.random.default_rng(0).standard_normal((8, vocab)) * 2.5).astype(np.float32)
    ones = np.ones(8, np.float32)
    npops.sample(logits, ones * 0.7, np.zeros(8, np.int32), ones * 0.9, ones * 0, ones * 0.5)
    assert sorted_sizes and max(sorted_sizes) < vocab // 8
