"""Structured outputs abused as vLLM users do, through the Python API (stories260K, CPU): the
schemas pydantic writes for its standard types, as the openai client's parse() sends them."""
from __future__ import annotations

import datetime

import pytest
from test_abuse30_structured import accepts, manager  # noqa: F401,F811 (a module fixture)

from minillm.structured_output import StructuredOutputsParams

DURATION = {"type": "string", "format": "duration"}


@pytest.mark.parametrize("text", ["P1Y2M3DT4H5M6S", "P999999W", "PT36H", "P0D",
                                  "P999999Y999999M999999DT999999H999999M999999S"])
def test_a_duration_pydantic_reads_is_taken(manager, text):
    pydantic = pytest.importorskip("pydantic")
    pydantic.TypeAdapter(datetime.timedelta).validate_python(text)
    assert accepts(manager, StructuredOutputsParams(json=DURATION), f'"{text}"')


@pytest.mark.parametrize("text", ["P1000000000D", "PT86399999999999S", "P2739727Y", "PT99999999999999999999H"])
def test_a_duration_pydantic_cannot_read_is_refused(manager, text):
    # A timedelta field's schema is a string of format duration. llguidance took numbers of any
    # length there, and the model wrote digits on and on ("PT91004000000000000000..."): what ended
    # failed pydantic's parse (past 999,999,999 days, or past its integers).
    pydantic = pytest.importorskip("pydantic")
    with pytest.raises(pydantic.ValidationError):
        pydantic.TypeAdapter(datetime.timedelta).validate_python(text)
    assert not accepts(manager, StructuredOutputsParams(json=DURATION), f'"{text}"')


# (max_digits, decimal_places) of a Decimal field: strings taken (pydantic reads each), and strings
# not taken (pydantic refuses them, or, under a bound, they hold zeros it drops: a model writes zeros on).
DECIMALS = {
    (None, None): (["0", "-12.50", "+.5", "7.", "000123.4500"], ["", ".", "-", "+.", "1e5", "1.2.3", "abc"]),
    (None, 2): (["12345.12", "-.25", "3", "1.5", "0012.1"], [".", "1.123", "-", "1.500"]),
    (None, 0): (["5", "5.", "-12", ".0"], ["5.5", "."]),
    (5, 2): (["123.45", "-0.5", "123", "012.3", ".07"], ["1234.5", "1.234", "12345", ".", "+", "00012.30"]),
    (4, None): (["1234", "1.234", "-.1234", "12.3"], ["12345", "1.2345", "."]),
    (3, 5): (["0.123", ".12", "-0.1"], ["0.1234", "1", "0"]),
}

# pydantic reads these, its pattern does not take 1e5, and the zeros are those left out.
READ_YET_NOT_TAKEN = {"1e5", "1.500", "00012.30"}

# The pattern of a Decimal's string form as pydantic 2.6-2.13 writes it, by (max_digits, decimal_places);
# pydantic 2.14 writes the string form without one.
PATTERNS = {
    (None, None): r"^(?!^[-+.]*$)[+-]?0*\d*\.?\d*$",
    (None, 2): r"^(?!^[-+.]*$)[+-]?0*\d*\.?\d{0,2}0*$",
    (None, 0): r"^(?!^[-+.]*$)[+-]?0*\d*\.?\d{0,0}0*$",
    (5, 2): r"^(?!^[-+.]*$)[+-]?0*(?:\d{0,3}|(?=[\d.]{1,6}0*$)\d{0,3}\.\d{0,2}0*$)",
    (4, None): r"^(?!^[-+.]*$)[+-]?0*(?:\d{0,4}|(?=[\d.]{1,5}0*$)\d*\.\d*0*$)",
    (3, 5): r"^(?!^[-+.]*$)[+-]?0*(?:\d{0,0}|(?=[\d.]{1,4}0*$)\d{0,0}\.\d{0,5}0*$)",
}


def decimal_schema(places) -> dict:
    """The JSON schema pydantic 2.13 writes for a model of one Decimal field, amount."""
    amount = {"anyOf": [{"type": "number"}, {"pattern": PATTERNS[places], "type": "string"}], "title": "Amount"}
    return {"properties": {"amount": amount}, "required": ["amount"], "title": "Price", "type": "object"}


def decimal_model(max_digits, decimal_places):
    pydantic = pytest.importorskip("pydantic")
    return pydantic.create_model("Price", amount=(pydantic.condecimal(max_digits=max_digits,
                                                                      decimal_places=decimal_places), ...))


@pytest.mark.parametrize("places", list(DECIMALS))
def test_a_pydantic_decimal_field_is_taken_and_what_ends_parses(manager, places):
    # pydantic writes a Decimal's string form with a look-ahead ((?!^[-+.]*$)...), which llguidance
    # does not take: a model with a Decimal field (a price) was refused whole, through parse() too.
    import json
    model = decimal_model(*places)
    pydantic = pytest.importorskip("pydantic")
    params = StructuredOutputsParams(json=decimal_schema(places))
    good, bad = DECIMALS[places]
    for text in good:
        model.model_validate_json(json.dumps({"amount": text}, separators=(",", ":")))
        assert accepts(manager, params, json.dumps({"amount": text}, separators=(",", ":"))), text
    for text in bad:
        if text in READ_YET_NOT_TAKEN:
            model.model_validate_json(json.dumps({"amount": text}))
        else:
            with pytest.raises(pydantic.ValidationError):
                model.model_validate_json(json.dumps({"amount": text}))
        assert not accepts(manager, params, json.dumps({"amount": text}, separators=(",", ":"))), text


def test_a_look_ahead_pattern_of_another_shape_is_still_a_value_error_naming_json():
    with pytest.raises(ValueError, match="(?s)^json: .*look-around"):
        StructuredOutputsParams(json={"type": "string", "pattern": "^(?!^[-+.]*$)[a-z]*$"})


def test_a_pydantic_dict_keyed_by_a_literal_or_an_enum_is_taken_with_only_those_keys(manager):
    # pydantic writes dict[Literal[...], V] and dict[SomeEnum, V] with propertyNames, which llguidance
    # does not implement: such a model was refused whole ("Unimplemented keys: propertyNames").
    import enum
    import typing
    pydantic = pytest.importorskip("pydantic")

    class Color(enum.Enum):
        RED = "red"
        BLUE = "blue"

    model = pydantic.create_model("Tally", by_name=(dict[typing.Literal["x", "y"], int], ...),
                                  by_color=(dict[Color, int], ...))
    params = StructuredOutputsParams(json=model.model_json_schema())
    for text in ['{"by_name":{"x":1,"y":2},"by_color":{"red":3}}', '{"by_name":{},"by_color":{"red":2,"blue":1}}']:
        model.model_validate_json(text)
        assert accepts(manager, params, text), text
    for text in ['{"by_name":{"z":1},"by_color":{}}', '{"by_name":{},"by_color":{"green":1}}',
                 '{"by_name":{"x":"a"},"by_color":{}}']:
        with pytest.raises(pydantic.ValidationError):
            model.model_validate_json(text)
        assert not accepts(manager, params, text), text


# (A pattern alone is taken, as xgrammar takes it: tests/test_abuse41_schemas.py.)
@pytest.mark.parametrize("names", [{"enum": ["a", 1]}, {"minLength": 2}])
def test_property_names_of_another_shape_are_still_a_value_error_naming_json(names):
    with pytest.raises(ValueError, match="(?s)^json: .*propertyNames"):
        StructuredOutputsParams(json={"type": "object", "additionalProperties": {"type": "integer"},
                                      "propertyNames": names})
