"""vLLM offline scripts against minillm's LLM, LLMEngine, SamplingParams and tokenizer: what vLLM
accepts works the same here, or fails with a ValueError that says why."""
import re

import pytest

from minillm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6)
PROMPTS = ["Once upon a time", "Lily had a red ball"]


@pytest.fixture(scope="module")
def expected(llm):
    """The greedy token ids of PROMPTS, generated plainly."""
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]


def _ids(outputs):
    return [out.outputs[0].token_ids for out in outputs]


# ---- LLM.generate's and LLM.chat's other vLLM arguments -----------------------------------------

def test_generate_takes_vllms_keyword_arguments_at_their_neutral_values(llm, expected):
    """vLLM scripts pass lora_request=None, priority and use_tqdm=False; lora_request was a TypeError."""
    assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=None)) == expected
    assert _ids(llm.generate(PROMPTS, GREEDY, lora_request=[None, None], priority=[0, 0])) == expected
    assert _ids(llm.generate(PROMPTS, GREEDY, tokenization_kwargs={}, prompt_adapter_request=None)) == expected
    [chat] = llm.chat([{"role": "user", "content": "Hi"}], GREEDY, lora_request=None, mm_processor_kwargs=None,
                      chat_template="{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert chat.prompt == "<s>Hi"
    assert llm.get_tokenizer(lora_request=None) is llm.get_tokenizer()


@pytest.mark.parametrize("kwargs, needle", [
    ({"lora_request": object()}, "lora_request=<object object at .*> is not supported: minillm runs the base "
                                 "model's own weights and loads no LoRA adapters"),
    ({"lora_request": [None, "adapter"]}, r"lora_request=\[None, 'adapter'\] is not supported"),
    ({"priority": [0, 1]}, "priority must be 0 under scheduling_policy 'fcfs', got 1"),
    ({"priority": [0]}, "priority has 1 entries for 2 prompts"),
    ({"priority": 1}, "priority must be a list of integers, one a prompt, got 1"),
    ({"prompt_adapter_request": "x"}, "prompt_adapter_request='x' is not supported: minillm has no prompt adapters"),
    ({"tokenization_kwargs": {"truncation": True}}, "tokenization_kwargs 'truncation': not supported"),
    ({"tokenization_kwargs": {"add_special_tokens": "no"}},
     r"tokenization_kwargs\['add_special_tokens'\] must be true or false, got 'no'"),
])
def test_generate_refuses_what_it_cannot_do_by_name_and_queues_nothing(llm, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        llm.generate(PROMPTS, GREEDY, **kwargs)
    assert not llm.llm_engine.has_unfinished_requests()


def test_lora_request_is_refused_by_chat_and_get_tokenizer_too(llm):
    for call in (lambda: llm.chat([{"role": "user", "content": "Hi"}], GREEDY, lora_request="adapter"),
                 lambda: llm.get_tokenizer(lora_request="adapter")):
        with pytest.raises(ValueError, match="lora_request='adapter' is not supported"):
            call()
    with pytest.raises(ValueError, match="mm_processor_kwargs=.* is not supported: minillm runs text-only models"):
        llm.chat([{"role": "user", "content": "Hi"}], GREEDY, mm_processor_kwargs={"num_crops": 4})


def test_tokenization_kwargs_add_special_tokens_false_leaves_out_bos(llm):
    """vLLM's tokenization_kwargs={"add_special_tokens": False}: the prompt's ids without BOS, the text as given."""
    tok = llm.get_tokenizer()
    [out] = llm.generate("Once upon a time", GREEDY, tokenization_kwargs={"add_special_tokens": False})
    assert out.prompt == "Once upon a time"
    assert out.prompt_token_ids == tok.encode("Once upon a time", add_special_tokens=False)
    assert out.prompt_token_ids[0] != tok.bos_token_id
    [same] = llm.generate({"prompt_token_ids": out.prompt_token_ids}, GREEDY)
    assert same.outputs[0].token_ids == out.outputs[0].token_ids


# ---- llm.llm_engine.model_config -----------------------------------------------------------------

def test_model_config_has_the_fields_vllm_scripts_read(llm, stories_path):
    """vLLM scripts read llm.llm_engine.model_config.max_model_len (to size prompts); minillm's
    model_config was the model's shape alone, an AttributeError for max_model_len."""
    import dataclasses
    import json
    engine = llm.llm_engine
    mc = engine.model_config
    assert engine.get_model_config() is mc
    path = str(stories_path)
    assert (mc.max_model_len, mc.model, mc.tokenizer, mc.dtype) == (128, path, path, "float32")
    assert mc.max_model_len == engine.max_model_len and mc.served_model_name == str(stories_path)
    assert (mc.seed, mc.max_logprobs, mc.quantization, mc.revision, mc.generation_config) == (0, 20, None, None, "auto")
    assert (mc.get_vocab_size(), mc.get_hidden_size(), mc.get_head_size()) == (512, 64, 8)
    assert mc.get_total_num_kv_heads() == 4
    on_disk = json.loads((stories_path / "config.json").read_text())
    assert mc.hf_config.to_dict() == on_disk and mc.hf_text_config is mc.hf_config
    assert mc.hf_config.num_hidden_layers == 5 and mc.hf_config.architectures == ["LlamaForCausalLM"]
    assert "model_type" in mc.hf_config and "sliding_window" not in mc.hf_config
    with pytest.raises(AttributeError, match="the model's config.json has no 'sliding_window'"):
        mc.hf_config.sliding_window
    assert getattr(mc.hf_config, "sliding_window", None) is None
    # read-only: the engine runs with these values, so changing them must not seem to work
    with pytest.raises(dataclasses.FrozenInstanceError):
        mc.max_model_len = 64
    with pytest.raises(AttributeError, match="hf_config is read-only"):
        mc.hf_config.vocab_size = 1
    mc.hf_config.to_dict()["vocab_size"] = 1
    assert mc.hf_config.vocab_size == 512 == mc.vocab_size


def test_model_config_max_model_len_is_the_one_fitted_to_the_pool(stories_path):
    """Without max_model_len the engine fits the model's 512 positions to a small pool: the view says what runs."""
    with LLM(str(stories_path), device="cpu", num_kv_blocks=8, block_size=16, served_model_name="tiny") as small:
        mc = small.llm_engine.model_config
        assert mc.max_model_len == small.llm_engine.max_model_len == 128 < mc.max_position_embeddings == 512
        assert mc.served_model_name == "tiny"


# ---- SamplingParams(output_kind=...) ----------------------------------------------------------------

def _run(engine, request_id, prompt, params, **kwargs):
    engine.add_request(request_id, prompt, params, **kwargs)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == request_id]
    return outs


def test_output_kind_delta_reports_only_what_is_new(llm):
    """vLLM's RequestOutputKind.DELTA: each step's output carries the new token ids, text and
    logprobs; their concatenation is the cumulative output. SamplingParams refused the field."""
    from minillm.sampling_params import RequestOutputKind
    engine = llm.llm_engine
    common = dict(temperature=0, max_tokens=10, logprobs=1, prompt_logprobs=1, stop=["girl"])
    full = _run(engine, "cumulative", "Once upon a time", SamplingParams(**common))
    deltas = _run(engine, "delta", "Once upon a time", SamplingParams(**common, output_kind=RequestOutputKind.DELTA))
    last = full[-1].outputs[0]
    assert last.finish_reason == "stop" and last.stop_reason == "girl"     # the stop string cuts the text
    assert len(deltas) > 2 and all(len(d.outputs[0].token_ids) == 1 for d in deltas)
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert sum((d.outputs[0].token_ids for d in deltas), []) == last.token_ids
    assert "".join(d.outputs[0].text for d in deltas) == last.text
    assert sum((d.outputs[0].logprobs for d in deltas), []) == last.logprobs
    assert deltas[-1].outputs[0].cumulative_logprob == pytest.approx(last.cumulative_logprob)
    assert (deltas[-1].outputs[0].finish_reason, deltas[-1].outputs[0].stop_reason) == ("stop", "girl")
    assert [d.outputs[0].finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    # the prompt's logprobs come once, whole; every delta names the prompt
    assert deltas[0].prompt_logprobs == full[-1].prompt_logprobs and len(deltas[0].prompt_logprobs) == 5
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    assert all(d.prompt_token_ids == full[-1].prompt_token_ids and d.prompt == "Once upon a time" for d in deltas)


def test_output_kind_final_only_reports_once_and_n_deltas_keep_their_index(llm):
    from minillm.sampling_params import RequestOutputKind
    engine = llm.llm_engine
    final = _run(engine, "final", "Once upon a time", SamplingParams(temperature=0, max_tokens=5,
                                                                     output_kind=RequestOutputKind.FINAL_ONLY))
    [cumulative] = [o for o in _run(engine, "c", "Once upon a time", SamplingParams(temperature=0, max_tokens=5))
                    if o.finished]
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].token_ids == cumulative.outputs[0].token_ids
    assert final[0].outputs[0].text == cumulative.outputs[0].text
    # n=2, the two completions ending at different steps (seed 4: the first at its stop string, the other later)
    sampling = dict(n=2, temperature=1.0, seed=4, max_tokens=30, stop=["."])
    deltas = _run(engine, "n", "Once upon a time", SamplingParams(**sampling, output_kind=RequestOutputKind.DELTA))
    [whole] = [o for o in _run(engine, "n-c", "Once upon a time", SamplingParams(**sampling)) if o.finished]
    assert len(whole.outputs[0].token_ids) != len(whole.outputs[1].token_ids)
    for index in (0, 1):
        mine = [c for d in deltas for c in d.outputs if c.index == index]
        assert sum((c.token_ids for c in mine), []) == whole.outputs[index].token_ids
        assert "".join(c.text for c in mine) == whole.outputs[index].text
        # a completion is reported while it has news: its finish reason comes once, in its last delta
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + ["stop"]
        assert all(c.token_ids for c in mine)
    assert all(d.outputs for d in deltas) and [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished


def test_output_kind_leaves_llm_generate_whole_and_takes_vllms_values_only(llm, expected):
    """As vLLM's LLM.generate, every kind returns the finished, whole outputs; the caller's params keep their kind."""
    from minillm.sampling_params import RequestOutputKind
    for kind in RequestOutputKind:
        params = SamplingParams(temperature=0, max_tokens=6, output_kind=kind)
        outs = llm.generate(PROMPTS, params)
        assert _ids(outs) == expected and all(o.finished for o in outs) and params.output_kind is kind
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA      # msgpack carries the value
    for value in ("delta", 3, True, None):
        with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
            SamplingParams(output_kind=value)
    engine = llm.llm_engine
    deltas = _run(engine, "by-name", "Once upon a time", SamplingParams(temperature=0, max_tokens=3),
                  output_kind="delta")
    assert [len(d.outputs[0].token_ids) for d in deltas] == [1, 1, 1]
    with pytest.raises(ValueError, match=r"output_kind must be 'cumulative', 'delta', 'final' or a "
                                         r"RequestOutputKind, got \['delta'\]"):
        engine.add_request("bad", "Once", GREEDY, output_kind=["delta"])
    assert not engine.has_unfinished_requests()


# ---- LLM(generation_config=<folder>) ---------------------------------------------------------------

def test_generation_config_folder_gives_the_sampling_defaults(stories_path, tmp_path):
    """vLLM takes generation_config as "auto", "vllm" or a folder holding generation_config.json;
    minillm refused the folder."""
    import json
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.25, "top_k": 7, "max_new_tokens": 9, "eos_token_id": 2}))
    logged = []
    from minillm.config import EngineConfig
    from minillm.engine import LLMEngine
    with LLMEngine(EngineConfig(model=str(stories_path), device="cpu", max_model_len=64,
                                generation_config=str(tmp_path)), log=logged.append) as engine:
        assert engine.sampling_defaults == {"temperature": 0.25, "top_k": 7, "max_tokens": 9}
        assert any(str(tmp_path / "generation_config.json") in line for line in logged)
    with LLM(str(stories_path), device="cpu", max_model_len=64, generation_config=tmp_path,
             override_generation_config={"top_k": 3}) as model:
        params = model.get_default_sampling_params()
        assert (params.temperature, params.top_k, params.max_tokens) == (0.25, 3, 9)
        [out] = model.generate("Once upon a time")
        assert len(out.outputs[0].token_ids) <= 9


@pytest.mark.parametrize("make, needle", [
    (lambda d: d / "missing", "generation_config '.*missing' is neither 'auto', 'vllm' nor a folder"),
    (lambda d: d, "generation_config folder .* holds no generation_config.json"),
    (lambda d: (d / "generation_config.json").write_text("[1]") and d, "generation_config.json .*object"),
    (lambda d: 5, "generation_config must be 'auto' .*, 'vllm' .* or a folder holding a generation_config.json, "
                  "got 5"),
    (lambda d: "", "generation_config must be 'auto'"),
])
def test_generation_config_that_is_no_such_folder_is_refused_by_name(stories_path, tmp_path, make, needle):
    with pytest.raises(ValueError, match=needle):
        LLM(str(stories_path), device="cpu", max_model_len=64, generation_config=make(tmp_path))


# ---- llm.get_tokenizer() reads as transformers' tokenizer ------------------------------------------

@pytest.fixture(scope="module")
def added_tokens_dir(stories_path, tmp_path_factory):
    """stories260K's tokenizer with two special tokens added past its 512 (ids 512, 513), as chat
    models add theirs."""
    import shutil

    from tokenizers import AddedToken, Tokenizer as HFTokenizer
    folder = tmp_path_factory.mktemp("added")
    backend = HFTokenizer.from_file(str(stories_path / "tokenizer.json"))
    backend.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    backend.save(str(folder / "tokenizer.json"))
    shutil.copy(stories_path / "tokenizer_config.json", folder)
    return folder


def test_vocab_size_leaves_added_tokens_out_and_len_counts_them_as_transformers(added_tokens_dir):
    """minillm's vocab_size counted the added tokens; a script sizing a logits mask by it got the wrong size."""
    transformers = pytest.importorskip("transformers")
    from minillm.tokenizer import Tokenizer
    tok, ref = Tokenizer.from_pretrained(added_tokens_dir), transformers.AutoTokenizer.from_pretrained(added_tokens_dir)
    assert (tok.vocab_size, len(tok)) == (ref.vocab_size, len(ref)) == (512, 514)
    assert tok.get_vocab() == ref.get_vocab()
    assert tok.convert_ids_to_tokens([511, 512, 513, 514]) == ref.convert_ids_to_tokens([511, 512, 513]) + [None]


def test_decode_keeps_special_tokens_unless_asked_as_transformers(added_tokens_dir):
    """transformers' decode and batch_decode keep special tokens by default; minillm's dropped them."""
    import numpy as np
    transformers = pytest.importorskip("transformers")
    from minillm.tokenizer import Tokenizer
    tok, ref = Tokenizer.from_pretrained(added_tokens_dir), transformers.AutoTokenizer.from_pretrained(added_tokens_dir)
    for ids in ([1, 403, 512, 300, 513, 2], [2, 1, 2], [403]):
        assert tok.decode(ids) == ref.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
        assert tok.decode(np.array(ids)) == ref.decode(ids)
    assert tok.decode([1, 403, 512, 2]) == "<s> Once<|im_start|></s>"
    assert tok.batch_decode([[1, 403], [513]]) == ref.batch_decode([[1, 403], [513]]) == ["<s> Once", "<|im_end|>"]
    assert tok.batch_decode([[1, 403]], skip_special_tokens=True) == ["Once"]
    assert tok.decode(403) == ref.decode(403) == "Once" == tok.decode(np.int64(403))   # one id, as transformers takes


def test_generated_text_still_leaves_special_tokens_out(llm):
    """The engine's text follows SamplingParams.skip_special_tokens (True, as vLLM's), not decode's default."""
    tok = llm.get_tokenizer()
    eos_third = SamplingParams(temperature=0, max_tokens=8, min_tokens=2, logit_bias={tok.eos_token_id: 100})
    [out] = llm.generate("Once upon a time", eos_third)
    c = out.outputs[0]
    assert c.finish_reason == "stop" and len(c.token_ids) == 3 and c.token_ids[-1] == tok.eos_token_id
    assert "</s>" not in c.text and c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    bos_only = dict(temperature=0, max_tokens=2, allowed_token_ids=[tok.bos_token_id])
    [skipped] = llm.generate("Once upon a time", SamplingParams(**bos_only))
    [kept] = llm.generate("Once upon a time", SamplingParams(**bos_only, skip_special_tokens=False))
    assert skipped.outputs[0].token_ids == kept.outputs[0].token_ids == [1, 1]
    assert (skipped.outputs[0].text, kept.outputs[0].text) == ("", "<s><s>")


# ---- SamplingParams fields of vLLM's that minillm has no setting for --------------------------------

@pytest.mark.parametrize("kwargs", [
    {"best_of": None}, {"best_of": 2, "n": 2}, {"use_beam_search": False}, {"length_penalty": 1.0},
    {"early_stopping": False}, {"logits_processors": None}, {"logits_processors": []}, {"guided_decoding": None},
    {"flat_logprobs": False}, {"stream_interval": 1}, {"stream_interval": None}, {"skip_clone": True},
    {"skip_reading_prefix_cache": False}, {"thinking_token_budget": None}, {"repetition_detection": None},
    {"logprob_token_ids": None}, {"prompt_logprob_token_ids": None}, {"prompt_logprob_start": 0},
    {"trace_decode_token_ids": None},
])
def test_vllms_sampling_fields_are_taken_at_what_minillm_does(kwargs):
    """They were TypeErrors (unexpected keyword argument) for a script ported as it was."""
    params = SamplingParams(temperature=0, max_tokens=3, **kwargs)
    assert params == SamplingParams(temperature=0, max_tokens=3, n=kwargs.get("n", 1))
    assert SamplingParams.from_optional(temperature=None, **kwargs).temperature == 1.0


@pytest.mark.parametrize("kwargs, needle", [
    ({"best_of": 3}, "best_of=3 is not supported: minillm returns all n completions it samples"),
    ({"use_beam_search": True}, "use_beam_search=True is not supported: minillm has no beam search"),
    ({"logits_processors": [abs]}, "logits_processors=.* is not supported: minillm runs no Python logits processors"),
    ({"guided_decoding": {"json": {}}}, "guided_decoding=.* is not supported: give a GuidedDecodingParams .* or "
                                        "vLLM's later name structured_outputs"),
    ({"flat_logprobs": True}, "flat_logprobs=True is not supported"),
    ({"stream_interval": 4}, "stream_interval=4 is not supported: LLMEngine.step.. reports every step"),
    ({"thinking_token_budget": 100}, "thinking_token_budget=100 is not supported: minillm has no thinking budget"),
    ({"logprobs": -1}, r"logprobs must be an integer in \[0, 20\] \(vLLM's -1, the whole vocabulary, is not "
                       r"supported\), got -1"),
])
def test_vllms_sampling_fields_minillm_cannot_honour_are_refused_by_name(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_sampling_params_keeps_its_signature_and_refuses_unknown_names():
    import inspect
    assert "output_kind" in inspect.signature(SamplingParams).parameters
    assert SamplingParams(2).n == 2            # positional n, as the dataclass took it
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        SamplingParams(temprature=0.5)


# ---- what else a vLLM script does with LLM.generate and its outputs ---------------------------------

def test_sampling_params_given_as_a_string_is_named_not_counted(llm):
    """A string was taken as a list of three SamplingParams ("sampling_params has 3 entries for 1 prompts")."""
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams or a list of them, got 'bad'"):
        llm.generate("Once", "bad")


def test_outputs_answer_vllms_fields_for_what_minillm_does_not_run(llm, expected):
    out = llm.generate(PROMPTS[0], GREEDY)[0]
    assert out.lora_request is None and out.encoder_prompt is None and out.encoder_prompt_token_ids is None
    assert out.outputs[0].lora_request is None
    assert isinstance(out.prompt_token_ids, list) and out.finished is True and out.outputs[0].finished()
    assert out.outputs[0].cumulative_logprob is None and out.outputs[0].logprobs is None   # no logprobs asked
    assert out.outputs[0].token_ids == expected[0] and isinstance(out.outputs[0].token_ids, list)
    with_logprobs = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, logprobs=0))[0].outputs[0]
    assert with_logprobs.cumulative_logprob == pytest.approx(
        sum(entry[t].logprob for entry, t in zip(with_logprobs.logprobs, with_logprobs.token_ids)))


def test_generate_takes_every_prompt_form_in_one_batch(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("Once upon a time")
    forms = ["Once upon a time", ids, {"prompt": "Once upon a time"}, {"prompt_token_ids": ids}, tuple(ids)]
    outs = llm.generate(forms, GREEDY)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.prompt for o in outs] == ["Once upon a time", None, "Once upon a time", None, None]
    assert all(o.prompt_token_ids == ids for o in outs)
    assert llm.generate([], GREEDY) == [] and llm.generate([], []) == []


# ---- LLM()'s other vLLM arguments ------------------------------------------------------------------

NEUTRAL_LLM_ARGS = dict(task="generate", runner="auto", model_impl="auto", config_format="hf", tokenizer_revision=None,
                        mm_processor_kwargs=None, limit_mm_per_prompt={}, allowed_local_media_path="",
                        override_pooler_config=None, logits_processors=None, enable_lora=False,
                        enable_sleep_mode=False, scheduling_policy="fcfs", compilation_config=0,
                        max_seq_len_to_capture=8192, disable_custom_all_reduce=False,
                        disable_async_output_proc=False, hf_token=None, distributed_executor_backend=None,
                        structured_outputs_config=None)


def test_llm_takes_the_rest_of_vllms_signature_at_what_minillm_does(stories_path, expected):
    """Each of these, at vLLM's default, was a TypeError (unexpected keyword argument)."""
    with LLM(str(stories_path), device="cpu", max_model_len=128, **NEUTRAL_LLM_ARGS) as model:
        assert _ids(model.generate(PROMPTS, GREEDY)) == expected


@pytest.mark.parametrize("kwargs, needle", [
    ({"task": "embed"}, "task='embed' is not supported: minillm runs generative models only"),
    ({"scheduling_policy": "lifo"}, "scheduling_policy must be 'fcfs' or 'priority', got 'lifo'"),
    ({"enable_lora": True}, "enable_lora=True is not supported: minillm loads no LoRA adapters"),
    ({"compilation_config": 3}, "compilation_config=3 is not supported: minillm compiles no torch graphs"),
    ({"hf_token": "hf_x"}, "hf_token='hf_x' is not supported: minillm downloads with huggingface_hub's own token"),
    ({"limit_mm_per_prompt": {"image": 1}}, "limit_mm_per_prompt=.* is not supported: minillm runs text-only models"),
])
def test_llm_refuses_vllm_arguments_it_cannot_honour_before_loading(stories_path, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        LLM(str(stories_path), device="cpu", **kwargs)


# ---- the rest of what scripts read of transformers' tokenizer ----------------------------------------

def test_tokenizer_answers_transformers_lookups(llm, stories_path, added_tokens_dir):
    """convert_tokens_to_ids (how scripts find a stop token's id), tokenize, special_tokens_map, ...
    were AttributeErrors."""
    transformers = pytest.importorskip("transformers")
    from minillm.tokenizer import Tokenizer
    for folder in (stories_path, added_tokens_dir):
        tok = Tokenizer.from_pretrained(folder)
        ref = transformers.AutoTokenizer.from_pretrained(folder)
        tokens = ["\u2581Once", "<s>", "no-such-token", "<|im_end|>"]
        assert tok.convert_tokens_to_ids(tokens) == ref.convert_tokens_to_ids(tokens)
        assert tok.convert_tokens_to_ids("</s>") == ref.convert_tokens_to_ids("</s>") == 2
        for text in ("Once upon a time", "héllo 你好 😀 end", "<s>hi</s>x<|im_start|>"):
            assert tok.tokenize(text) == ref.tokenize(text)
            assert tok.convert_tokens_to_string(tok.tokenize(text)) == ref.convert_tokens_to_string(ref.tokenize(text))
        assert (tok.unk_token, tok.pad_token, tok.model_max_length) == (ref.unk_token, ref.pad_token, 512)
        assert tok.special_tokens_map == ref.special_tokens_map
        assert tok.get_added_vocab() == ref.get_added_vocab()
        assert {i: t.content for i, t in tok.added_tokens_decoder.items()} == \
            {i: t.content for i, t in ref.added_tokens_decoder.items()}
        assert tok.vocab == ref.vocab and tok.is_fast and tok.name_or_path == str(folder)
    llm_tok = llm.get_tokenizer()
    assert sorted(llm_tok.all_special_tokens) == ["</s>", "<s>", "<unk>"]
    stop_id = llm_tok.convert_tokens_to_ids("\u2581time")
    [out] = llm.generate("Once upon a", SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[stop_id]))
    assert out.outputs[0].stop_reason == stop_id and out.outputs[0].token_ids[-1] == stop_id


def test_tokenizer_takes_transformers_options_only_when_off(llm):
    tok = llm.get_tokenizer()
    off = dict(padding=False, truncation=None, max_length=None, return_tensors=None)
    assert tok.encode("Once upon", **off) == tok.encode("Once upon")
    assert tok("Once upon", **off) == tok("Once upon")
    assert tok.decode([1, 403], clean_up_tokenization_spaces=False) == tok.batch_decode(
        [[1, 403]], clean_up_tokenization_spaces=None)[0] == "<s> Once"
    for call, name in [(lambda: tok.encode("x", truncation=True, max_length=2), "encode: truncation=True"),
                       (lambda: tok(["x"], return_tensors="np"), "calling the tokenizer: return_tensors='np'")]:
        with pytest.raises(ValueError, match=f"{re.escape(name)} is not supported"):
            call()
    # transformers' clean-up leaves a BPE tokenizer's text alone (tests/test_abuse34_model_files.py: the others')
    spaced = tok.encode("Once , upon . ok")
    assert tok.decode(spaced, clean_up_tokenization_spaces=True) == tok.decode(spaced) == "<s> Once , upon . ok"
    for spaces in (True, False):      # transformers' fast tokenizers take it and decode the same
        assert tok.decode([1, 403, 2, 2], spaces_between_special_tokens=spaces) == "<s> Once</s></s>"
    with pytest.raises(TypeError, match="encode: unexpected keyword argument 'add_special_token'"):
        tok.encode("x", add_special_token=False)


# ---- LLMEngine.add_request's other vLLM arguments ---------------------------------------------------

def test_engine_add_request_takes_vllms_arguments_at_what_minillm_does(llm):
    """vLLM's LLMEngine.add_request takes lora_request, priority, tokenization_kwargs and trace_headers;
    each was a TypeError."""
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    [plain] = [o for o in _run(engine, "plain", "Once upon a time", GREEDY) if o.finished]
    [same] = [o for o in _run(engine, "same", "Once upon a time", GREEDY, lora_request=None, priority=0,
                              trace_headers=None, tokenization_kwargs={"add_special_tokens": True}) if o.finished]
    assert same.outputs[0].token_ids == plain.outputs[0].token_ids
    [no_bos] = [o for o in _run(engine, "no-bos", "Once upon a time", GREEDY,
                                tokenization_kwargs={"add_special_tokens": False}) if o.finished]
    assert no_bos.prompt_token_ids == tok.encode("Once upon a time", add_special_tokens=False)
    assert no_bos.prompt == "Once upon a time"
    for kwargs, needle in [({"lora_request": "adapter"}, "lora_request='adapter' is not supported"),
                           ({"priority": 2}, "priority must be 0 under scheduling_policy 'fcfs', got 2"),
                           ({"priority": None}, "priority must be an integer, got None"),
                           ({"trace_headers": {"traceparent": "00-ab"}}, "trace_headers=.* is not supported: minillm "
                                                                        "has no OpenTelemetry tracing"),
                           ({"tokenization_kwargs": {"max_length": 4}}, "tokenization_kwargs 'max_length': not "
                                                                        "supported")]:
        with pytest.raises(ValueError, match=needle):
            engine.add_request("refused", "Once upon a time", GREEDY, **kwargs)
    assert not engine.has_unfinished_requests()


def test_prompt_dicts_take_vllms_other_keys_as_none_and_say_why_otherwise(llm, expected):
    """Code that builds vLLM prompt dicts generically sets multi_modal_data=None and the like; that was refused."""
    outs = llm.generate([{"prompt": PROMPTS[0], "multi_modal_data": None, "mm_processor_kwargs": None},
                         {"prompt": PROMPTS[1], "token_type_ids": None, "multi_modal_uuids": None}], GREEDY)
    assert _ids(outs) == expected
    for prompt, why in [({"prompt": "Once", "multi_modal_data": {"image": b""}}, "multi_modal_data: minillm runs "
                                                                                 "text-only models"),
                        ({"prompt_embeds": [[0.5]]}, "prompt_embeds: minillm takes text or token ids, not embeddings")]:
        with pytest.raises(ValueError, match=re.escape(why)):
            llm.generate(prompt, GREEDY)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("name, why", [("collective_rpc", "not a torch module"), ("apply_model", "not a torch module")])
def test_more_vllm_methods_minillm_lacks_say_why(llm, name, why):
    with pytest.raises(AttributeError, match=rf"LLM\.{name}\(\) is vLLM's and not supported: .*{why}"):
        getattr(llm, name)()
    assert not hasattr(llm, name)


def test_guided_decoding_params_is_taken_under_vllms_earlier_name(llm):
    """vLLM scripts before structured_outputs wrote SamplingParams(guided_decoding=GuidedDecodingParams(...));
    both names were missing."""
    from minillm.sampling_params import GuidedDecodingParams, StructuredOutputsParams
    guided = GuidedDecodingParams(choice=["yes", "no"], backend="guidance", disable_fallback=True)
    assert isinstance(guided, StructuredOutputsParams)
    params = SamplingParams(temperature=0, max_tokens=8, guided_decoding=guided)
    assert params.structured_outputs is guided
    [out] = llm.generate("Once upon a time", params)
    assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"
    [same] = llm.generate("Once upon a time", SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))
    assert same.outputs[0].token_ids == out.outputs[0].token_ids
    with pytest.raises(ValueError, match="backend: 'xgrammar' is not supported: minillm builds every constraint "
                                         "with llguidance"):
        GuidedDecodingParams(json={"type": "object"}, backend="xgrammar")
    with pytest.raises(ValueError, match="guided_decoding and structured_outputs are the same setting"):
        SamplingParams(guided_decoding=guided, structured_outputs=guided)
    with pytest.raises(ValueError, match="guided_decoding=.* is not supported: give a GuidedDecodingParams"):
        SamplingParams(guided_decoding={"choice": ["yes"]})
