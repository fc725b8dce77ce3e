"""Streamed text across tokenizer families (WordPiece / BERT-like, whose decoder joins tokens with spaces, among
them) checked against vLLM's detokenizer: tokenizers' DecodeStream primed with the prompt's tail, and
spaces_between_special_tokens=False giving an added token that follows another its bare content."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from test_abuse29_tokenizers import _with_dummy_model, run_frontend

WORDPIECE = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "the", "cat", "##s", ".", ",", "'",
             "do", "n't", "日", "本"]
CLS, SEP, HELLO, EXTRA = 2, 3, 5, len(WORDPIECE)


def save_wordpiece(out: Path) -> Path:
    """A BERT-like model directory (dummy weights): WordPiece with "##" continuations, a decoder that joins
    words with spaces and cleans up " ." and " n't", [CLS] $A [SEP], and "<extra>", an added token not special."""
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(WORDPIECE)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                       special_tokens=[("[CLS]", CLS), ("[SEP]", SEP)])
    tok.add_special_tokens(WORDPIECE[:5])
    tok.add_tokens([AddedToken("<extra>", special=False, normalized=False)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]",
        "eos_token": "[SEP]", "clean_up_tokenization_spaces": True, "tokenizer_class": "BertTokenizer"}))
    return _with_dummy_model(out, len(WORDPIECE) + 1)


@pytest.fixture(scope="module")
def wordpiece(tmp_path_factory) -> Path:
    return save_wordpiece(tmp_path_factory.mktemp("wordpiece"))


@pytest.fixture(scope="module")
def wordpiece_llm(wordpiece):
    from minillm.llm import LLM
    with LLM(str(wordpiece), load_format="dummy", device="cpu", dtype="float32", seed=0) as model:
        yield model


# (output ids after the prompt [CLS] hello, skip_special_tokens, spaces_between_special_tokens) -> vLLM's text
SPACING = [
    ([SEP, SEP, SEP], False, True, " [SEP] [SEP] [SEP]"),
    ([SEP, SEP, SEP], False, False, " [SEP][SEP][SEP]"),
    ([EXTRA, EXTRA], False, False, " <extra><extra>"),       # added tokens that are not special too
    ([SEP, EXTRA, SEP, EXTRA], False, False, " [SEP]<extra>[SEP]<extra>"),
    ([SEP, HELLO, SEP, SEP, HELLO], False, False, " [SEP] hello [SEP][SEP] hello"),
    ([EXTRA, EXTRA], True, False, " <extra> <extra>"),       # skipping specials keeps the decoder's spaces
    ([SEP, EXTRA, SEP], True, False, " <extra>"),
]


@pytest.mark.parametrize("kind", ["CUMULATIVE", "FINAL_ONLY"])
@pytest.mark.parametrize("output,skip,spaces,text", [case for case in SPACING if len(set(case[0])) == 1])
def test_spaces_between_special_tokens_in_llm_generate(wordpiece_llm, kind, output, skip, spaces, text):
    """spaces_between_special_tokens=False (lm-evaluation-harness passes it) drops the space a WordPiece decoder
    puts between two added tokens, as vLLM's detokenizer does, streamed or not; it was taken and ignored."""
    from minillm.sampling_params import RequestOutputKind, SamplingParams
    params = SamplingParams(max_tokens=len(output), allowed_token_ids=[output[0]], ignore_eos=True,
                            skip_special_tokens=skip, spaces_between_special_tokens=spaces,
                            output_kind=RequestOutputKind[kind])
    [out] = wordpiece_llm.generate({"prompt_token_ids": [CLS, HELLO]}, params, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == output
    assert out.outputs[0].text == text


@pytest.mark.parametrize("output,skip,spaces,text", SPACING)
def test_spaces_between_special_tokens_in_the_servers_output_processing(wordpiece, output, skip, spaces, text):
    """The API server's output processing (streamed deltas and the text made once at the end) as vLLM's."""
    from minillm.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(wordpiece)
    deltas, final, _ = run_frontend(tok, [CLS, HELLO], output, skip_special_tokens=skip,
                                    spaces_between_special_tokens=spaces)
    assert "".join(deltas) == final == text


@pytest.fixture(scope="module")
def wordpiece_http(wordpiece):
    import httpx
    from test_server_helpers import running_server
    with running_server(wordpiece, served_model_name="wp", load_format="dummy", dtype="float32") as (url, _engine):
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client


@pytest.mark.parametrize("spaces,text,offsets", [(True, " [SEP] [SEP] [SEP]", [0, 6, 12]),
                                                 (False, " [SEP][SEP][SEP]", [0, 6, 11])])
def test_spaces_between_special_tokens_over_http(wordpiece_http, spaces, text, offsets):
    """/v1/completions streamed and not: the text without the spaces, and the logprobs' text_offset indexing
    that text (each token's text starts where its offset says)."""
    from test_server_helpers import sse_events
    body = {"model": "wp", "prompt": [CLS, HELLO], "max_tokens": 3, "allowed_token_ids": [SEP], "logprobs": 0,
            "skip_special_tokens": False, "spaces_between_special_tokens": spaces, "ignore_eos": True}
    whole = wordpiece_http.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    assert choice["text"] == text
    assert choice["logprobs"]["text_offset"] == offsets
    with wordpiece_http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    streamed = [c for e in events for c in e["choices"]]
    assert "".join(c["text"] for c in streamed) == text
    assert [o for c in streamed if c.get("logprobs") for o in c["logprobs"]["text_offset"]] == offsets
