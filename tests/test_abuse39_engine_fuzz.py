"""Property-based fuzz of LLMEngine on stories260K: random engine settings and request mixes.

Hypothesis draws an engine (block size, a pool at or near its minimum, max_num_seqs, the token
budget, chunked prefill, prefix caching, FP8 KV, the host KV tier, async scheduling, n-gram
speculation, the priority policy) and requests that share prefixes, arrive at random steps and are
aborted at random steps, with n > 1, seeds, stop strings, stop ids, min_tokens, max_tokens 1,
logprobs, prompt_logprobs and every output kind. After every step the pool agrees with the queued
sequences; at the end each greedy or seeded completion equals the request's output alone on an
engine of default settings (an aborted one's is a prefix of it), each request is reported finished
once, the pool and the host tier are whole, and the stats' counters add up to the outputs.

CI draws the same examples every run (conftest's deterministic profile); MINILLM_HYPOTHESIS=explore
with MINILLM_FUZZ_EXAMPLES=500 draws new ones to hunt for bugs.
"""
from __future__ import annotations

import functools
import json
import os
import re
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_abuse37_engine_invariants import assert_invariants
from test_kv_offload import assert_host_consistent

from minillm import SamplingParams
from minillm.block_manager import cache_salt_root, prompt_block_keys
from minillm.bad_words import bad_word_ids, banned_next_tokens
from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.engine_stats import MAX_WAITING_ROWS
from minillm.sampling_params import RequestOutputKind, StructuredOutputsParams, truncate_prompt

MAX_LEN = 48
EOS = 2
VOCAB = 512
EXAMPLES = int(os.environ.get("MINILLM_FUZZ_EXAMPLES", "12"))
BYTES_PER_TOKEN = 2 * 5 * 4 * 8 * 4      # K and V, 5 layers, 4 KV heads of 8, float32
STOP_WORDS = [".", " the", "Tim", ",", " was", "!"]
REFUSED = "refused"      # a request's final output when add_request refused it
STRUCTURES = [{"choice": ["Tim was happy", "Lily ran", "the end"]}, {"regex": "(the )+[a-z]+"},
              {"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}]
KINDS = [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY]


def make_engine(path, **kw) -> LLMEngine:
    kw = {"max_model_len": MAX_LEN, **kw}
    return LLMEngine(EngineConfig(model=str(path), device="cpu", **kw), log=lambda m: None)


@pytest.fixture(scope="module")
def golden(stories_path) -> list[int]:
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


@pytest.fixture(scope="module")
def alone(stories_path):
    """A request's completions (token ids, text, logprob ids, finish and stop reasons) and prompt
    logprob ids, run alone on an engine of default settings (one per KV cache dtype and
    max_model_len), memoised."""
    engines, memo = {}, {}

    def run(prompt, params, kv_cache_dtype, max_model_len=MAX_LEN):
        key = (tuple(prompt), repr(params), kv_cache_dtype, max_model_len)     # final-only: one report
        if key not in memo:
            if (kv_cache_dtype, max_model_len) not in engines:
                engines[kv_cache_dtype, max_model_len] = make_engine(stories_path, kv_cache_dtype=kv_cache_dtype,
                                                                     max_model_len=max_model_len)
            engine = engines[kv_cache_dtype, max_model_len]
            engine.add_request("alone", prompt, params, output_kind="final")
            done = None
            while engine.has_unfinished_requests():
                done = next((o for o in engine.step() if o.finished), done)
            memo[key] = {"outputs": [(c.token_ids, c.text, [sorted(d) for d in c.logprobs or []], c.finish_reason,
                                      c.stop_reason) for c in done.outputs],
                         "prompt_logprobs": None if done.prompt_logprobs is None else
                         [None if d is None else sorted(d) for d in done.prompt_logprobs]}
        return memo[key]

    yield run
    for engine in engines.values():
        engine.shutdown()


@st.composite
def engine_configs(draw, host_tier: bool = False, by_priority: bool = False) -> dict:
    """Engine settings; host_tier: prefix caching and the host tier on, the pool at its minimum;
    by_priority: the priority policy, the pool at its minimum."""
    bs = draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64]))
    max_len = draw(st.sampled_from([MAX_LEN, MAX_LEN, 33]))
    min_blocks = -(-max_len // bs)
    extra_blocks = 0 if host_tier or by_priority else draw(st.integers(0, min_blocks))
    kw = dict(max_model_len=max_len, block_size=bs, num_kv_blocks=min_blocks + extra_blocks,
              max_num_seqs=draw(st.integers(1, 6)),
              enable_prefix_caching=host_tier or draw(st.booleans()),
              async_scheduling=draw(st.booleans()),
              kv_cache_dtype=draw(st.sampled_from(["auto", "auto", "fp8"])),
              scheduling_policy="priority" if by_priority else draw(st.sampled_from(["fcfs", "fcfs", "priority"])))
    if kw["kv_cache_dtype"] == "fp8":
        kw["calculate_kv_scales"] = draw(st.booleans())      # the scales of the first prefill
    if draw(st.booleans()):
        kw["enable_chunked_prefill"] = False
        kw["max_num_batched_tokens"] = draw(st.integers(max_len, 2 * max_len))
    else:
        kw["max_num_batched_tokens"] = draw(st.integers(1, 24))
    if host_tier or kw["enable_prefix_caching"] and draw(st.booleans()):   # the host tier extends the prefix cache
        per_block = BYTES_PER_TOKEN * bs // (4 if kw["kv_cache_dtype"] == "fp8" else 1)
        kw["kv_offload_gib"] = draw(st.integers(1, 3 * min_blocks)) * per_block / 2**30
    # a step-time budget sizes prompt chunks: only with chunked prefill
    chunked = kw.get("enable_chunked_prefill", True)
    step_budget = draw(st.sampled_from([None, None, None, "ms", "factor"])) if chunked else None
    if step_budget == "ms":
        kw["max_step_ms"] = draw(st.sampled_from([0.5, 2.0, 5.0]))
    elif step_budget == "factor":
        kw["max_step_factor"] = draw(st.sampled_from([1.0, 2.0]))
    if draw(st.sampled_from([False, True, True])):
        lo = draw(st.integers(1, 3))
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": draw(st.integers(1, 5)),
                                    "prompt_lookup_min": lo, "prompt_lookup_max": lo + draw(st.integers(0, 2)),
                                    "disable_by_batch_size": draw(st.sampled_from([None, None, 2, 3]))}
    return kw


@st.composite
def request_lists(draw, golden: list[int], waves: bool = False) -> list[dict]:
    """Requests over a few prompt families sharing prefixes, each with its arrival and abort steps
    (some take the id of an earlier one); waves: they arrive over 60 steps, so later ones find the
    earlier ones' blocks cached, on the device or on the host."""
    # a story's start, a loop, and a passage followed by its start again (the output copies it on:
    # n-gram drafts are accepted)
    bases = [[1] + golden[1:40], [1] + golden[60:70] * 3, [1] + golden[1:30] + golden[1:8]]
    requests = []
    for i in range(draw(st.integers(1, 8))):
        base = draw(st.sampled_from(bases))
        cut = draw(st.one_of(st.sampled_from([9, 17, 33, len(base)]), st.integers(1, len(base))))
        prompt = base[:cut] + draw(st.one_of(st.just([]), st.lists(st.integers(3, 511), max_size=3)))
        prompt = prompt[:MAX_LEN - 1]
        kind = draw(st.sampled_from(["greedy", "greedy", "seeded", "random"]))
        max_tokens = draw(st.one_of(st.none(), st.integers(1, 3), st.integers(1, MAX_LEN)))
        params = dict(
            n=draw(st.sampled_from([1, 1, 2, 3])), max_tokens=max_tokens,
            min_tokens=draw(st.sampled_from([0, 0, 1, 5])) if max_tokens is None else
            draw(st.integers(0, max_tokens)) // 2,
            ignore_eos=draw(st.booleans()),
            stop=draw(st.lists(st.sampled_from(STOP_WORDS), max_size=2, unique=True)),
            stop_token_ids=draw(st.lists(st.integers(3, 511), max_size=2)),
            logprobs=draw(st.sampled_from([None, None, 0, 2])),
            prompt_logprobs=draw(st.sampled_from([None, None, None, 1])),
            repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.2])),
            presence_penalty=draw(st.sampled_from([0.0, 0.0, 0.5])),
            frequency_penalty=draw(st.sampled_from([0.0, 0.0, -0.3])),
            logit_bias=draw(st.sampled_from([None, None, {432: 2.0, 261: -3.0}])),
            bad_words=draw(st.sampled_from([None, None, [" the"], ["Tim was", "."]])),
            include_stop_str_in_output=draw(st.booleans()),
            truncate_prompt_tokens=draw(st.sampled_from([None, None, None, 1, 7, -1])),
            output_kind=draw(st.sampled_from(KINDS)),
        )
        mask = draw(st.sampled_from([None, None, None, "allowed", "trap", "structured"]))
        if mask == "allowed":
            params["allowed_token_ids"] = [2, *range(256, 300), 410, 426]
        elif mask == "trap":      # "the" then nothing: the output ends with an error after its first "the"
            params.update(allowed_token_ids=[265, 426], bad_words=["the the", "the."])
        elif mask == "structured":
            params["structured_outputs"] = StructuredOutputsParams(**draw(st.sampled_from(STRUCTURES)))
        if kind == "greedy":
            params["temperature"] = 0.0
        else:
            params.update(temperature=draw(st.sampled_from([0.7, 1.0])), top_k=draw(st.sampled_from([-1, 5])),
                          top_p=draw(st.sampled_from([1.0, 0.9])), min_p=draw(st.sampled_from([0.0, 0.05])))
            if kind == "seeded":
                params["seed"] = draw(st.integers(0, 1000))
        arrival = draw(st.integers(0, 60 if waves else 12))
        abort = draw(st.one_of(st.none(), st.none(), st.integers(0, 25)))
        rid = f"r{i}"
        if requests and draw(st.integers(0, 4)) == 0:
            rid = draw(st.sampled_from(requests))["rid"]      # reused once the earlier one is done
        requests.append(dict(rid=rid, prompt=prompt, params=SamplingParams(**params), kind=kind,
                             arrival=arrival, abort=None if abort is None else arrival + abort,
                             priority=draw(st.integers(-1, 1)), salt=draw(st.sampled_from([None, None, "a"])),
                             form=draw(st.sampled_from(["ids", "ids", "dict", "keys"]))))
    return requests


def assert_stats_consistent(stats) -> None:
    """A mid-run EngineStats agrees with itself."""
    assert stats.kv_num_free_blocks + stats.kv_num_cached_blocks + stats.kv_num_used_blocks == stats.kv_num_blocks
    assert 0 <= stats.kv_usage <= 1 and 0 <= stats.kv_token_utilization <= 1
    assert 0 <= stats.num_preempted <= stats.num_waiting
    assert len(stats.requests) == stats.num_running + min(stats.num_waiting, MAX_WAITING_ROWS)
    for row in stats.requests:
        assert 0 <= row.num_cached_tokens < row.prompt_tokens, row
        assert row.output_tokens >= 0 and (row.num_blocks > 0) == (row.state == "running"), row
    assert all(-3 <= cell < len(stats.requests) for cell in stats.block_map)
    assert sum(stats.prompt_tokens_by_source.values()) == stats.prompt_tokens_total
    assert min(stats.prompt_tokens_by_source.values()) >= 0, stats.prompt_tokens_by_source
    assert sum(stats.iteration_tokens_buckets) == stats.num_steps
    assert stats.prefix_cache_hits <= stats.prefix_cache_queries
    assert 0 <= stats.kv_offload_num_used_blocks <= stats.kv_offload_num_blocks
    for step in stats.recent_steps:
        assert step.num_prefill_tokens + step.num_decode_tokens <= step.token_budget, step
        assert 0 < step.num_seqs <= stats.max_num_seqs, step


def is_complete(structure: StructuredOutputsParams, text: str) -> bool:
    """True when text is a whole answer of one of STRUCTURES."""
    if structure.choice is not None:
        return text in structure.choice
    if structure.regex is not None:
        return re.fullmatch(structure.regex, text) is not None
    return isinstance(json.loads(text).get("a"), int)


def assert_rules_kept(tokenizer, params: SamplingParams, num_prompt: int, ids: list[int], text: str, lps: list,
                      end: tuple, max_len: int) -> None:
    """One completion keeps its request's rules, whatever it sampled: its length, why it ended,
    min_tokens, stop tokens, EOS, stop strings, allowed ids, bad words and logprobs."""
    reason, stop = end
    assert len(ids) <= (params.max_tokens or max_len) and num_prompt + len(ids) <= max_len, (len(ids), end)
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else {EOS})
    # the last token of a stopped completion may be a stop token (its stop string, when the same token
    # completes one, is the reason reported, as vLLM's output processor reports it)
    for i, token in enumerate(ids[:-1] if reason == "stop" else ids):
        # EOS and stop ids end a completion, and min_tokens bans them before
        assert token not in stop_ids and (i >= params.min_tokens or token != EOS), (i, token, ids, end)
    if reason == "length":
        assert len(ids) == params.max_tokens or num_prompt + len(ids) == max_len, (len(ids), end)
    elif reason == "stop" and stop is None and params.structured_outputs is not None:
        assert is_complete(params.structured_outputs, text), (text, end)   # whatever min_tokens says
    elif reason == "stop":
        assert len(ids) >= params.min_tokens or isinstance(stop, str) and not ids, (len(ids), end)
        if isinstance(stop, str):
            # (without it the text may still end with the string, held off by min_tokens before)
            assert stop in params.stop and (text.endswith(stop) or not params.include_stop_str_in_output), (text, end)
        elif stop is None:
            assert ids[-1] == EOS and not params.ignore_eos, (ids, end)
        else:
            assert ids[-1] == stop and stop in params.stop_token_ids, (ids, end)
    elif reason == "error":
        assert params.allowed_token_ids == [265, 426], end        # only the trap runs out of tokens
    else:
        assert reason == "abort", end
    if params.allowed_token_ids is not None:
        assert set(ids) <= set(params.allowed_token_ids), ids
    if params.bad_words:
        words = bad_word_ids(tuple(params.bad_words), tokenizer, VOCAB)
        assert all(token not in banned_next_tokens(words, ids[:i]) for i, token in enumerate(ids)), ids
    if params.logprobs is not None:
        assert len(lps) == len(ids) and all(t in d and len(d) <= params.logprobs + 1 for t, d in zip(ids, lps))


class Driver:
    """Adds and aborts a scenario's requests at their steps and gathers what step() reports."""

    def __init__(self, engine: LLMEngine, requests: list[dict], by_priority: bool):
        self.engine, self.requests, self.by_priority = engine, requests, by_priority
        n = len(requests)
        self.added = [False] * n
        self.tokens = [[[] for _ in range(r["params"].n)] for r in requests]   # each completion's tokens so far
        self.texts = [["" for _ in range(r["params"].n)] for r in requests]
        self.logprobs = [[[] for _ in range(r["params"].n)] for r in requests]
        self.prompt_logprobs = [None] * n
        self.final = [None] * n                      # the finished RequestOutput, or REFUSED
        self.finishes: dict[tuple[int, int], tuple] = {}   # (request, completion) -> (finish reason, stop reason)
        self.aborted: set[int] = set()

    @property
    def is_done(self) -> bool:
        return None not in self.final and not self.engine.has_unfinished_requests()

    def arrive_and_abort(self, step: int) -> None:
        """Add the requests due (once their id is free) and abort those due."""
        engine, max_len = self.engine, self.engine.max_model_len
        for k, r in enumerate(self.requests):
            held = engine.requests.get(r["rid"])
            if not self.added[k] and step >= r["arrival"] and (held is None or held.is_finished):
                self.added[k] = True
                prompt, salt, keys = r["prompt"], r["salt"], None
                if r["form"] == "dict":          # vLLM's TokensPrompt, its salt inside
                    prompt, salt = {"prompt_token_ids": prompt, "cache_salt": salt}, None
                elif r["form"] == "keys":        # an API server's keys, hashed beside its tokenizer
                    keys = prompt_block_keys(prompt, engine.block_manager.block_size, cache_salt_root(salt))
                add = functools.partial(engine.add_request, r["rid"], prompt, r["params"], cache_salt=salt,
                                        prompt_block_keys=keys, priority=r["priority"] if self.by_priority else 0)
                if len(truncate_prompt(r["prompt"], r["params"].truncate_prompt_tokens, max_len)) < max_len:
                    add()
                else:                # no room for an output: refused, and the engine holds nothing of it
                    with pytest.raises(ValueError, match="leaves no room under max_model_len"):
                        add()
                    assert engine.requests.get(r["rid"]) is held
                    self.final[k] = REFUSED
            elif self.added[k] and r["abort"] is not None and step >= r["abort"] and self.final[k] is None \
                    and k not in self.aborted:
                engine.abort_request(r["rid"])
                self.aborted.add(k)

    def read(self, out) -> None:
        """Take one RequestOutput into its request's completions."""
        # the oldest unreported request of that id (an aborted one reports before its successor)
        k = next(k for k, r in enumerate(self.requests)
                 if r["rid"] == out.request_id and self.added[k] and self.final[k] is None)
        params = self.requests[k]["params"]
        is_delta = params.output_kind is RequestOutputKind.DELTA
        for c in out.outputs:
            i = c.index
            if is_delta:
                self.tokens[k][i] = self.tokens[k][i] + list(c.token_ids)
                self.texts[k][i] += c.text
                self.logprobs[k][i] = self.logprobs[k][i] + (c.logprobs or [])
            else:
                self.tokens[k][i], self.texts[k][i], self.logprobs[k][i] = list(c.token_ids), c.text, c.logprobs or []
            if c.finish_reason is not None:
                end = (c.finish_reason, c.stop_reason)
                assert self.finishes.setdefault((k, i), end) == end, (k, i, end)
        if out.prompt_logprobs is not None:
            have = self.prompt_logprobs[k]
            self.prompt_logprobs[k] = have + out.prompt_logprobs if is_delta and have else out.prompt_logprobs
        if params.output_kind is RequestOutputKind.FINAL_ONLY:
            assert out.finished, f"{out.request_id}: a final-only request reported before it finished"
        if out.finished:
            self.final[k] = out
            assert out.num_cached_tokens is None or 0 <= out.num_cached_tokens < len(out.prompt_token_ids)
            assert all((k, i) in self.finishes for i in range(params.n)), f"{out.request_id} unfinished"


def run_scenario(stories_path, config: dict, requests: list[dict], alone, resets: list[int] = ()) -> None:
    """Drive one engine through the requests' arrivals and aborts, checking the invariants."""
    engine = make_engine(stories_path, **config)
    try:
        run = Driver(engine, requests, config.get("scheduling_policy") == "priority")
        step = 0
        while not run.is_done:
            run.arrive_and_abort(step)
            if step in resets:
                in_use = engine.block_manager.num_used_blocks    # refused only while blocks are in use, as vLLM's
                assert engine.reset_prefix_cache() == (not in_use), (step, in_use)
            for out in engine.step():
                run.read(out)
            assert_invariants(engine)
            if step % 5 == 3:
                assert_stats_consistent(engine.stats(cells=step % 50 + 1))
            step += 1
            assert step < 5000, "the engine made no progress"
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
        if engine.kv_connector is not None:
            assert_host_consistent(engine.kv_connector)
        check_outputs(run, alone, config.get("kv_cache_dtype", "auto"))
    finally:
        engine.shutdown()


def check_outputs(run: Driver, alone, kv_dtype: str) -> None:
    """Each completion keeps its rules, a greedy or seeded one is its request's alone, and the
    stats' totals are the outputs'."""
    engine, max_len = run.engine, run.engine.max_model_len
    reasons, num_generated, num_prompt = Counter(), 0, 0
    for k, r in enumerate(run.requests):
        params, out = r["params"], run.final[k]
        if out is REFUSED:
            continue
        prompt = out.prompt_token_ids
        reasons.update(run.finishes[k, i][0] for i in range(params.n))
        num_generated += sum(len(ids) for ids in run.tokens[k])
        num_prompt += sum(len(prompt) for ids in run.tokens[k] if ids)     # each sequence's, at its first token
        for i, ids in enumerate(run.tokens[k]):
            assert_rules_kept(engine.tokenizer, params, len(prompt), ids, run.texts[k][i], run.logprobs[k][i],
                              run.finishes[k, i], max_len)
        got_prompt_lps = run.prompt_logprobs[k]
        if params.prompt_logprobs is not None and k not in run.aborted:
            assert len(got_prompt_lps) == len(prompt) and got_prompt_lps[0] is None, (k, len(got_prompt_lps))
            assert all(t in d for t, d in zip(prompt[1:], got_prompt_lps[1:]))
        # FP8 K/V are not batch-invariant on the CPU: OpenBLAS's sums differ in the last bits with
        # the rows of a product (a chunk of 24 prompt tokens against 16), and E4M3's 3-bit mantissa
        # turns such a difference into a rounding flip of a cache element (0.1 to 1 in a later
        # logprob): only the float32 cache's outputs are the request's alone
        if r["kind"] == "random" or kv_dtype == "fp8":
            continue
        want = alone(r["prompt"], params, kv_dtype, max_len)
        if params.prompt_logprobs is not None and k not in run.aborted:
            assert [None if d is None else sorted(d) for d in got_prompt_lps] == want["prompt_logprobs"], k
        for i, ids in enumerate(run.tokens[k]):
            w_ids, w_text, w_lps, *w_end = want["outputs"][i]
            lps = [sorted(d) for d in run.logprobs[k][i]]
            if run.finishes[k, i][0] == "abort":
                assert k in run.aborted and ids == w_ids[:len(ids)] and lps == w_lps[:len(lps)], (r["rid"], i)
            else:
                assert (ids, list(run.finishes[k, i])) == (w_ids, w_end), (r["rid"], i, ids, w_ids, w_end)
                assert (run.texts[k][i], lps) == (w_text, w_lps), (r["rid"], i)
    stats = engine.stats()
    assert +Counter(stats.num_requests_finished) == +reasons
    assert (stats.generation_tokens_total, stats.prompt_tokens_total) == (num_generated, num_prompt)
    for name, value in [("preempted", stats.num_preemptions), ("prefix hit", stats.prefix_cache_hits),
                        ("host hit", stats.kv_offload_hits), ("aborted", len(run.aborted)),
                        ("accepted drafts", stats.spec_decode.num_accepted_tokens if stats.spec_decode else 0)]:
        event(f"{name}: {'yes' if value else 'no'}")


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.data_too_large])
@given(data=st.data())
def test_random_engines_and_request_mixes_keep_every_invariant(stories_path, golden, alone, data):
    config = data.draw(engine_configs(), label="config")
    requests = data.draw(request_lists(golden, waves=data.draw(st.booleans())), label="requests")
    resets = data.draw(st.lists(st.integers(0, 40), max_size=3), label="reset_prefix_cache steps")
    run_scenario(stories_path, config, requests, alone, resets)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.data_too_large])
@given(data=st.data())
def test_waves_of_shared_prompts_through_the_host_tier_keep_every_invariant(stories_path, golden, alone, data):
    config = data.draw(engine_configs(host_tier=True), label="config")
    requests = data.draw(request_lists(golden, waves=True), label="requests")
    resets = data.draw(st.lists(st.integers(0, 70), max_size=2), label="reset_prefix_cache steps")
    run_scenario(stories_path, config, requests, alone, resets)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.data_too_large])
@given(data=st.data())
def test_priorities_on_a_pool_at_its_minimum_keep_every_invariant(stories_path, golden, alone, data):
    config = data.draw(engine_configs(by_priority=True), label="config")
    requests = data.draw(request_lists(golden), label="requests")
    run_scenario(stories_path, config, requests, alone)
