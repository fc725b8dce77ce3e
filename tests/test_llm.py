"""The LLM class under vLLM's names: llm_engine, prompt dicts, and LLM.chat with a chat template."""
from __future__ import annotations

import pytest

from minillm import LLM, LLMEngine, SamplingParams

# A ChatML template: stories260K has none of its own.
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(stories_path):
    return LLM(str(stories_path), device="cpu")


def test_llm_engine_is_the_engine_underneath(llm):
    assert isinstance(llm.llm_engine, LLMEngine) and llm.llm_engine is llm.engine
    llm.llm_engine.add_request("direct", "Once upon a time", GREEDY)
    outs = []
    while llm.llm_engine.has_unfinished_requests():
        outs += [o for o in llm.llm_engine.step() if o.finished]
    [done] = outs
    assert done.outputs[0].token_ids == llm.generate("Once upon a time", GREEDY)[0].outputs[0].token_ids


def test_prompt_dicts_as_vllm_has_them(llm):
    ids = llm.get_tokenizer().encode("Once upon a time")
    outs = llm.generate([{"prompt_token_ids": ids}, {"prompt": "Once upon a time"}, "Once upon a time", ids,
                         {"prompt": "Once upon a time", "prompt_token_ids": ids}], GREEDY)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.prompt for o in outs] == [None, "Once upon a time", "Once upon a time", None, "Once upon a time"]
    assert all(o.prompt_token_ids == ids for o in outs)
    [single] = llm.generate({"prompt_token_ids": ids}, GREEDY)
    assert single.outputs[0].token_ids == outs[0].outputs[0].token_ids


@pytest.mark.parametrize("prompt, needle", [
    ({"prompt": "hi", "multi_modal_data": {"image": "cat.png"}}, "multi_modal_data"),
    ({"prompt_token_ids": "1 2 3"}, "prompt_token_ids must be a list"),
    ({}, "needs 'prompt'"),
    ({"prompt_token_ids": [1, 10 ** 9]}, "prompt token ids must be integers"),
])
def test_bad_prompt_dicts_are_refused_and_nothing_is_left_running(llm, prompt, needle):
    with pytest.raises(ValueError, match=needle):
        llm.generate(["Once upon a time", prompt], GREEDY)
    assert not llm.llm_engine.has_unfinished_requests()


def test_chat_renders_the_template_and_generates(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Tell me one."}]
    [out] = llm.chat(messages, GREEDY, chat_template=CHATML)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, chat_template=CHATML)
    assert out.prompt == text and text.endswith("<|im_start|>assistant\n")
    [same] = llm.generate({"prompt_token_ids": tok.encode(text, add_special_tokens=False)}, GREEDY)
    assert out.prompt_token_ids == same.prompt_token_ids
    assert out.outputs[0].token_ids == same.outputs[0].token_ids
    # A batch of conversations, one output each, in order.
    other = [{"role": "user", "content": "Lily?"}]
    outs = llm.chat([messages, other], GREEDY, chat_template=CHATML)
    want = tok.apply_chat_template(other, add_generation_prompt=True, tokenize=False, chat_template=CHATML)
    assert [o.prompt for o in outs] == [text, want]
    assert outs[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_chat_template_matches_transformers(stories_path, llm):
    transformers = pytest.importorskip("transformers")
    messages = [{"role": "user", "content": "Tell me about Lily."}, {"role": "assistant", "content": "She plays."},
                {"role": "user", "content": "And then?"}]
    hf = transformers.AutoTokenizer.from_pretrained(str(stories_path))
    want = hf.apply_chat_template(messages, chat_template=CHATML, add_generation_prompt=True, tokenize=False)
    [out] = llm.chat(messages, GREEDY, chat_template=CHATML)
    assert out.prompt == want


def test_chat_without_any_template_says_so(llm):
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("prompts, params, needle", [
    (None, GREEDY, "prompts must be a prompt or a list of prompts"),
    (5, GREEDY, "prompts must be a prompt or a list of prompts"),
    ([3.5], GREEDY, "prompt must be a string, a list of token ids or a prompt dict"),
    ("a \ud800 b", GREEDY, "prompt is not valid Unicode: a lone surrogate at index 2"),
    ("Once", {"max_tokens": 2}, "sampling_params must be a SamplingParams"),
    (["Once", "Lily"], [GREEDY, 7], "sampling_params must be a SamplingParams"),
])
def test_bad_generate_arguments_are_value_errors_naming_the_argument(llm, prompts, params, needle):
    with pytest.raises(ValueError, match=needle):
        llm.generate(prompts, params)
    assert not llm.llm_engine.has_unfinished_requests()


def test_the_engine_refuses_params_that_are_not_sampling_params(llm):
    with pytest.raises(ValueError, match="params must be a SamplingParams, got dict"):
        llm.llm_engine.add_request("not-params", "Once", {"max_tokens": 2})
    assert not llm.llm_engine.has_unfinished_requests()


def test_chat_joins_text_parts_and_refuses_other_content(llm):
    # As the server reads them (and vLLM): strings and text-like parts, joined by newlines.
    parts = [{"role": "user", "content": ["Tell me", {"type": "input_text", "text": "a story"},
                                         {"type": "text", "text": "now."}]},
             {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
             {"role": "user", "content": [{"type": "output_text", "text": "Please?"}]}]
    whole = [{"role": "user", "content": "Tell me\na story\nnow."}, {"role": "assistant", "content": "No."},
             {"role": "user", "content": "Please?"}]
    [joined] = llm.chat(parts, GREEDY, chat_template=CHATML)
    [plain] = llm.chat(whole, GREEDY, chat_template=CHATML)
    assert joined.prompt == plain.prompt and joined.outputs[0].token_ids == plain.outputs[0].token_ids
    bad = [([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text parts"),
           ([{"role": "user", "content": [{"type": "refusal", "text": "No."}]}], r"\[0\]\['content'\]\[0\]"),
           ([{"role": "user", "content": 5}], "must be a string or a list of text parts"),
           ([{"role": "user", "content": "a\udc80"}], "not valid Unicode"),
           ("hello", "messages must be a list of message dicts"),
           (None, "messages must be a list of message dicts")]
    for messages, needle in bad:
        with pytest.raises(ValueError, match=needle):
            llm.chat(messages, GREEDY, chat_template=CHATML)
    assert not llm.llm_engine.has_unfinished_requests()


def test_continue_final_message_matches_transformers(stories_path, llm):
    transformers = pytest.importorskip("transformers")
    messages = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a"}]
    hf = transformers.AutoTokenizer.from_pretrained(str(stories_path))
    want = hf.apply_chat_template(messages, chat_template=CHATML, add_generation_prompt=False,
                                  continue_final_message=True, tokenize=False)
    [out] = llm.chat(messages, GREEDY, chat_template=CHATML, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt == want and want.endswith("Once upon a")
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(messages, GREEDY, chat_template=CHATML, continue_final_message=True)


@pytest.mark.parametrize("kwargs, needle", [
    ({"max_model_len": "128"}, "max_model_len must be an integer, got '128'"),
    ({"max_model_len": 64.5}, "max_model_len must be an integer"),
    ({"max_num_seqs": True}, "max_num_seqs must be an integer, got True"),
    ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization must be a number"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be true or false"),
])
def test_engine_arguments_of_the_wrong_kind_are_value_errors_naming_them(stories_path, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        LLM(str(stories_path), device="cpu", **kwargs)


@pytest.mark.parametrize("kwargs, needle", [
    ({"block_size": 1 << 30}, r"block_size must be a power of two in \[1, 1024\], got 1073741824"),
    ({"block_size": 24}, "block_size must be a power of two"),
    ({"max_num_seqs": 10 ** 9}, r"max_num_seqs must be in \[1, 65536\], got 1000000000"),
    ({"max_num_seqs": 10 ** 20}, "max_num_seqs must be in"),
])
def test_engine_arguments_past_their_bounds_are_value_errors_naming_them(kwargs, needle):
    """Refused before anything is allocated (they were a NumPy MemoryError or 'dimension exceeded')."""
    from minillm.config import EngineConfig
    with pytest.raises(ValueError, match=needle):
        EngineConfig(model="any", **kwargs)


def test_none_for_an_engine_argument_with_a_default_takes_the_default():
    """As vLLM's engine arguments: max_num_seqs=None is the default, not a TypeError."""
    from minillm.config import EngineConfig
    config = EngineConfig(model="any", max_num_seqs=None, block_size=None, enable_prefix_caching=None,
                          max_num_batched_tokens=None)
    default = EngineConfig(model="any")
    assert (config.max_num_seqs, config.block_size, config.enable_prefix_caching, config.max_num_batched_tokens) == \
        (default.max_num_seqs, default.block_size, default.enable_prefix_caching, default.max_num_batched_tokens)
    assert config.max_model_len is None and config.num_kv_blocks is None      # None is these fields' default


def test_vllm_arguments_with_the_values_minillm_follows_are_taken(stories_path):
    llm = LLM(str(stories_path), device="cpu", trust_remote_code=True, quantization=None, disable_log_stats=True,
              enable_chunked_prefill=True, pipeline_parallel_size=1, data_parallel_size=1, cpu_offload_gb=0,
              tokenizer=str(stories_path), tokenizer_mode="auto", skip_tokenizer_init=False, dtype="float",
              max_logprobs=2)
    assert llm.llm_engine.dtype == "float32"
    [out] = llm.generate("Once upon a time", SamplingParams(max_tokens=2, logprobs=2, prompt_logprobs=2))
    assert all(len(lp) <= 3 for lp in out.outputs[0].logprobs)
    for field in ("logprobs", "prompt_logprobs"):       # vLLM's max_logprobs bounds both
        with pytest.raises(ValueError, match=rf"{field} must be at most max_logprobs \(2\), got 3"):
            llm.generate("Once upon a time", SamplingParams(max_tokens=2, **{field: 3}))
    assert not llm.llm_engine.has_unfinished_requests()
    assert LLM(str(stories_path), device="cpu", trust_remote_code=False).generate("Once", GREEDY)
    from minillm.config import EngineConfig
    assert (EngineConfig(model="any", dtype="half").dtype, EngineConfig(model="any", dtype="float").dtype) == \
        ("float16", "float32")                                      # vLLM's ModelDType aliases


@pytest.mark.parametrize("kwargs, needle", [
    ({"quantization": "awq"}, "quantization='awq' is not supported: minillm runs unquantized"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 64, "max_model_len": 128},
     "max_num_batched_tokens 64 is smaller than max_model_len 128"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2 is not supported"),
    ({"cpu_offload_gb": 4}, "cpu_offload_gb=4 is not supported"),
    ({"disable_log_stats": "no"}, "disable_log_stats must be true or false, got 'no'"),
    ({"trust_remote_code": "yes"}, "trust_remote_code='yes' is not supported"),
    ({"tokenizer": "./no/such/tokenizer"}, "tokenizer: no such directory: ./no/such/tokenizer"),
    ({"max_logprobs": -1}, r"max_logprobs must be an integer in \[0, 20\]"),
    ({"max_logprobs": "5"}, "max_logprobs must be an integer"),
    ({"dtype": "double"}, "dtype must be auto, float32"),
    ({"revision": "main"}, "revision 'main' names a version of a hub model"),
])
def test_vllm_arguments_minillm_cannot_honour_are_value_errors_naming_them(stories_path, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        LLM(str(stories_path), device="cpu", **kwargs)


@pytest.mark.parametrize("name, needle", [
    ("max_num_seq", r"LLM\(\) got an unexpected keyword argument 'max_num_seq' \(did you mean 'max_num_seqs'\?\)"),
    ("gpu_memory_util", r"'gpu_memory_util' \(did you mean 'gpu_memory_utilization'\?\)"),
    ("num_scheduler_steps", r"LLM\(\) got an unexpected keyword argument 'num_scheduler_steps'$"),
])
def test_an_unknown_argument_is_named_with_the_close_ones(stories_path, name, needle):
    with pytest.raises(TypeError, match=needle):
        LLM(str(stories_path), device="cpu", **{name: 1})


def test_a_revision_of_a_hub_model_is_loaded(stories_path, tmp_path, monkeypatch):
    from conftest import put_in_hf_cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    put_in_hf_cache(tmp_path / "hub", "someorg/stories", stories_path, revision="0123abcd")
    llm = LLM("someorg/stories", device="cpu", download_dir=str(tmp_path / "hub"), revision="0123abcd")
    assert llm.generate("Once upon a time", GREEDY)[0].outputs[0].token_ids == \
        LLM(str(stories_path), device="cpu").generate("Once upon a time", GREEDY)[0].outputs[0].token_ids


def test_a_model_that_is_not_a_path_is_a_value_error():
    for model in (None, 5):
        with pytest.raises(ValueError, match="model must be a model directory or hub id"):
            LLM(model, device="cpu")


def test_sampling_params_changed_after_construction_are_what_the_engine_uses(llm):
    params = SamplingParams(temperature=0, max_tokens=30, stop=["zzz"])
    unstopped = llm.generate("Once upon a time", params)[0].outputs[0]
    assert " was" in unstopped.text
    params.stop = [" was"]
    stopped = llm.generate("Once upon a time", params)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.text == unstopped.text.split(" was")[0]
    for field, value, needle in (("stop", 5, "stop must be a string or a list"),
                                 ("stop_token_ids", 5, "stop_token_ids must be a list of integers")):
        bad = SamplingParams(max_tokens=2)
        setattr(bad, field, value)
        with pytest.raises(ValueError, match=needle):
            llm.generate("Once upon a time", bad)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, needle", [
    ({"messages": []}, "may not set messages"),
    ({"tokenize": True}, "may not set tokenize"),
    (["enable_thinking"], "must be a dict"),
])
def test_chat_template_kwargs_that_clash_or_are_no_dict_are_value_errors(llm, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, chat_template=CHATML, chat_template_kwargs=kwargs)
