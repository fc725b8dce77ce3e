"""EngineConfig's switches take NumPy's True and False as Python's, as SamplingParams does; other
values are still refused naming the field."""
from __future__ import annotations

import numpy as np
import pytest

from minillm.config import EngineConfig

SWITCHES = ("enable_prefix_caching", "enforce_eager", "async_scheduling", "calculate_kv_scales", "grammar_process")


@pytest.mark.parametrize("name", SWITCHES)
@pytest.mark.parametrize("value", [np.True_, np.False_])
def test_a_numpy_bool_is_taken_as_a_bool(name, value):
    # It was refused: "enable_prefix_caching must be true or false, got np.True_".
    config = EngineConfig(model="m", **{name: value})
    assert getattr(config, name) is bool(value)


@pytest.mark.parametrize("value", [1, "yes", np.int64(1), np.array([True])])
def test_anything_else_is_still_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="^enforce_eager must be true or false"):
        EngineConfig(model="m", enforce_eager=value)
