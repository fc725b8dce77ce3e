"""Structured outputs abused as vLLM users do: many distinct schemas through the grammar cache,
grammars past llguidance's parser limits, on stories260K (CPU)."""
from __future__ import annotations

import gc
import re
import weakref

import pytest

from minillm import LLM, SamplingParams
from minillm.structured_output import StructuredOutputManager, StructuredOutputsError, StructuredOutputsParams

VOCAB = 512


@pytest.fixture
def manager(tok):
    mgr = StructuredOutputManager.from_tokenizer(tok, VOCAB, max_num_seqs=8, max_cached_grammars=2)
    yield mgr
    mgr.shutdown()


def schema(i: int) -> dict:
    return {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"],
            "additionalProperties": False}


def test_a_grammar_dropped_from_the_cache_is_freed_at_once(manager):
    """A compiled grammar holds llguidance's lexer and parser tables (about half a MiB for a
    schema of a few hundred enum values); one evicted from the cache must go with its last
    reference, not wait for Python's cycle collector, which a busy server runs too seldom: 3,000
    distinct schemas grew the engine's memory by over a GiB."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        first = manager.grammar_init(StructuredOutputsParams(json=schema(0))).result()
        first_ref = weakref.ref(first)
        del first
        for i in range(1, 4):
            manager.grammar_init(StructuredOutputsParams(json=schema(i))).result()
        assert manager.num_cached_grammars() == 2
        assert first_ref() is None
    finally:
        if was_enabled:
            gc.enable()


WIDE = {
    "grammar": "start: " + " | ".join(f'"w{i}"' for i in range(2500)),
    "gbnf": "root ::= " + " | ".join(f'"w{i}"' for i in range(2500)),
    "json": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(700)},
             "additionalProperties": False},
}


@pytest.mark.parametrize("name", list(WIDE))
def test_a_grammar_whose_first_tokens_pass_the_parsers_row_limit_fails_its_compile(manager, name):
    """A rule of 2,500 alternatives, or an object of 700 optional properties, makes one row of
    llguidance's parser hold more than its 2,000 items: it compiled, and every request then ended
    at its first token with finish_reason "error" and no text. The compile walks the first
    tokens, so it is refused up front (a 400 on the server) naming the field."""
    field = "json" if name == "json" else "grammar"
    params = StructuredOutputsParams(**{field: WIDE[name]})
    with pytest.raises(StructuredOutputsError, match=f"^{field}: .*too large to match.*2000"):
        manager.grammar_init(params).result()


@pytest.fixture(scope="module")
def llm(stories_path):
    with LLM(str(stories_path), device="cpu") as llm:
        yield llm


def test_llm_generate_says_a_wide_grammar_is_too_large_rather_than_refusing_its_first_token(llm):
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(grammar=WIDE["grammar"]))
    out = llm.generate(["Once upon a time"], params)[0].outputs[0]
    assert out.finish_reason == "error" and "too large to match" in (out.stop_reason or ""), out


@pytest.mark.parametrize("grammar,pattern", [
    (r'root ::= "caf\u00e9 " [\u0041-\u005A] "\u0021"', "café [A-Z]!"),
    (r'root ::= "\U0001F600" [\u00e0-\u00ff]{2}', "😀[à-ÿ]{2}"),
    (r'root ::= "\u005b" [\u005d\u002d]+ "\x41"', r"\[[\]-]+A"),
    (r'root ::= "a\\u0041"', r"a\\u0041"),             # an escaped backslash, then the text u0041
    ('root ::= "\u4e2d" [\u4e00-\u4e01]', "中[一丁]"),
])
def test_a_gbnf_grammar_takes_llama_cpps_unicode_escapes(llm, grammar, pattern):
    """llama.cpp's GBNF writes a code point as \\uXXXX or \\UXXXXXXXX; llguidance's conversion to
    Lark dropped their leading zeros ("\\u00e9" became "\\ue9"), and the grammar was refused as a
    lexer error of a text the client never wrote."""
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=0,
                            structured_outputs=StructuredOutputsParams(grammar=grammar))
    out = llm.generate(["Once upon a time"], params)[0].outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), (out.text, out.stop_reason)


@pytest.mark.parametrize("rest", [False, {"type": "string"}])
def test_prefix_items_beside_additional_items_without_items_is_refused(rest):
    """With additionalItems (draft 7's keyword) and no items, llguidance left prefixItems unenforced:
    {"prefixItems": [integer, boolean], "additionalItems": false} gave [0.3, 6691, false]."""
    schema = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}], "additionalItems": rest}
    with pytest.raises(StructuredOutputsError, match="^json: .*additionalItems.*items"):
        StructuredOutputsParams(json={"type": "object", "properties": {"pair": schema}})


@pytest.mark.parametrize("schema", [
    {"type": "array", "prefixItems": [{"type": "integer"}], "items": False, "additionalItems": False},
    {"type": "array", "items": [{"type": "integer"}], "additionalItems": False},
])
def test_additional_items_beside_items_is_taken(manager, schema):
    manager.grammar_init(StructuredOutputsParams(json=schema)).result()
