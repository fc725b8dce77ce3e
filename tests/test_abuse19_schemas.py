"""Structured outputs under schemas and grammars users write (OpenAI examples, pydantic's
model_json_schema(), $defs and recursive $refs, nullable types, formats, patterns, bounds,
patternProperties, prefixItems, unicode and escaped keys, huge enums, deep nesting), on
stories260K (CPU). Each is either enforced (every output parses and validates with jsonschema) or
refused up front naming the field: a ValueError in the Python API, a 400 with its param on the
server. Outputs are drawn twice: from the model at temperature 1.0, and by random walks over the
grammar's own masks (uniform over the allowed tokens), which reach the corners a tiny model does
not."""
from __future__ import annotations

import json
import random
import re
import unicodedata

import httpx
import jsonschema
import numpy as np
import pytest

from minillm import LLM, SamplingParams, StructuredOutputsParams
from minillm.structured_output import StructuredOutputManager, StructuredOutputsError, bitmask_words
from test_structured_output import char_ids, token_bytes

PROMPT = "Once upon a time"
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


def nested(depth: int) -> dict:
    schema = {"type": "integer"}
    for i in range(depth):
        schema = {"type": "object", "properties": {f"l{i}": schema}, "required": [f"l{i}"], "additionalProperties": False}
    return schema


def obj(**properties) -> dict:
    """An object whose properties are all required and nothing else is allowed (OpenAI's strict shape)."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


CORPUS = {
    "openai_weather": obj(location={"type": "string", "description": "City"},
                          unit={"type": "string", "enum": ["celsius", "fahrenheit"]}),
    "openai_math": obj(steps={"type": "array", "items": obj(explanation={"type": "string"}, output={"type": "string"})},
                       final_answer={"type": "string"}),
    "pydantic_nested": {   # model_json_schema() of models with Optional, Literal, Enum, list, dict
        "$defs": {"Color": {"enum": ["red", "green", "blue"], "title": "Color", "type": "string"},
                  "Pet": {"properties": {"name": {"title": "Name", "type": "string"},
                                         "age": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None},
                                         "kind": {"const": "cat", "title": "Kind", "type": "string"}},
                          "required": ["name", "kind"], "title": "Pet", "type": "object"}},
        "properties": {"owner": {"title": "Owner", "type": "string"},
                       "pets": {"items": {"$ref": "#/$defs/Pet"}, "title": "Pets", "type": "array"},
                       "favorite": {"$ref": "#/$defs/Color"},
                       "tags": {"additionalProperties": {"type": "integer"}, "type": "object"},
                       "mode": {"enum": ["a", 1, None, True]}},
        "required": ["owner", "pets", "favorite"], "title": "Owner", "type": "object"},
    "recursive_tree": {"$defs": {"Node": obj(v={"type": "integer"},
                                             children={"type": "array", "items": {"$ref": "#/$defs/Node"}, "maxItems": 2})},
                       "$ref": "#/$defs/Node"},
    "recursive_root": obj(name={"type": "string", "maxLength": 5}, next={"anyOf": [{"$ref": "#"}, {"type": "null"}]}),
    "nullable_types": {"type": "object", "required": ["a", "b", "c"],
                       "properties": {"a": {"type": ["string", "null"]}, "b": {"type": ["integer", "number", "null"]},
                                      "c": {"type": ["boolean", "array"], "items": {"type": "integer"}}}},
    "const_enum_mixed": obj(k={"const": "fixed"}, e={"enum": [1, 2.5, "x", None, False, [1, 2], {"a": "b"}]},
                            o={"const": {"nested": [1, {"z": None}]}}),
    "formats": obj(mail={"type": "string", "format": "email"}, id={"type": "string", "format": "uuid"},
                   ip={"type": "string", "format": "ipv4"}, ip6={"type": "string", "format": "ipv6"},
                   host={"type": "string", "format": "hostname"}, dur={"type": "string", "format": "duration"}),
    "dates": obj(day={"type": "string", "format": "date"}, when={"type": "string", "format": "date-time"},
                 at={"type": ["string", "null"], "format": "time"},
                 span={"type": "array", "items": {"type": "string", "format": "date", "pattern": "^20"}, "maxItems": 2}),
    "patterns": obj(code={"type": "string", "pattern": "^[A-Z]{3}-\\d{2,4}$"},
                    short={"type": "string", "minLength": 2, "maxLength": 4},
                    free={"type": "string", "pattern": "b"},          # unanchored: contains a b
                    both={"type": "string", "pattern": "^[a-z]+$", "minLength": 3, "maxLength": 5},
                    greek={"type": "string", "pattern": "^[α-ω]+$", "minLength": 3, "maxLength": 3}),
    "numbers": obj(i={"type": "integer", "minimum": -5, "exclusiveMaximum": 7},
                   n={"type": "number", "minimum": 0.5, "maximum": 2.25},
                   m={"type": "integer", "multipleOf": 7}, f={"type": "number", "multipleOf": 0.25},
                   x={"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                   big={"type": "integer", "minimum": 1000000000000}, half={"type": "integer", "minimum": 1.5, "maximum": 4.5}),
    "additional_schema": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"],
                          "additionalProperties": {"type": "string", "maxLength": 3}},
    "additional_default": {"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"}}},
    "pattern_properties": {"type": "object", "patternProperties": {"^x_[a-z]+$": {"type": "integer"}, "^s_": {"type": "string"}},
                           "additionalProperties": False},
    "pattern_and_properties": {"type": "object", "properties": {"x_fixed": {"type": "string"}},
                               "patternProperties": {"^x_": {"type": "integer"}}},
    "min_max_properties": {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1, "maxProperties": 2},
    "prefix_items": {"type": "array", "prefixItems": [{"type": "integer"}, {"enum": ["a", "b"]}, {"type": "boolean"}],
                     "items": False, "minItems": 2},
    "prefix_items_rest": {"type": "array", "prefixItems": [{"const": "head"}], "items": {"type": "integer"}, "maxItems": 4},
    "array_bounds": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 3},
    "any_of_objects": {"anyOf": [obj(kind={"const": "a"}, x={"type": "integer"}), obj(kind={"const": "b"}, y={"type": "string"})]},
    "all_of_merge": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                               {"properties": {"b": {"type": "string"}}, "required": ["b"]},
                               {"properties": {"a": {"maximum": 3}}}]},
    "empty_schema": {},
    "true_subschemas": {"type": "object", "properties": {"anything": True, "also": {}}, "required": ["anything", "also"],
                        "additionalProperties": False},
    "deep_nesting": nested(40),
    "huge_enum": obj(v={"enum": [f"item-{i:05d}" for i in range(3000)]}),
    "unicode_keys": obj(**{"名前": {"enum": ["東京", "café", "naïve ☃", "😀"]}, "ключ": {"type": "integer"},
                           "Ω≈ç√": {"type": "boolean"}}),
    "escaped_keys": obj(**{"a\"b": {"type": "integer"}, "back\\slash": {"type": "integer"}, "new\nline": {"type": "integer"},
                           "tab\t": {"const": "q\"\\\n"}, "ctl\u0001": {"type": "integer"}, "/slash": {"type": "null"}}),
    "escaped_enum": {"enum": ["a\"b", "c\\d", "e\nf", "\u0000", "tab\t", "</script>"]},
    "draft7_definitions": {"definitions": {"pos": {"type": "integer", "minimum": 1}}, "type": "object",
                           "properties": {"n": {"$ref": "#/definitions/pos"}}, "required": ["n"], "additionalProperties": False},
    "anchor_ref": {"$defs": {"x": {"$anchor": "num", "type": "integer", "minimum": 5, "maximum": 6}},
                   "type": "array", "items": {"$ref": "#num"}, "minItems": 1, "maxItems": 2},
    "top_level_scalars": {"type": ["number", "boolean", "null"], "maximum": 10},
    "annotations": {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "https://example.com/p",
                    "$comment": "c", "title": "T", "description": "d", "examples": [{"a": 1}], "deprecated": False,
                    "type": "object", "properties": {"a": {"type": "integer", "readOnly": True, "default": 0}},
                    "required": ["a"], "additionalProperties": False},
}


# ----------------------------------------------------------------------------- random walks

@pytest.fixture(scope="module")
def walker(tok):
    manager = StructuredOutputManager.from_tokenizer(tok, tok.vocab_size, max_num_seqs=4)
    yield Walker(tok, manager)
    manager.shutdown()


class Walker:
    """Outputs drawn uniformly from each step's allowed tokens (the model's preferences left out):
    EOS, where allowed, with probability p_end; with probability p_close a token with a quote (that
    may end a string), else one with a bracket or a comma, so that strings and lists end."""

    def __init__(self, tok, manager) -> None:
        self.tok, self.manager = tok, manager
        self.vocab = tok.vocab_size
        self.eos = set(tok.eos_token_ids)
        pieces = {i: token_bytes(tok, i) for i in range(self.vocab)}
        self.bytes = pieces
        self.quotes = {i for i, b in pieces.items() if b and b'"' in b}
        self.closers = {i for i, b in pieces.items() if b and any(c in b for c in b'}],')}

    def walks(self, params: StructuredOutputsParams, n: int, max_tokens: int = 240, seed: int = 0,
              p_end: float = 0.7, p_close: float = 0.4) -> list[tuple[str, str]]:
        """n (text, "stop" | "length" | "error: ...") drawn under params."""
        rng = random.Random(seed)
        grammar = self.manager.grammar_init(params).result(timeout=300)
        row = np.zeros((1, bitmask_words(self.vocab)), np.int32)
        out = []
        for _ in range(n):
            matcher, ids, end = grammar.new_matcher(), [], "length"
            for _ in range(max_tokens):
                if matcher.is_stopped():
                    end = f"error: {matcher.error}" if matcher.is_error() else "stop"
                    break
                row[:] = 0
                matcher.fill_bitmask(row, 0)
                allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:self.vocab]).tolist()
                if any(t in self.eos for t in allowed) and rng.random() < p_end:
                    end = "stop"
                    break
                choices = [t for t in allowed if t not in self.eos]
                if not choices:
                    end = "error: no token allowed"
                    break
                if rng.random() < p_close:
                    choices = ([t for t in choices if t in self.quotes] or [t for t in choices if t in self.closers]
                               or choices)
                token = rng.choice(choices)
                if not matcher.accept_token(token):
                    end = f"error: {matcher.error}"
                    break
                ids.append(token)
            out.append((b"".join(self.bytes[i] for i in ids).decode("utf-8", "replace"), end))
        return out

    def accepts(self, params: StructuredOutputsParams, text: str) -> bool:
        """The grammar takes text, spelled a character a token, as a whole output."""
        matcher = self.manager.grammar_init(params).result(timeout=300).new_matcher()
        return matcher.accept_tokens(char_ids(self.tok, text)) and matcher.can_terminate()


def validate(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)


@pytest.mark.parametrize("name", list(CORPUS))
def test_every_walk_under_a_schema_validates(walker, name):
    schema = CORPUS[name]
    # formats' email is free text a walk seldom closes (about one walk in six ends): more walks there.
    outs = walker.walks(StructuredOutputsParams(json=schema), n=40 if name == "formats" else 25,
                        max_tokens=400 if name == "deep_nesting" else 240)
    assert not [end for _, end in outs if end not in ("stop", "length")], outs
    finished = [text for text, end in outs if end == "stop"]
    assert len(finished) >= 5, outs
    for text in finished:
        validate(text, schema)


# ----------------------------------------------------------------------------- the model

@pytest.fixture(scope="module")
def llm(stories_path):
    with LLM(str(stories_path), device="cpu", max_num_seqs=64) as engine:
        yield engine


MODEL_MAX_TOKENS = 160


@pytest.fixture(scope="module")
def corpus_outputs(llm):
    """Two seeds at temperature 1.0 per schema of the corpus, all in one batch."""
    rows = [(name, seed) for name in CORPUS for seed in range(2)]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=MODEL_MAX_TOKENS,
                             structured_outputs=StructuredOutputsParams(json=CORPUS[name])) for name, seed in rows]
    return rows, llm.generate([PROMPT] * len(rows), params, use_tqdm=False)


def test_every_model_output_under_a_schema_validates_or_ran_out_of_tokens(corpus_outputs):
    rows, outs = corpus_outputs
    num_stopped = 0
    for (name, seed), out in zip(rows, outs):
        completion = out.outputs[0]
        assert completion.finish_reason in ("stop", "length"), (name, seed, completion.stop_reason)
        if completion.finish_reason == "length":
            assert len(completion.token_ids) == MODEL_MAX_TOKENS, (name, seed)
            continue
        num_stopped += 1
        validate(completion.text, CORPUS[name])
    assert num_stopped >= len(rows) // 3


def test_an_output_cut_by_max_tokens_says_length_at_every_cut(llm):
    schema = obj(a={"type": "integer"}, b={"enum": ["x", "y"]})
    cuts = range(1, 12)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=cut,
                             structured_outputs=StructuredOutputsParams(json=schema)) for cut in cuts for seed in range(2)]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for p, out in zip(params, outs):
        completion = out.outputs[0]
        if completion.finish_reason == "stop":
            validate(completion.text, schema)
        else:
            assert completion.finish_reason == "length" and len(completion.token_ids) == p.max_tokens, completion
            with pytest.raises(ValueError):
                json.loads(completion.text)


def test_choices_with_duplicates_and_prefix_overlaps(llm):
    choices = ["a", "ab", "a", "abc", "b", "ba"]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(choice=choices)) for seed in range(12)]
    for out in llm.generate([PROMPT] * len(params), params, use_tqdm=False):
        assert (out.outputs[0].finish_reason, out.outputs[0].text in choices) == ("stop", True), out.outputs[0]
    cut = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, structured_outputs=StructuredOutputsParams(
        choice=["ab", "abc"])), use_tqdm=False)[0].outputs[0]
    assert (cut.finish_reason, cut.text) == ("length", "a")


@pytest.mark.parametrize("choice", [["a", ""], [""], ["a", None], "a"])
def test_a_choice_list_with_an_empty_or_odd_entry_is_refused(choice):
    with pytest.raises(StructuredOutputsError, match="^choice: ") as info:
        StructuredOutputsParams(choice=choice)
    assert info.value.field == "choice"


def test_many_schemas_in_flight_leave_unconstrained_greedy_outputs_alone(llm, corpus_outputs):
    prompts = ["Once upon a time", "Lily and Tom", "The cat sat", "One day, a little bird"]
    plain = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=64,
                                  structured_outputs=StructuredOutputsParams(json=schema))
                   for i, schema in enumerate(CORPUS.values())]
    mixed = [p for pair in zip(constrained[:len(prompts)], [plain] * len(prompts)) for p in pair] + constrained[len(prompts):]
    mixed_prompts = [p for prompt in prompts for p in (PROMPT, prompt)] + [PROMPT] * (len(constrained) - len(prompts))
    outs = llm.generate(mixed_prompts, mixed, use_tqdm=False)
    together = [outs[2 * i + 1].outputs[0].token_ids for i in range(len(prompts))]
    assert together == alone


# ----------------------------------------------------------------------------- refused up front

UNSUPPORTED = {
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "if": {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
    "not": {"not": {"type": "string"}},
    "contains": {"type": "array", "contains": {"type": "integer"}},
    "propertyNames": {"type": "object", "properties": {"a": {}}, "propertyNames": {"pattern": "^[a-z]+$"}},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "number"}]},
    "unevaluatedProperties": {"type": "object", "allOf": [{"properties": {"a": {}}}], "unevaluatedProperties": False},
    "dependencies": {"type": "object", "dependencies": {"a": ["b"]}},
    "look-around": {"type": "string", "pattern": "^(?=a)a+$"},
    "backreferences": {"type": "string", "pattern": "^(a)\\1$"},
    "not present in a registry": {"$ref": "https://example.com/schema.json"},
    "Invalid type": {"type": "strng"},
    "min/maxProperties only supported": {"type": "object", "properties": {"a": {}, "b": {}}, "minProperties": 1,
                                         "additionalProperties": True},      # closed (the default) it is enforced
    "must be an object": True,
}


@pytest.mark.parametrize("what", list(UNSUPPORTED))
def test_a_keyword_that_cannot_be_enforced_is_a_value_error_naming_json(what):
    with pytest.raises(StructuredOutputsError, match="^json: ") as info:
        StructuredOutputsParams(json=UNSUPPORTED[what])
    assert info.value.field == "json" and what in str(info.value)


@pytest.mark.parametrize("schema,least", [
    ({"type": "object", "minProperties": 2}, 1),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 3}, 1),
    ({"type": "object", "patternProperties": {"^x": {}}, "additionalProperties": False, "minProperties": 2}, 1),
    ({"type": "object", "properties": {"a": {}}, "required": ["a"], "minProperties": 3}, 2),
])
def test_a_min_properties_that_repeated_keys_could_meet_is_refused(walker, schema, least):
    # llguidance counts members, and keys outside `properties` may repeat: {"": 1, "": 2} met
    # minProperties 2 and parsed to one property, failing the schema it was held to.
    with pytest.raises(StructuredOutputsError, match=r"^json: minProperties \d+ is not supported here") as info:
        StructuredOutputsParams(json=schema)
    assert f"at most {least}" in str(info.value)
    lower = StructuredOutputsParams(json={**schema, "minProperties": least})   # one member past the listed ones: fine
    outs = walker.walks(lower, n=20)
    assert [end for _, end in outs].count("stop") >= 5
    for text, end in outs:
        if end == "stop":
            validate(text, {**schema, "minProperties": least})


@pytest.mark.parametrize("kwargs", [
    dict(regex="a\\"), dict(regex="\\"), dict(regex="[0-9]+\\\\\\"),
    dict(json={"type": "string", "pattern": "^a\\"}),
    dict(json={"type": "object", "patternProperties": {"^k\\": {"type": "integer"}}}),
])
def test_a_pattern_ending_in_a_lone_backslash_is_refused(kwargs):
    # llguidance dropped the backslash and matched the rest: regex "a\" generated "a", and
    # the pattern "^a\" let any string starting with "a" through.
    field = next(iter(kwargs))
    with pytest.raises(StructuredOutputsError, match=f"^{field}: invalid .*lone backslash"):
        StructuredOutputsParams(**kwargs)


def test_an_escaped_backslash_at_the_end_is_taken(walker):
    for text, end in walker.walks(StructuredOutputsParams(regex="[ab]\\\\"), n=10):
        assert end == "stop" and re.fullmatch(r"[ab]\\", text), text
    assert walker.accepts(StructuredOutputsParams(json={"type": "string", "pattern": "^a\\\\$"}), '"a\\\\"')


@pytest.mark.parametrize("fmt,text,ok", [
    ("date", "2023-02-29", False), ("date", "1900-02-29", False), ("date", "0000-01-01", False),
    ("date", "2023-04-31", False), ("date", "2024-02-29", True), ("date", "2000-02-29", True), ("date", "0001-12-31", True),
    ("date-time", "2023-01-01T21:02:60Z", False), ("date-time", "2023-02-29T00:00:00Z", False),
    ("date-time", "2024-02-29t23:59:59.25+05:30", True), ("time", "23:59:60Z", False), ("time", "12:00:00-01:00", True),
])
def test_date_formats_take_only_real_dates_and_times(walker, fmt, text, ok):
    # llguidance's formats took February 29 of any year, the year 0000 and a second 60 at any time of
    # day: datetime.fromisoformat, pydantic and jsonschema's format check refuse them.
    params = StructuredOutputsParams(json={"type": "string", "format": fmt})
    assert walker.accepts(params, json.dumps(text)) == ok
    with_pattern = StructuredOutputsParams(json={"type": "string", "format": fmt, "pattern": "^[0-9]"})
    assert walker.accepts(with_pattern, json.dumps(text)) == ok


def test_date_walks_parse_with_datetime(walker):
    import datetime
    outs = walker.walks(StructuredOutputsParams(json=CORPUS["dates"]), n=40, p_close=0.6)
    finished = [json.loads(text) for text, end in outs if end == "stop"]
    assert len(finished) >= 10
    def iso(text: str) -> str:
        """text as Python 3.10's fromisoformat takes it too: no "Z", fractions of 6 digits (3.11 takes both)."""
        text = re.sub(r"\.(\d+)", lambda m: "." + (m.group(1) + "000000")[:6], text.upper())
        return text[:-1] + "+00:00" if text.endswith("Z") else text

    for value in finished:
        datetime.date.fromisoformat(value["day"])
        datetime.datetime.fromisoformat(iso(value["when"]))
        assert value["at"] is None or datetime.time.fromisoformat(iso(value["at"]))


def test_a_format_inside_a_const_is_data(walker):
    params = StructuredOutputsParams(json={"const": {"format": "date"}, "enum": [{"format": "date"}]})
    assert walker.accepts(params, '{"format":"date"}')


# ----------------------------------------------------------------------------- regexes and grammars

def is_digit(c: str) -> bool:
    """A decimal digit of any script (Rust's \\d), or a code point newer than Python's Unicode tables."""
    return unicodedata.category(c) in ("Nd", "Cn")


def greekish(text: str) -> bool:
    """\\p{Greek}: Python has no script classes; Greek letters, signs (Ω, the ohm sign) and numerals."""
    return 2 <= len(text) <= 4 and all(not c.isascii() for c in text)


REGEXES = {
    r"^abc$": lambda s: s == "abc",
    r"\Aab+\z": lambda s: re.fullmatch("ab+", s),
    r"^a|b$": lambda s: s in ("a", "b"),
    r"(?i)hello": lambda s: s.lower() == "hello",
    r"\p{Greek}{2,4}": greekish,
    r"[[:digit:]]{2}-[^\x00-\x7F]": lambda s: re.fullmatch(r"[0-9]{2}-[^\x00-\x7F]", s),
    r"\d{3}-\d{4}": lambda s: len(s) == 8 and s[3] == "-" and all(map(is_digit, s[:3] + s[4:])),
    r"(?:ab)*?c{0,2}": lambda s: re.fullmatch(r"(?:ab)*c{0,2}", s),
    r"x\ny\t/": lambda s: s == "x\ny\t/",
}


@pytest.mark.parametrize("regex", list(REGEXES))
def test_every_walk_under_a_regex_matches_it(walker, regex):
    outs = walker.walks(StructuredOutputsParams(regex=regex), n=20, max_tokens=40, p_close=0.0)
    finished = [text for text, end in outs if end == "stop"]
    assert len(finished) >= 5, outs
    for text in finished:
        assert REGEXES[regex](text), text


@pytest.mark.parametrize("regex,what", [
    ("(?=a)ab", "look-around"), ("(?<!a)b", "look-around"), (r"(a)\1", "backreferences"),
    (r"(?P<n>x)(?P=n)", "regex parse error"), (r"\bword\b", "lookarounds not supported"),
    ("(?m)^a$", "lookarounds not supported"), ("a^b", "lookarounds not supported"),
])
def test_an_unsupported_regex_feature_is_refused(regex, what):
    with pytest.raises(StructuredOutputsError, match="^regex: invalid regular expression") as info:
        StructuredOutputsParams(regex=regex)
    assert what in str(info.value)


NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
GRAMMARS = {
    "import": ('%import common.NUMBER\nstart: NUMBER ("," NUMBER)*', lambda s: re.fullmatch(f"{NUMBER}(?:,{NUMBER})*", s)),
    "ignore": ('%import common.CNAME\n%import common.WS\n%ignore WS\nstart: CNAME "=" CNAME',
               lambda s: re.fullmatch(r"\s*[A-Za-z_]\w*\s*=\s*[A-Za-z_]\w*\s*", s, re.ASCII)),
    "regex_terminal": ('start: WORD ("-" WORD)*\nWORD: /[a-z]+/', lambda s: re.fullmatch(r"[a-z]+(?:-[a-z]+)*", s)),
    "ambiguous": ('start: a | b\na: "x" "y"?\nb: "x"? "y"', lambda s: s in ("x", "xy", "y")),
    "ambiguous_recursion": ('start: e\ne: e "+" e | "1"', lambda s: re.fullmatch(r"1(?:\+1)*", s)),
    "case_insensitive": ("start: /hello/i", lambda s: s.lower() == "hello"),
    "json_inside": ('start: "x=" %json {"type": "integer", "minimum": 3, "maximum": 5}', lambda s: s in ("x=3", "x=4", "x=5")),
    "gbnf": ('root ::= "a" b+\nb ::= [0-9]', lambda s: re.fullmatch("a[0-9]+", s)),
    "empty_or_a": ('start: "" | "a"', lambda s: s in ("", "a")),
    "unicode": ('start: "héllo" | /[α-ω]{2}/', lambda s: s == "héllo" or re.fullmatch("[α-ω]{2}", s)),
}


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_every_walk_under_a_lark_grammar_is_in_its_language(walker, name):
    grammar, check = GRAMMARS[name]
    outs = walker.walks(StructuredOutputsParams(grammar=grammar), n=20, max_tokens=60, p_close=0.0)
    finished = [text for text, end in outs if end == "stop"]
    assert len(finished) >= 5, outs
    for text in finished:
        assert check(text), text


def test_json_object_walks_are_json_objects(walker):
    for whitespace in (None, False):
        outs = walker.walks(StructuredOutputsParams(json_object=True, disable_any_whitespace=whitespace), n=30)
        finished = [text for text, end in outs if end == "stop"]
        assert len(finished) >= 10
        assert all(isinstance(json.loads(text), dict) for text in finished)


# ----------------------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    from test_server_helpers import chat_model_dir, running_server
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat-model"))
    with running_server(model, served_model_name="stories") as (url, engine):
        yield url, engine


def chat_body(schema, **fields) -> dict:
    return {"model": "stories", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 120,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}, **fields}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("schema,what", [
    (UNSUPPORTED["uniqueItems"], "uniqueItems"),
    (UNSUPPORTED["if"], "if"),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}, "minProperties 2"),
    ({"type": "string", "pattern": "^x\\"}, "lone backslash"),
    (True, "must be an object"),
    ([{"type": "string"}], "must be an object"),
])
def test_the_server_refuses_an_unsupported_schema_naming_the_field(http, endpoint, schema, what):
    if endpoint == "chat":
        r = http.post("/v1/chat/completions", json=chat_body(schema))
        param = "response_format.json_schema.schema"
        if what == "must be an object":       # response_format's own check words it so, naming what came
            what = "must be a JSON object"
    else:
        r = http.post("/v1/completions", json={"model": "stories", "prompt": PROMPT, "max_tokens": 8,
                                               "structured_outputs": {"json": schema}})
        param = "structured_outputs.json"
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and what in error["message"], error


@pytest.mark.parametrize("regex,what", [("a\\", "lone backslash"), ("(?=a)a", "look-around"), (r"(.)\1", "backreferences")])
def test_the_server_refuses_an_unsupported_regex_naming_the_field(http, regex, what):
    r = http.post("/v1/completions", json={"model": "stories", "prompt": PROMPT, "max_tokens": 8,
                                           "structured_outputs": {"regex": regex}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "structured_outputs.regex" and what in error["message"], error


def sse_events(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_the_server_says_length_for_a_cut_output_and_stop_for_a_whole_one(server, stream):
    schema = obj(unit={"enum": ["celsius", "fahrenheit"]}, n={"type": "integer", "minimum": 0, "maximum": 99},
                 ok={"type": "boolean"})
    for max_tokens, expect in [(5, "length"), (400, "stop")]:
        body = chat_body(schema, max_tokens=max_tokens, temperature=1.0, seed=3, stream=stream)
        if stream:
            with httpx.stream("POST", f"{server[0]}/v1/chat/completions", json=body, timeout=120) as r:
                assert r.status_code == 200
                events = sse_events(r)
            text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
            finish = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
        else:
            r = httpx.post(f"{server[0]}/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            text, finish = choice["message"]["content"], [choice["finish_reason"]]
        assert finish == [expect], (max_tokens, finish, text)
        if expect == "stop":
            validate(text, schema)
        else:
            with pytest.raises(ValueError):
                json.loads(text)


def test_the_server_json_object_mode_gives_objects(http):
    body = {"model": "stories", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "n": 4,
            "temperature": 1.0, "seed": 5, "response_format": {"type": "json_object"}}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["message"]["content"]), dict)
        else:
            assert choice["finish_reason"] == "length"
