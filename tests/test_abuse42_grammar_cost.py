"""A constraint whose compile would cost minutes and gigabytes (llguidance's regex derivatives grow
with the square of a run of optional items) is tried first in a grammar check process that is
killed at the compile timeout or stopped by its memory cap: the constraint is refused, naming its
field, and the engine's process never compiles it (stories260K's tokenizer, CPU)."""
from __future__ import annotations

import json
import subprocess

import llguidance
import pytest

import minillm.grammar_check as grammar_check
from minillm.structured_output import StructuredOutputManager, StructuredOutputsError, StructuredOutputsParams

COSTLY = ".?" * 6000     # about 4 s of one core and 0.5 GB in llguidance's lexer setup
LARGE = ".?" * 3000      # about 1 s and 0.2 GB


def _children() -> set[int]:
    """Pids of running grammar check processes."""
    out = subprocess.run(["pgrep", "-f", ".*-m minillm[.]grammar_check [0-9]+$"], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def _compile(manager, **constraint):
    return manager.grammar_init(StructuredOutputsParams(**constraint)).result(timeout=120)


def test_a_compile_past_the_timeout_is_refused_without_running_here(tok, monkeypatch):
    manager = StructuredOutputManager.from_tokenizer(tok, tok.vocab_size, max_num_seqs=4, compile_timeout_s=0.5)
    assert manager.ll_tokenizer is not None                 # built (its warm-up compiles a matcher here)
    real, compiled_here = llguidance.LLMatcher, []

    class NoMatcherHere:
        """llguidance.LLMatcher's static methods, and a note of each matcher built in this process over
        the model's tokenizer (the entry check's byte-level probe, with its small limits, is not one)."""

        def __getattr__(self, name):
            return getattr(real, name)

        def __call__(self, tokenizer, *args, **kwargs):
            if tokenizer is manager.ll_tokenizer:
                compiled_here.append(args)
            return real(tokenizer, *args, **kwargs)

    monkeypatch.setattr(llguidance, "LLMatcher", NoMatcherHere())
    try:
        with pytest.raises(StructuredOutputsError) as err:
            _compile(manager, regex=COSTLY)
        assert err.value.field == "regex"
        assert "takes longer than 0.5 s to compile" in str(err.value)
        assert compiled_here == []
    finally:
        manager.shutdown()


def test_a_compile_past_the_memory_cap_is_refused_and_the_next_one_compiles(tok, monkeypatch):
    monkeypatch.setattr(grammar_check, "CHECK_MEMORY_BYTES", 32 << 20)
    manager = StructuredOutputManager.from_tokenizer(tok, tok.vocab_size, max_num_seqs=4)
    try:
        with pytest.raises(StructuredOutputsError, match="needs more than 0.03125 GiB of memory to compile") as err:
            _compile(manager, regex=LARGE)
        assert err.value.field == "regex"
        date = _compile(manager, regex=r"\d{4}-\d{2}-\d{2}")          # a new check process serves it
        assert date.key[1] == r"\d{4}-\d{2}-\d{2}"
        with pytest.raises(StructuredOutputsError, match="memory"):     # refused again: not cached as compiled
            _compile(manager, regex=LARGE)
    finally:
        manager.shutdown()


def test_the_same_run_inside_a_lark_grammar_and_a_schema_pattern(tok):
    manager = StructuredOutputManager.from_tokenizer(tok, tok.vocab_size, max_num_seqs=4, compile_timeout_s=0.5)
    try:
        with pytest.raises(StructuredOutputsError, match="takes longer than") as err:
            _compile(manager, grammar=f"start: /{COSTLY}/")
        assert err.value.field == "grammar"
        with pytest.raises(StructuredOutputsError) as err:     # there llguidance's own limit ends it soon
            _compile(manager, json={"type": "string", "pattern": f"^{COSTLY}$"})
        assert err.value.field == "json"
    finally:
        manager.shutdown()


def test_realistic_constraints_compile_and_the_processes_end_with_the_manager(tok):
    before = _children()
    manager = StructuredOutputManager.from_tokenizer(tok, tok.vocab_size, max_num_seqs=4)
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                        "maxItems": 3},
                                               **{f"field_{i}": {"type": "string", "maxLength": 20,
                                                                 "description": f"free text {i}"}
                                                  for i in range(20)}},
              "required": ["name", "age"]}            # past the length that compiles without the check
    assert len(json.dumps(schema)) > 1000
    try:
        for constraint in ({"json": schema}, {"regex": r"[\w.+-]+@[\w-]+\.[a-z]{2,}"}, {"choice": ["yes", "no"]},
                           {"grammar": 'start: expr\nexpr: NUMBER | expr "+" expr | "(" expr ")"\n%import common.NUMBER'}):
            assert not _compile(manager, **constraint).empty_only
        assert _children() - before                   # the check process stays for the next compile
    finally:
        manager.shutdown()
    assert not (_children() - before)
