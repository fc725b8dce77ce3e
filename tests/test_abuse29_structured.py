"""Structured outputs abused as vLLM users do: many distinct schemas through the grammar cache,
grammars past llguidance's parser limits, on stories260K (CPU)."""
from __future__ import annotations

import gc
import weakref

import pytest

from minillm.structured_output import StructuredOutputManager, StructuredOutputsParams

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
