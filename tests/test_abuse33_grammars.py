"""Grammars as users of llama.cpp (GBNF) and vLLM (Lark) write them, through the Python API
(stories260K, CPU): llama.cpp's own sample grammars, GBNF's character-by-character meaning, and
Lark grammars that once hung the engine."""
from __future__ import annotations

import regex
import pytest
from test_abuse30_structured import accepts, manager  # noqa: F401 (a module fixture)

from minillm import SamplingParams
from minillm.structured_output import StructuredOutputsError, StructuredOutputsParams

# llama.cpp's grammars/arithmetic.gbnf
ARITHMETIC = r'''root  ::= (expr "=" ws term "\n")+
expr  ::= term ([-+*/] term)*
term  ::= ident | num | "(" ws expr ")" ws
ident ::= [a-z] [a-z0-9_]* ws
num   ::= [0-9]+ ws
ws    ::= [ \t\n]*
'''
# llama.cpp's grammars/chess.gbnf, list.gbnf and japanese.gbnf, each beside the same language as a regex
CHESS = r'''root    ::= "1. " move " " move "\n" ([1-9] [0-9]? ". " move " " move "\n")+
move    ::= (pawn | nonpawn | castle) [+#]?
nonpawn ::= [NBKQR] [a-h]? [1-8]? "x"? [a-h] [1-8]
pawn    ::= ([a-h] "x")? [a-h] [1-8] ("=" [NBKQR])?
castle  ::= "O-O" "-O"?
'''
MOVE = r"(?:(?:[a-h]x)?[a-h][1-8](?:=[NBKQR])?|[NBKQR][a-h]?[1-8]?x?[a-h][1-8]|O-O(?:-O)?)[+#]?"
LIST = r'''root ::= item+

# Excludes various line break characters
item ::= "- " [^\r\n\x0b\x0c\x85\u2028\u2029]+ "\n"
'''
JAPANESE = r'''# A probably incorrect grammar for Japanese
root        ::= jp-char+ ([ \t\n] jp-char+)*
jp-char     ::= hiragana | katakana | punctuation | cjk
hiragana    ::= [ぁ-ゟ]
katakana    ::= [ァ-ヿ]
punctuation ::= [、-〾]
cjk         ::= [一-鿿]
'''
JP = "[ぁ-ゟァ-ヿ、-〾一-鿿]"
REGULAR = {
    "chess": (CHESS, f"1\\. {MOVE} {MOVE}\\n(?:[1-9][0-9]?\\. {MOVE} {MOVE}\\n)+"),
    "list": (LIST, "(?:- [^\\r\\n\\x0b\\x0c\\x85\\u2028\\u2029]+\\n)+"),
    "japanese": (JAPANESE, f"{JP}+(?:[ \\t\\n]{JP}+)*"),
}
SEEDS = 50


@pytest.mark.parametrize("text", ["a=b\n", "1+2=3\n", "x*(y+1) = z \n", "a=1\nb = 2\n"])
def test_llama_cpps_arithmetic_grammar_takes_its_sentences(manager, text):
    # GBNF rules were turned into greedy Lark terminals: a term's trailing [ \t\n]* took the newline
    # the grammar requires after it, so no text ended the grammar and every output ran to max_tokens.
    assert accepts(manager, StructuredOutputsParams(grammar=ARITHMETIC), text)


@pytest.mark.parametrize("grammar,text", [
    ('root ::= ("a" | "ab") "bc"', "abc"),                 # "a" then "bc": a literal is not greedy
    ('root ::= word ws "!"\nword ::= [a-z]+\nws ::= [ !]*', "hi !"),
    ('root ::= . . .', "a\nb"),                             # GBNF's . is any character, newline too
    ('root ::= [^x]+', "a\nb"),
])
def test_a_gbnf_grammar_matches_characters_as_llama_cpp_does(manager, grammar, text):
    assert accepts(manager, StructuredOutputsParams(grammar=grammar), text)


@pytest.mark.parametrize("grammar", ['root ::= "a" root', "root ::= root", 'root ::= x\nx ::= "(" x ")"'])
def test_a_gbnf_grammar_that_can_never_end_is_a_value_error_naming_grammar(grammar):
    # It compiled, and each request then failed at its first token (or ran on to max_tokens).
    with pytest.raises(StructuredOutputsError, match="^grammar: .*never end") as err:
        StructuredOutputsParams(grammar=grammar)
    assert err.value.field == "grammar"


@pytest.mark.parametrize("grammar", [r'root ::= "\q"', 'root ::= "a" undefined', 'root ::= []',
                                     'root ::= "a"{3,2}', 'root ::= "a" )', 'root ::= ' + "(" * 3000 + '"a"' + ")" * 3000])
def test_a_gbnf_grammar_llama_cpp_refuses_is_a_value_error_naming_grammar(grammar):
    with pytest.raises(StructuredOutputsError, match="^grammar: invalid grammar: ") as err:
        StructuredOutputsParams(grammar=grammar)
    assert err.value.field == "grammar"


def test_a_lark_lexeme_that_can_only_grow_does_not_hang_the_engine(llm):
    # After "y", A (/a+/) takes every "a" greedily and "ab" can never start: llguidance's forced
    # bytes ran on forever inside the engine's step (consume_token), and the engine hung for good.
    grammar = 'start: "x" | "y" A "ab"\nA: /a+/'
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=6,
                             structured_outputs=StructuredOutputsParams(grammar=grammar)) for seed in range(8)]
    outs = [out.outputs[0] for out in llm.generate(["Once upon a time"] * 8, params, use_tqdm=False)]
    assert all(out.text == "x" or regex.fullmatch("ya+", out.text) for out in outs), outs
    assert any(out.text.startswith("y") for out in outs)
    plain = llm.generate(["Once upon a time"], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert plain.finish_reason == "length"


@pytest.mark.parametrize("name", list(REGULAR))
def test_llama_cpps_regular_grammars_are_enforced_over_many_seeds(llm, name):
    grammar, pattern = REGULAR[name]
    constraint = StructuredOutputsParams(grammar=grammar)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=48, structured_outputs=constraint)
              for seed in range(SEEDS)]
    for out in llm.generate(["Once upon a time"] * SEEDS, params, use_tqdm=False):
        comp = out.outputs[0]
        assert comp.finish_reason in ("stop", "length"), comp
        # a finished output is a sentence; one cut at max_tokens is the start of one
        assert regex.fullmatch(pattern, comp.text, partial=comp.finish_reason == "length"), comp.text


@pytest.mark.parametrize("grammar", ['start: "a', 'start: ("a"', 'start: "a" |\n%%%'])
def test_a_lark_grammars_error_shows_the_clients_lines_only(grammar):
    import llguidance
    with pytest.raises(StructuredOutputsError) as err:
        StructuredOutputsParams(grammar=grammar)
    own = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar))
    assert str(err.value) == f"grammar: invalid grammar: {own.strip()}"


def test_a_long_chain_of_gbnf_rules_is_checked_in_one_pass(monkeypatch):
    # Whether root can end was found by sweeping every rule until none changed: one sweep for each
    # rule of a chain (r0 ::= "x" r1, ...), 16 s for 6,000 rules on the thread that took the request.
    import minillm.gbnf as gbnf
    calls = []
    real = gbnf._can_end
    monkeypatch.setattr(gbnf, "_can_end", lambda node, ending: calls.append(1) or real(node, ending))
    n = 2000
    grammar = "root ::= r0\n" + "".join(f'r{i} ::= "x" r{i + 1}\n' for i in range(n)) + f'r{n} ::= "z"\n'
    assert gbnf.gbnf_to_lark(grammar).startswith("start: r0\n")
    assert len(calls) < 10 * n
