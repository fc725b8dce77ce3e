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
