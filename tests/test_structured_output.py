"""Structured outputs on the CPU, over stories260K's tokenizer: params, matchers, the compile
cache, the NumPy mask op, and a constrained generation loop driving the model directly."""
import ast
import json
import re
import threading

import jsonschema
import llguidance
import numpy as np
import pytest

import minillm.structured_output as so
from minillm.attention import AttentionMetadata
from minillm.loader import load_model_config, load_weights
from minillm.models.decoder import DecoderModel
from minillm.ops import numpy as ops
from minillm.structured_output import (GrammarMatcher, StructuredOutputManager, StructuredOutputsError,
                                       StructuredOutputsParams, allocate_token_bitmask, bitmask_words)
from minillm.tokenizer import IncrementalDetokenizer, Tokenizer

VOCAB = 512
EOS = 2
DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
EMAIL = r"[a-z][a-z0-9._]{0,9}@[a-z]{1,8}\.(com|org|net)"
CHOICES = ["yes", "no", "the cat sat", "maybe"]
# Recursive: checked by walking known sentences.
ARITHMETIC = """
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
# Bounded (at most 71 characters), so that every sampled sentence ends within the token budget.
ARITHMETIC_BOUNDED = """
start: expr
expr: term (("+" | "-") term)~0..2
term: factor (("*" | "/") factor)~0..2
factor: NUMBER | "(" inner ")"
inner: NUMBER (("+" | "-" | "*" | "/") NUMBER)~0..1
NUMBER: /[1-9][0-9]?/
"""
# The same language as ARITHMETIC_BOUNDED, written as a Python regular expression.
_N = r"[1-9][0-9]?"
_F = rf"(?:{_N}|\({_N}(?:[-+*/]{_N})?\))"
_T = rf"{_F}(?:[*/]{_F}){{0,2}}"
ARITHMETIC_BOUNDED_RE = rf"{_T}(?:[-+]{_T}){{0,2}}"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer", "minimum": 1, "maximum": 99},
        "mood": {"enum": ["happy", "sad", "angry"]},
        "pets": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                 "minItems": 1, "maxItems": 3},
        "home": {"type": "object",
                 "properties": {"floor": {"type": "integer", "minimum": 0, "maximum": 9}},
                 "required": ["floor"], "additionalProperties": False},
    },
    "required": ["name", "age", "mood", "pets", "home"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def manager(tok):
    mgr = StructuredOutputManager.from_tokenizer(tok, VOCAB, max_num_seqs=256)
    yield mgr
    mgr.shutdown()


def token_bytes(tok, token_id):
    """A token's bytes as the model's vocabulary spells them (sentencepiece: '▁' is a space)."""
    piece = tok.id_to_token(token_id)
    if token_id in tok.all_special_ids:
        return None
    m = re.fullmatch(r"<0x([0-9A-F]{2})>", piece)
    return bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode()


def char_ids(tok, text):
    """text spelled one character a token: the character's own piece, else its byte-fallback tokens.

    (llguidance refuses a byte-fallback token where the grammar forces that byte and the
    vocabulary has a piece for it, as the tokenizer would never produce it there.)
    """
    ids = []
    for ch in text:
        piece = tok.backend.token_to_id("\u2581" if ch == " " else ch)
        ids += [piece] if piece is not None else [tok.backend.token_to_id(f"<0x{b:02X}>") for b in ch.encode()]
    return ids


def allowed(matcher, vocab=VOCAB):
    """The set of token ids a matcher allows next (read from a fresh, all-zero row)."""
    row = np.zeros((1, bitmask_words(vocab)), np.int32)
    matcher.fill_bitmask(row, 0)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return set(np.nonzero(bits)[0].tolist())


def compile_(manager, **kwargs):
    return manager.grammar_init(StructuredOutputsParams(**kwargs)).result(timeout=120)


# ----------------------------------------------------------------------------- params

@pytest.mark.parametrize("kwargs,field", [
    (dict(json={"type": "strin"}), "json"),
    (dict(json='{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}'), "json"),
    (dict(json="{not json"), "json"),
    (dict(json=[1, 2]), "json"),
    (dict(json={"type": "integer", "minimum": 5, "maximum": 2}), "json"),
    (dict(regex="a(b"), "regex"),
    (dict(regex="[0-9"), "regex"),
    (dict(regex=42), "regex"),
    (dict(grammar="start: undefined_rule"), "grammar"),
    (dict(grammar="start: 'a' | "), "grammar"),
    (dict(grammar=""), "grammar"),
    (dict(grammar='root ::= "a" | undefined'), "grammar"),         # GBNF with a rule it never defines
    (dict(grammar='root ::= "a" "b'), "grammar"),
    (dict(choice=[]), "choice"),
    (dict(choice=["a", 3]), "choice"),
    (dict(choice="abc"), "choice"),
    (dict(json_object="yes"), "json_object"),
    (dict(json={"type": "object"}, regex="a"), "structured_outputs"),
    (dict(choice=["a"], grammar="start: \"a\"", json_object=True), "structured_outputs"),
    (dict(), "structured_outputs"),
    (dict(json_object=False), "structured_outputs"),
    (dict(regex="a", disable_any_whitespace="no"), "disable_any_whitespace"),
])
def test_invalid_input_is_a_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError) as info:
        StructuredOutputsParams(**kwargs)
    assert isinstance(info.value, StructuredOutputsError)
    assert info.value.field == field
    assert str(info.value).split(" ", 1)[0] == field + ":"
    if field == "structured_outputs" and len(kwargs) > 1:
        named = [k for k in kwargs if k != "json_object" or kwargs[k]]
        assert all(name in str(info.value) for name in named)


def test_equal_constraints_share_a_key():
    as_dict = StructuredOutputsParams(json=SCHEMA)
    as_text = StructuredOutputsParams(json=json.dumps(SCHEMA, indent=2))
    assert as_dict.key == as_text.key
    assert as_dict.key != StructuredOutputsParams(json={**SCHEMA, "required": ["name"]}).key
    assert StructuredOutputsParams(choice=["a", "b"]).key != StructuredOutputsParams(choice=["b", "a"]).key


def pattern_object(n: int) -> dict:
    """An object whose keys are n disjoint patterns (p0..., p1..., ...), all strings."""
    return {"type": "object", "patternProperties": {f"^p{i}[a-z]+$": {"type": "string"} for i in range(n)}}


def test_an_object_with_too_many_pattern_properties_is_refused_up_front(manager):
    from minillm.structured_output import MAX_PATTERN_PROPERTIES
    nested = {"type": "object", "properties": {"inner": {"type": "array", "items": pattern_object(MAX_PATTERN_PROPERTIES + 1)}}}
    for schema in (pattern_object(MAX_PATTERN_PROPERTIES + 1), nested):
        with pytest.raises(StructuredOutputsError, match=f"has {MAX_PATTERN_PROPERTIES + 1} patternProperties; at most "
                                                         f"{MAX_PATTERN_PROPERTIES} are taken") as info:
            StructuredOutputsParams(json=schema)
        assert info.value.field == "json"
    # At the bound the schema compiles and its keys follow the patterns.
    matcher = compile_(manager, json=pattern_object(MAX_PATTERN_PROPERTIES)).new_matcher()
    assert allowed(matcher)


# ----------------------------------------------------------------------------- matchers

@pytest.mark.parametrize("no_whitespace", [True, False])
def test_json_schema_allows_exactly_the_tokens_that_start_json(tok, manager, no_whitespace):
    starts = {i for i in range(VOCAB) if (token_bytes(tok, i) or b"").startswith(b"{")}
    assert starts == {tok.backend.token_to_id("<0x7B>")}         # stories260K spells "{" with one token
    for kwargs in (dict(json=SCHEMA), dict(json_object=True)):
        matcher = compile_(manager, disable_any_whitespace=no_whitespace, **kwargs).new_matcher()
        assert allowed(matcher) == starts
        assert matcher.accept_token(next(iter(starts)))
        after = allowed(matcher)
        spaces = {i for i in after if token_bytes(tok, i).strip() == b""}
        assert bool(spaces) != no_whitespace                     # whitespace only when allowed
        if kwargs.get("json"):                                   # the first required key is forced
            assert all(b'"name":'.startswith(token_bytes(tok, i).lstrip()) for i in after - spaces)


def walk(tok, matcher, ids, pattern=None):
    """Accept ids one by one, checking each is allowed and that EOS is allowed exactly where
    the text so far fully matches pattern (when given)."""
    text = b""
    for t in ids:
        assert t in allowed(matcher), (text, t)
        if pattern is not None:
            is_full = re.fullmatch(pattern, text.decode(errors="replace")) is not None
            assert (EOS in allowed(matcher)) == is_full == matcher.can_terminate(), text
        assert not matcher.is_stopped()
        assert matcher.accept_token(t), matcher.error
        text += token_bytes(tok, t)
    return text


@pytest.mark.parametrize("spelling", ["chars", "tokenizer"])
def test_regex_matcher_accepts_a_matching_string_and_terminates(tok, manager, spelling):
    compiled = compile_(manager, regex=DATE)
    matcher = compiled.new_matcher()
    text = "2024-05-17"
    ids = char_ids(tok, text) if spelling == "chars" else manager.ll_tokenizer.tokenize_str(text)
    assert walk(tok, matcher, ids, DATE) == text.encode()
    assert matcher.is_stopped() and matcher.can_terminate() and not matcher.is_terminated()
    assert allowed(matcher) == {EOS}
    assert matcher.accept_token(EOS) and matcher.is_terminated()
    assert not matcher.accept_token(char_ids(tok, "1")[0])       # nothing after the end
    # A month starting with 2 is refused; a refused token leaves the matcher in error, EOS only.
    other = compiled.new_matcher()
    assert other.accept_tokens(char_ids(tok, "2024-"))
    assert char_ids(tok, "2")[0] not in allowed(other) and char_ids(tok, "1")[0] in allowed(other)
    assert not other.accept_token(char_ids(tok, "2")[0])
    assert other.is_error() and other.is_stopped() and allowed(other) == {EOS}


def test_eos_is_allowed_only_where_the_grammar_may_end(tok, manager):
    pattern = "ab(cd)?e?"
    matcher = compile_(manager, regex=pattern).new_matcher()
    walk(tok, matcher, char_ids(tok, "abcde"), pattern)
    assert matcher.is_stopped() and allowed(matcher) == {EOS}
    early = compile_(manager, regex=pattern).new_matcher()
    assert not early.accept_token(EOS) and early.is_error()     # "" does not match


def test_choice_allows_only_the_choices(tok, manager):
    compiled = compile_(manager, choice=CHOICES)
    first = allowed(compiled.new_matcher())
    assert first and all(any(c.encode().startswith(token_bytes(tok, i)) for c in CHOICES) for i in first)
    assert all(char_ids(tok, c)[0] in first for c in CHOICES)
    for choice in CHOICES:
        matcher = compiled.new_matcher()
        walk(tok, matcher, manager.ll_tokenizer.tokenize_str(choice))
        assert matcher.is_stopped() and matcher.accept_token(EOS) and matcher.is_terminated()
    prefix = compiled.new_matcher()
    prefix.accept_tokens(char_ids(tok, "the c"))
    assert not prefix.can_terminate() and EOS not in allowed(prefix)


def test_lark_arithmetic_grammar(tok, manager):
    compiled = compile_(manager, grammar=ARITHMETIC)
    start = allowed(compiled.new_matcher())
    assert char_ids(tok, "(")[0] in start and char_ids(tok, "7")[0] in start
    assert char_ids(tok, "+")[0] not in start and char_ids(tok, ")")[0] not in start and EOS not in start
    for sentence in ["(12+3)*4-5/6", "((1))", "7", "1*(2-(3+4))/5"]:
        matcher = compiled.new_matcher()
        walk(tok, matcher, char_ids(tok, sentence))
        assert matcher.can_terminate() and EOS in allowed(matcher)
        assert matcher.accept_token(EOS) and matcher.is_terminated()
    open_paren = compiled.new_matcher()
    open_paren.accept_tokens(char_ids(tok, "(12+3"))
    assert not open_paren.can_terminate() and EOS not in allowed(open_paren)
    assert char_ids(tok, ")")[0] in allowed(open_paren)


# ARITHMETIC in llama.cpp's GBNF, as vLLM's examples write grammars.
ARITHMETIC_GBNF = """
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
"""


def test_a_gbnf_grammar_is_taken_as_the_same_language_as_its_lark_form(tok, manager):
    gbnf, lark = compile_(manager, grammar=ARITHMETIC_GBNF), compile_(manager, grammar=ARITHMETIC)
    assert allowed(gbnf.new_matcher()) == allowed(lark.new_matcher())
    for sentence in ["(12+3)*4-5/6", "((1))", "7", "1*(2-(3+4))/5"]:
        matcher = gbnf.new_matcher()
        walk(tok, matcher, char_ids(tok, sentence))
        assert matcher.can_terminate() and matcher.accept_token(EOS) and matcher.is_terminated()
    for prefix in ["(12+3", "1+"]:
        matcher = gbnf.new_matcher()
        matcher.accept_tokens(char_ids(tok, prefix))
        assert not matcher.can_terminate() and EOS not in allowed(matcher)
    refused = gbnf.new_matcher()
    assert not refused.accept_tokens(char_ids(tok, "1+)"))


def test_rollback_restores_the_earlier_state(tok, manager):
    compiled = compile_(manager, regex=DATE)
    matcher = compiled.new_matcher()
    ids = char_ids(tok, "2024-05-17")
    masks = []
    for t in ids:
        masks.append(allowed(matcher))
        matcher.accept_token(t)
    assert matcher.accept_token(EOS) and matcher.is_terminated() and matcher.num_accepted == 11
    matcher.rollback(1)                                    # the EOS, taken after the grammar stopped
    assert not matcher.is_terminated() and matcher.is_stopped() and allowed(matcher) == {EOS}
    matcher.rollback(3)                                    # "-17"
    assert allowed(matcher) == masks[7] and not matcher.is_stopped() and matcher.num_accepted == 7
    with pytest.raises(ValueError):
        matcher.rollback(8)
    assert not matcher.is_error()
    matcher.rollback(7)
    assert allowed(matcher) == masks[0] and matcher.num_accepted == 0
    assert matcher.accept_tokens(ids) and matcher.is_stopped()
    # An EOS taken where the grammar could go on is recorded by llguidance: rolled back the same way.
    choice = compile_(manager, regex="ab(c)?").new_matcher()
    choice.accept_tokens(char_ids(tok, "ab") + [EOS])
    assert choice.is_terminated()
    choice.rollback(1)
    assert not choice.is_terminated() and EOS in allowed(choice)
    assert {token_bytes(tok, i) for i in allowed(choice) - {EOS}} == {b"c"}
    assert choice.validate_tokens(char_ids(tok, "cc")) == char_ids(tok, "c")


def test_matchers_of_one_compiled_grammar_are_independent(tok, manager):
    compiled = compile_(manager, regex=DATE)
    a, b = compiled.new_matcher(), compiled.new_matcher()
    a.accept_tokens(char_ids(tok, "2024-"))
    assert allowed(b) == allowed(compiled.new_matcher()) != allowed(a)


def test_padded_vocab_ids_are_never_allowed(tok, eos_model_path):
    """The LM head may be wider than the tokenizer: the extra ids stay masked; every EOS id is allowed."""
    tok2 = Tokenizer.from_pretrained(eos_model_path)
    assert sorted(tok2.eos_token_ids) == [1, 2]
    mgr = StructuredOutputManager.from_tokenizer(tok2, 600, max_num_seqs=4)
    try:
        assert mgr.bitmask.shape == (4, 19)
        matcher = mgr.grammar_init(StructuredOutputsParams(regex="ab?")).result(timeout=120).new_matcher()
        seen = allowed(matcher, 600)
        matcher.accept_token(char_ids(tok2, "a")[0])
        at_end = allowed(matcher, 600)
        assert {1, 2} <= at_end and char_ids(tok2, "b")[0] in at_end
        assert max(seen | at_end) < VOCAB
        matcher.accept_token(char_ids(tok2, "a")[0])                     # refused: error, EOS only
        assert allowed(matcher, 600) == {1, 2}
    finally:
        mgr.shutdown()
    with pytest.raises(ValueError, match="vocab_size"):
        StructuredOutputManager.from_tokenizer(tok, 500, max_num_seqs=4)


# ----------------------------------------------------------------------------- manager

def test_compile_cache_returns_the_same_compiled_grammar(manager):
    first = manager.grammar_init(StructuredOutputsParams(json=SCHEMA))
    again = manager.grammar_init(StructuredOutputsParams(json=json.dumps(SCHEMA)))
    assert again is first and again.result(timeout=120) is first.result()
    assert first.result().compile_time_s > 0
    other = manager.grammar_init(StructuredOutputsParams(json={**SCHEMA, "required": ["name"]}))
    assert other.result(timeout=120) is not first.result()
    flexible = manager.grammar_init(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=False))
    assert flexible.result(timeout=120) is not first.result()         # a different grammar
    regex = manager.grammar_init(StructuredOutputsParams(regex=DATE, disable_any_whitespace=False))
    assert regex.result(timeout=120) is manager.grammar_init(StructuredOutputsParams(regex=DATE)).result()


def test_a_slow_compile_does_not_block_the_caller(manager, monkeypatch):
    manager.ll_tokenizer                                     # built once, before the gate
    params = StructuredOutputsParams(regex="slow[0-9]+")     # validated on this thread
    cached = manager.grammar_init(StructuredOutputsParams(regex=DATE))
    cached.result(timeout=120)
    gate, entered = threading.Event(), threading.Event()
    real = so.serialize_grammar

    def slow_serialize(key, *args):
        if key == params.key:
            entered.set()
            assert gate.wait(timeout=120)
        return real(key, *args)

    monkeypatch.setattr(so, "serialize_grammar", slow_serialize)
    pending = manager.grammar_init(params)
    assert entered.wait(timeout=120)                         # the compile runs on the pool ...
    assert not pending.done()                                # ... and the caller already has its future
    assert manager.grammar_init(StructuredOutputsParams(regex=DATE)) is cached
    gate.set()
    assert pending.result(timeout=120).key == params.key


def test_a_failed_compile_is_not_cached(manager, monkeypatch):
    params = StructuredOutputsParams(regex="fails[0-9]")
    real = so.serialize_grammar

    def broken(key, *args):
        if key == params.key:
            raise ValueError("compiler failure")
        return real(key, *args)

    monkeypatch.setattr(so, "serialize_grammar", broken)
    failed = manager.grammar_init(params)
    with pytest.raises(ValueError, match="compiler failure"):
        failed.result(timeout=120)
    monkeypatch.setattr(so, "serialize_grammar", real)
    retried = manager.grammar_init(params)
    assert retried is not failed and retried.result(timeout=120).key == params.key
    assert manager.grammar_init(params) is retried


def test_a_grammar_past_llguidance_limits_fails_its_compile_and_a_matcher_that_hits_one_refuses_eos(manager):
    # a{1000000} is a valid regex whose lexer outgrows llguidance's limit on its second mask.
    with pytest.raises(StructuredOutputsError, match="regular expression too large to match: lexer error"):
        manager.grammar_init(StructuredOutputsParams(regex="a{1000000}")).result(timeout=120)
    # A matcher that runs into the limit while its mask is filled (past the compile's probe) allows
    # only EOS; taking it ends the sequence with the grammar's error, never as a clean stop.
    template = llguidance.LLMatcher(manager.ll_tokenizer, so.serialize_grammar(
        StructuredOutputsParams(regex="a{1000000}").key))
    first, second = (GrammarMatcher(template.deep_copy(), frozenset({EOS})) for _ in range(2))
    assert EOS not in allowed(first) and allowed(second) == {EOS}
    assert not second.accept_token(EOS) and second.is_error() and not second.is_terminated()
    assert second.error == "lexer error: too many expressions constructed"


def test_batch_fill_writes_only_the_given_rows(tok, manager):
    date, email = compile_(manager, regex=DATE), compile_(manager, regex=EMAIL)
    matchers = [date.new_matcher(), email.new_matcher(), compile_(manager, json=SCHEMA).new_matcher()]
    matchers[0].accept_tokens(char_ids(tok, "19"))
    rows = [5, 0, 9]
    out = np.full((12, bitmask_words(VOCAB)), 0x5A5A5A5A, np.int32)
    assert manager.fill_bitmask(matchers, rows, out=out) is out
    for m, r in zip(matchers, rows):
        single = np.zeros((1, out.shape[1]), np.int32)
        m.fill_bitmask(single, 0)
        assert np.array_equal(out[r], single[0])
    untouched = [r for r in range(12) if r not in rows]
    assert (out[untouched] == 0x5A5A5A5A).all()
    assert manager.fill_bitmask(matchers[:1], [3]) is manager.bitmask
    assert manager.last_fill_time_s > 0
    with pytest.raises(ValueError):
        manager.fill_bitmask(matchers, [0, 1])
    with pytest.raises(ValueError):
        manager.fill_bitmask(matchers[:1], [12], out=out)
    with pytest.raises(ValueError):
        manager.fill_bitmask(matchers[:1], [0], out=out.astype(np.int64))


# ----------------------------------------------------------------------------- the mask op

def reference_mask(logits, bitmask, rows):
    """The rule written out token by token: mask row i for logits row rows[i]."""
    out = logits.copy()
    batch, vocab = logits.shape
    for i, r in enumerate(int(r) for r in rows):
        if not 0 <= r < batch:
            continue
        for t in range(vocab):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                out[r, t] = -np.inf
    return out


@pytest.mark.parametrize("batch,vocab,extra_words", [(1, 1, 0), (4, 100, 0), (6, 512, 0), (3, 70, 2)])
def test_numpy_mask_op_sets_exactly_the_forbidden_ids(batch, vocab, extra_words):
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((batch, vocab)).astype(np.float32)
    rows = np.array([batch - 1, -1, 0, batch + 3][: max(1, batch)], np.int32)
    bitmask = rng.integers(-2**31, 2**31, (len(rows), bitmask_words(vocab) + extra_words)).astype(np.int32)
    expect = reference_mask(logits, bitmask, rows)
    ops.apply_token_bitmask(logits, bitmask, rows)
    assert np.array_equal(logits, expect)
    masked = {int(r) for r in rows if 0 <= r < batch}
    for r in range(batch):                                   # unlisted rows untouched
        if r not in masked:
            assert np.isfinite(logits[r]).all()


def test_numpy_mask_op_checks_its_arguments():
    logits = np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError):
        ops.apply_token_bitmask(logits, np.zeros((1, 1), np.int32), np.array([0], np.int32))     # too few words
    with pytest.raises(ValueError):
        ops.apply_token_bitmask(logits, np.zeros((3, 2), np.int32), np.array([0], np.int32))     # a mask row each
    with pytest.raises(ValueError):
        ops.apply_token_bitmask(logits, np.zeros((1, 2), np.uint32), np.array([0], np.int32))
    all_allowed = allocate_token_bitmask(2, 64)
    ops.apply_token_bitmask(logits, all_allowed, np.array([0, 1], np.int32))
    assert (logits == 0).all()


# ----------------------------------------------------------------------------- generation

class StoriesModel:
    """stories260K on the NumPy ops with a KV pool of contiguous blocks per row."""

    BLOCK = 16

    def __init__(self, path, max_rows, max_len):
        self.config = load_model_config(path)
        self.model = DecoderModel(self.config, load_weights(path, self.config, "float32"), ops,
                                  np.float32, max_len)
        c = self.config
        self.blocks_per_row = -(-max_len // self.BLOCK)
        # pool: [L, 2, rows * blocks_per_row, BLOCK, Hk, Dh]
        self.pool = np.zeros((c.num_layers, 2, max_rows * self.blocks_per_row, self.BLOCK,
                              c.num_kv_heads, c.head_dim), np.float32)
        self.tables = np.arange(max_rows * self.blocks_per_row, dtype=np.int32).reshape(max_rows, -1)

    def forward(self, rows, ids_per_row, start_pos):
        """Run each row's new ids (a list per row) from start_pos[row]; logits of each row's last id."""
        lens = np.array([len(x) for x in ids_per_row], np.int32)
        qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        ids = np.concatenate([np.asarray(x, np.int32) for x in ids_per_row])
        pos = np.concatenate([start_pos[r] + np.arange(n) for r, n in zip(rows, lens)]).astype(np.int32)
        tables = self.tables[rows]                                   # [B, blocks_per_row]
        which = np.repeat(np.arange(len(rows)), lens)
        slots = (tables[which, pos // self.BLOCK] * self.BLOCK + pos % self.BLOCK).astype(np.int32)
        seq_lens = (np.asarray(start_pos)[rows] + lens).astype(np.int32)
        meta = AttentionMetadata(qsl, seq_lens, tables, slots, int(lens.max()), int(seq_lens.max()),
                                 bool((lens == 1).all()))
        hidden = self.model.forward(ids, pos, meta, self.pool)
        return self.model.compute_logits(hidden[qsl[1:] - 1])       # [B, V]


def generate_constrained(model, manager, matchers, prompt, temperatures, seeds, max_tokens):
    """logits -> mask -> sample -> accept, for one matcher per row, until each grammar ends."""
    num_rows = len(matchers)
    rngs = [np.random.default_rng(s) for s in seeds]
    outputs = [[] for _ in range(num_rows)]
    start = np.zeros(num_rows, np.int64)
    active = list(range(num_rows))
    logits = model.forward(active, [prompt] * num_rows, start)
    start[:] = len(prompt)
    while active:
        n = len(active)
        manager.fill_bitmask([matchers[r] for r in active], list(range(n)))
        ops.apply_token_bitmask(logits, manager.bitmask[:n], np.arange(n, dtype=np.int32))
        temp = np.array([temperatures[r] for r in active], np.float32)
        uniforms = np.array([rngs[r].random() for r in active], np.float32)
        tokens = ops.sample(logits, temp, np.zeros(n, np.int32), np.ones(n, np.float32),
                            np.zeros(n, np.float32), uniforms)
        still = []
        for r, t in zip(active, tokens.tolist()):
            assert matchers[r].accept_token(t), matchers[r].error
            if matchers[r].is_terminated():
                continue
            outputs[r].append(t)
            if not matchers[r].is_stopped() and len(outputs[r]) < max_tokens:
                still.append(r)
        active = still
        if active:
            logits = model.forward(active, [[outputs[r][-1]] for r in active], start)
            start[active] += 1
    return outputs


def test_constrained_generation_on_stories260k(stories_path, tok, manager):
    """50 seeds at temperature 1.0 (and one greedy row) per constraint, all in one batch."""
    checks = {
        "json": (dict(json=SCHEMA), lambda s: jsonschema.validate(json.loads(s), SCHEMA) is None),
        "date": (dict(regex=DATE), lambda s: re.fullmatch(DATE, s) is not None),
        "email": (dict(regex=EMAIL), lambda s: re.fullmatch(EMAIL, s) is not None),
        "choice": (dict(choice=CHOICES), lambda s: s in CHOICES),
        "arithmetic": (dict(grammar=ARITHMETIC_BOUNDED),
                       lambda s: re.fullmatch(ARITHMETIC_BOUNDED_RE, s) is not None
                       and isinstance(ast.parse(s, mode="eval").body, (ast.BinOp, ast.Constant))),
    }
    # Every grammar here is finite and none spells more than 93 bytes: one token a byte at worst.
    max_tokens, seeds = 96, list(range(50))
    prompt = tok.encode("Once upon a time")
    rows = []                                      # (name, seed or None for greedy)
    matchers = []
    for name, (kwargs, _) in checks.items():
        compiled = compile_(manager, **kwargs)
        for seed in seeds + [None]:
            rows.append((name, seed))
            matchers.append(compiled.new_matcher())
    model = StoriesModel(stories_path, len(rows), len(prompt) + max_tokens + 1)
    outputs = generate_constrained(model, manager, matchers, prompt,
                                   [0.0 if s is None else 1.0 for _, s in rows],
                                   [0 if s is None else s for _, s in rows], max_tokens)
    texts = {}
    for (name, seed), ids, matcher in zip(rows, outputs, matchers):
        assert matcher.is_stopped(), f"{name} seed {seed} hit max_tokens: {ids}"
        detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
        text = "".join(detok.add(t) for t in ids)
        assert checks[name][1](text), f"{name} seed {seed}: {text!r}"
        texts.setdefault(name, set()).add(text)
    # temperature 1.0 explores: the outputs are not one string repeated
    assert all(len(v) > 3 for k, v in texts.items() if k != "choice")
    assert len(texts["choice"]) >= 2
