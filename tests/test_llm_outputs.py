"""What vLLM users read of LLM.generate's outputs: RequestOutput and CompletionOutput fields, and
the stop rules that shape the text (min_tokens holds stop strings off, as it does EOS)."""
from __future__ import annotations

import math

import pytest

from minillm import LLM, SamplingParams

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm(stories_path):
    return LLM(str(stories_path), device="cpu")


def test_min_tokens_holds_stop_strings_off(llm):
    """vLLM looks for stop strings only once min_tokens tokens are out; the greedy story's first
    token is ',' so without min_tokens the text is empty."""
    [plain] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30, stop=[","]))
    assert plain.outputs[0].text == "" and plain.outputs[0].stop_reason == ","
    [held] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30, min_tokens=10, stop=[","]))
    out = held.outputs[0]
    assert len(out.token_ids) > 10 and out.finish_reason == "stop" and out.stop_reason == ","
    assert out.text.startswith(", there was") and not out.text.endswith(",")
    [free] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=len(out.token_ids), ignore_eos=True))
    assert free.outputs[0].text.startswith(out.text + ",")


def test_request_output_fields_vllm_users_read(llm):
    ids = llm.get_tokenizer().encode(PROMPT)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, logprobs=2, n=2)
    outs = llm.generate([PROMPT, ids, {"prompt": "Lily"}, {"prompt_token_ids": ids}], params, use_tqdm=True)
    assert [o.prompt for o in outs] == [PROMPT, None, "Lily", None]
    assert outs[0].prompt_token_ids == ids and outs[2].prompt_token_ids[0] == 1
    for out in outs:
        assert out.finished is True and isinstance(out.num_cached_tokens, int)
        assert len(out.outputs) == 2 and [c.index for c in out.outputs] == [0, 1]
        for c in out.outputs:
            assert c.finished() and c.finish_reason == "length" and c.stop_reason is None
            assert len(c.token_ids) == 12 == len(c.logprobs)
            assert all(t in lp and len(lp) in (2, 3) for t, lp in zip(c.token_ids, c.logprobs))
            assert math.isclose(c.cumulative_logprob, sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs)),
                                rel_tol=1e-6, abs_tol=1e-6)
            assert c.text == llm.get_tokenizer().decode(out.prompt_token_ids + c.token_ids)[len(
                llm.get_tokenizer().decode(out.prompt_token_ids)):]
    # the same seed and prompt give the same n choices, and the two choices differ
    assert [c.token_ids for c in outs[0].outputs] == [c.token_ids for c in outs[1].outputs]
    assert outs[0].outputs[0].token_ids != outs[0].outputs[1].token_ids


def test_num_cached_tokens_counts_the_prefix_cache(llm):
    prompt = "Once upon a time there was a little girl named Lily who liked to"
    [first] = llm.generate(prompt + " run", SamplingParams(temperature=0, max_tokens=2))
    [again] = llm.generate(prompt + " play", SamplingParams(temperature=0, max_tokens=2))
    assert again.num_cached_tokens == again.metrics.num_cached_tokens
    assert again.num_cached_tokens >= 16 and again.num_cached_tokens % 16 == 0
    assert again.num_cached_tokens < len(again.prompt_token_ids)


def test_a_prompt_near_the_context_end_is_cut_with_length_not_refused(stories_path):
    """As in vLLM's LLM: max_tokens past max_model_len ends the output where the context does
    ("length"), and the batch's other prompts run as asked; a prompt with no room left is refused."""
    small = LLM(str(stories_path), device="cpu", max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    near, plain = small.generate([[1] + [263] * 59, PROMPT], params)
    assert len(near.outputs[0].token_ids) == 4 and near.outputs[0].finish_reason == "length"
    assert len(plain.outputs[0].token_ids) == 16
    [last] = small.generate([[1] + [263] * 62], params)
    assert len(last.outputs[0].token_ids) == 1 and last.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="64 tokens.*max_model_len 64"):
        small.generate([[1] + [263] * 63], params)


def test_logprobs_read_as_vllms_logprob_objects(llm):
    """vLLM users read out.logprobs[i][token_id].logprob (and .rank, .decoded_token); the values are
    also plain floats, as minillm's own code and JSON writers take them."""
    [out] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=3))
    c = out.outputs[0]
    tok = llm.get_tokenizer()
    for token_id, entries in zip(c.token_ids, c.logprobs):
        chosen = entries[token_id]
        assert chosen.logprob == float(chosen) <= 0 and chosen.rank == 1         # greedy: the likeliest
        # decoded alone, with the leading space a SentencePiece "▁" stands for (decode() strips it) put back
        piece = tok.convert_ids_to_tokens(token_id)
        spaces = " " * (len(piece) - len(piece.lstrip("▁")))
        assert chosen.decoded_token == spaces + tok.decode([token_id], skip_special_tokens=False)
        ranked = sorted(entries.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked] == [1, 2, 3] and [float(lp) for lp in ranked] == sorted(
            map(float, entries.values()), reverse=True)
    assert math.isclose(c.cumulative_logprob, sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)),
                        rel_tol=1e-6, abs_tol=1e-6)
    [sampled] = llm.generate(PROMPT, SamplingParams(temperature=5.0, seed=1, max_tokens=12, logprobs=1))
    below = [lp[t] for t, lp in zip(sampled.outputs[0].token_ids, sampled.outputs[0].logprobs) if len(lp) == 2]
    assert below and all(lp.rank > 1 for lp in below)            # sampled below the top one: its place
