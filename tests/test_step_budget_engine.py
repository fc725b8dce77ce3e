"""The step-time budget in the engine on stories260K: chunk sizes change, outputs do not; the
stats carry the budget and the estimated and measured step times."""
import json
import math

import pytest

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ENGINE = dict(device="cpu", max_num_seqs=8, max_num_batched_tokens=64, block_size=16)


@pytest.fixture(scope="module")
def prompts(stories_path):
    """Twelve short prompts and two long ones (300 and 400 tokens) that arrive among them."""
    golden = json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]
    short = [[1] + golden[1 + i * 3: 1 + i * 3 + 3 + i] for i in range(12)]
    long = [(golden * 3)[:300], (golden[5:] * 3)[:400]]
    return short[:6] + long[:1] + short[6:] + long[1:]


@pytest.fixture(scope="module")
def token_budget_only(stories_path, prompts):
    llm = LLM(str(stories_path), **ENGINE)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert llm.engine.scheduler.step_cost is None and not llm.engine.runner.profile
    llm.shutdown()
    return outs


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_budget_below_any_step_changes_the_chunks_not_the_outputs(stories_path, prompts, token_budget_only,
                                                                          async_scheduling):
    # 1 us: no step fits, so while anything decodes each step carries the oldest prefill's one block.
    llm = LLM(str(stories_path), max_step_ms=1e-3, async_scheduling=async_scheduling, **ENGINE)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert outs == token_budget_only
    steps = list(llm.engine.metrics.recent_steps)
    mixed = [s for s in steps if s.num_decode_tokens and s.num_prefill_tokens]
    assert mixed and all(s.num_prefill_tokens <= 16 for s in mixed)
    assert any(s.num_prefill_tokens > 16 for s in steps if not s.num_decode_tokens)   # the token budget alone
    llm.shutdown()


def test_a_step_budget_the_steps_fit_changes_nothing(stories_path, prompts, token_budget_only):
    llm = LLM(str(stories_path), max_step_ms=1e4, **ENGINE)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert outs == token_budget_only
    assert max(s.num_prefill_tokens for s in llm.engine.metrics.recent_steps) == 64
    llm.shutdown()


def test_stats_report_the_budget_and_the_estimated_and_measured_step_times(stories_path, prompts):
    from minillm.tui.client import parse_stats
    llm = LLM(str(stories_path), max_step_ms=25.0, **ENGINE)
    llm.generate(prompts[:8], GREEDY)
    stats = llm.engine.stats()
    assert stats.max_step_ms == 25.0
    assert list(stats.step_cost_coefficients) == ["base", "mixed", "tokens", "attention", "kv_read"]
    assert all(v >= 0 for v in stats.step_cost_coefficients.values())
    assert stats.step_estimated_ms > 0 and stats.step_measured_ms > 0
    assert 0 <= stats.step_cost_error_p50 and stats.step_cost_num_refits >= 1   # dozens of steps: refitted
    timed = [s for s in stats.recent_steps if s.device_step_s is not None]
    assert timed and all(s.estimated_step_s > 0 and s.device_step_s > 0 for s in timed)
    assert stats.recent_steps[-1].device_step_s is not None                     # every launched step was read
    assert "forward_device" in stats.step_time_breakdown_s
    parsed = parse_stats(json.loads(json.dumps(stats.to_dict())))
    assert parsed.max_step_ms == 25.0 and parsed.step_cost_coefficients == stats.step_cost_coefficients
    assert parsed.recent_steps[-1].device_step_s == stats.recent_steps[-1].device_step_s
    llm.shutdown()


def test_a_relative_budget_changes_the_chunks_not_the_outputs(stories_path, prompts, token_budget_only):
    from minillm.tui.client import parse_stats
    from minillm.step_cost import StepCostModel
    llm = LLM(str(stories_path), max_step_factor=1.0, **ENGINE)
    # The model fitted at start-up depends on how busy the machine is; pin one whose mixed step's
    # fixed cost (1 ms) is more than the room the joining rows leave, and never refit it.
    llm.engine.scheduler.step_cost = StepCostModel([3e-3, 1e-3, 2e-5, 1e-9, 3e-6], refit_every=10**9)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == token_budget_only
    # A step beside decodes holds its prompt chunks to 1x the batch's decode step (the prompts
    # still to join it counted as its decode rows); past that only the oldest chunk's one block.
    mixed = [s for s in llm.engine.metrics.recent_steps if s.num_decode_tokens and s.num_prefill_tokens]
    assert mixed and all(s.step_limit_s is not None for s in mixed)
    assert all(s.estimated_step_s <= s.step_limit_s * (1 + 1e-9) or s.num_prefill_tokens <= 16 for s in mixed)
    assert any(s.estimated_step_s > s.step_limit_s for s in mixed)            # the floor was needed
    assert any(16 < s.num_prefill_tokens < 64 for s in mixed)                  # and room was used
    stats = llm.engine.stats()
    assert stats.max_step_factor == 1.0 and stats.max_step_ms is None and stats.step_estimated_ms > 0
    assert parse_stats(json.loads(json.dumps(stats.to_dict()))).max_step_factor == 1.0
    llm.shutdown()


@pytest.mark.parametrize("value", [0.5, float("nan"), float("inf"), True, "2"])
def test_a_bad_step_factor_is_refused_by_name(stories_path, value):
    with pytest.raises(ValueError, match="max_step_factor must be"):
        EngineConfig(model=str(stories_path), max_step_factor=value)


def test_without_a_step_budget_the_stats_say_so(stories_path):
    llm = LLM(str(stories_path), **ENGINE)
    llm.generate([[1, 2, 3]], GREEDY)
    stats = llm.engine.stats()
    assert stats.max_step_ms is None and stats.step_cost_coefficients == {}
    assert stats.step_estimated_ms is None and stats.step_measured_ms is None
    assert all(s.estimated_step_s is None and s.device_step_s is None for s in stats.recent_steps)
    llm.shutdown()


@pytest.mark.parametrize("bad", [0, -5.0, math.nan, math.inf, True, "5"])
def test_max_step_ms_must_be_a_positive_number(bad):
    with pytest.raises(ValueError, match="max_step_ms"):
        EngineConfig(model="unused", max_step_ms=bad)
