"""The engine core's add path, made cheaper, refuses and accepts exactly what it did: its params are
validated once (by their constructor) and not copied, while LLMEngine.add_request still validates
and copies a caller's own SamplingParams; every field is still refused with the same message."""
from __future__ import annotations

import math
import time

import pytest

from minillm.config import EngineConfig
from minillm.engine_core import messages as m
from minillm.engine_core.core import SAMPLING_FIELDS, EngineCore, sampling_fields
from minillm.sampling_params import RequestOutputKind, SamplingParams

# One bad value per check of SamplingParams.validate (and of the engine's vocabulary and
# max_logprobs checks, which run on both paths), as (field, value).
BAD_FIELDS = [
    ("n", 0), ("n", 1.5), ("temperature", -1.0), ("temperature", "hot"), ("temperature", math.inf),
    ("temperature", 1e39), ("top_p", 0.0), ("top_k", -2), ("top_k", 2.0), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", 1e-39), ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0), ("max_tokens", 0), ("max_tokens", "many"), ("min_tokens", -1),
    ("min_tokens", 100), ("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 2.0),
    ("seed", 2**63), ("seed", "s"), ("ignore_eos", 1), ("skip_special_tokens", None), ("detokenize", "no"),
    ("include_stop_str_in_output", 0), ("spaces_between_special_tokens", "x"),
    ("stop", 5), ("stop", [""]), ("stop", ["ok", 3]), ("stop_token_ids", 7), ("stop_token_ids", [-1]),
    ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2), ("extra_args", [1]),
    ("output_kind", 3), ("output_kind", "delta"), ("logit_bias", [1]), ("logit_bias", {1: float("nan")}),
    ("logit_bias", {-1: 1.0}), ("allowed_token_ids", []), ("allowed_token_ids", [-5]),
    ("bad_words", "word"), ("bad_words", ["a"] * 129), ("structured_outputs", 5),
    # checked where the vocabulary and the engine's limits are known (a top_k past it is all of it)
    ("stop_token_ids", [10**6]), ("logit_bias", {10**6: 1.0}), ("allowed_token_ids", [10**6]),
]


@pytest.fixture(scope="module")
def core(stories_path):
    return EngineCore(EngineConfig(model=str(stories_path), device="cpu", max_logprobs=5), log=lambda _: None)


def _add(core: EngineCore, request_id: str, fields: dict, prompt=None, arrival_time=None, keys=None) -> str | None:
    """Add a request through the wire, as an API server sends it; the core's answer."""
    raw = m.encoder().encode(m.AddRequest(request_id, prompt if prompt is not None else [1, 2, 3], fields,
                                          time.time() if arrival_time is None else arrival_time, 0, keys))
    return core.add_request(m.down_decoder().decode(raw))


def _fields(**changes) -> dict:
    params = SamplingParams(max_tokens=4)
    return {**{name: getattr(params, name) for name in SAMPLING_FIELDS}, **changes}


def _engine_error(core: EngineCore, request_id: str, name: str, value) -> str:
    """LLMEngine.add_request's message for a caller's own params changed to the bad value after construction."""
    params = SamplingParams(max_tokens=4)
    setattr(params, name, value)
    with pytest.raises(ValueError) as info:
        core.engine.add_request(request_id, [1, 2, 3], params)
    return str(info.value)


@pytest.mark.parametrize("name, value", BAD_FIELDS, ids=[f"{n}={str(v)[:12]}" for n, v in BAD_FIELDS])
def test_each_bad_field_is_refused_by_both_paths_with_one_message(core, name, value):
    error = _add(core, f"core-{name}", _fields(**{name: value}))
    assert error is not None and error.startswith(name), error
    assert error == _engine_error(core, f"api-{name}", name, value)
    assert f"core-{name}" not in core.engine.requests and f"api-{name}" not in core.engine.requests


def test_logprobs_past_max_logprobs_are_refused_on_both_paths(core):
    error = _add(core, "core-many-logprobs", _fields(logprobs=6))
    assert error == "logprobs must be at most max_logprobs (5), got 6"
    assert error == _engine_error(core, "api-many-logprobs", "logprobs", 6)


def test_the_core_refuses_what_the_engine_refuses_besides_params(core):
    assert _add(core, "nan-time", _fields(), arrival_time=math.nan) == \
        "arrival_time must be a finite number of seconds, got nan"
    assert _add(core, "empty", _fields(), prompt=[]) == \
        "prompt must be a non-empty string or a non-empty list of token ids"
    assert _add(core, "twice", _fields()) is None
    assert _add(core, "twice", _fields()) == "request_id 'twice' is already in use"
    core.engine.abort_request("twice")
    core.step()


def test_core_params_are_validated_and_kept_without_a_copy(core):
    """The core's params come normalized by their constructor (as validate() leaves them) and are
    the sequences' own: no copy is needed, none is made."""
    fields = _fields(seed=-1, logprobs=True, stop="end", stop_token_ids=(9,), output_kind=0, n=2, temperature=0.5)
    assert _add(core, "normalized", fields) is None
    seqs = core.engine.requests["normalized"].seqs
    params = seqs[0].params
    assert params is seqs[1].params
    assert params.seed is None and params.logprobs == 1 and params.stop_strings == ["end"]
    assert params.output_kind is RequestOutputKind.CUMULATIVE   # msgpack carried its value
    assert 9 in params.stop_token_ids and isinstance(params.stop_token_ids, list)
    core.engine.abort_request("normalized")
    core.step()


def test_a_callers_params_are_still_validated_and_copied(core):
    """LLMEngine.add_request: params changed after construction are validated again, and the
    request keeps its own copy, so the caller's later changes do not reach it."""
    params = SamplingParams(max_tokens=4, stop=["x"])
    params.temperature = -0.5
    with pytest.raises(ValueError, match="temperature must be non-negative"):
        core.engine.add_request("mutated", [1, 2, 3], params)
    params.temperature = 0.0
    core.engine.add_request("copied", [1, 2, 3], params)
    own = core.engine.requests["copied"].seqs[0].params
    params.stop.append("y")
    params.max_tokens = 9
    assert own is not params and own.stop == ["x"] and own.max_tokens == 4
    core.engine.abort_request("copied")
    core.step()


def test_sampling_fields_leaves_out_unknown_names_and_leaves_its_input_alone():
    fields = _fields(temperature=0.25)
    assert sampling_fields(fields) == fields and sampling_fields(fields) is not fields
    extra = {**fields, "not_a_field": 1, "best_of": 3}
    assert sampling_fields(extra) == fields
    assert "not_a_field" in extra and "best_of" in extra


def test_the_pools_snapshot_lists_the_cached_free_blocks_as_they_change():
    """The cached-free flags (a bytearray the admission sets a block at a time) read as the
    snapshot's int64 ids of exactly the free blocks that keep a key."""
    import numpy as np

    from minillm.block_manager import BlockManager
    from minillm.sequence import Sequence

    bm = BlockManager(16, 4)

    def seq(tokens, name):
        return Sequence(name, 0, list(tokens), SamplingParams(), 0.0, 0, 8)

    def cached_free():
        return {b for b in bm.free_queue if bm.block_keys[b] is not None}

    a = seq(range(13), "a")
    assert bm.allocate(a, [], 13)
    a.num_computed_tokens = 13
    bm.cache_full_blocks(a)
    bm.free(a)
    snap = bm.snapshot()
    assert snap.cached_free_block_ids.dtype == np.int64
    assert set(snap.cached_free_block_ids.tolist()) == cached_free() and len(cached_free()) == 3
    b = seq(range(13), "b")
    hits = bm.find_cached_blocks(b)
    assert len(hits) == 3 and bm.allocate(b, hits, 1)        # all three back in use
    assert bm.snapshot().cached_free_block_ids.tolist() == [] and bm.num_cached_free_blocks == 0
    bm.free(b)
    assert set(bm.snapshot().cached_free_block_ids.tolist()) == cached_free() and bm.num_cached_free_blocks == 3
    bm.reset_prefix_cache()
    assert bm.snapshot().cached_free_block_ids.tolist() == [] and bm.num_cached_free_blocks == 0


def test_from_fields_builds_what_the_constructor_builds():
    """SamplingParams.from_fields (the core's constructor) gives the instance SamplingParams(**fields)
    gives, normalized and with containers of its own, and refuses a name that is no field."""
    from minillm.sampling_params import SamplingParams as SP
    cases = [{}, _fields(), _fields(seed=-1, logprobs=True, stop="x", stop_token_ids=(3, 4), output_kind=2, n=3,
                                    temperature=0, logit_bias={5: 1.5}, allowed_token_ids=[9, 2, 9],
                                    bad_words=["no"], extra_args={"k": 1}, truncate_prompt_tokens=-1)]
    for fields in cases:
        built, constructed = SP.from_fields(dict(fields)), SP(**fields)
        assert built == constructed and vars(built).keys() == vars(constructed).keys()
        assert built._logit_bias_entries == constructed._logit_bias_entries
        assert (built._allowed_entries is None) == (constructed._allowed_entries is None)
    a, b = SP.from_fields({}), SP.from_fields({})
    assert a.stop_strings == [] and a.stop_strings is not b.stop_strings
    with pytest.raises(TypeError, match="best_of"):
        SP.from_fields({"best_of": 1})
    with pytest.raises(ValueError, match="^temperature must be non-negative"):
        SP.from_fields({"temperature": -1})


@pytest.mark.parametrize("kind", [0, 1, 2], ids=["cumulative", "delta", "final_only"])
def test_every_output_kind_through_the_core_reports_the_requests_tokens(core, kind):
    # DELTA failed the core's step: the engine's delta filter read token_ids from the core's SeqOutputs.
    assert _add(core, f"kind-{kind}", _fields(output_kind=kind, temperature=0, max_tokens=6, ignore_eos=True)) is None
    tokens, finished = [], False
    while not finished:
        for out in core.step().outputs:
            if out.request_id == f"kind-{kind}":
                tokens += out.seqs[0].new_token_ids
                finished = out.finished
    assert len(tokens) == 6
