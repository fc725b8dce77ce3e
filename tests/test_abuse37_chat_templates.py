"""Chat templates as popular models ship them, and templates that try to outgrow a render's bounds."""
from __future__ import annotations

import pytest

from minillm.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok(stories_path) -> Tokenizer:
    """stories260K's tokenizer."""
    return Tokenizer.from_pretrained(stories_path)


@pytest.mark.parametrize("template", [
    "{{ ((((2 ** 256) ** 256) ** 256) ** 256) > 1 }}",
    "{% set n = namespace(v=3) %}{% for i in range(40) %}{% set n.v = n.v * n.v %}{% endfor %}{{ n.v > 1 }}",
])
def test_huge_integer_arithmetic_is_refused_before_it_runs(tok, template):
    """Squaring or powering big integers is one C call that the render's deadline cannot stop (it ran
    for 20 to 30 s and took gigabytes): the template is refused by the size of the integer it builds."""
    with pytest.raises(ValueError, match="computes an integer of more than"):
        tok.render_chat(MESSAGES, template=template)


def test_ordinary_integer_arithmetic_still_renders(tok):
    """Integers of a few hundred digits, negative powers and powers of 1 are left alone."""
    text = tok.render_chat(MESSAGES, template="{{ 2 ** 256 * 3 }} {{ (-7) ** 255 > 0 }} {{ 2 ** -2 }} {{ 1 ** 99 }}")
    assert text == f"{2 ** 256 * 3} False 0.25 1"


def test_strftime_now_refuses_a_format_that_writes_megabytes(tok):
    """strftime_now('%c' * 8_000_000) wrote 96M characters in one C call (5 s, a gigabyte) before the
    size bound saw them: a format past the bound is refused; a date's format renders as before."""
    with pytest.raises(ValueError, match="strftime_now a format of more than"):
        tok.render_chat(MESSAGES, template="{{ strftime_now('%c' * 300000) | length }}")
    assert tok.render_chat(MESSAGES, template="{{ strftime_now('%Y') | int > 2000 }}") == "True"
