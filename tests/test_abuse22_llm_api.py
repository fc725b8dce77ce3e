"""A vLLM offline script ported to minillm: the tokenizer LLM hands out, the LLM methods vLLM has,
and the SamplingParams and constructor values vLLM takes, each doing what vLLM does or refused by name."""
import re

import pytest

from minillm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6)
TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m.content }} {% endfor %}{% if add_generation_prompt %}Tom:{% endif %}"
MESSAGES = [{"role": "user", "content": "Lily had a red ball."}]


@pytest.fixture(scope="module")
def llm(stories_path):
    """One stories260K LLM on the CPU for the module."""
    with LLM(str(stories_path), device="cpu", max_model_len=128) as model:
        yield model


def test_apply_chat_template_has_the_defaults_of_vllms_transformers_tokenizer(llm, stories_path):
    """vLLM's get_tokenizer() is a transformers tokenizer (transformers < 5): apply_chat_template returns
    token ids and adds no generation prompt unless asked. minillm's returned the text with the
    generation prompt, so a ported script tokenized it again or counted characters as tokens."""
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(stories_path))
    tok = llm.get_tokenizer()
    ids = tok.apply_chat_template(MESSAGES, chat_template=TEMPLATE)
    assert ids == ref.apply_chat_template(MESSAGES, chat_template=TEMPLATE, return_dict=False)
    assert tok.apply_chat_template(MESSAGES, chat_template=TEMPLATE, tokenize=False) == "<s>Lily had a red ball. "
    assert tok.apply_chat_template(MESSAGES, chat_template=TEMPLATE, return_dict=True) == \
        dict(ref.apply_chat_template(MESSAGES, chat_template=TEMPLATE, return_dict=True))
    # The ids of the generation prompt are what LLM.chat generates from.
    prompt_ids = tok.apply_chat_template(MESSAGES, chat_template=TEMPLATE, add_generation_prompt=True)
    assert prompt_ids == ref.apply_chat_template(MESSAGES, chat_template=TEMPLATE, add_generation_prompt=True,
                                                 return_dict=False)
    [chat] = llm.chat(MESSAGES, GREEDY, chat_template=TEMPLATE)
    [tokens] = llm.generate({"prompt_token_ids": prompt_ids}, GREEDY)
    assert chat.prompt_token_ids == prompt_ids and chat.outputs[0].token_ids == tokens.outputs[0].token_ids


@pytest.mark.parametrize("kwargs", [{"return_tensors": "np"}, {"padding": "longest"}, {"truncation": True},
                                    {"max_length": 4}, {"return_assistant_tokens_mask": True}])
def test_apply_chat_template_refuses_tokenization_options_it_cannot_honour(llm, kwargs):
    """transformers' return_tensors, padding, truncation, ... reached the template as variables: the
    ids came back as a plain, whole list without a word."""
    tok = llm.get_tokenizer()
    off = dict(padding=False, truncation=False, max_length=None, return_tensors=None, tokenizer_kwargs={})
    assert tok.apply_chat_template(MESSAGES, chat_template=TEMPLATE, **off) == \
        tok.apply_chat_template(MESSAGES, chat_template=TEMPLATE)
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=rf"apply_chat_template: {name}=.* is not supported"):
        tok.apply_chat_template(MESSAGES, chat_template=TEMPLATE, **kwargs)


def test_reset_prefix_cache_forgets_the_cached_prompts(llm):
    """vLLM's LLM.reset_prefix_cache (benchmarks call it between runs) was an AttributeError."""
    prompt = "Once upon a time there was a little girl named Lily who liked to play in the park"
    first = llm.generate(prompt, GREEDY)[0]
    again = llm.generate(prompt, GREEDY)[0]
    assert again.num_cached_tokens >= 16 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.reset_prefix_cache() is True
    fresh = llm.generate(prompt, GREEDY)[0]
    assert fresh.num_cached_tokens == 0 and fresh.outputs[0].token_ids == first.outputs[0].token_ids
    # While a request holds blocks nothing is forgotten, as in vLLM.
    engine = llm.llm_engine
    engine.add_request("running", prompt, GREEDY)
    engine.step()
    assert engine.reset_prefix_cache() is False
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.generate(prompt, GREEDY)[0].num_cached_tokens >= 16


def test_set_tokenizer_takes_back_the_tokenizer_get_tokenizer_returned(llm, stories_path):
    """vLLM scripts set a chat template on llm.get_tokenizer() and hand it back with set_tokenizer,
    which was an AttributeError; another tokenizer is refused by name, never taken without effect."""
    from minillm.tokenizer import Tokenizer
    tok = llm.get_tokenizer()
    saved = tok.chat_template
    tok.chat_template = TEMPLATE
    try:
        llm.set_tokenizer(tok)
        [out] = llm.chat(MESSAGES, GREEDY)
    finally:
        tok.chat_template = saved
    assert out.prompt == "<s>Lily had a red ball. Tom:"
    with pytest.raises(ValueError, match="set_tokenizer takes only the tokenizer get_tokenizer"):
        llm.set_tokenizer(Tokenizer.from_pretrained(stories_path))
    assert llm.get_tokenizer() is tok


@pytest.mark.parametrize("name, why", [
    ("embed", "generative models only"), ("encode", "generative models only"), ("classify", "no pooling API"),
    ("score", "no pooling API"), ("reward", "no pooling API"),
    ("sleep", "until shutdown"), ("wake_up", "until shutdown"), ("start_profile", "no torch profiler"),
    ("stop_profile", "no torch profiler"),
])
def test_vllm_methods_minillm_lacks_are_refused_with_the_reason(llm, name, why):
    """They were bare AttributeErrors; hasattr() stays False, as a script that looks first needs."""
    with pytest.raises(AttributeError, match=rf"LLM\.{name}\(\) is vLLM's and not supported: .*{why}"):
        getattr(llm, name)("Once")
    assert not hasattr(llm, name)
    with pytest.raises(AttributeError, match="'LLM' object has no attribute 'generat'$"):
        llm.generat


def test_logprobs_true_asks_for_one_as_in_vllm(llm):
    """vLLM reads logprobs=True and prompt_logprobs=True as 1; minillm refused them."""
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=True, prompt_logprobs=True)
    assert (params.logprobs, params.prompt_logprobs) == (1, 1)
    [out] = llm.generate("Once upon", params)
    [one] = llm.generate("Once upon", SamplingParams(temperature=0, max_tokens=3, logprobs=1, prompt_logprobs=1))
    assert out.outputs[0].logprobs == one.outputs[0].logprobs and out.prompt_logprobs == one.prompt_logprobs
    assert all(1 <= len(entry) <= 2 for entry in out.outputs[0].logprobs)
    with pytest.raises(ValueError, match=r"logprobs must be an integer in \[0, 20\], got False"):
        SamplingParams(logprobs=False)


def test_swap_space_and_hf_overrides_are_taken_where_minillm_does_the_same(stories_path):
    """vLLM scripts pass swap_space and hf_overrides; both were TypeErrors that did not say why."""
    # swap_space at vLLM's default of 4 GiB too: vLLM's V1 engine recomputes a preempted request, as minillm does.
    model = LLM(str(stories_path), device="cpu", max_model_len=64, swap_space=4, hf_overrides={})
    assert model.generate("Once", GREEDY)[0].outputs[0].text
    model.shutdown()
    for kwargs, needle in [({"swap_space": -1}, "swap_space=-1 is not supported: minillm keeps no CPU swap space"),
                           ({"hf_overrides": {"max_position_embeddings": 1024}},
                            "hf_overrides={'max_position_embeddings': 1024} is not supported: minillm reads the "
                            "model's config.json as it is")]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            LLM(str(stories_path), device="cpu", **kwargs)


def test_a_prompt_dicts_cache_salt_keeps_its_prefix_cache_to_its_salt(llm):
    """vLLM's TextPrompt and TokensPrompt take "cache_salt"; LLM.generate refused the key, though the
    engine keeps a salted request's prefix-cache blocks to requests of the same salt."""
    from minillm import TextPrompt, TokensPrompt
    text = "Tom and Lily went to the park to play with a big red ball and a small blue kite one day"
    ids = llm.get_tokenizer().encode(text)
    salted = llm.generate(TextPrompt(prompt=text, cache_salt="user-a"), GREEDY)[0]
    same = llm.generate(TokensPrompt(prompt_token_ids=ids, cache_salt="user-a"), GREEDY)[0]
    other = llm.generate({"prompt": text, "cache_salt": "user-b"}, GREEDY)[0]
    plain = llm.generate(text, GREEDY)[0]
    assert same.num_cached_tokens >= 16 and other.num_cached_tokens == 0 == plain.num_cached_tokens
    assert same.outputs[0].token_ids == salted.outputs[0].token_ids == other.outputs[0].token_ids
    engine = llm.llm_engine
    engine.add_request("salted", {"prompt": text, "cache_salt": "user-b"}, GREEDY)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].num_cached_tokens >= 16
    for prompt, needle in [({"prompt": text, "cache_salt": ""}, "cache_salt must be a non-empty string"),
                           ({"prompt": text, "cache_salt": 5}, "cache_salt must be a non-empty string, got 5")]:
        with pytest.raises(ValueError, match=needle):
            llm.generate(["Once", prompt], GREEDY)
    with pytest.raises(ValueError, match="cache_salt is given twice"):
        engine.add_request("twice", {"prompt": text, "cache_salt": "a"}, GREEDY, cache_salt="b")
    assert not engine.has_unfinished_requests()


def test_engine_counts_its_unfinished_requests_as_vllm_names_it(stories_path):
    from minillm import SamplingParams
    from minillm.config import EngineConfig
    from minillm.engine import LLMEngine
    engine = LLMEngine(EngineConfig(model=str(stories_path), device="cpu", num_kv_blocks=32), log=lambda _: None)
    assert engine.get_num_unfinished_requests() == 0
    for rid in ("a", "b", "c"):
        engine.add_request(rid, "Once upon a time", SamplingParams(temperature=0, max_tokens=4))
    assert engine.get_num_unfinished_requests() == 3
    engine.abort_request("b")
    assert engine.get_num_unfinished_requests() == 2
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {o.request_id for o in engine.step() if o.finished}
        assert engine.get_num_unfinished_requests() == 2 - len(finished - {"b"})
    assert engine.get_num_unfinished_requests() == 0 and finished >= {"a", "c"}
