"""Structured outputs abused as vLLM users do, through the Python API (stories260K, CPU): vLLM's
StructuredOutputsParams options, and a constraint as it crosses from an API server to the engine core."""
from __future__ import annotations

import json

import msgspec
import pytest

import minillm.structured_output as so
from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.engine_core.core import sampling_fields
from minillm.engine_core.messages import encoder
from minillm.server.async_llm import _wire_constraint
from minillm.structured_output import (MAX_CONSTRAINT_CHARS, StructuredOutputManager, StructuredOutputsError,
                                       StructuredOutputsParams)
import test_structured_engine

VOCAB = 512
gated_compile = test_structured_engine.gated_compile        # a fixture
run_until = test_structured_engine.run_until
OPEN = {"type": "object", "properties": {"a": {"type": "integer"},
                                         "b": {"type": "object", "properties": {"c": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def manager(tok):
    mgr = StructuredOutputManager.from_tokenizer(tok, VOCAB, max_num_seqs=4)
    yield mgr
    mgr.shutdown()


def accepts(manager, params: StructuredOutputsParams, text: str) -> bool:
    """Whether the constraint takes text as a whole output."""
    matcher = manager.grammar_init(params).result().new_matcher()
    return matcher.accept_tokens(manager.ll_tokenizer.tokenize_str(text)) and matcher.can_terminate()


def across_the_wire(params: StructuredOutputsParams) -> StructuredOutputsParams:
    """params as the engine core rebuilds it from an API server's AddRequest."""
    wire = msgspec.msgpack.decode(encoder().encode(_wire_constraint(params)))
    return sampling_fields({"structured_outputs": wire})["structured_outputs"]


def test_vllms_options_at_their_defaults_are_taken():
    # vLLM's StructuredOutputsParams has these fields; a script that names them at their defaults
    # got a TypeError (an unexpected keyword argument).
    params = StructuredOutputsParams(json={"type": "integer"}, disable_additional_properties=False,
                                     whitespace_pattern=None, structural_tag=None)
    assert params.key == StructuredOutputsParams(json={"type": "integer"}).key


@pytest.mark.parametrize("name,value", [("whitespace_pattern", r"[ \n]*"), ("structural_tag", '{"triggers": []}'),
                                        ("disable_additional_properties", "yes")])
def test_vllms_options_minillm_does_not_do_are_a_value_error_naming_them(name, value):
    with pytest.raises(StructuredOutputsError, match=f"^{name}: ") as err:
        StructuredOutputsParams(json={"type": "object"}, **{name: value})
    assert err.value.field == name


def test_disable_additional_properties_closes_the_schemas_objects_as_vllm_does(manager):
    # vLLM's guidance backend adds additionalProperties: false to every object schema with properties
    # that does not say; here True was refused (and the keyword itself a TypeError). Its default
    # backend (xgrammar, strict) does so too, and so does the default here; False reads JSON Schema's way.
    closed = StructuredOutputsParams(json=OPEN, disable_additional_properties=True)
    assert accepts(manager, closed, '{"a":1,"b":{"c":2}}')
    assert not accepts(manager, closed, '{"a":1,"z":2}')
    assert not accepts(manager, closed, '{"b":{"c":2,"z":3}}')
    assert StructuredOutputsParams(json=OPEN).key == closed.key
    assert accepts(manager, StructuredOutputsParams(json=OPEN, disable_additional_properties=False), '{"a":1,"z":2}')
    said = {**OPEN, "additionalProperties": {"type": "integer"}}          # an object that says is left as it is
    assert accepts(manager, StructuredOutputsParams(json=said, disable_additional_properties=True), '{"z":2}')
    data = {"const": {"properties": {"x": 1}}}                             # a const is data, not a schema
    assert accepts(manager, StructuredOutputsParams(json=data, disable_additional_properties=True),
                   '{"properties":{"x":1}}')


DATED = {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"},
                                          "day": {"type": "string", "format": "date"}}, "required": ["when"]}


@pytest.mark.parametrize("options", [{}, {"disable_additional_properties": True}])
def test_a_constraint_rebuilt_by_the_engine_core_is_the_same_constraint(options):
    # The core rebuilt a schema from its key's text, which held the strict date patterns already:
    # each got a second copy in allOf (compiled twice over).
    params = StructuredOutputsParams(json=DATED, **options)
    assert across_the_wire(params).key == params.key


def test_a_schema_under_the_size_bound_is_taken_by_the_engine_core_too():
    # 150 date-time properties in 114,000 characters: within the bound where the request entered;
    # the core counted the strict date patterns added to it (173,000 characters) and refused it,
    # a 400 with no param that gave the client's schema a length it never had.
    properties = {f"p{i}": {"type": "string", "format": "date-time", "description": "x" * 700} for i in range(150)}
    schema = {"type": "object", "properties": properties, "required": ["p0"], "additionalProperties": False}
    assert len(json.dumps(schema, separators=(",", ":"))) < MAX_CONSTRAINT_CHARS
    params = StructuredOutputsParams(json=schema)
    assert across_the_wire(params).key == params.key


@pytest.mark.parametrize("grammar", ['?start: value\n?value: "yes" | "no"', '// Lark\n!start: "yes" | "no"',
                                     '%import common.WS\n?start : ANSWER\nANSWER: "yes" | "no"'])
def test_a_lark_grammar_whose_start_rule_is_inlined_is_read_as_lark(manager, grammar):
    # Lark writes ?start: (inlined) and !start: (tokens kept), as in its own example grammars, and
    # llguidance's Lark takes them; they were read as GBNF, and refused as a GBNF syntax error.
    params = StructuredOutputsParams(grammar=grammar)
    assert accepts(manager, params, "yes") and not accepts(manager, params, "maybe")


@pytest.mark.parametrize("grammar,error", [('value: "a"', "no start rule found"),
                                           ('start: value\nvalue: ("a"', r"2\(\d+\): Expected token '\)'")])
def test_a_lark_grammar_with_no_start_rule_or_a_syntax_error_is_told_as_lark(grammar, error):
    # Text with no `::=` is no GBNF: it was converted as GBNF all the same when it had no start rule,
    # and the error spoke of GBNF ("Expected ::= at line 1").
    with pytest.raises(StructuredOutputsError, match=f"^grammar: invalid grammar: {error}") as err:
        StructuredOutputsParams(grammar=grammar)
    assert "GBNF" not in str(err.value)


def test_a_oneof_llguidance_cannot_prove_exclusive_says_how_to_read_it_as_anyof(manager):
    # llguidance's error asks to "enable 'coerce_one_of'", an option no minillm or vLLM setting names;
    # a schema sets it itself, in its top-level "x-guidance" object.
    schema = {"type": "object", "properties": {"n": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}}
    with pytest.raises(StructuredOutputsError, match='"x-guidance": {"coerce_one_of": true}'):
        StructuredOutputsParams(json=schema)
    coerced = StructuredOutputsParams(json={**schema, "x-guidance": {"coerce_one_of": True}})
    assert accepts(manager, coerced, '{"n":1.5}')


@pytest.fixture(scope="module", params=[False, True], ids=["in-process", "grammar-process"])
def llm(request, stories_path):
    with LLM(str(stories_path), device="cpu", grammar_process=request.param) as llm:
        yield llm


@pytest.mark.parametrize("regex", ["yes", "[0-9]+"])
def test_allowed_tokens_outside_a_forced_text_are_named_not_a_special_tokens_text(llm, regex):
    # Where the grammar forces text ("yes"), the fully masked row's id 0 (a special token: <unk>) was
    # refused with llguidance's "applying" error, and the message said the constraint's text held a
    # special token's text, which it does not; the cause is allowed_token_ids.
    letter = llm.get_tokenizer().encode("a", add_special_tokens=False)[-1]
    params = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=[letter],
                            structured_outputs=StructuredOutputsParams(regex=regex))
    out = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "error" and out.token_ids == []
    assert "excluded them all" in out.stop_reason and "special token" not in out.stop_reason, out.stop_reason


def test_a_constraint_changed_after_it_was_built_is_the_one_enforced(llm):
    # vLLM reads a StructuredOutputsParams' fields when a request is added; here its key was made once,
    # when it was built, and a script that set choice afterwards got the old choices ("pear").
    constraint = StructuredOutputsParams(choice=["apple", "pear"])
    constraint.choice = ["Lily", "Ben"]
    params = SamplingParams(temperature=0, max_tokens=4, structured_outputs=constraint)
    assert llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].text in ("Lily", "Ben")
    constraint.choice = []
    with pytest.raises(StructuredOutputsError, match="^choice: "):
        llm.generate(["Once upon a time"], params, use_tqdm=False)
    constraint.choice = None
    constraint.json = {"type": "boolean"}
    assert llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].text in ("true", "false")


def test_a_compile_past_the_timeout_fails_its_requests_and_frees_its_worker(stories_path, gated_compile, monkeypatch):
    # A regex of 16,000 [abc]{0,3} items takes llguidance 23 s to compile (8,000 ".?" 4 s; the time
    # grows with the square of the length) and passes the entry check: two such requests held both
    # compile workers, and every later constrained request, whatever its constraint, waited behind them.
    monkeypatch.setattr(so, "COMPILE_TIMEOUT_S", 1.0)
    engine = LLMEngine(EngineConfig(model=str(stories_path), device="cpu"))
    gates = []
    for i in range(2):                      # both compile workers held, as by a slow compile
        slow = StructuredOutputsParams(regex=f"slow{i}")
        gates.append(gated_compile(slow))
        engine.add_request(f"slow{i}", "Once upon a time", SamplingParams(temperature=0, max_tokens=8,
                                                                          structured_outputs=slow))
    for _, entered in gates:
        assert entered.wait(timeout=120)
    later = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="later"))
    engine.add_request("later", "Once upon a time", later)
    engine.add_request("plain", "Once upon a time", SamplingParams(temperature=0, max_tokens=8))
    try:
        outs = run_until(engine, lambda o: all(k in o and o[k].finished for k in ("slow0", "slow1", "later", "plain")),
                         max_steps=500)
        for i in range(2):
            failed = outs[f"slow{i}"].outputs[0]
            assert failed.finish_reason == "error" and failed.token_ids == []
            assert failed.stop_reason.startswith("structured_outputs.regex: the regular expression took more than 1 s "
                                                 "to compile"), failed.stop_reason
        assert (outs["later"].outputs[0].text, outs["later"].outputs[0].finish_reason) == ("later", "stop")
        assert outs["plain"].outputs[0].finish_reason == "length"
    finally:
        for gate, _ in gates:
            gate.set()
        engine.shutdown()


def test_a_regex_past_the_size_bound_is_refused_where_it_enters():
    # A schema or grammar past MAX_CONSTRAINT_CHARS was refused, a regex of any length taken: one of
    # 16 MiB (what the server reads) would hold a compile thread for hours after its request failed.
    with pytest.raises(StructuredOutputsError, match=f"^regex: the regular expression is {MAX_CONSTRAINT_CHARS + 1} "
                                                     f"characters long; at most {MAX_CONSTRAINT_CHARS} are taken"):
        StructuredOutputsParams(regex="a" * (MAX_CONSTRAINT_CHARS + 1))
    assert StructuredOutputsParams(regex="a" * MAX_CONSTRAINT_CHARS).key[1] == "a" * MAX_CONSTRAINT_CHARS
