"""Streamed text and stop strings held to vLLM's detokenizer, on stories260K with outputs forced by a choice
constraint (byte-fallback tokens among them): each token's text completes stop strings and characters as vLLM
reads them, in the Python API, the API server's output processing and the server's SSE alike."""
from __future__ import annotations

import pytest

from test_abuse29_tokenizers import run_frontend

PROMPT = "Once upon a time"
STORY = "Lily saw the cat"       # stories260K: ... "▁saw" "▁the" ...: one token ends " th" and "e" alike


def forced(text: str, kind: str = "CUMULATIVE", **params):
    """SamplingParams whose greedy output is TEXT (a choice constraint), of output kind KIND."""
    from minillm.sampling_params import RequestOutputKind, SamplingParams
    from minillm.structured_output import StructuredOutputsParams
    return SamplingParams(max_tokens=40, temperature=0, structured_outputs=StructuredOutputsParams(choice=[text]),
                          output_kind=RequestOutputKind[kind], **params)


def generated(llm, params) -> tuple[str, str | None, int | str | None, list[str]]:
    """(text, finish_reason, stop_reason, the streamed texts) of one request stepped through LLM's engine; the
    texts of a CUMULATIVE request's outputs are what each output adds to the one before."""
    from minillm.sampling_params import RequestOutputKind
    engine = llm.llm_engine
    engine.add_request("detok", PROMPT, params)
    pieces, text, last = [], "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out.outputs[0]
            if params.output_kind is RequestOutputKind.CUMULATIVE:
                assert last.text.startswith(text), (last.text, text)     # nothing streamed is taken back
                pieces.append(last.text[len(text):])
                text = last.text
            else:
                pieces.append(last.text)
                text += last.text if params.output_kind is RequestOutputKind.DELTA else ""
    if params.output_kind is RequestOutputKind.FINAL_ONLY:
        text = last.text
    return text, last.finish_reason, last.stop_reason, pieces


@pytest.mark.parametrize("kind", ["CUMULATIVE", "DELTA", "FINAL_ONLY"])
@pytest.mark.parametrize("include,text", [(False, "Lily saw"), (True, "Lily saw th")])
def test_the_stop_string_a_token_completes_first_wins(llm, kind, include, text):
    """"▁the" completes both stop strings: " th" first (vLLM's check_stop_strings picks the one that ends
    first, the list's order breaking ties). The first one listed that matched won: the text kept "Lily saw th"
    of stop ["e", " th"], which holds " th", and stop_reason said "e"."""
    params = forced(STORY, kind, stop=["e", " th"], include_stop_str_in_output=include)
    got, finish, reason, pieces = generated(llm, params)
    assert (got, finish, reason) == (text, "stop", " th")
    assert "".join(pieces) == got


@pytest.mark.parametrize("stop,reason", [(["e", " th"], " th"), (["he", "the"], "he"), (["the", "he"], "the")])
def test_the_stop_string_a_token_completes_first_wins_in_the_servers_output_processing(tok, stop, reason):
    """The same in the API server's output processing; two stops that end together go by the list's order."""
    prompt, output = tok.encode(PROMPT), tok.encode(STORY, add_special_tokens=False)
    deltas, final, got = run_frontend(tok, prompt, output, stop=stop)
    text = " " + STORY
    assert (final, got) == (text[:text.index(reason)], reason)
    assert "".join(deltas) == final


@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    """One server on stories260K with a chat template: (url, engine)."""
    from test_server_helpers import chat_model_dir, running_server
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    with running_server(model, engine_core="thread") as running:
        yield running


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_stop_string_a_token_completes_first_wins_over_sse(http, path):
    """Through the server, streamed and whole: the same text and stop_reason, the streamed pieces adding up to it."""
    from test_server_helpers import sse_events
    body = {"model": "stories", "max_tokens": 16, "temperature": 0, "stop": ["e", " th"],
            "structured_outputs": {"choice": [STORY]}}
    body.update({"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    whole = http.post(path, json=body)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    text_of = (lambda c: c["text"]) if path == "/v1/completions" else (lambda c: c["message"]["content"])
    assert (text_of(choice), choice["finish_reason"], choice["stop_reason"]) == ("Lily saw", "stop", " th")
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        chunks = [c for e in sse_events(response.iter_lines()) for c in e["choices"]]
    piece = (lambda c: c["text"]) if path == "/v1/completions" else (lambda c: c["delta"].get("content") or "")
    assert "".join(piece(c) for c in chunks) == "Lily saw"
    assert [(c["finish_reason"], c["stop_reason"]) for c in chunks if c["finish_reason"]] == [("stop", " th")]


NAMED = "Lily saw 猫"     # "L" "ily" "▁saw" "▁" <0xE7> <0x8C> <0xAB>
NAMES = ["L", "ily", " saw", " ", "", "", "猫"]


def test_logprob_tokens_of_a_legacy_sentencepiece_tokenizer_keep_their_space(llm, http):
    """stories260K's tokenizer.json spells SentencePiece's leading space as a normalizer (Prepend "▁", Replace
    " " -> "▁"), which transformers loads as the Metaspace pre-tokenizer vLLM looks for: "▁saw" is named " saw" and
    "▁" " " (Logprob.decoded_token, sample and prompt alike), as the server's logprobs named them; LLM.generate
    named them "saw" and "", so its tokens no longer spelled the text."""
    from minillm.sampling_params import SamplingParams
    from minillm.structured_output import StructuredOutputsParams
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=1, prompt_logprobs=1,
                            structured_outputs=StructuredOutputsParams(choice=[NAMED]))
    [out] = llm.generate(PROMPT, params, use_tqdm=False)
    c = out.outputs[0]
    assert c.text == NAMED
    assert [row[t].decoded_token for row, t in zip(c.logprobs, c.token_ids)] == NAMES
    prompt_names = [row[t].decoded_token for row, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
    assert "".join(prompt_names) == " " + PROMPT
    body = {"model": "stories", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "logprobs": 1,
            "structured_outputs": {"choice": [NAMED]}}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["logprobs"]["tokens"] == NAMES


@pytest.fixture(scope="module")
def wordpiece_server(tmp_path_factory):
    """A server on a BERT-like tokenizer (WordPiece: its decoder joins words with spaces) and dummy weights."""
    import json
    from test_abuse33_detokenize import save_wordpiece
    from test_server_helpers import running_server
    path = save_wordpiece(tmp_path_factory.mktemp("wordpiece"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with running_server(path, served_model_name="wp", load_format="dummy", dtype="float32") as running:
        yield running


def test_server_logprob_tokens_are_the_decoded_tokens_of_the_python_api(wordpiece_server):
    """The server names each token as LLM.generate's Logprob.decoded_token names it, as vLLM's server does (it reads
    that name): "world" decoded alone, in tokens, top_logprobs' keys and chat's token and bytes. The server named a
    token by the text it adds after the token before it, " world", which its Python API never gave."""
    import httpx
    from test_abuse33_detokenize import CLS, HELLO, WORDPIECE
    url, engine = wordpiece_server
    world = WORDPIECE.index("world")
    body = {"model": "wp", "max_tokens": 3, "allowed_token_ids": [world], "ignore_eos": True}
    completion = httpx.post(f"{url}/v1/completions", json={**body, "prompt": [CLS, HELLO], "logprobs": 1}, timeout=60)
    assert completion.status_code == 200, completion.text
    choice = completion.json()["choices"][0]
    assert choice["text"] == " world world world"
    assert choice["logprobs"]["tokens"] == ["world"] * 3
    tops = choice["logprobs"]["top_logprobs"]
    assert all("world" in top and not any(name.startswith(" ") for name in top) for top in tops), tops
    assert choice["logprobs"]["text_offset"] == [0, 6, 12]         # offsets still index the text
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        **body, "messages": [{"role": "user", "content": "hello"}], "logprobs": True, "top_logprobs": 1})
    assert chat.status_code == 200, chat.text
    entries = chat.json()["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["bytes"]) for e in entries] == [("world", list(b"world"))] * 3
    assert not any(top["token"].startswith(" ") for e in entries for top in e["top_logprobs"])
