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
