"""The offline API as vLLM scripts drive it on stories260K, with inputs earlier tests did not send:
SamplingParams built from NumPy values, and what must then travel to an engine core."""
import time

import numpy as np
import pytest

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.engine_core import messages as m
from minillm.engine_core.core import SAMPLING_FIELDS, EngineCore


@pytest.fixture(scope="module")
def engine(stories_path):
    """One stories260K engine on the CPU for the module."""
    with LLMEngine(EngineConfig(model=str(stories_path), device="cpu"), log=lambda _: None) as engine:
        yield engine


@pytest.fixture(scope="module")
def core(stories_path):
    """An engine core in this process, fed through its wire format as an API server feeds it."""
    core = EngineCore(EngineConfig(model=str(stories_path), device="cpu"), log=lambda _: None)
    yield core
    core.engine.shutdown()


def run_engine(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    """The token ids LLMEngine generates for one request."""
    engine.add_request("local", prompt, params, output_kind="final")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    [out] = outputs
    return list(out.outputs[0].token_ids)


def run_core(core: EngineCore, prompt: list[int], params: SamplingParams) -> list[int]:
    """The token ids an engine core generates for one request sent over its wire (msgpack), as
    AsyncLLM sends it: the fields of the caller's validated params."""
    fields = {name: getattr(params, name) for name in SAMPLING_FIELDS}
    raw = m.encoder().encode(m.AddRequest("wire", prompt, fields, time.time()))
    assert core.add_request(m.down_decoder().decode(raw)) is None
    ids = []
    while core.engine.has_unfinished_requests():
        for out in core.step().outputs:
            ids += out.seqs[0].new_token_ids
    return ids


# Each field given as NumPy values, as a script computing them with NumPy (or reading them from a
# pandas frame) passes them.
NUMPY_FIELDS = {
    "stop_token_ids": lambda: dict(stop_token_ids=list(np.array([426, 13])), ignore_eos=True),
    "allowed_token_ids": lambda: dict(allowed_token_ids=list(np.arange(300, 420))),
    "logit_bias": lambda: dict(logit_bias={np.int64(261): np.float32(5.0), np.int32(426): np.float64(-50.0)}),
    "stop": lambda: dict(stop=list(np.array(["girl", "park"]))),
    "stop as one string": lambda: dict(stop=np.str_("girl")),
    "bad_words": lambda: dict(bad_words=list(np.array([" little", " girl"]))),
}


@pytest.mark.parametrize("name", NUMPY_FIELDS)
def test_numpy_values_in_sampling_params_reach_an_engine_core(engine, core, name):
    # SamplingParams took NumPy integers, floats and strings in its list and dict fields and kept
    # them: LLMEngine ran them, but AsyncLLM (the server's --engine-core process, and any script
    # that drives it) refused the request, "Encoding objects of type int64 is unsupported", since
    # msgpack carries Python's own types only. The scalar fields were already made Python numbers.
    prompt = [1, 403, 407, 261, 378]            # "Once upon a time"
    params = SamplingParams(temperature=0, max_tokens=24, **NUMPY_FIELDS[name]())
    want = run_engine(engine, prompt, params)
    got = run_core(core, prompt, params)
    if params.stop:       # an engine core leaves stop strings to the API server: it generates on past them
        got = got[:len(want)]
    assert got == want
    for value in (params.stop_token_ids, params.allowed_token_ids or [], params.bad_words or [],
                  params.stop if isinstance(params.stop, list) else [params.stop] if params.stop else []):
        assert all(type(v) in (int, str) for v in value)
    assert all(type(k) is int and type(v) is float for k, v in (params.logit_bias or {}).items())


def test_an_arrival_time_in_the_future_counts_from_the_add(engine):
    # A request cannot arrive after it is added: a future arrival_time made its time to first token
    # about -1e6 s, in its own metrics and in the engine's TTFT percentiles.
    before = time.time()
    engine.add_request("future", [1, 403], SamplingParams(max_tokens=3), arrival_time=before + 1e6)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    metrics = outputs[-1].metrics
    assert before <= metrics.arrival_time <= time.time()
    assert metrics.ttft is not None and metrics.ttft >= 0
    assert engine.stats().ttft_p50_s >= 0


def test_reset_prefix_cache_after_shutdown_says_the_engine_is_shut_down(stories_path):
    # It returned True, as if a cache that no longer exists had been reset.
    llm = LLM(str(stories_path), device="cpu")
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.reset_prefix_cache()


def test_a_bad_prompt_among_several_is_named_by_its_place(stories_path):
    # "prompt has 4002 tokens, which leaves no room under max_model_len 512" did not say which of
    # the batch's prompts it was; nothing of the batch runs either way.
    with LLM(str(stories_path), device="cpu") as llm:
        with pytest.raises(ValueError, match=r"^prompt 2 of 3: prompt has \d+ tokens"):
            llm.generate(["Tom", "Tom ran " * 1000, "Lily"], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match=r"^prompt has \d+ tokens"):        # one prompt: as it was
            llm.generate("Tom ran " * 1000, SamplingParams(max_tokens=2))
        assert [o.outputs[0].token_ids for o in llm.generate(["Tom"], SamplingParams(max_tokens=2))]


@pytest.mark.parametrize("value", ["", " "])
def test_an_empty_download_dir_is_named(stories_path, value):
    # "" meant the Hugging Face cache and " " a folder named " " here, as the CLI refuses both.
    with pytest.raises(ValueError, match="download_dir is (empty|blank)"):
        EngineConfig(model=str(stories_path), device="cpu", download_dir=value)
