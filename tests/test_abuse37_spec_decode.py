"""Speculative decoding's interval log line, as vLLM's server logs it beside the throughput line."""
import json
import re

import pytest
from test_serve_vllm_flags import logged as server_log  # noqa: F401 - the minillm.server log lines, a fixture

from minillm import LLM, SamplingParams
from minillm.server.app import ThroughputLogger

K = 3
LINE = re.compile(r"SpecDecoding metrics: Mean acceptance length: ([\d.]+), Accepted throughput: [\d.]+ tokens/s, "
                  r"Drafted throughput: [\d.]+ tokens/s, Accepted: (\d+) tokens, Drafted: (\d+) tokens, "
                  r"Per-position acceptance rate: ([\d., ]+), Avg Draft acceptance rate: ([\d.]+)%$")


def test_throughput_log_adds_the_spec_decoding_line_of_the_interval(stories_path, server_log):
    golden = json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]
    llm = LLM(str(stories_path), device="cpu", max_model_len=128,
              speculative_config={"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1})
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    throughput = ThroughputLogger(None, 1.0)
    llm.generate([[1] + golden[:20] * 2], params, use_tqdm=False)
    first = llm.engine.stats().spec_decode
    throughput.log(llm.engine.stats())
    server_log.clear()
    llm.generate([[1] + golden[:30] + golden[:10]] * 2, params, use_tqdm=False)
    now = llm.engine.stats()
    throughput.log(now)
    lines = [m for m in server_log if m.startswith("SpecDecoding")]
    assert len(lines) == 1, server_log
    mean, accepted, drafted, per_pos, rate = LINE.fullmatch(lines[0]).groups()
    spec = now.spec_decode
    drafts = spec.num_drafts - first.num_drafts
    assert drafts > 0 and (int(accepted), int(drafted)) == (spec.num_accepted_tokens - first.num_accepted_tokens,
                                                          spec.num_draft_tokens - first.num_draft_tokens)
    assert float(mean) == pytest.approx(1 + int(accepted) / drafts, abs=0.005)
    assert float(rate) == pytest.approx(100 * int(accepted) / int(drafted), abs=0.05)
    want = [(a - b) / drafts for a, b in zip(spec.num_accepted_tokens_per_pos, first.num_accepted_tokens_per_pos)]
    assert [float(r) for r in per_pos.split(", ")] == pytest.approx(want, abs=5e-4)
    server_log.clear()
    throughput.log(llm.engine.stats())      # no draft verified since: no line
    assert not [m for m in server_log if m.startswith("SpecDecoding")]
