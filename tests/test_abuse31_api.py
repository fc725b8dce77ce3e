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
