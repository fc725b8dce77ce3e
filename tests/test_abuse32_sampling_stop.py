"""SamplingParams.stop is a list, as vLLM's __post_init__ makes it: [] when left out, [s] for one
string. It kept None and the bare string: `params.stop.append(...)` failed on None, and `"x" in
params.stop` tested for a substring of the one stop string."""
from __future__ import annotations

from minillm.sampling_params import SamplingParams


def test_stop_is_always_a_list():
    assert SamplingParams().stop == []
    assert SamplingParams(stop="the end").stop == ["the end"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams.from_fields({}).stop == []
    assert "the" not in SamplingParams(stop="the end").stop


def test_a_stop_appended_after_construction_is_used_once_validated():
    params = SamplingParams()
    params.stop.append("\n")
    params.validate()          # as add_request validates it
    assert params.stop_strings == ["\n"]
