"""Prompt log-probabilities (SamplingParams.prompt_logprobs, and echo with logprobs on the server) on
stories260K (CPU): equal to transformers' logits, and the same however the prompt is computed
(one step or chunks, after a preemption, with async scheduling, speculation or n > 1, beside a
cached copy of the prompt), while requests that do not ask are unchanged."""
import json

import numpy as np
import pytest
from test_server_helpers import running_server

from minillm import LLM, SamplingParams
from minillm.ops import numpy as npops

TOP = 3


@pytest.fixture(scope="module")
def reference(stories_path) -> dict:
    return json.loads((stories_path / "reference.json").read_text())


@pytest.fixture(scope="module")
def long_prompt(reference) -> list[int]:
    """70 tokens of the golden text: several chunks at a 16-token budget."""
    return reference["greedy_from_bos_200_ids"][:70]


def scored(llm: LLM, prompts, **kw) -> list:
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=TOP, **kw)
    return llm.generate(prompts, params)


def assert_same_entries(got: list, want: list) -> None:
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for i, (a, b) in enumerate(zip(got[1:], want[1:]), start=1):
        assert a.keys() == b.keys(), i
        np.testing.assert_allclose([a[k] for k in b], list(b.values()), rtol=1e-4, atol=1e-5, err_msg=str(i))


def test_prompt_logprobs_are_transformers_log_softmax(stories_path, reference):
    ids = reference["prompt_ids"]
    logits = np.asarray(reference["prompt_logits_fp32"], np.float32)          # [P, V] at each position
    out = scored(LLM(str(stories_path), device="cpu"), [ids])[0]
    assert out.prompt_token_ids == ids and len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        want = npops.log_softmax(logits[i - 1:i])[0]
        entry = out.prompt_logprobs[i]
        top = set(np.argsort(-want)[:TOP].tolist())
        assert set(entry) == top | {ids[i]}                                     # the token and the top 3
        for token, logprob in entry.items():
            assert logprob == pytest.approx(float(want[token]), abs=1e-4)
            # vLLM's Logprob, as the outputs' own: the top ones ranked 1.., each with its text
            assert logprob.logprob == float(logprob) and logprob.decoded_token is not None
        ranks = sorted(lp.rank for t, lp in entry.items() if t in top)
        assert ranks == list(range(1, TOP + 1))


def test_each_prompt_token_carries_its_rank_in_the_vocabulary(stories_path, long_prompt):
    """vLLM's rank for a prompt token (the entries at least as likely, itself included), whether or
    not it is among the top ones asked for."""
    from test_model_parity import minillm_prompt_logits
    from test_sampling import rank_bounds
    ids = long_prompt[:1] + long_prompt[1:30][::-1]            # backwards: tokens far down the ranking
    want = npops.log_softmax(minillm_prompt_logits(stories_path, ids))       # [P, V]
    llm = LLM(str(stories_path), device="cpu")
    for k in (0, 2):
        [out] = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=k))
        ranks = [out.prompt_logprobs[i][ids[i]].rank for i in range(1, len(ids))]
        for i, rank in enumerate(ranks, start=1):
            low, high = rank_bounds(want[i - 1], ids[i])
            assert low <= rank <= high, i
        assert max(ranks) > 10


def test_the_same_entries_however_the_prompt_is_computed(stories_path, long_prompt):
    whole = scored(LLM(str(stories_path), device="cpu"), [long_prompt])[0]
    assert len(whole.prompt_logprobs) == len(long_prompt)
    variants = {
        "chunks of 16": dict(max_num_batched_tokens=16),
        "async scheduling": dict(max_num_batched_tokens=16, async_scheduling=True),
        "speculation": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
    }
    for name, engine_args in variants.items():
        out = scored(LLM(str(stories_path), device="cpu", **engine_args), [long_prompt])[0]
        assert_same_entries(out.prompt_logprobs, whole.prompt_logprobs)
        assert out.outputs[0].token_ids == whole.outputs[0].token_ids, name
    # The prompt cached by an earlier request is computed again for one that scores it, n > 1 too.
    llm = LLM(str(stories_path), device="cpu", max_num_batched_tokens=16)
    llm.generate([long_prompt], SamplingParams(temperature=0, max_tokens=2))
    again = scored(llm, [long_prompt], n=2)[0]
    assert_same_entries(again.prompt_logprobs, whole.prompt_logprobs)
    assert [c.token_ids for c in again.outputs] == [whole.outputs[0].token_ids] * 2


def test_a_preempted_request_keeps_one_entry_per_prompt_token(stories_path, long_prompt):
    whole = scored(LLM(str(stories_path), device="cpu"), [long_prompt])[0]
    # 12 blocks of 16 tokens for 4 requests of 70 + 40 tokens: they preempt each other.
    llm = LLM(str(stories_path), device="cpu", num_kv_blocks=12, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=TOP)
    outs = llm.generate([long_prompt] * 4, params)
    assert llm.engine.stats().num_preemptions > 0
    for out in outs:
        assert_same_entries(out.prompt_logprobs, whole.prompt_logprobs)


def test_requests_that_do_not_ask_are_unchanged_and_get_none(stories_path, long_prompt, reference):
    llm = LLM(str(stories_path), device="cpu", max_num_batched_tokens=16)
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([reference["prompt_ids"]], plain)[0]
    both = llm.generate([reference["prompt_ids"], long_prompt],
                        [plain, SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=0)])
    assert both[0].outputs[0].token_ids == alone.outputs[0].token_ids and both[0].prompt_logprobs is None
    assert all(len(e) == 1 for e in both[1].prompt_logprobs[1:])              # prompt_logprobs=0: the token alone


@pytest.mark.parametrize("value", [-1, 21, 1.5, False])
def test_bad_prompt_logprobs_name_the_field(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_echo_with_logprobs_scores_the_prompt_on_the_server(stories_path, long_prompt, caplog):
    import httpx

    whole = scored(LLM(str(stories_path), device="cpu"), [long_prompt])[0]
    with running_server(stories_path) as (url, _):
        body = {"prompt": long_prompt, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": TOP}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        n = len(long_prompt)
        assert len(lp["tokens"]) == n + 4 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = [whole.prompt_logprobs[i][t] for i, t in enumerate(long_prompt) if i]
        np.testing.assert_allclose(lp["token_logprobs"][1:n], want, rtol=1e-4, atol=1e-5)
        # the TOP most likely, and the prompt's own token where it is not among them
        assert all(TOP <= len(top) <= TOP + 1 and top[t] == v
                   for t, v, top in zip(lp["tokens"][1:n], lp["token_logprobs"][1:n], lp["top_logprobs"][1:n]))
        assert lp["text_offset"] == sorted(lp["text_offset"])
        # streamed: the first event carries the prompt's rows, and the whole equals the response
        streamed = {"tokens": [], "token_logprobs": []}
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    part = json.loads(line[6:])["choices"][0]["logprobs"]
                    if part:
                        streamed["tokens"] += part["tokens"]
                        streamed["token_logprobs"] += part["token_logprobs"]
        assert streamed["tokens"] == lp["tokens"]
        np.testing.assert_allclose(streamed["token_logprobs"][1:], lp["token_logprobs"][1:], rtol=1e-6)
        # max_tokens 0 with echo (vLLM's echo without generation): the prompt back, scored
        bare = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 0}, timeout=60).json()
        choice = bare["choices"][0]
        assert choice["finish_reason"] == "length" and bare["usage"]["completion_tokens"] == 0
        assert choice["logprobs"]["tokens"] == lp["tokens"][:n]
        np.testing.assert_allclose(choice["logprobs"]["token_logprobs"][1:], want, rtol=1e-4, atol=1e-5)
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "max_tokens": 0, "stream": True, "n": 2},
                          timeout=60) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert sorted(e["choices"][0]["index"] for e in events) == [0, 1]
        for e in events:
            c = e["choices"][0]
            assert c["text"] == choice["text"] and c["logprobs"]["tokens"] == lp["tokens"][:n]
        without_echo = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 0, "echo": False}, timeout=60)
        assert without_echo.status_code == 400 and without_echo.json()["error"]["param"] == "max_tokens"
        # vLLM's own field is taken (tests/test_server_prompt_logprobs.py), not logged as ignored
        with caplog.at_level("WARNING", logger="minillm"):
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "Once", "max_tokens": 2, "prompt_logprobs": 1},
                           timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"][0]["prompt_logprobs"]) == 2
        assert not [rec for rec in caplog.records if "ignored" in rec.getMessage()]
