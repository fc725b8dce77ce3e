"""The offline API used as a vLLM user uses it: LLM, its tokenizer, SamplingParams and the outputs."""
import pytest


def test_tokenizer_call_result_reads_as_attributes_too(llm):
    """transformers' BatchEncoding: tokenizer(text).input_ids, as vLLM's get_tokenizer() hands it out."""
    tok = llm.get_tokenizer()
    enc = tok("Once upon a time")
    assert enc.input_ids == enc["input_ids"] == tok.encode("Once upon a time")
    assert enc.attention_mask == [1] * len(enc.input_ids)
    batch = tok(["Lily", "Once upon"], add_special_tokens=False)
    assert batch.input_ids == [tok.encode("Lily", add_special_tokens=False),
                               tok.encode("Once upon", add_special_tokens=False)]
    chat = tok.apply_chat_template([{"role": "user", "content": "Lily"}], chat_template="{{ messages[0].content }}",
                                   return_dict=True)
    assert chat.input_ids == tok.encode("Lily", add_special_tokens=False)
    with pytest.raises(AttributeError, match="token_type_ids"):
        enc.token_type_ids


def test_llm_has_vllms_model_config_attribute(llm):
    """vLLM's LLM keeps its engine's model config as llm.model_config (llm.model_config.max_model_len)."""
    assert llm.model_config is llm.llm_engine.model_config
    assert llm.model_config.max_model_len == 128


@pytest.mark.parametrize("name, value", [("logprobs_mode", "raw_logprobs"), ("code_revision", None)])
def test_vllm_engine_args_at_what_minillm_does_are_taken(stories_path, name, value):
    """vLLM's logprobs_mode (its default, raw_logprobs: minillm's log-probabilities are the model's
    before any penalty) and code_revision (None) are taken; other values are named."""
    from minillm import LLM
    with LLM(str(stories_path), device="cpu", max_model_len=64, **{name: value}) as model:
        assert model.generate("Lily", max_tokens_params())[0].outputs[0].token_ids
    other = {"logprobs_mode": "processed_logprobs", "code_revision": "main"}[name]
    with pytest.raises(ValueError, match=f"^{name}="):
        LLM(str(stories_path), device="cpu", max_model_len=64, **{name: other})


def max_tokens_params(n: int = 2):
    """Greedy SamplingParams of n tokens."""
    from minillm import SamplingParams
    return SamplingParams(temperature=0, max_tokens=n)
