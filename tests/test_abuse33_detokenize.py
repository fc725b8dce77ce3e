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


def frontend_text(tok, prompt: list[int], output: list[int], finish: tuple[str, int | None], **params):
    """The API server's output processing of OUTPUT, one token a step, the last ending the request with FINISH
    (finish_reason, stop_reason): (the streamed pieces, their stop reason, the FINAL_ONLY text and stop reason)."""
    from minillm.engine_core import messages as m
    from minillm.engine_core.output_processor import OutputProcessor
    from minillm.sampling_params import RequestOutputKind, SamplingParams
    results = []
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY):
        proc = OutputProcessor(tok)
        proc.add("r", None, prompt, SamplingParams(max_tokens=len(output), output_kind=kind, **params), 0.0, "h")
        pieces, reason = [], None
        for i, token in enumerate(output):
            last = i == len(output) - 1
            seq = m.SeqOutput(0, [token], finish_reason=finish[0] if last else None,
                              stop_reason=finish[1] if last else None)
            done = proc.process(m.StepOutputs(i, 0.0, [m.RequestStepOutput("r", [seq], last, 0, None, None, None)]),
                                0.0)
            for _, out in done.outputs:
                pieces.append(out.outputs[0].text)
                reason = out.outputs[0].stop_reason
            if done.stops:
                break
        results.append((pieces, reason))
    (pieces, reason), (final, final_reason) = results
    return pieces, reason, "".join(final), final_reason


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    from test_abuse29_tokenizers import save_qwen
    from minillm.tokenizer import Tokenizer
    path = save_qwen(tmp_path_factory.mktemp("qwen"))
    return _with_dummy_model(path, len(Tokenizer.from_pretrained(path)))


def _text_then_broken_character(tok) -> tuple[int, str]:
    """A byte-level token whose text is whole letters and then the first bytes of one more character ('na' and
    the first byte of 'ï'), and those letters."""
    for token_id in range(len(tok)):
        text = tok.decode([token_id])
        whole = text.rstrip("\ufffd")
        if text.endswith("\ufffd") and len(whole) >= 2 and whole.isalpha() and "\ufffd" not in whole:
            return token_id, whole
    raise AssertionError("no token of whole characters and a broken one")


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("ending", ["length", "eos"])
def test_stop_string_in_text_held_back_at_the_end(qwen, include, ending):
    """The last tokens' text, held back while a character was in progress, comes out when the request ends (its
    bytes as decode() has them); a stop string in it stops the request and cuts the text as anywhere else. It
    was added after the stop strings were looked for: the final text held the stop string, finish_reason length."""
    from minillm.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(qwen)
    token_id, whole = _text_then_broken_character(tok)
    eos = tok.eos_token_ids[0]
    output = tok.encode("hi ", add_special_tokens=False) + [token_id] + ([eos] if ending == "eos" else [])
    finish = ("length", None) if ending == "length" else ("stop", eos)
    stop = whole[-1]
    pieces, reason, final, final_reason = frontend_text(tok, [1], output, finish, stop=[stop],
                                                        include_stop_str_in_output=include)
    text = "hi " + whole if include else "hi " + whole[:-1]
    assert ("".join(pieces), reason) == (final, final_reason) == (text, stop)
    pieces, reason, final, _ = frontend_text(tok, [1], output, finish, stop=["never"])
    assert "".join(pieces) == final == tok.decode(output, skip_special_tokens=True)


@pytest.mark.parametrize("kind", ["CUMULATIVE", "FINAL_ONLY"])
def test_stop_string_in_text_held_back_at_the_end_in_llm_generate(qwen, kind):
    """The same through LLM.generate: a request whose last token holds the stop string ends by it."""
    from minillm.llm import LLM
    from minillm.sampling_params import RequestOutputKind, SamplingParams
    with LLM(str(qwen), load_format="dummy", device="cpu", dtype="float32", seed=0) as llm:
        token_id, whole = _text_then_broken_character(llm.get_tokenizer())
        params = SamplingParams(max_tokens=2, allowed_token_ids=[token_id], stop=[whole[-1]], ignore_eos=True,
                                output_kind=RequestOutputKind[kind])
        [out] = llm.generate({"prompt_token_ids": [1, 2]}, params, use_tqdm=False)
    completion = out.outputs[0]
    assert (completion.text, completion.finish_reason, completion.stop_reason) == (whole[:-1], "stop", whole[-1])


def frontend_logprobs(tok, prompt: list[int], output: list[int], alternative: int) -> list[dict]:
    """Each output token's logprobs as the API server's output processing makes them (LLM.generate's shape), the
    token itself and ALTERNATIVE offered at every position."""
    from minillm.engine_core import messages as m
    from minillm.engine_core.output_processor import OutputProcessor
    from minillm.sampling_params import SamplingParams
    proc = OutputProcessor(tok)
    proc.add("r", None, prompt, SamplingParams(max_tokens=len(output), logprobs=1), 0.0, "h")
    logprobs = []
    for i, token in enumerate(output):
        last = i == len(output) - 1
        row = {token: -0.5, alternative: -1.0} if token != alternative else {token: -0.5}
        seq = m.SeqOutput(0, [token], [row], finish_reason="length" if last else None)
        done = proc.process(m.StepOutputs(i, 0.0, [m.RequestStepOutput("r", [seq], last, 0, None, None, None)]), 0.0)
        for _, out in done.outputs:
            logprobs = out.outputs[0].logprobs
    return logprobs


def test_logprob_tokens_of_a_character_in_byte_tokens_as_vllm(stories_path):
    """A character the model writes as several byte-fallback tokens: vLLM names each byte token that leaves the
    character unfinished "" and the one that completes it by the whole character, read with the tokens before it
    (Logprob.decoded_token); every one was U+FFFD. A token offered beside them keeps its own text."""
    from minillm.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(stories_path)
    output = tok.encode("a中", add_special_tokens=False)
    pieces = [tok.id_to_token(t) for t in output]
    assert pieces[-3:] == ["<0xE4>", "<0xB8>", "<0xAD>"], pieces
    alternative = tok.encode("x", add_special_tokens=False)[-1]
    rows = frontend_logprobs(tok, [1], output, alternative)
    assert [row[t].decoded_token for row, t in zip(rows, output)][-3:] == ["", "", "中"]
    assert all(row[alternative].decoded_token == tok.decode([alternative]) for row in rows if alternative in row)
    # a byte token offered beside another is read after the same sampled tokens (E4 B8 then B8 is 丸, AD 中)
    rows = frontend_logprobs(tok, [1], output[:-1] + [output[-2]], output[-1])
    assert (rows[-1][output[-2]].decoded_token, rows[-1][output[-1]].decoded_token) == ("丸", "中")
    # A prompt longer than the output: the API server's sequence holds only output tokens, and its context
    # was cut at the prompt's length (empty), so the last byte token read alone was "\ufffd".
    rows = frontend_logprobs(tok, tok.encode("Once upon a time there was a"), output, alternative)
    assert [row[t].decoded_token for row, t in zip(rows, output)][-3:] == ["", "", "中"]


def test_prompt_logprob_tokens_of_a_character_in_byte_tokens_as_vllm(stories_path):
    """The same for prompt_logprobs, the prompt's earlier tokens (its first, which has no entry, aside) the context."""
    from minillm import LLM
    from minillm.sampling_params import SamplingParams
    with LLM(str(stories_path), device="cpu", max_model_len=64) as llm:
        tok = llm.get_tokenizer()
        prompt = tok.encode("Once 中")
        [out] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=1),
                             use_tqdm=False)
    names = [entry[t].decoded_token for entry, t in zip(out.prompt_logprobs[1:], prompt[1:])]
    assert names[-3:] == ["", "", "中"], names


def test_logprob_tokens_keep_the_sentencepiece_leading_space_as_vllm(tmp_path):
    """A Metaspace tokenizer's "▁the" is named " the" (decode() of the token alone strips the space a first
    token's "▁" stands for; vLLM puts it back, so that "▁the" and "the" differ); it was "the"."""
    from test_abuse29_tokenizers import save_mistral
    from minillm.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(save_mistral(tmp_path / "mistral"))
    vocab = tok.get_vocab()
    word = next(w for w in sorted(vocab) if w.isalpha() and len(w) > 1 and "▁" + w in vocab)
    spaced, bare = vocab["▁" + word], vocab[word]
    assert tok.decode([spaced]) == tok.decode([bare]) == word
    rows = frontend_logprobs(tok, [1], [spaced], bare)
    assert (rows[0][spaced].decoded_token, rows[0][bare].decoded_token) == (" " + word, word)


def test_a_sequences_output_tail_on_both_sides():
    """output_tail(count): the last count output tokens (none for 0) of an engine sequence and of the API
    server's mirror of it alike."""
    from minillm.engine_core.output_processor import SequenceMirror
    from minillm.sampling_params import SamplingParams
    from minillm.sequence import Sequence
    params = SamplingParams()
    seq = Sequence("r", 0, [5, 6, 7], params, 0.0, None, 16)
    seq.token_ids += [1, 2]
    mirror = SequenceMirror(0, [5, 6, 7], params, token_ids=[1, 2])
    for count, tail in [(0, []), (1, [2]), (2, [1, 2]), (9, [1, 2])]:
        assert seq.output_tail(count) == mirror.output_tail(count) == tail
