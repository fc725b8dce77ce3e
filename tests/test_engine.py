"""The engine end to end on stories260K: batching changes nothing; bad input is a clear error."""
import json

import numpy as np

import pytest

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(stories_path):
    """32 token-id prompts of different lengths; half share a 40-token prefix."""
    golden = json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]
    out = []
    for i in range(32):
        if i % 2:
            out.append(golden[:40] + golden[100 + i: 100 + i + 1 + i % 7])
        else:
            out.append([1] + golden[1 + i * 3: 1 + i * 3 + 3 + i])
    return out


@pytest.fixture(scope="module")
def alone(stories_path, prompts):
    llm = LLM(str(stories_path), device="cpu", enable_prefix_caching=False)
    return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]


def run_together(path, prompts, **kw):
    llm = LLM(str(path), device="cpu", **kw)
    outs = llm.generate(prompts, GREEDY)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_batch_equals_alone(stories_path, prompts, alone, async_scheduling):
    _, together = run_together(stories_path, prompts, async_scheduling=async_scheduling)
    assert together == alone


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_batch_equals_alone_under_preemption(stories_path, prompts, alone, async_scheduling):
    llm, together = run_together(stories_path, prompts, num_kv_blocks=24, block_size=4, max_model_len=96,
                                 async_scheduling=async_scheduling)
    assert llm.engine.scheduler.num_preemptions > 0
    assert together == alone
    assert llm.engine.block_manager.num_free_blocks == 24


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_batch_equals_alone_with_chunked_prefill(stories_path, prompts, alone, async_scheduling):
    llm, together = run_together(stories_path, prompts, max_num_batched_tokens=16, max_num_seqs=8,
                                 async_scheduling=async_scheduling)
    assert max(len(p) for p in prompts) > 16            # some prompts had to be split
    steps = llm.engine.metrics.recent_steps
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= 16 for s in steps)
    assert together == alone


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_batch_equals_alone_with_prefix_cache_hits(stories_path, prompts, alone, async_scheduling):
    llm, together = run_together(stories_path, prompts, max_num_seqs=4, async_scheduling=async_scheduling)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_queries > stats.prefix_cache_hits
    assert together == alone


def test_outputs_carry_text_reason_and_metrics(stories_path):
    llm = LLM(str(stories_path), device="cpu")
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=8))[0]
    c = out.outputs[0]
    assert out.prompt_token_ids == [1, 403, 407, 261, 378]
    assert c.finish_reason == "length" and len(c.token_ids) == 8
    assert c.text == llm.get_tokenizer().decode(c.token_ids)
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_any_of_several_eos_ids_finishes_with_stop(eos_model_path):
    """As vLLM's update_from_generation_config: the EOS ids beyond the tokenizer's own are stop token
    ids, so the one that ends a completion is its stop_reason (the tokenizer's own gives None)."""
    llm = LLM(str(eos_model_path), device="cpu")
    assert set(llm.engine.eos_token_ids) == {1, 2} and llm.get_tokenizer().eos_token_id == 2
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=450))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == 1 and out.stop_reason == 1
    assert "<s>" not in out.text and out.text == llm.get_tokenizer().decode(out.token_ids[:-1])
    params = SamplingParams(temperature=0, max_tokens=4, logit_bias={2: 100.0}, stop_token_ids=[300])
    own = llm.generate(["Once upon a time"], params)[0].outputs[0]
    assert own.token_ids == [2] and own.finish_reason == "stop" and own.stop_reason is None
    assert params.stop_token_ids == [300]                       # the caller's params are left as given
    assert 1 not in out.token_ids[:-1]
    ignored = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=450,
                                                                ignore_eos=True))[0].outputs[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 450


def test_abort_frees_blocks_and_reports(stories_path):
    engine = LLMEngine(EngineConfig(model=str(stories_path), device="cpu"))
    engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", "Lily went", SamplingParams(temperature=0, max_tokens=5))
    engine.step()
    engine.abort_request("a")
    assert engine.block_manager.num_used_blocks < engine.block_manager.num_blocks
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a"].finished and outs["a"].outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_used_blocks == 0


def test_stats_snapshot(stories_path):
    engine = LLMEngine(EngineConfig(model=str(stories_path), device="cpu", num_kv_blocks=100))
    engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    engine.step()
    s = engine.stats(cells=100)
    assert s.num_running == 1 and s.kv_num_blocks == 100 and s.kv_num_used_blocks == 1
    assert s.block_map_blocks_per_cell == 1 and s.block_map.count(0) == 1 and s.block_map.count(-1) == 99
    assert len(engine.stats(cells=10).block_map) == 10
    assert s.requests[0].request_id == "a" and s.requests[0].output_tokens == 2
    assert s.recent_steps[-1].num_decode_tokens == 1 and s.memory.kv_pool_bytes > 0
    json.dumps(s.to_dict())


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_k=-5), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(n=0), "n"),
    (dict(n=10**20), "n"),                               # built sequences until the process was killed
    (dict(temperature=10**400), "temperature"),          # past float's range: a ValueError, not an OverflowError
    (dict(logit_bias={5: "high"}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={True: 1.0}), "logit_bias"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"),
    (dict(logit_bias=[5]), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(1025)}), "logit_bias"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_name_the_problem(stories_path):
    engine = LLMEngine(EngineConfig(model=str(stories_path), device="cpu", max_model_len=64))
    with pytest.raises(ValueError, match="prompt"):      # "" without BOS: no tokens ("" alone is BOS, as in vLLM)
        engine.add_request("e", "", SamplingParams(), tokenization_kwargs={"add_special_tokens": False})
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("e", [], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", [1] * 65, SamplingParams())
    engine.add_request("sum", [1] * 60, SamplingParams(max_tokens=10))   # capped by the context, as in vLLM
    with pytest.raises(ValueError, match="prompt token ids"):
        engine.add_request("v", [1, 100000], SamplingParams())
    engine.add_request("ok", "Once", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("ok", "Once", SamplingParams(max_tokens=2))
    done = {}
    for bad_id in (None, 7, ["x"]):
        with pytest.raises(ValueError, match="request_id"):
            engine.add_request(bad_id, "Once", SamplingParams(max_tokens=2))
    for bad_time in ("now", float("nan"), float("inf"), True):   # the loop subtracts it from clock times
        with pytest.raises(ValueError, match="arrival_time"):
            engine.add_request("t", "Once", SamplingParams(max_tokens=2), arrival_time=bad_time)
    engine.abort_request(["x"])                    # an id that cannot be known is as unknown as any other
    while engine.has_unfinished_requests():        # the good request is untouched
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.block_manager.num_used_blocks == 0
    assert len(done["sum"].outputs[0].token_ids) == 4 and done["sum"].outputs[0].finish_reason == "length"
    assert len(done["ok"].outputs[0].token_ids) == 2


def test_block_map_downsampling_keeps_the_commonest_state():
    from minillm.engine_stats import downsample_block_map
    states = np.array([0, 0, 1, -1, -1, -1, -2, -2, -2, 3], dtype=np.int64)
    cells, per = downsample_block_map(states, 4)
    assert per == 3 and cells == [0, -1, -2, 3]
    big, per = downsample_block_map(np.full(100_000, -1, dtype=np.int64), 500)
    assert len(big) == 500 and per == 200


def test_token_utilization_counts_shared_blocks_once(stories_path):
    engine = LLMEngine(EngineConfig(model=str(stories_path), device="cpu", num_kv_blocks=64, block_size=4))
    prompt = list(range(3, 40))
    engine.add_request("first", prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    engine.add_request("second", prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    s = engine.stats(cells=64)
    assert s.prefix_cache_hits > 0
    assert 0.0 < s.kv_token_utilization <= 1.0


def test_a_mixed_step_describes_its_chunks_and_uploads_one_array(stories_path, prompts):
    """A step of decodes beside a new prompt: the decode rows first, the chunk's own context apart
    from the decodes' (the GPU's prefill kernel sizes its key splits by it), and the metadata on
    the device as views of one upload equal to the host arrays."""
    engine = LLMEngine(EngineConfig(model=str(stories_path), device="cpu", async_scheduling=False))
    runner, seen = engine.runner, []
    to_device = runner._to_device

    def spy(meta):
        dev = to_device(meta)
        seen.append((meta, dev))
        return dev

    runner._to_device = spy
    for i in range(3):
        engine.add_request(f"d{i}", prompts[2 * i + 1], GREEDY)       # 41-47 tokens each
    while not seen or engine.scheduler.num_waiting:
        engine.step()
    for _ in range(5):
        engine.step()                                                 # decoding, contexts near 50
    seen.clear()
    engine.add_request("new", prompts[0][:4], GREEDY)
    engine.step()
    meta, dev = seen[-1]
    assert meta.num_decode_seqs == 3 and not meta.is_decode_only
    assert meta.prefill_max_seq_len == 4 < meta.max_seq_len
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        host, view = getattr(meta, name), getattr(dev, name)
        assert view.shape == host.shape and np.array_equal(view, host), name
    base = dev.query_start_loc.base
    assert base is not None and all(getattr(dev, n).base is base for n in ("seq_lens", "slot_mapping"))
    engine.shutdown()


def test_device_cuda_without_a_usable_gpu_says_what_is_missing(stories_path):
    """No CuPy, or CuPy without a GPU: a ValueError naming the device and what to install or
    check, before anything is loaded (was CuPy's bare ImportError)."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("a GPU is here")
    except Exception:              # no CuPy, or CuPy without a driver: the cases under test
        pass
    with pytest.raises(ValueError, match=r"device 'cuda'.*(CuPy|GPU)"):
        LLMEngine(EngineConfig(model=str(stories_path), device="cuda"))
