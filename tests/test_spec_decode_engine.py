"""Speculative decoding through the engine on stories260K (CPU).

Greedy output with n-gram speculation equals greedy output without it, token for token, for 64
prompts in one batch, under preemption and aborts, with async scheduling on and off, and the pool
is all free afterwards. Sampled output keeps its distribution: 4,000 seeded samples of the first
tokens after a fixed prompt pass a chi-square test against plain sampling, and fail it with a
deliberately broken acceptance rule.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from test_server_helpers import get_stats, running_server
from test_spec_decode import chi2_two_sample_pvalue

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.server.metrics import ServerMetrics
from minillm.spec_decode import SpeculativeConfig
from minillm.spec_decode import rejection as rejection_mod
from minillm.tokenizer import Tokenizer
from minillm.tui.client import parse_stats
from minillm.tui.queue_panel import _wide_rows

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def golden(stories_path) -> list[int]:
    """stories260K's greedy text from BOS (it repeats itself: n-gram drafts find it)."""
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


@pytest.fixture(scope="module")
def prompts(golden) -> list[list[int]]:
    """64 prompts: passages that repeat their start (the output goes on repeating) and prefixes
    of the golden text (whose continuation repeats earlier sentences)."""
    out = []
    for i in range(64):
        if i % 2:
            out.append(golden[:10 + i % 48])
        else:
            start = 1 + (5 * i) % 120
            passage = golden[start:start + 8 + i % 9]
            out.append([1] + passage + passage[:3 + i % 4])
    return out


def params_for(i: int) -> SamplingParams:
    """Greedy with a mix of rules that speculation must keep: plain, EOS-free, stop tokens and
    strings, min_tokens, penalties, logprobs, logit biases."""
    kind = i % 8
    if kind == 3:
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[267])
    if kind == 5:
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=["know what"])
    if kind == 6:
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=8, repetition_penalty=1.2)
    if kind == 7:
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True)
    if kind == 4:
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                              logit_bias={286: -100.0, 376: 2.5, 261: -3.0})
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=kind % 2 == 0)


def summary(outputs) -> list[tuple]:
    return [(tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason)
            for o in outputs for c in o.outputs]


def assert_pool_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    assert not llm.engine.has_unfinished_requests()


def generate(path, prompts, spec, **engine_args):
    llm = LLM(str(path), device="cpu", speculative_config=spec, **engine_args)
    outputs = llm.generate(prompts, [params_for(i) for i in range(len(prompts))])
    assert_pool_free(llm)
    return llm, outputs


@pytest.fixture(scope="module")
def reference(stories_path, prompts):
    """Greedy outputs without speculation, all 64 prompts in one batch."""
    _, outputs = generate(stories_path, prompts, None, async_scheduling=False)
    return outputs


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_equals_plain_for_64_prompts(stories_path, prompts, reference, async_scheduling):
    llm, outputs = generate(stories_path, prompts, SPEC, async_scheduling=async_scheduling)
    assert summary(outputs) == summary(reference)
    stats = llm.engine.stats().spec_decode
    # drafts were verified in bulk, and both accepted and rejected
    assert stats.num_drafts > 100 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.mean_acceptance_length > 1.5
    # logprobs: one entry per output token, each holding that token, equal to the plain run's
    for i in range(7, 64, 8):
        got, want = outputs[i].outputs[0], reference[i].outputs[0]
        assert len(got.logprobs) == len(got.token_ids)
        assert all(t in lp for t, lp in zip(got.token_ids, got.logprobs))
        for a, b in zip(got.logprobs, want.logprobs):
            assert a.keys() == b.keys()
            np.testing.assert_allclose(list(a.values()), list(b.values()), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_equals_plain_under_preemption(stories_path, prompts, reference, async_scheduling):
    llm, outputs = generate(stories_path, prompts, SPEC, async_scheduling=async_scheduling,
                            num_kv_blocks=40, block_size=4, max_model_len=96)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
    assert summary(outputs) == summary(reference)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_aborts_leave_the_others_exact_and_the_pool_free(stories_path, prompts, reference, async_scheduling):
    llm = LLM(str(stories_path), device="cpu", speculative_config=SPEC, async_scheduling=async_scheduling,
              num_kv_blocks=64, block_size=4, max_model_len=96)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params_for(i))
    finished, aborted, steps = {}, {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        running = [rid for rid, req in engine.requests.items() if not req.is_finished]
        # With async scheduling the step just launched is still in flight: abort some requests
        # whose drafts it verifies; and every 5th request a few steps apart.
        with_drafts = [rid for rid in running if engine.requests[rid].seqs[0].spec_token_ids]
        victim = str(5 * (steps // 2))
        if with_drafts and sum(aborted.values()) < 4 and steps % 3 == 0:
            aborted[with_drafts[0]] = True
            engine.abort_request(with_drafts[0])
        elif steps % 2 == 0 and victim in running:
            aborted[victim] = False
            engine.abort_request(victim)
    assert len(finished) == len(prompts) and len(aborted) > 5
    assert sum(aborted.values()) == (4 if async_scheduling else 0)
    for rid, out in finished.items():
        got, want = out.outputs[0], reference[int(rid)].outputs[0]
        if got.finish_reason == "abort":
            assert tuple(got.token_ids) == tuple(want.token_ids[:len(got.token_ids)])
        else:
            assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert sum(o.outputs[0].finish_reason == "abort" for o in finished.values()) == len(aborted)
    assert_pool_free(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_allowed_ids_and_bad_words_hold_under_speculation(stories_path, prompts, golden, async_scheduling):
    """Greedy with bad words or allowed ids: speculation gives the plain tokens, which keep the rules."""
    allowed = sorted(set(golden) - {426})                   # no "."
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, bad_words=["Lily", "know"])
              if i % 2 else SamplingParams(temperature=0, max_tokens=MAX_TOKENS, allowed_token_ids=allowed)
              for i in range(16)]
    plain = LLM(str(stories_path), device="cpu", async_scheduling=async_scheduling)
    want = plain.generate(prompts[:16], params)
    llm = LLM(str(stories_path), device="cpu", speculative_config=SPEC, async_scheduling=async_scheduling)
    got = llm.generate(prompts[:16], params)
    assert summary(got) == summary(want)
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
    texts = [o.outputs[0].text for o in got]
    assert not any("Lily" in t or "know" in t for t in texts[1::2])
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in got[::2])
    assert_pool_free(llm)


def test_stats_are_none_without_speculation_and_count_drafts_with_it(stories_path, golden):
    prompt = [1] + golden[1:20] + golden[1:6]
    plain = LLM(str(stories_path), device="cpu")
    plain.generate([prompt], SamplingParams(temperature=0, max_tokens=16))
    assert plain.engine.stats().spec_decode is None
    llm = LLM(str(stories_path), device="cpu", speculative_config=SPEC)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16))
    s = llm.engine.stats()
    d = s.to_dict()["spec_decode"]
    assert d["num_spec_tokens"] == 4 and d["num_drafts"] == s.spec_decode.num_drafts > 0
    assert sum(d["num_accepted_tokens_per_pos"]) == d["num_accepted_tokens"] > 0
    # one verified step yields at most k + 1 tokens: 15 decode tokens in fewer steps than 15
    assert s.num_steps < 1 + 15
    assert s.generation_tokens_total == 16


@pytest.mark.parametrize("bad,field", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min"),
    ('{"num_speculative_tokens": ', "speculative_config"),
])
def test_bad_speculative_config_is_a_value_error_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="unused", speculative_config=bad)
    good = EngineConfig(model="unused", speculative_config=json.dumps(SPEC)).speculative_config
    assert good == SpeculativeConfig.from_dict(SPEC)


# ----------------------------------------------------------------------------- distribution

NUM_SAMPLES = 4000
FIRST_TOKENS = 3


@pytest.fixture(scope="module")
def dist_prompt(golden) -> list[int]:
    """A prompt whose tail repeats an earlier passage: drafts from the second token on, and a
    next-token distribution at temperature 0.8 spread over many tuples."""
    return [1] + golden[37:45] + golden[37:45] + golden[37:42]


def sample_first_tokens(path, prompt, spec, seed0: int) -> list[tuple[int, ...]]:
    """NUM_SAMPLES seeded samples of the first tokens after prompt, one request each, one batch."""
    llm = LLM(str(path), device="cpu", speculative_config=spec, max_num_seqs=NUM_SAMPLES,
              max_num_batched_tokens=NUM_SAMPLES * 8)
    llm.generate([prompt], SamplingParams(max_tokens=1))      # its full blocks go to the prefix cache
    params = [SamplingParams(temperature=0.8, max_tokens=FIRST_TOKENS + 1, seed=seed0 + i, ignore_eos=True)
              for i in range(NUM_SAMPLES)]
    outs = llm.generate([prompt] * NUM_SAMPLES, params)
    assert_pool_free(llm)
    if spec is not None:
        s = llm.engine.stats().spec_decode
        # nearly every sample verified drafts, and a fair share were rejected at each of two positions
        assert s.num_drafts > NUM_SAMPLES * 0.8
        assert 0.2 < s.acceptance_rate < 0.9 and s.num_accepted_tokens_per_pos[1] > 300
    return [tuple(o.outputs[0].token_ids[:FIRST_TOKENS]) for o in outs]


def tuple_counts(samples: list[tuple], *others: list[tuple]) -> list[np.ndarray]:
    keys = sorted(set(samples).union(*others))
    index = {k: i for i, k in enumerate(keys)}
    return [np.bincount([index[t] for t in s], minlength=len(keys)) for s in (samples, *others)]


@pytest.fixture(scope="module")
def plain_samples(stories_path, dist_prompt):
    return sample_first_tokens(stories_path, dist_prompt, None, seed0=0)


def test_distribution_of_the_first_tokens_is_kept(stories_path, dist_prompt, plain_samples):
    spec = sample_first_tokens(stories_path, dist_prompt, SPEC, seed0=100_000)
    a, b = tuple_counts(spec, plain_samples)
    assert len(a) > 20                                     # a real spread, not one likely path
    p = chi2_two_sample_pvalue(a, b)
    assert p > 0.01, p


def test_same_seeds_give_the_same_samples(stories_path, dist_prompt, plain_samples):
    """With one seed the n-th token uses the n-th uniform of its stream, with or without drafts
    (draws past a rejection are given back): the samples are equal, not just alike."""
    spec = sample_first_tokens(stories_path, dist_prompt, SPEC, seed0=0)
    assert spec == plain_samples


def test_a_broken_acceptance_rule_fails_the_test(stories_path, dist_prompt, plain_samples, monkeypatch):
    monkeypatch.setattr(rejection_mod, "num_accepted_drafts",
                        lambda sampled, drafts, num_drafts: np.asarray(num_drafts, np.int32))
    llm = LLM(str(stories_path), device="cpu", speculative_config=SPEC, max_num_seqs=NUM_SAMPLES,
              max_num_batched_tokens=NUM_SAMPLES * 8)
    params = [SamplingParams(temperature=0.8, max_tokens=FIRST_TOKENS + 1, seed=200_000 + i, ignore_eos=True)
              for i in range(NUM_SAMPLES)]
    broken = [tuple(o.outputs[0].token_ids[:FIRST_TOKENS]) for o in llm.generate([dist_prompt] * NUM_SAMPLES, params)]
    a, b = tuple_counts(broken, plain_samples)
    assert chi2_two_sample_pvalue(a, b) < 0.01


def test_metrics_and_monitor_show_the_spec_decode_counters(stories_path, golden):
    llm = LLM(str(stories_path), device="cpu", speculative_config=SPEC, served_model_name="m")
    llm.generate([[1] + golden[1:20] + golden[1:6]] * 3, SamplingParams(temperature=0, max_tokens=16))
    stats = llm.engine.stats()
    spec = stats.spec_decode
    metrics = ServerMetrics("m", 128)
    metrics.update(stats)
    text = metrics.render().decode()
    assert f'minillm:spec_decode_num_drafts_total{{model_name="m"}} {float(spec.num_drafts)}' in text
    assert f'minillm:spec_decode_num_draft_tokens_total{{model_name="m"}} {float(spec.num_draft_tokens)}' in text
    assert f'minillm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {float(spec.num_accepted_tokens)}' in text
    for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
        assert (f'minillm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{pos}"}} '
                f'{float(n)}') in text
    # the monitor reads the JSON snapshot and shows one line for it
    parsed = parse_stats(json.loads(json.dumps(stats.to_dict())))
    assert parsed.spec_decode == spec
    line = [" ".join(t for t, _ in row) for row in _wide_rows(parsed) if any("accept" in t for t, _ in row)]
    assert len(line) == 1
    assert f"accept {spec.acceptance_rate:.0%} · len {spec.mean_acceptance_length:.2f}" in line[0]
    # off: no series, no line
    plain = LLM(str(stories_path), device="cpu").engine.stats()
    metrics.update(plain)
    assert "spec_decode" not in metrics.render().decode()
    assert parse_stats(json.loads(json.dumps(plain.to_dict()))).spec_decode is None
    assert not any("accept" in t for row in _wide_rows(plain) for t, _ in row)


def test_server_streams_the_same_text_with_speculation(stories_path, golden):
    """The server with speculation: streamed and whole completions equal the plain engine's (a stop
    string ends the text where it does there), and /metrics and /v1/stats count the drafts."""
    tok = Tokenizer.from_pretrained(stories_path)
    prompt = tok.decode(golden[1:60])          # its continuation repeats sentences of the prompt
    plain = LLM(str(stories_path), device="cpu")
    want = {}
    for stop in (None, ["know what"]):
        out = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=48, stop=stop))[0].outputs[0]
        want[bool(stop)] = (out.text, out.finish_reason)
    assert want[True][1] == "stop"
    with running_server(stories_path, speculative_config=SPEC) as (url, engine):
        for stop in (None, ["know what"]):
            body = {"model": "stories", "prompt": prompt, "max_tokens": 48, "temperature": 0, "stop": stop}
            whole = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
            assert (whole["text"], whole["finish_reason"]) == want[bool(stop)]
            text = ""
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
            assert text == whole["text"]
        stats = get_stats(url)["spec_decode"]
        assert stats["num_drafts"] > 0 and stats["num_accepted_tokens"] > 0
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert f'minillm:spec_decode_num_drafts_total{{model_name="stories"}} {float(stats["num_drafts"])}' in metrics


def test_cli_takes_speculative_config_as_json(stories_path):
    repo = Path(__file__).resolve().parents[1]

    def generate(*extra):
        args = [sys.executable, "-m", "minillm.cli", "generate", str(stories_path), "--device", "cpu", "--json",
                "--temperature", "0", "--max-tokens", "24", "-p", "Once upon a time, there was a little girl.",
                *extra]
        return subprocess.run(args, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)},
                              capture_output=True, text=True, timeout=120)
    bad = generate("--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}')
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "minillm generate: error: Invalid value for '--speculative-config': num_speculative_tokens must be an "
        "integer in [1, 64], got -1 (try 'minillm generate --help')"]
    good = generate("--speculative-config", json.dumps(SPEC))
    plain = generate()
    assert good.returncode == plain.returncode == 0
    assert json.loads(good.stdout)["outputs"] == json.loads(plain.stdout)["outputs"]


def test_speculation_with_tensor_parallelism(stories_path, prompts, reference):
    """Two processes: the workers compute the same logits rows as rank 0 in a verify step."""
    llm = LLM(str(stories_path), device="cpu", speculative_config=SPEC, tensor_parallel_size=2)
    assert type(llm.engine.runner).__name__ == "TensorParallelExecutor"
    try:
        outputs = llm.generate(prompts[:16], [params_for(i) for i in range(16)])
        assert summary(outputs) == summary(reference[:16])
        assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
        assert_pool_free(llm)
    finally:
        llm.shutdown()
