"""logprobs and prompt_logprobs past a vocabulary smaller than max_logprobs: refused where the
request enters, naming the field, instead of failing inside the engine's step."""
import pytest

from minillm import LLM, SamplingParams


def test_counts_past_the_vocabulary_are_refused_by_name():
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"^{name} must be at most the vocabulary's size \(16\), got 17"):
            SamplingParams(**{name: 17}).validate_for_vocab(16)
        SamplingParams(**{name: 16}).validate_for_vocab(16)          # the whole vocabulary is a top k


@pytest.fixture(scope="module")
def small_vocab_llm(tmp_path_factory):
    pytest.importorskip("torch")
    from conftest import save_tiny_model
    from tokenizers import Tokenizer, models, pre_tokenizers
    path = save_tiny_model(tmp_path_factory.mktemp("vocab16"), "llama", vocab_size=16)
    words = ["<unk>", "<s>", "</s>", *"abcdefghijklm"]                  # 16 ids: the model's vocabulary
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    llm = LLM(str(path), device="cpu", max_model_len=64)
    yield llm
    llm.shutdown()


def test_an_engine_with_a_small_vocabulary_refuses_them_and_keeps_serving(small_vocab_llm):
    llm = small_vocab_llm
    prompt = {"prompt_token_ids": [1, 5, 7, 3]}
    alone = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].token_ids
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"^{name} must be at most the vocabulary's size \(16\)"):
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, **{name: 20}))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=16, prompt_logprobs=16))[0]
    assert out.outputs[0].token_ids == alone
    assert all(len(d) == 16 for d in out.outputs[0].logprobs)        # every token of the vocabulary
    assert all(len(d) == 16 for d in out.prompt_logprobs[1:])
