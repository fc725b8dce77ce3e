"""SamplingParams and LLM.generate's inputs against vLLM's: normalisation, refusals, tokenization_kwargs."""
import pickle

import pytest

from minillm import SamplingParams

GREEDY = dict(temperature=0, max_tokens=2)
IDS = [1, 403, 407, 261, 378, 432, 383]      # "Once upon a time, there" as stories260K tokenizes it


def test_fields_after_n_are_keyword_only_as_their_order_differs_from_vllms():
    """vLLM's second positional field is presence_penalty: SamplingParams(1, 0.5) set temperature here."""
    with pytest.raises(TypeError, match="positional"):
        SamplingParams(1, 0.5)
    assert SamplingParams(2, temperature=0.5).n == 2


@pytest.mark.parametrize("budget", [-1, None])
def test_thinking_token_budget_minus_one_is_no_budget_as_in_vllm(budget):
    assert SamplingParams(thinking_token_budget=budget) == SamplingParams()


@pytest.mark.parametrize("budget", [0, 16, True, -2, 1.0])
def test_a_thinking_token_budget_is_still_refused_by_name(budget):
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=budget)


def test_stop_token_ids_and_bad_words_keep_the_first_of_each_in_order_as_vllms_do():
    p = SamplingParams(stop_token_ids=[7, 3, 7, 5, 3], bad_words=("dog", "cat", "dog"))
    assert p.stop_token_ids == [7, 3, 5] and p.bad_words == ["dog", "cat"]
    assert pickle.loads(pickle.dumps(p)) == p and p.clone() == p


@pytest.mark.parametrize("words", [[""], ["dog", ""]])
def test_an_empty_bad_word_is_refused_where_the_params_are_made(words):
    with pytest.raises(ValueError, match="bad_words cannot contain an empty string"):
        SamplingParams(bad_words=words)


def test_generate_truncates_prompts_by_tokenization_kwargs_as_vllm_017_does(llm):
    """vLLM 0.17 moved truncate_prompt_tokens from SamplingParams to generate's tokenization_kwargs;
    minillm refused that key."""
    params = SamplingParams(**GREEDY)
    outs = llm.generate([{"prompt_token_ids": IDS}, "Once upon a time, there"], params, use_tqdm=False,
                        tokenization_kwargs={"truncate_prompt_tokens": 3})
    assert [o.prompt_token_ids for o in outs] == [IDS[-3:], IDS[-3:]]
    want = llm.generate({"prompt_token_ids": IDS[-3:]}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert outs[0].outputs[0].token_ids == want
    assert params.truncate_prompt_tokens is None       # the caller's params are left as they were


def test_truncation_by_tokenization_kwargs_keeps_add_special_tokens(llm):
    out = llm.generate("Once upon", SamplingParams(**GREEDY), use_tqdm=False,
                       tokenization_kwargs={"truncate_prompt_tokens": 5, "add_special_tokens": False})[0]
    assert out.prompt_token_ids == IDS[1:3]


def test_chat_truncates_by_tokenization_kwargs(llm):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    messages = [{"role": "user", "content": "Once upon a time, there"}]
    out = llm.chat(messages, SamplingParams(**GREEDY), use_tqdm=False, chat_template=template,
                   tokenization_kwargs={"truncate_prompt_tokens": 2})[0]
    assert out.prompt_token_ids == IDS[-2:]


@pytest.mark.parametrize("keep", [0, -2, 1.5, True, "3"])
def test_a_bad_truncate_prompt_tokens_in_tokenization_kwargs_is_named(llm, keep):
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate("Once", SamplingParams(**GREEDY), use_tqdm=False,
                     tokenization_kwargs={"truncate_prompt_tokens": keep})
    assert llm.llm_engine.get_num_unfinished_requests() == 0


def test_truncate_prompt_tokens_in_both_places_must_agree(llm):
    with pytest.raises(ValueError, match="truncate_prompt_tokens is 3 in tokenization_kwargs and 4"):
        llm.generate("Once", SamplingParams(truncate_prompt_tokens=4, **GREEDY), use_tqdm=False,
                     tokenization_kwargs={"truncate_prompt_tokens": 3})
    out = llm.generate({"prompt_token_ids": IDS}, SamplingParams(truncate_prompt_tokens=3, **GREEDY),
                       use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 3})[0]
    assert out.prompt_token_ids == IDS[-3:]


def test_a_lora_request_list_of_another_length_than_the_prompts_is_refused(llm):
    """vLLM: 'Lora request list should be the same length as the prompts'; minillm ran both prompts."""
    with pytest.raises(ValueError, match="lora_request has 1 entries for 2 prompts"):
        llm.generate(["Once", "Lily"], SamplingParams(**GREEDY), use_tqdm=False, lora_request=[None])
    assert len(llm.generate(["Once", "Lily"], SamplingParams(**GREEDY), use_tqdm=False,
                            lora_request=[None, None])) == 2
