"""The two seeds minillm takes, each with vLLM's range: the engine's and a request's.

The engine seed (LLM(seed=...), serve's and the benchmarks' --seed) seeds the seeds of requests that
bring none, dummy weights and the benchmarks' prompts. vLLM hands it to Python's random, NumPy's
global generator and torch (Platform.seed_everything), and np.random.seed takes [0, 2**32 - 1]
only, so any other value stops vLLM's workers at start-up. A request's seed (SamplingParams.seed,
generate's and chat's --seed) is a signed 64-bit integer, vLLM's server bound, -1 meaning none.
"""
from __future__ import annotations

import numbers

MIN_ENGINE_SEED, MAX_ENGINE_SEED = 0, 2**32 - 1
MIN_SEED, MAX_SEED = -2**63, 2**63 - 1
ENGINE_SEED_RANGE = "an integer in [0, 2**32 - 1]"
REQUEST_SEED_RANGE = "an integer in [-2**63, 2**63 - 1] (-1: no seed)"


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_engine_seed(value) -> bool:
    """True when VALUE is an integer vLLM takes as its engine seed."""
    return _is_int(value) and MIN_ENGINE_SEED <= value <= MAX_ENGINE_SEED


def is_request_seed(value) -> bool:
    """True when VALUE is an integer vLLM takes as SamplingParams.seed (-1 among them: no seed)."""
    return _is_int(value) and MIN_SEED <= value <= MAX_SEED


def check_engine_seed(value, name: str = "seed") -> int:
    """VALUE as a Python int; a ValueError naming NAME when it is no engine seed."""
    if not is_engine_seed(value):
        from minillm.sampling_params import short_repr
        raise ValueError(f"{name} must be {ENGINE_SEED_RANGE}, got {short_repr(value)}")
    return int(value)
