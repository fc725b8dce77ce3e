"""The step-time budget on the GPU: calibration through the CUDA runner (graphs for decode, eager
prefill) gives a usable model, and chunk sizes change while the greedy tokens do not."""
import json

import numpy as np
import pytest

from minillm import LLM, SamplingParams

from gpu_support import HAS_GPU

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def prompts(stories_path):
    golden = json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]
    short = [[1] + golden[1 + i: 1 + i + 3 + i % 11] for i in range(12)]
    return short + [(golden * 3)[:400]] + short[:4]


@pytest.mark.parametrize("max_step_ms", [1e-3, 50.0])
def test_gpu_step_budget_keeps_the_cpu_tokens(stories_path, max_step_ms):
    ps = prompts(stories_path)
    cpu = [o.outputs[0].token_ids for o in LLM(str(stories_path), device="cpu").generate(ps, GREEDY)]
    llm = LLM(str(stories_path), device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=16,
              max_num_batched_tokens=64, max_step_ms=max_step_ms)
    model = llm.engine.scheduler.step_cost
    assert np.all(model.coefficients >= 0) and model.coefficients[0] > 0
    assert np.all(model.anchor_y > 0) and len(model.anchor_y) >= 16
    gpu = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY)]
    assert gpu == cpu
    steps = list(llm.engine.metrics.recent_steps)
    assert all(s.device_step_s is not None and s.device_step_s > 0 for s in steps)
    if max_step_ms < 1:                    # no step fits: the long prompt moves a block at a time
        assert all(s.num_prefill_tokens <= 16 for s in steps if s.num_decode_tokens and s.num_prefill_tokens)
    stats = llm.engine.stats()
    assert stats.step_measured_ms > 0 and stats.step_cost_num_refits >= 1
    llm.shutdown()
