"""Text fidelity: the text a user gets is the same whichever path produced it, and is UTF-8 text.

stories260K's tokenizer falls back to byte tokens (<0xE2>, ...), so a completion can hold
characters split over several tokens and bytes that are no UTF-8 at all. Each defect found by
driving such outputs through LLM.generate and the server has its test here.
"""
from __future__ import annotations

import httpx
import pytest
from test_server_helpers import chat_template_server, sse_events  # noqa: F401

from minillm import LLM, SamplingParams

PROMPT = "Once upon a time"
V, CONTINUATION = 3 + 0x76, 3 + 0xAD     # the byte tokens of "v" and of a lone continuation byte 0xAD


def byte_token(b: int) -> int:
    """stories260K's byte-fallback token of one byte (<0x00> is id 3)."""
    return 3 + b


@pytest.fixture(scope="module")
def llm(stories_path):
    """The Python API on stories260K."""
    return LLM(str(stories_path), device="cpu")


def test_broken_bytes_read_the_same_with_and_without_stop_strings(llm):
    """A valid byte before a run of bytes that is no UTF-8 ("v" then 0xAD) keeps its character in
    LLM.generate's text, as in the text built token by token (stop strings, the server's streams);
    before, the final decode turned every byte of the run into U+FFFD ("vx" read "\ufffd\ufffd")."""
    common = dict(temperature=1.0, seed=7, n=16, max_tokens=6, allowed_token_ids=[V, CONTINUATION])
    final = llm.generate([PROMPT], SamplingParams(**common))[0].outputs
    stepwise = llm.generate([PROMPT], SamplingParams(**common, stop=["never said"]))[0].outputs
    assert [o.token_ids for o in final] == [o.token_ids for o in stepwise]
    assert any(o.token_ids[:2] == [V, CONTINUATION] for o in final), "no completion to check"
    for a, b in zip(final, stepwise):
        assert a.text == b.text
        expected = bytes(t - 3 for t in a.token_ids).decode("utf-8", "replace")
        assert a.text.startswith("v") == expected.startswith("v"), (a.token_ids, a.text)


@pytest.mark.parametrize("prompt", ["日本語", "Tom saw 😀😀"])
def test_byte_token_prompt_end_keeps_the_output_characters(llm, prompt):
    """A prompt ending in characters spelt with byte tokens, then an output spelt with byte tokens:
    the output reads "はい". Before, the decode window over the prompt's last five tokens began
    inside a character, and the byte-fallback decoder turned the whole run, the output's bytes
    included, into U+FFFD (six of them, streamed or not)."""
    from minillm.sampling_params import StructuredOutputsParams
    regex = StructuredOutputsParams(regex="はい")
    for stop in (None, ["never said"]):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, structured_outputs=regex,
                                                    stop=stop))[0].outputs[0]
        assert out.text == "はい", (stop, out.token_ids)


def completion_texts(url: str, body: dict) -> tuple[str, str]:
    """A completion's text, asked for once whole and once as a stream (its deltas joined)."""
    body = {"model": "stories", "temperature": 0, **body}
    whole = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert whole.status_code == 200, whole.text[:500]
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        deltas = [c["text"] for e in sse_events(r.iter_lines()) for c in e["choices"]]
    assert all("\ufffd" not in d for d in deltas), deltas
    return whole.json()["choices"][0]["text"], "".join(deltas)


def test_byte_token_prompt_end_through_the_server(server):
    """The same through the server, whole and streamed."""
    body = {"prompt": "日本語", "max_tokens": 8, "structured_outputs": {"regex": "はい"}}
    assert completion_texts(server[0], body) == ("はい", "はい")


EURO = [byte_token(b) for b in "€".encode()]       # E2 82 AC


@pytest.mark.parametrize("stop", [None, ["never said"]])
def test_output_completing_the_prompts_last_character(llm, stop):
    """A prompt of token ids that ends inside a character (a client continuing an output cut there):
    the output's byte that completes it gives the character. Before, the text was empty."""
    params = SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=[EURO[2]], stop=stop)
    out = llm.generate([{"prompt_token_ids": [1, 400] + EURO[:2]}], params)[0].outputs[0]
    assert (out.token_ids, out.text) == ([EURO[2]], "€")


def test_output_completing_the_prompts_last_character_through_the_server(server):
    """The same through the server, whole and streamed."""
    body = {"prompt": [1, 400] + EURO[:2], "max_tokens": 1, "allowed_token_ids": [EURO[2]]}
    assert completion_texts(server[0], body) == ("€", "€")


def test_text_after_a_completed_prompt_character_is_kept(tok):
    """The characters after it are kept too: before, "a" was lost ("b" came first)."""
    from minillm.tokenizer import IncrementalDetokenizer
    for cut in (1, 2):
        detok = IncrementalDetokenizer(tok, prompt_token_ids=[1, 400] + EURO[:cut])
        deltas = [detok.add(t) for t in EURO[cut:] + [tok.get_vocab()["a"], tok.get_vocab()["b"]]]
        assert "".join(deltas) + detok.flush() == "€ab" and "\ufffd" not in "".join(deltas)
