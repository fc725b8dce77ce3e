"""Many engines in one process on the GPU: each runs mixed loads, shuts down, and gives its memory
back, so the next one sizes the same KV pool. Catches use-after-free across engines and streams."""
import gc

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from gpu_support import HAS_GPU
if not HAS_GPU:
    pytest.skip("no CUDA GPU", allow_module_level=True)

from minillm import LLM, SamplingParams  # noqa: E402
from minillm.benchmarks.workload import write_random_model_dir  # noqa: E402

ENGINE_ARGS = dict(device="cuda", dtype="bfloat16", load_format="dummy", gpu_memory_utilization=0.15,
                   max_model_len=20000, max_num_seqs=128, max_num_batched_tokens=4096)


def ids(rng, n):
    return rng.integers(10, 150000, size=n).tolist()


def run_until_done(engine, max_steps=20000):
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError("the engine did not finish")


def decoders_then_long_prompt_then_abort(engine, rng):
    """128 decoders; a 16,000-token prompt arrives; everything is aborted mid-flight."""
    decode = SamplingParams(temperature=0.8, max_tokens=400, ignore_eos=True, seed=1)
    for i in range(128):
        engine.add_request(f"d{i}", ids(rng, 64 + i), decode)
    for _ in range(20):
        engine.step()
    engine.add_request("long", ids(rng, 16000), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(6):                              # the long prompt is part-way through its chunks
        engine.step()
    for rid in [f"d{i}" for i in range(128)] + ["long"]:
        engine.abort_request(rid)
    run_until_done(engine)


def shared_prefix(engine, rng):
    """64 requests sharing a 4,000-token prefix: prefix-cache hits, then a chunked long prompt."""
    prefix = ids(rng, 4000)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for i in range(64):
        engine.add_request(f"p{i}", prefix + ids(rng, 10 + i), greedy)
    run_until_done(engine)
    assert engine.stats().prefix_cache_hits > 0


def preemption(engine, rng):
    """Prompts that together fill the pool, then grow while decoding: preemption by recompute,
    then all free."""
    bs = engine.config.block_size
    capacity = engine.block_manager.num_blocks * bs
    num_prompts = max(8, capacity // (engine.max_model_len - 300) + 2)
    prompt_len = capacity // num_prompts - 2 * bs       # every prompt fits; the pool is left 2 blocks a prompt
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    for i in range(num_prompts):
        engine.add_request(f"q{i}", ids(rng, prompt_len), params)
    run_until_done(engine)
    assert engine.scheduler.num_preemptions > 0


SCENARIOS = (decoders_then_long_prompt_then_abort, shared_prefix, preemption)


def test_six_engines_in_one_process_size_the_same_pool_and_never_fault(tmp_path):
    model_dir = str(write_random_model_dir(tmp_path / "qwen3-0.6b-random"))
    pool_sizes = []
    for i in range(6):
        rng = np.random.default_rng(i)
        llm = LLM(model_dir, seed=i, **ENGINE_ARGS)
        engine = llm.engine
        assert engine.async_scheduling and engine.runner.graphs is not None
        pool_sizes.append(engine.block_manager.num_blocks)
        for scenario in SCENARIOS[i % 3:] + SCENARIOS[:i % 3]:
            scenario(engine, rng)
            assert engine.block_manager.num_used_blocks == 0
        if i % 2:
            llm.shutdown()                          # explicit
        del llm, engine                             # even ones: dropping the last reference releases
        gc.collect()
    # The first engine sizes its pool before the process holds anything of CUDA's that outlives an
    # engine, so it may get up to 2 % more (seen on the H200: 9,756 against 9,644 blocks, then 9,644
    # five times). The one-time state is most likely the kernels loaded on their first launch, which
    # stay loaded (the start-up pass of the head's GEMM at every row count loads cuBLAS's); not
    # measured. From the second engine on, a leak would shrink each pool after the one before.
    later = pool_sizes[1:]
    assert max(later) <= min(later) * 1.01, pool_sizes
    assert min(later) <= pool_sizes[0] <= min(later) * 1.02, pool_sizes
