"""Structured outputs: a JSON schema, regex, choice or Lark grammar enforced by a token bitmask.

llguidance does the work: it compiles a constraint into a matcher over the model's tokenizer, and
the matcher writes which tokens may come next into an int32 bitmask row. The flow, in vLLM V1's
shape:

    StructuredOutputsParams(json=...)        validated where the request enters (ValueError naming
                                             the field; the constraint is compile-checked here)
    manager.grammar_init(params)             -> Future[CompiledGrammar], compiled on a small thread
                                             pool and cached by the constraint's text
    compiled.new_matcher()                   -> GrammarMatcher, one per request
    manager.fill_bitmask(matchers, rows)     fills bitmask rows (llguidance's threads, GIL released)
    ops.apply_token_bitmask(logits, bitmask, rows)   in the sampler, before temperature etc.
    matcher.accept_token(token)              each sampled token advances the matcher

In the engine (vLLM V1's shape): add_request -> manager.attach(seqs, params) gives each sequence a
StructuredOutputRequest; the scheduler admits a sequence only once `is_ready` (its grammar
compiled; a failed compile is finished with an error by the engine, take_failed()); each step the
masks of its constrained rows are filled on the mask thread (manager.start_fill -> PendingBitmask)
and the runner's grammar_bitmask callback takes them just before the sampling is queued; the
scheduler's update_from_output feeds each token to accept_token, and check_stop ends a sequence
whose grammar is complete (finish_reason "stop").

Under async scheduling a constrained row's mask needs its previous token, which is still on the
device when the step is launched. The step then goes with its sampling deferred; when the step
before is read back, manager.advance() hands its tokens to the matchers (the scheduler's
accept_token takes the recorded results) and the fill starts at once, beside the engine thread's
update, outputs and next schedule; the sampling is queued at the start of the next step, right
before its forward pass, so the device never waits for the host's mask work in between.
Meanwhile the engine thread asks the matchers only flags cached when they took a token.

With speculative decoding (vLLM's shape) a constrained sequence's drafts are held to its grammar:
the scheduler cuts them before the first token the grammar refuses (validate_drafts: the matcher's
validate_tokens, nothing consumed), and the step's fill writes one mask per verified position, the
mask after drafts[:j] for position j (a copy of the matcher walks the drafts and rolls back), so every
token the verification accepts or samples is one the grammar allows, and the matcher itself only ever
takes the tokens the sequence gets.

Bitmask layout: bitmask [rows, ceil(vocab / 32)] int32; bit j of word w in a row is token id
32 * w + j, 1 = allowed. vocab is the LM head's size; ids past the tokenizer's vocabulary (the
head is often padded) are never allowed.
"""
from __future__ import annotations

import concurrent.futures
import contextvars
import decimal
import enum
import functools
import hashlib
import itertools
import json as jsonlib
import math
import os
import re
import threading
import time
import urllib.parse
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from minillm.gbnf import gbnf_to_lark
from minillm.grammar_process import ERROR, STOPPED, TERMINATED, tokens_taken
from minillm.lark_ending import start_can_never_end
from minillm.sampling_params import short_repr
from minillm.stats import StructuredOutputStats

if TYPE_CHECKING:
    from minillm.grammar_process import GrammarProcess, RemoteMatcher

# What llguidance's matcher logs by itself: nothing (errors are read back and raised or reported).
_LOG_LEVEL = 0
_CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsError(ValueError):
    """A bad constraint; `field` names the StructuredOutputsParams field (its message starts with it)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class StructuredOutputOptions(enum.Enum):
    """The kind of constraint a request carries."""

    JSON = "json"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    GRAMMAR = "grammar"
    CHOICE = "choice"


# (kind, canonical text): the cache key of a compiled grammar.
StructuredOutputKey = tuple[StructuredOutputOptions, str]


@dataclass
class StructuredOutputsParams:
    """One output constraint per request, with vLLM's field names; exactly one must be set.

    json: a JSON schema (a dict or its text); regex: a regular expression the whole output must
    match (Rust regex syntax: \\d and \\w are Unicode, as in Python's re); choice: the output is
    one of these strings; grammar: a Lark grammar in llguidance's syntax (rule `start`) or a GBNF
    one (llama.cpp's, rule `root`);
    json_object: any JSON object. disable_any_whitespace (vLLM's option): JSON with no whitespace
    between its tokens; None takes the engine's default (StructuredOutputManager's, True: a model
    free to add whitespace can spend its whole budget on it). disable_additional_properties (vLLM's):
    None, the default, or True reads a schema as vLLM's default backend (xgrammar, in its strict mode)
    does: an object schema with properties that does not say what other keys it takes takes none, and a
    tuple (prefixItems) that does not say what follows takes nothing more (_with_closed_objects). An
    object schema with no properties is any object when it is the bare {"type": "object"} (title,
    description and other annotations aside: xgrammar's any-object rule), and only {} when it says more
    than its type and nothing of other keys ({"type": "object", "maxProperties": 3}); likewise an array
    schema with no items is any array when it is the bare {"type": "array"}, and only [] when it says
    more ({"type": "array", "maxItems": 3}); a list of types (["object", "null"]) holds each rule for
    the object or array it takes. False reads it as JSON Schema does (llguidance's reading, vLLM's
    guidance backend's default), where such an object takes any other key, and such an array any items;
    None reads so too a schema that vLLM's default backend hands to its guidance fallback
    (is_read_by_guidance: multipleOf, uniqueItems, a pattern beside a length bound, ...).
    A schema's own additionalProperties or items is kept either way.
    An engine with a structured_outputs_config (every LLM's) reads the option as vLLM does first
    (StructuredOutputsConfig.applied: under the default backend False, vLLM's default, closes too).
    whitespace_pattern and structural_tag (vLLM's) are taken only as None. reasoning (minillm's: vLLM
    sets it for the whole engine with --reasoning-parser) is the (start, end) token ids of a thinking
    block: the output is free until the end token and the grammar holds what follows it (from the first
    token when the prompt's last start or end token is the end). num_output_prefix_tokens (minillm's, set
    by beam search's steps): the prompt's last tokens that are already the output's start; the grammar
    takes them before it masks the first token (a prompt whose reasoning goes on takes none of them; one
    whose last thinking tag is among them, those after it), so a request goes on with an output that an
    earlier request began. Tokens the grammar refuses end the request with an error; where they complete
    its sentence, EOS is the one token allowed. Construction validates
    and compile-checks the constraint (StructuredOutputsError, a ValueError naming the field); a
    field set later is checked when the constraint is next used (a request added with it), as
    vLLM reads the fields then. A dict or list changed in place is not seen: set the field anew.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    reasoning: tuple[int, int] | None = None
    num_output_prefix_tokens: int = 0
    _key: StructuredOutputKey | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._key = self._validate()

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if not name.startswith("_") and self.__dict__.get("_key") is not None:
            super().__setattr__("_key", None)       # made anew, and checked, where it is next asked for

    @classmethod
    def from_checked(cls, **fields: Any) -> StructuredOutputsParams:
        """The constraint an API server built and compile-checked, rebuilt by the engine core: its
        fields are checked again, its grammar and its length are not (llguidance's check of a large
        grammar takes a quarter of a second, and the core runs it on its step loop; the length bound is
        the client's text's, and a schema crosses with its objects closed); one that does not compile
        ends its request with the compile's error, reported from the compile pool."""
        token = _IS_GRAMMAR_CHECKED.set(True)
        try:
            return cls(**fields)
        finally:
            _IS_GRAMMAR_CHECKED.reset(token)

    @property
    def key(self) -> StructuredOutputKey:
        """(kind, canonical text): equal constraints share a key, and so a compiled grammar. A field
        set since the key was made makes it anew (a StructuredOutputsError when it no longer holds)."""
        if self._key is None:
            self._key = self._validate()
        return self._key

    def _validate(self) -> StructuredOutputKey:
        self._check_options()            # first: vLLM counts structural_tag as a constraint, given alone too
        is_set = {"json": self.json is not None, "regex": self.regex is not None,
                  "choice": self.choice is not None, "grammar": self.grammar is not None,
                  "json_object": bool(self.json_object)}
        chosen = [name for name in _CONSTRAINT_FIELDS if is_set[name]]
        if len(chosen) != 1:
            got = ", ".join(chosen) if chosen else "none"
            raise StructuredOutputsError("structured_outputs", f"exactly one of {', '.join(_CONSTRAINT_FIELDS)} "
                                         f"must be set, got {got}")
        name = chosen[0]
        key = _canonical_key(name, getattr(self, name))
        # The client's text is bounded; the core takes the closed text its API server bounded so.
        if key[0] in _BOUNDED_KINDS and len(key[1]) > MAX_CONSTRAINT_CHARS and not _IS_GRAMMAR_CHECKED.get():
            raise StructuredOutputsError(name, f"the {_WHAT[name]} is {len(key[1])} characters long; "
                                               f"at most {MAX_CONSTRAINT_CHARS} are taken")
        if key[0] is StructuredOutputOptions.JSON:
            key = (key[0], self._closed_text(key[1]))
        error = "" if _IS_GRAMMAR_CHECKED.get() else _checked_grammar(key)
        if error:
            raise _invalid(name, error)
        return key


    def _closed_text(self, text: str) -> str:
        """A JSON schema's text with its objects closed where this constraint reads them closed: not under
        disable_additional_properties False, nor, when it is None (vLLM's default backend), for a schema that
        backend hands to its guidance fallback (is_read_by_guidance); then its minProperties checked as read."""
        asked, schema = self.disable_additional_properties, jsonlib.loads(text)
        if asked is not False and (asked or not is_read_by_guidance(schema)):
            text = _with_closed_objects(text)
            schema = jsonlib.loads(text)
        for node in _subschemas(schema):
            _check_min_properties(node)
        return text

    def _check_options(self) -> None:
        """A StructuredOutputsError naming the first option beside the constraint that is not taken."""
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise StructuredOutputsError(name, f"must be a boolean, got {short_repr(value)}")
        if self.reasoning is not None and not _is_token_pair(self.reasoning):
            raise StructuredOutputsError("reasoning", "must be the (start, end) token ids of a thinking block, "
                                         f"two different non-negative integers, got {short_repr(self.reasoning)}")
        count = self.num_output_prefix_tokens
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise StructuredOutputsError("num_output_prefix_tokens", "must be an integer >= 0 (the prompt's last "
                                         f"tokens that are the output's start), got {short_repr(count)}")
        if self.whitespace_pattern is not None:
            raise StructuredOutputsError("whitespace_pattern", f"{short_repr(self.whitespace_pattern)} is not "
                                         "supported: disable_any_whitespace sets JSON's whitespace (none, or any)")
        if self.structural_tag is not None:
            raise StructuredOutputsError("structural_tag", f"{short_repr(self.structural_tag)} is not supported: "
                                         "minillm has no structural tags")


# llguidance refuses a oneOf whose alternatives it cannot prove exclusive, asking to "enable" an
# option that a schema sets itself, in its top-level "x-guidance" object; the error says where.
_COERCE_ONE_OF = "Enable 'coerce_one_of'"
_HOW_TO_COERCE_ONE_OF = (' (a schema reads its oneOf as anyOf with "x-guidance": {"coerce_one_of": true} at its top '
                         "level: an output may then match more than one of the alternatives)")


# True while StructuredOutputsParams.from_checked builds a constraint: its grammar is not checked.
_IS_GRAMMAR_CHECKED = contextvars.ContextVar("minillm_is_grammar_checked", default=False)


def _is_token_pair(value: Any) -> bool:
    """Whether value is two different token ids (a list too: msgpack carries a tuple as one)."""
    return (isinstance(value, (tuple, list)) and len(value) == 2 and value[0] != value[1]
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value))


def prompt_ends_reasoning(prompt_token_ids: Sequence[int], reasoning: Sequence[int]) -> bool:
    """Whether the prompt's last thinking tag is the end one (vLLM's is_reasoning_end): a template that
    closed the thinking block (Qwen3's enable_thinking false) leaves the output to the grammar at once."""
    start, end = reasoning
    for token in reversed(prompt_token_ids):
        if token == start:
            return False
        if token == end:
            return True
    return False


def output_prefix(prefix: Sequence[int], reasoning: Sequence[int] | None, reasoning_end_id: int | None) -> list[int]:
    """The tokens of an output's given start (num_output_prefix_tokens) its grammar takes: none while its
    reasoning goes on (reasoning_end_id set), those after its last thinking tag, else all."""
    if reasoning_end_id is not None:
        return []
    ids = [int(t) for t in prefix]
    if reasoning is not None:
        for k in range(len(ids) - 1, -1, -1):
            if ids[k] in reasoning:
                return ids[k + 1:]
    return ids


def _invalid(name: str, error: str) -> StructuredOutputsError:
    """The StructuredOutputsError of a constraint llguidance refused with error."""
    error = error.strip()
    if error == _NO_TOKEN_ALLOWED:
        return _matches_nothing_error(name)
    if _COERCE_ONE_OF in error:
        error += _HOW_TO_COERCE_ONE_OF
    return StructuredOutputsError(name, f"invalid {_WHAT[name]}: {error}")


# llguidance's answers for the constraints checked last, by a digest of their key: an API server
# that gets the same large schema in many requests serialises and validates it once (a grammar of
# 4,000 rules took 0.25 s a check).
_MAX_CHECKED = 256
_checked: OrderedDict[tuple[StructuredOutputOptions, bytes], str] = OrderedDict()
_checked_lock = threading.Lock()


def _checked_grammar(key: StructuredOutputKey) -> str:
    """_check_grammar's answer for key, from the cache of the last _MAX_CHECKED constraints checked."""
    digest = (key[0], hashlib.blake2b(key[1].encode("utf-8", "surrogatepass"), digest_size=16).digest())
    with _checked_lock:
        if digest in _checked:
            _checked.move_to_end(digest)
            return _checked[digest]
    error = on_large_stack(_check_grammar, key)
    with _checked_lock:
        _checked[digest] = error
        if len(_checked) > _MAX_CHECKED:
            _checked.popitem(last=False)
    return error


def _check_grammar(key: StructuredOutputKey) -> str:
    """llguidance's error for a constraint ('' when it is valid; _NO_TOKEN_ALLOWED when nothing matches it)."""
    # Whitespace does not change whether a schema is valid: check it in the default form.
    try:
        grammar = serialize_grammar(key)
        error = _without_options_line(llguidance.LLMatcher.validate_grammar(grammar))
    except ValueError as e:
        return _with_client_patterns(key, str(e))
    if not error and _matches_nothing(key, grammar):
        return _NO_TOKEN_ALLOWED
    if not error and key[0] is StructuredOutputOptions.GRAMMAR and not _is_gbnf(key[1]) \
            and start_can_never_end(key[1]):
        return _NEVER_ENDS
    return _with_client_patterns(key, error)


class _ByteTokens:
    """A tokenizer of one token a byte and an end token: what matches a grammar's language, not a model's."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"</s>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


# The byte-level probe's limits: its first mask costs a few milliseconds at most. A constraint past
# them (a regex of thousands of alternatives) is left to the compile with the model's tokenizer.
_PROBE_LIMITS = dict(initial_lexer_fuel=10_000, step_lexer_fuel=5_000, max_lexer_states=1_000, verbose_errors=False)


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    """llguidance's tokenizer over _ByteTokens, made once."""
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens()), slices=[])


def _matches_nothing(key: StructuredOutputKey, grammar: str) -> bool:
    """Whether no output at all satisfies the constraint (a regex like [^\\s\\S], a rule only
    left-recursive, a $ref loop): the first byte-level mask allows no byte and no end. A grammar
    with token ids (<[...]>) is the model tokenizer's to judge."""
    if key[0] is StructuredOutputOptions.GRAMMAR and "<[" in key[1]:
        return False
    probe = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=_LOG_LEVEL,
                                 limits=llguidance.LLParserLimits(**_PROBE_LIMITS))
    if not probe.is_error():
        probe.compute_bitmask()
    return probe.is_error() and _first_line(probe.get_error()) == _NO_TOKEN_ALLOWED


def _matches_nothing_error(name: str) -> StructuredOutputsError:
    """The StructuredOutputsError of a constraint no output satisfies."""
    return StructuredOutputsError(name, f"no output satisfies the {_WHAT[name]} "
                                        "(it allows no first token and may not be empty)")


# llguidance recurses once per rule a grammar's rules chain through, and per $ref a schema's refs
# chain through, on the calling thread's stack: a chain of a few hundred to a few thousand
# overflows an 8 MiB stack and kills the process. So its work runs on threads with a large stack,
# and a schema's or grammar's text is bounded, which keeps the deepest chain that fits well inside
# that stack (about 13 KiB of stack per $ref at 30 characters or more each). A regex's text is
# bounded too: llguidance's lexer setup for one can take time that grows with the square of its
# length (see COMPILE_TIMEOUT_S), and a compile past the timeout still runs to its end.
_GRAMMAR_STACK_BYTES = 256 << 20
MAX_CONSTRAINT_CHARS = 128 * 1024
_stack_lock = threading.Lock()


@contextmanager
def _large_stack():
    """Threads started inside get a _GRAMMAR_STACK_BYTES stack (the setting is process-wide:
    it is held only while they start)."""
    with _stack_lock:
        old = threading.stack_size(_GRAMMAR_STACK_BYTES)
        try:
            yield
        finally:
            threading.stack_size(old)


_checker: ThreadPoolExecutor | None = None    # the large-stack threads of on_large_stack, made on first use


def on_large_stack(fn, *args):
    """fn(*args) on a thread with a large stack; returns what it returns or raises what it raises."""
    global _checker
    with _large_stack():               # the pool starts its threads in submit
        if _checker is None:
            _checker = ThreadPoolExecutor(max_workers=4, thread_name_prefix="minillm-grammar-check")
        future = _checker.submit(fn, *args)
    return future.result()


def _first_line(message: str) -> str:
    """llguidance's error without the parser state it appends."""
    return message.strip().split("\n", 1)[0]


_WHAT = {"json": "JSON schema", "regex": "regular expression", "choice": "choice list",
         "grammar": "grammar", "json_object": "json_object"}


def _canonical_key(name: str, value: Any) -> StructuredOutputKey:
    """Type-check one constraint and return its cache key (JSON is re-serialised, keeping key order)."""
    if name == "json":
        if isinstance(value, str):
            try:
                value = jsonlib.loads(value)
            except ValueError as e:
                raise StructuredOutputsError("json", f"the schema is not valid JSON: {e}") from None
            except RecursionError:
                raise StructuredOutputsError("json", "the schema is nested too deeply") from None
        if not isinstance(value, dict):
            raise StructuredOutputsError("json", f"a JSON schema must be an object, got {type(value).__name__}")
        try:
            text = jsonlib.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise StructuredOutputsError("json", f"the schema is not serialisable as JSON: {e}") from None
        except RecursionError:
            raise StructuredOutputsError("json", "the schema is nested too deeply") from None
        _check_schema_bounds(value)
        return StructuredOutputOptions.JSON, text
    if name == "json_object":
        if value is not True:
            raise StructuredOutputsError("json_object", "must be true when set")
        return StructuredOutputOptions.JSON_OBJECT, '{"type":"object"}'
    if name == "choice":
        if (not isinstance(value, (list, tuple)) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise StructuredOutputsError("choice", "must be a non-empty list of non-empty strings")
        num_chars = sum(len(c) for c in value)
        if num_chars > MAX_CONSTRAINT_CHARS:
            raise StructuredOutputsError("choice", f"the choice list's strings are {num_chars} characters long "
                                                   f"together; at most {MAX_CONSTRAINT_CHARS} are taken")
        return StructuredOutputOptions.CHOICE, jsonlib.dumps(list(value), ensure_ascii=False)
    if not isinstance(value, str):
        raise StructuredOutputsError(name, f"must be a string, got {type(value).__name__}")
    if name == "grammar" and not value.strip():
        raise StructuredOutputsError("grammar", "must not be empty")
    if name == "regex" and _ends_in_lone_backslash(value):
        raise StructuredOutputsError("regex", "invalid regular expression: it ends in a lone backslash "
                                              "(an escape with nothing to escape)")
    return (StructuredOutputOptions.REGEX if name == "regex" else StructuredOutputOptions.GRAMMAR), value


_INT64_MAX = 2 ** 63 - 1
_BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# llguidance checks every pair of an object's patternProperties for overlap when it compiles the
# schema, at a cost that grows faster than the square of their number (on one core: 64 patterns
# 0.03 s, 128 0.35 s, 200 1.5-4 s, 500 74 s, each holding a compile thread the whole time).
MAX_PATTERN_PROPERTIES = 64


def _check_schema_bounds(schema: Any) -> None:
    """A StructuredOutputsError('json') for a schema that cannot be matched as written or that
    would hold a compile thread for minutes: see _check_schema_node."""
    todo = [schema]
    while todo:                                   # a loop, not recursion: schemas nest deeply
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        _check_schema_node(node)
        todo.extend(node.values())
    _check_intersected_steps(schema)
    for node in _subschemas(schema):        # schemas, not const or enum data
        _check_patterns(node)
        _check_number_bounds(node)
        _check_length_bounds(node)
    check_finite_instance(schema)


def _check_length_bounds(node: dict) -> None:
    """A StructuredOutputsError for a minLength or maxLength past _U32_MAX: llguidance matches a string's
    length with a regex repetition, whose counts are 32-bit ("decimal literal invalid" past it)."""
    for name in ("minLength", "maxLength"):
        bound = node.get(name)
        if isinstance(bound, (int, float)) and not isinstance(bound, bool) and bound > _U32_MAX:
            raise StructuredOutputsError("json", f"{name}={bound!r} is past the largest string length bound "
                                                 f"that can be matched, {_U32_MAX} (2**32 - 1)")


def _check_patterns(node: dict) -> None:
    """A StructuredOutputsError for a pattern (or patternProperties name) whose ECMA-262 meaning is not kept."""
    patterns = node.get("patternProperties") if isinstance(node.get("patternProperties"), dict) else {}
    for pattern in [node.get("pattern"), *patterns]:
        if not isinstance(pattern, str) or _decimal_pattern(pattern) is not None:
            continue
        try:
            _ecma_pattern(pattern)
        except _PatternError as e:
            raise StructuredOutputsError("json", f"the pattern {jsonlib.dumps(pattern, ensure_ascii=False)} is "
                                                 f"not supported: {e}") from None


def check_finite_instance(schema: Any) -> None:
    """A StructuredOutputsError for a schema whose every instance holds another instance of one of its
    $ref targets (a required property, a non-empty array's item, an allOf, every anyOf or oneOf branch
    leads back): it has no finite instance, and llguidance's parser grows until it reaches a limit."""
    if not isinstance(schema, dict) or not _has_local_ref(schema):
        return
    graph = _InstanceGraph(schema)
    if not graph.is_finite(schema, follow_refs=False) or graph.is_finite(schema, follow_refs=True):
        return                              # without its $refs it has no instance either: not a cycle's doing
    refs, is_inside_value = graph.unfinished_refs(schema)
    if not is_inside_value:
        return
    named = ", ".join(jsonlib.dumps(ref) for ref in refs[:4]) + (f" and {len(refs) - 4} more" if len(refs) > 4 else "")
    raise StructuredOutputsError("json", f"the schema has no finite instance: every instance of {named} holds "
                                         "another one (a required property, an item of an array whose minItems is "
                                         "above 0, an allOf, or every branch of an anyOf or oneOf leads back); let "
                                         "the recursion end: a property not required, an array that may be empty, "
                                         "or an anyOf branch without it")


def _has_local_ref(schema: dict) -> bool:
    """Whether some subschema has a $ref within the document (the only way a schema recurses)."""
    return any(isinstance(node.get("$ref"), str) and node["$ref"].startswith("#") for node in _subschemas(schema))


_ALL_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


class _InstanceGraph:
    """Which subschemas of a schema have a finite instance, as a least fixed point over what each one's
    instance must hold; keywords it does not read count as satisfiable, and `false` as not."""

    def __init__(self, schema: dict) -> None:
        self.root = schema
        self.nodes = list(_subschemas(schema))
        self.resource = _resource_roots(schema, self.nodes)
        self.node_ids = {id(node) for node in self.nodes}
        self.follow_refs = True
        self.finite: set[int] = set()

    def is_finite(self, schema: Any, follow_refs: bool) -> bool:
        """Whether schema has a finite instance (a $ref taken as satisfiable when not follow_refs)."""
        self.follow_refs = follow_refs
        self.finite = set()
        dependents: dict[int, list[dict]] = {}
        for node in self.nodes:
            for child in self._needs(node):
                if isinstance(child, dict):
                    dependents.setdefault(id(child), []).append(node)
        todo = list(self.nodes)
        while todo:
            node = todo.pop()
            if id(node) not in self.finite and self._holds(node):
                self.finite.add(id(node))
                todo.extend(dependents.get(id(node), ()))
        return self._is_done(schema)

    def unfinished_refs(self, schema: Any) -> tuple[list[str], bool]:
        """The $refs without a finite instance reached from schema through what its instance must hold, and
        whether one of those is held inside a value (a property, an item), not only through $ref and allOf,
        anyOf or oneOf (a loop of those alone allows no first token: llguidance's compile says so)."""
        refs, seen, todo, is_inside_value = [], set(), [schema], False
        while todo:
            node = todo.pop()
            if not isinstance(node, dict) or id(node) in seen or self._is_done(node):
                continue
            seen.add(id(node))
            ref = node.get("$ref")
            if isinstance(ref, str) and not self._is_done(self._target(ref, node)) and ref not in refs:
                refs.append(ref)
            values = self._value_needs(node)
            is_inside_value = is_inside_value or not all(self._is_done(s) for s in values)
            todo.extend(self._needs(node))
        return sorted(refs), is_inside_value

    def _is_done(self, schema: Any) -> bool:
        """Whether schema has a finite instance as far as is known (a schema outside the graph has)."""
        if isinstance(schema, bool):
            return schema
        return not isinstance(schema, dict) or id(schema) in self.finite or id(schema) not in self.node_ids

    def _needs(self, node: dict) -> list[Any]:
        """Every subschema whose instance node's instance may have to hold."""
        needs = [self._target(node["$ref"], node)] if self.follow_refs and isinstance(node.get("$ref"), str) else []
        for name in ("allOf", "anyOf", "oneOf"):
            if isinstance(node.get(name), list):
                needs.extend(node[name])
        return needs + self._value_needs(node)

    @staticmethod
    def _value_needs(node: dict) -> list[Any]:
        """The subschemas that a property or an item of node's instance may have to match."""
        needs = [schema for name in _required_names(node) for schema in _property_schemas(node, name)]
        return needs + _item_schemas(node) + _extra_property_schemas(node)

    def _holds(self, node: dict) -> bool:
        """Whether node has a finite instance, given those of its subschemas known so far."""
        ref = node.get("$ref") if self.follow_refs else None
        if isinstance(ref, str) and not self._is_done(self._target(ref, node)):
            return False
        if isinstance(node.get("allOf"), list) and not all(self._is_done(s) for s in node["allOf"]):
            return False
        for name in ("anyOf", "oneOf"):
            if isinstance(node.get(name), list) and not any(self._is_done(s) for s in node[name]):
                return False
        if "const" in node or isinstance(node.get("enum"), list):
            return True                       # an instance is given (whether it fits is llguidance's to check)
        kinds = node.get("type", _ALL_TYPES)
        kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else _ALL_TYPES
        return any(kind not in ("object", "array") or self._holds_as(node, kind) for kind in kinds)

    def _holds_as(self, node: dict, kind: str) -> bool:
        """Whether node has a finite object (kind "object") or array instance."""
        if kind == "array":
            return all(self._is_done(s) for s in _item_schemas(node))
        if not all(self._is_done(s) for name in _required_names(node) for s in _property_schemas(node, name)):
            return False
        extra = _extra_property_schemas(node)
        return not extra or any(self._is_done(s) for s in extra)

    def _target(self, ref: str, holder: dict) -> Any:
        """The subschema a $ref within holder's resource (the document, or the nearest enclosing
        subschema with an $id) names; None for any other $ref."""
        return _ref_target(ref, self.resource.get(id(holder), self.root))


def _ref_target(ref: str, root: Any) -> Any:
    """The subschema a $ref names inside the resource root ("#" or a JSON pointer "#/..."); None for any other."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _resource_roots(schema: dict, nodes: list[dict]) -> dict[int, dict]:
    """Each node's (by id) resource root: the nearest subschema above or at it with an $id, else schema;
    nodes: _subschemas(schema), each after the node that holds it."""
    roots = {id(schema): schema}
    for node in nodes:
        for child in _children(node):
            if isinstance(child, dict) and id(child) not in roots:
                roots[id(child)] = child if isinstance(child.get("$id"), str) else roots[id(node)]
    return roots


def _required_names(node: dict) -> list[str]:
    """The property names an object instance of node must have."""
    required = node.get("required")
    return [name for name in required if isinstance(name, str)] if isinstance(required, list) else []


def _property_schemas(node: dict, name: str) -> list[Any]:
    """The subschemas the value of property name must match: its own, patternProperties' that match
    the name, or additionalProperties."""
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    patterns = node.get("patternProperties") if isinstance(node.get("patternProperties"), dict) else {}
    schemas = [properties[name]] if name in properties else []
    for pattern, schema in patterns.items():
        try:
            if re.search(pattern, name):
                schemas.append(schema)
        except (re.error, TypeError):
            return []                          # not read here: counted as satisfiable
    if not schemas:
        schemas.append(node.get("additionalProperties", True))
    return schemas


def _extra_property_schemas(node: dict) -> list[Any]:
    """When minProperties asks for more properties than are required, the subschemas one more of them
    may match (an optional property's, a patternProperties', additionalProperties); else none."""
    least = node.get("minProperties")
    required = set(_required_names(node))
    if not isinstance(least, int) or isinstance(least, bool) or least <= len(required):
        return []
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    patterns = node.get("patternProperties") if isinstance(node.get("patternProperties"), dict) else {}
    return ([schema for name, schema in properties.items() if name not in required] + list(patterns.values())
            + [node.get("additionalProperties", True)])


def _item_schemas(node: dict) -> list[Any]:
    """The subschemas the items of an array instance of node must match up to its minItems."""
    least = node.get("minItems")
    if not isinstance(least, int) or isinstance(least, bool) or least <= 0:
        return []
    items = node.get("items", True)
    if isinstance(items, list):                # draft 7's tuple form
        prefix, rest = items, node.get("additionalItems", True)
    else:
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        rest = items
    return prefix[:least] + ([rest] if least > len(prefix) else [])


def _check_schema_node(node: dict) -> None:
    """One object of a schema: an integer bound past the 64-bit range (llguidance matches integers
    as 64-bit and would clamp it: a minimum of 1e19 let 9223372036854775807 through) or that a
    64-bit float does not hold, a const or enum integer a float does not hold, a multipleOf of
    too many significant digits, more than
    MAX_PATTERN_PROPERTIES patternProperties, a pattern that ends in a lone backslash (llguidance
    drops it and matches the rest), prefixItems beside additionalItems with no items (prefixItems
    unenforced). minProperties is checked once objects are closed or not (_check_min_properties)."""
    patterns = node.get("patternProperties")
    if isinstance(patterns, dict) and len(patterns) > MAX_PATTERN_PROPERTIES:
        raise StructuredOutputsError("json", f"an object of the schema has {len(patterns)} patternProperties; "
                                             f"at most {MAX_PATTERN_PROPERTIES} are taken (compiling checks every "
                                             "pair of them for overlap)")
    for pattern in [node.get("pattern"), *(patterns if isinstance(patterns, dict) else ())]:
        if isinstance(pattern, str) and _ends_in_lone_backslash(pattern):
            raise StructuredOutputsError("json", f"invalid JSON schema: the pattern {pattern!r} ends in a lone "
                                                 "backslash (an escape with nothing to escape)")
    if "prefixItems" in node and "additionalItems" in node and "items" not in node:
        # llguidance then reads the array as draft 7 does, and prefixItems (2020-12's) is not enforced.
        raise StructuredOutputsError("json", "an array of the schema has prefixItems and additionalItems but no "
                                             "items: additionalItems (draft 7's) leaves prefixItems unenforced; "
                                             "say what follows prefixItems with items (false, or a schema)")
    kind = node.get("type")
    if kind == "integer" or (isinstance(kind, list) and "integer" in kind):
        for name in _BOUND_KEYS:
            bound = node.get(name)
            if isinstance(bound, (int, float)) and not isinstance(bound, bool):
                _check_integer_bound(name, bound)
    step = node.get("multipleOf")
    if isinstance(step, (int, float)) and not isinstance(step, bool):
        _check_multiple_of(step)
    data = [node["const"]] if "const" in node else []
    for value in _numbers_in(data + [node["enum"]] if isinstance(node.get("enum"), list) else data):
        _check_const_number(value)


# llguidance reads a schema's numbers as 64-bit floats: integers past 2**53 in magnitude are
# rounded to one (an exclusive bound's neighbour too: 2**60 - 1 is 2**60), and an integer range
# that reaches -2**63 overflows its stack and kills the process (a const of -2**63 + 1 did).
_FLOAT_EXACT_MAX = 2 ** 53


def _check_integer_bound(name: str, bound: int | float) -> None:
    """A StructuredOutputsError for an integer bound that is not matched as written."""
    if abs(bound) > _INT64_MAX:
        raise StructuredOutputsError("json", f"the integer bound {name}={bound!r} lies outside the "
                                             f"64-bit range [-{_INT64_MAX}, {_INT64_MAX}] that can be matched")
    if name.startswith("exclusive"):      # matched from the integer next to it, inside
        inside = bound - 1 if name == "exclusiveMaximum" else bound + 1
        if abs(inside) > _FLOAT_EXACT_MAX:
            raise StructuredOutputsError("json", f"the integer bound {name}={bound!r} is read as a 64-bit float, "
                                                 "which holds integers exactly only up to 2**53 in magnitude: the "
                                                 f"integers next to it are not told apart; use {name[9:].lower()}")
        return
    as_float = float(bound)
    if (as_float == bound and as_float > -2 ** 63) or bound == _INT64_MAX:   # 2**63 - 1 is read as 2**63, clamped back
        return
    if as_float <= -2 ** 63:
        raise StructuredOutputsError("json", f"the integer bound {name}={bound!r} is read as a 64-bit float at "
                                             "-2**63, past the 64-bit integers that can be matched")
    if (as_float > bound) == (name == "maximum"):
        as_float = math.nextafter(as_float, -math.inf if name == "maximum" else math.inf)
    raise StructuredOutputsError("json", f"the integer bound {name}={bound!r} is read as a 64-bit float, which "
                                         "holds integers exactly only up to 2**53 in magnitude: it would be matched "
                                         f"as another integer; the nearest one it holds inside is {int(as_float)}")


# llguidance matches multipleOf with an automaton of a state per multiple of its significant digits
# (trailing zeros left out): 9973 compiles in 0.04 s holding 7 MB, 99991 in 0.6 s holding 50 MB per
# cached grammar, and 2**31 asks for gigabytes and aborts the process that compiles it.
MAX_MULTIPLE_OF_DIGITS = 10_000


def _check_multiple_of(step: int | float) -> None:
    """A StructuredOutputsError for a multipleOf not above 0 (JSON Schema's rule; llguidance took -3 as 3),
    whose significant digits make too large an automaton, or whose digits llguidance does not read
    as written (_llguidance_step: 0.07 was refused as "too many digits: 7000000000000001")."""
    if step <= 0:
        raise StructuredOutputsError("json", f"invalid JSON schema: multipleOf must be greater than 0, got {step!r}")
    wanted = _decimal_step(step)
    significant = _significant_digits(wanted[0])
    if significant > MAX_MULTIPLE_OF_DIGITS:
        raise StructuredOutputsError("json", f"multipleOf {step!r} is not supported: its significant digits "
                                             f"({significant}) are matched by an automaton of as many states; at "
                                             f"most {MAX_MULTIPLE_OF_DIGITS} are taken")
    if isinstance(step, float) and wanted[0] <= _U32_MAX and _llguidance_step(step) != wanted:
        raise StructuredOutputsError("json", f"multipleOf {step!r} is not supported: llguidance finds a step's "
                                             "decimal digits by multiplying its binary float by 10 until it is a "
                                             f"whole number, which for {step!r} does not come to {wanted[0]}, and "
                                             "it cannot be matched exactly")


def _significant_digits(coef: int) -> int:
    """coef without its trailing zeros."""
    while coef and coef % 10 == 0:
        coef //= 10
    return coef


def _decimal_step(step: int | float) -> tuple[int, int]:
    """(coef, exp) with step = coef * 10**-exp as written (its shortest digits), exp >= 0 and as small
    as it can be: llguidance's Decimal of a step it reads exactly."""
    value = decimal.Decimal(step if isinstance(step, int) else repr(step)).normalize()
    _, digits, exp = value.as_tuple()
    coef = int("".join(map(str, digits)))
    return (coef * 10 ** exp, 0) if exp >= 0 else (coef, -exp)


_U32_MAX = 2 ** 32 - 1


def _llguidance_step(step: float) -> tuple[int, int] | None:
    """(coef, exp) as llguidance reads a multipleOf (numeric.rs, Decimal::try_from): the float
    multiplied by 10 until it is whole, then its trailing zeros dropped; None where it refuses it."""
    value, exp = step, 0
    while value != math.floor(value):
        value *= 10.0
        exp += 1
    if value > _U32_MAX:
        return None
    coef = int(value)
    while exp and coef % 10 == 0:
        coef //= 10
        exp -= 1
    return coef, exp


# llguidance intersects the subschemas of an allOf, and a $ref with the keywords beside it: two
# multipleOf become their least common multiple, computed in 32-bit integers (Decimal::lcm), which
# wrap past 2**32 (multipleOf 9973 with 1e-9 took only 0) and make an automaton of a state per unit
# of its significant digits (8192 with 9999: 82 million, and the engine process aborted for memory
# at its first mask). Every number that lcm multiplies divides the combined step written at the
# finest exponent, so one of at most 2**16 - 1 keeps their products inside 32 bits.
_MAX_COMBINED_STEP = 2 ** 16 - 1
# Keys beside a $ref that do not make an intersection.
_REF_ANNOTATIONS = frozenset({"$ref", "$defs", "definitions", "title", "description", "default", "examples",
                              "$comment", "$schema", "$id"})


def _check_intersected_steps(schema: Any) -> None:
    """A StructuredOutputsError when multipleOf values llguidance may intersect combine into a step it
    cannot match (_MAX_COMBINED_STEP, MAX_MULTIPLE_OF_DIGITS); each value alone is checked already."""
    if _combined_step(_steps_in(schema)) is None:
        return                                   # all of them together fit: so does every group
    for group in _intersected_step_groups(schema):
        combined = _combined_step(group)
        if combined is not None:
            listed = ", ".join(sorted(_decimal_text(coef, exp) for coef, exp in group))
            raise StructuredOutputsError("json", f"multipleOf {listed} of subschemas that are intersected (allOf, "
                                                 "or a $ref beside other keywords) combine into the step "
                                                 f"{_decimal_text(*combined)}, which cannot be matched: a combined "
                                                 f"step is taken up to {_MAX_COMBINED_STEP} units of its finest "
                                                 f"place and {MAX_MULTIPLE_OF_DIGITS} significant digits")


def _combined_step(steps: set[tuple[int, int]]) -> tuple[int, int] | None:
    """The least common multiple (coef, exp) of two or more steps when it is too large to match; None
    when it fits (or there are fewer than two)."""
    if len(steps) < 2:
        return None
    finest = max(exp for _, exp in steps)
    combined = 1
    for coef, exp in steps:
        combined = math.lcm(combined, coef * 10 ** (finest - exp))
    if combined <= _MAX_COMBINED_STEP and _significant_digits(combined) <= MAX_MULTIPLE_OF_DIGITS:
        return None
    return combined, finest


def _decimal_text(coef: int, exp: int) -> str:
    """coef * 10**-exp written out."""
    return format(decimal.Decimal(coef).scaleb(-exp).normalize(), "f")


def _steps_in(*schemas: Any) -> set[tuple[int, int]]:
    """The (coef, exp) of every multipleOf in the subschemas of these schemas."""
    return {step for schema in schemas for node in _subschemas(schema) if (step := _step_of(node)) is not None}


def _step_of(node: dict) -> tuple[int, int] | None:
    """The (coef, exp) of one subschema's own multipleOf; None without one."""
    step = node.get("multipleOf")
    if isinstance(step, bool) or not isinstance(step, (int, float)) or step <= 0:
        return None
    return _decimal_step(step)


def _intersected_step_groups(schema: Any):
    """For each outermost allOf, or $ref beside other keywords, the steps it may intersect: those inside
    it, and those where its $refs may lead (the definitions, or for another $ref the whole schema)."""
    definitions = [schema.get(name) for name in ("$defs", "definitions")] if isinstance(schema, dict) else []
    defined = _steps_in(*(value for d in definitions if isinstance(d, dict) for value in d.values()))
    everything, inside = _steps_in(schema), set()
    for node in _subschemas(schema):
        if id(node) in inside or not (isinstance(node.get("allOf"), list)
                                      or ("$ref" in node and set(node) - _REF_ANNOTATIONS)):
            continue
        group, refs = set(), set()
        for inner in _subschemas(node):
            inside.add(id(inner))
            if (step := _step_of(inner)) is not None:
                group.add(step)
            if isinstance(inner.get("$ref"), str):
                refs.add(inner["$ref"].startswith(("#/$defs/", "#/definitions/")))
        yield group | (defined if True in refs else set()) | (everything if False in refs else set())


def _numbers_in(values: list) -> list[int | float]:
    """The numbers in JSON data (const and enum values), nested ones included."""
    numbers, todo = [], list(values)
    while todo:
        value = todo.pop()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            numbers.append(value)
        elif isinstance(value, list):
            todo.extend(value)
        elif isinstance(value, dict):
            todo.extend(value.values())
    return numbers


def _check_const_number(value: int | float) -> None:
    """A StructuredOutputsError for a const or enum number that is not matched as written: an
    integer a 64-bit float does not hold, or written back otherwise (past the 64-bit range llguidance
    writes the float's shortest digits: 2**63 as 9223372036854776000), a float from 2**63 up whose
    shortest digits are another integer (1e300), or one at -2**63 or below."""
    if (isinstance(value, float) and not value.is_integer()) or abs(value) <= _FLOAT_EXACT_MAX:
        return
    as_float = float(value)
    if as_float <= -2 ** 63:
        raise StructuredOutputsError("json", f"the number {value!r} of a const or enum is read as a 64-bit float "
                                             "at or below -2**63, past the 64-bit integers that can be matched")
    if isinstance(value, float):
        written = int(decimal.Decimal(repr(value)))
        if as_float >= 2 ** 63 and written != value:    # below 2**63 it is written exactly (_with_exact_integers)
            raise StructuredOutputsError("json", f"the float {value!r} of a const or enum is written by its shortest "
                                                 "digits as an integer, which a JSON reader that keeps integers exact "
                                                 "(Python's) reads as another number than the float; a const or enum "
                                                 "float that is an integer is matched exactly under 2**63")
        return
    if value <= _INT64_MAX:
        written = _INT64_MAX if value == _INT64_MAX else int(as_float)
    else:
        written = int(decimal.Decimal(repr(as_float)))
    if written != value:
        raise StructuredOutputsError("json", f"the integer {value} of a const or enum is read as a 64-bit float, "
                                             "which holds integers exactly only up to 2**53 in magnitude: "
                                             f"it would be written as {written}")


def _with_exact_integers(text: str) -> str:
    """The schema text with each integer-valued float past 2**53 and under 2**63 in magnitude written
    as its exact integer. llguidance writes a const or enum float by its shortest digits and no dot
    or exponent: 2.0**60 as 1152921504606847000, which a reader that keeps integers exact (Python's
    json) takes as that integer, another number than the float; written as an integer under 2**63 it
    is matched exactly. Bounds are read as the same 64-bit float either way."""
    if "e+" not in text:               # json.dumps writes every float from 1e16 up with an exponent
        return text
    changed = False

    def exact(digits: str) -> float | int:
        nonlocal changed
        value = float(digits)
        if value.is_integer() and _FLOAT_EXACT_MAX < abs(value) < 2 ** 63:
            changed = True
            return int(value)
        return value

    schema = jsonlib.loads(text, parse_float=exact)
    return jsonlib.dumps(schema, ensure_ascii=False, separators=(",", ":")) if changed else text


# llguidance matches a number bound by its digits written out (0.000012 for 1.2e-5), exactly only up
# to this many of them: past it the bound's last digits are rounded (maximum 0.9999999999999999 let 1
# through, minimum 0.9688114292759761 let 0.968811429275976 through).
_BOUND_DIGITS = 15


def _with_exact_bounds(text: str) -> str:
    """The schema text with the bounds of each number schema (one whose type is not integer alone)
    that llguidance does not keep as written rewritten, inside, as bounds it keeps (_exact_bound):
    an exclusive bound as an inclusive one (llguidance took an integer exclusive bound itself when
    the other bound lay within the unit interval beside it: "0" under exclusiveMinimum 0 and
    exclusiveMaximum 0.5), and a bound of more than _BOUND_DIGITS digits written out as one of that
    many. Bounds past 2**53 in magnitude, where floats are integers, are left as they are."""
    if '"exclusiveM' not in text and '"minimum"' not in text and '"maximum"' not in text:
        return text
    schema, changed = jsonlib.loads(text), False
    for node in _subschemas(schema):
        kind = node.get("type")
        if kind == "integer" or (isinstance(kind, list) and "number" not in kind):
            continue
        for name, inclusive, upper in (("exclusiveMinimum", "minimum", False), ("exclusiveMaximum", "maximum", True),
                                       ("minimum", "minimum", False), ("maximum", "maximum", True)):
            bound = node.get(name)
            if isinstance(bound, bool) or not isinstance(bound, (int, float)) or abs(bound) > _FLOAT_EXACT_MAX:
                continue
            kept = _exact_bound(bound, upper, exclusive=name != inclusive)
            if kept is bound:
                continue
            other = node.get(inclusive) if name != inclusive else None
            if isinstance(other, (int, float)) and not isinstance(other, bool):
                kept = min(kept, other) if upper else max(kept, other)
            node.pop(name)
            node[inclusive] = kept
            changed = True
    return jsonlib.dumps(schema, ensure_ascii=False, separators=(",", ":")) if changed else text


def _exact_bound(bound: int | float, upper: bool, exclusive: bool) -> int | float:
    """The inclusive bound nearest to bound on its inside with at most _BOUND_DIGITS digits written
    out; bound itself when it is inclusive and has no more. An exclusive one moves at least a unit of
    its last kept digit inside, more than a float's rounding: no number read back as the bound is kept."""
    value = decimal.Decimal(repr(float(bound)) if isinstance(bound, float) else bound)
    places = _BOUND_DIGITS - max(1, value.adjusted() + 1)             # digits kept after the point
    unit = decimal.Decimal(1).scaleb(-places)
    kept = value.quantize(unit, rounding=decimal.ROUND_FLOOR if upper else decimal.ROUND_CEILING)
    if kept == value:
        if not exclusive:
            return bound
        kept = kept - unit if upper else kept + unit
    return float(kept)



def _check_number_bounds(node: dict) -> None:
    """A StructuredOutputsError naming the client's bounds of a number schema when those llguidance is given
    (_with_exact_bounds) leave no number between them: llguidance's own error names the rewritten ones
    (minimum 1e-300 and maximum 2e-300 as "minimum (0.00000000000001) is greater than maximum (0)")."""
    kind = node.get("type")
    if kind != "number" and not (isinstance(kind, list) and "number" in kind and set(kind) <= {"number", "integer"}):
        return                                 # bounds kept as written, or another type's instance is taken
    lower = upper = None                       # (kept bound, name, client's bound)
    for name, is_upper in (("minimum", False), ("exclusiveMinimum", False), ("maximum", True),
                           ("exclusiveMaximum", True)):
        bound = node.get(name)
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or abs(bound) > _FLOAT_EXACT_MAX:
            continue
        kept = (_exact_bound(bound, is_upper, exclusive=name.startswith("exclusive")), name, bound)
        if is_upper and (upper is None or kept[0] < upper[0]):
            upper = kept
        elif not is_upper and (lower is None or kept[0] > lower[0]):
            lower = kept
    if lower is None or upper is None or lower[0] <= upper[0]:
        return
    (_, low_name, low), (_, high_name, high) = lower, upper
    if low > high or (low == high and (low_name + high_name).count("exclusive")):
        raise StructuredOutputsError("json", f"invalid JSON schema: no number lies between {low_name} {low!r} "
                                             f"and {high_name} {high!r}")
    raise StructuredOutputsError("json", f"the bounds {low_name} {low!r} and {high_name} {high!r} are not supported: "
                                         f"a number bound is matched by its digits written out, at most {_BOUND_DIGITS} "
                                         "of them, and no number written so lies between these two")

def _check_min_properties(node: dict) -> None:
    """llguidance counts an object's members to meet minProperties, and keys outside `properties`
    (additionalProperties, patternProperties) may repeat: {"": 1, "": 2} has two members and, once
    parsed, one property. A repeat is harmless while one member past the listed properties is
    enough; a minProperties that needs two or more of them is refused, not broken."""
    least = node.get("minProperties")
    if not isinstance(least, int) or isinstance(least, bool):
        return
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    listed = len(set(properties) & {name for name in required if isinstance(name, str)})
    free_keys = node.get("additionalProperties", True) is not False or bool(node.get("patternProperties"))
    if free_keys and least - listed >= 2:
        raise StructuredOutputsError("json", f"minProperties {least} is not supported here: it needs "
                                             f"{least - listed} properties outside the required `properties`, "
                                             "and those keys may repeat in the output (a repeated key counts once "
                                             f"when parsed); list the properties, or ask for at most {listed + 1}")


def _ends_in_lone_backslash(regex: str) -> bool:
    """The regex ends in an odd run of backslashes: an escape of nothing (invalid, and dropped by llguidance)."""
    return (len(regex) - len(regex.rstrip("\\"))) % 2 == 1


_JSON_KINDS = (StructuredOutputOptions.JSON, StructuredOutputOptions.JSON_OBJECT)
# Kinds whose text is bounded by MAX_CONSTRAINT_CHARS (rules and $refs recurse; a regex's setup is slow).
_BOUNDED_KINDS = (StructuredOutputOptions.JSON, StructuredOutputOptions.GRAMMAR, StructuredOutputOptions.REGEX)
# llguidance's error when a mask allows no token at all and the output may not end there: the
# constraint matches nothing (a regex like [^\s\S], a $ref cycle, a rule only left-recursive).
_NO_TOKEN_ALLOWED = "NoExtensionBias"
# Tokens of an output walked when a grammar is compiled, to meet a parser limit there, not in a request.
_PROBE_TOKENS = 8


# llguidance's date, date-time and time formats take a second 60 at any time of day, February 29
# of any year and the year 0000, which Python's datetime, pydantic and jsonschema's format check
# refuse. A schema that names one of them gets this pattern beside it (llguidance matches the
# intersection): every day of the Gregorian calendar from the year 1, seconds 00-59.
_YEAR = "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         f"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)")
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
# llguidance's duration takes numbers of any length, and a model free to write digits writes them on
# ("PT91004000000000000000..."); pydantic's timedelta refuses one past 999,999,999 days or past its
# integers. Beside llguidance's RFC 3339 duration, each number has at most 6 digits: any of them
# together then stay under pydantic's bound (P999999Y999999M999999DT999999H999999M999999S).
_DURATION = "P(?:[0-9]{1,6}[YMWDHS]|T)+"
# llguidance's hostname takes any number of labels and its email any length of local part and of
# domain label: beside them, RFC 1123's 253 characters for a hostname, and RFC 5321's 64 for a local
# part, 63 for a label and 254 for an address.
_EMAIL = r"^[^@]{1,64}@(?:[^.@]{1,63}\.)*[^.@]{1,63}$"
_FORMAT_SCHEMAS = {"date": {"pattern": f"^{_DATE}$"}, "date-time": {"pattern": f"^{_DATE}[Tt]{_TIME}$"},
                   "time": {"pattern": f"^{_TIME}$"}, "duration": {"pattern": f"^{_DURATION}$"},
                   "hostname": {"maxLength": 253}, "email": {"pattern": _EMAIL, "maxLength": 254}}
# The string formats llguidance enforces. JSON Schema makes "format" an annotation that a validator
# ignores when it does not know it; llguidance refuses the whole schema instead ("Unknown format:
# password"). pydantic writes such formats (SecretStr's password, bytes' binary, OpenAPI's int32),
# so a format outside this set is left out where the schema is serialised: the value is any string.
_LLGUIDANCE_FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6",
                                 "uri", "uuid"})
# Where a schema holds subschemas: a map of them, one, or a list of them.
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_KEYS = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
                   "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")



# JSON Schema's `pattern` is an ECMA-262 regular expression; llguidance reads Rust's regex syntax.
# Where they read the same text differently, the pattern is written in Rust's syntax for the meaning
# ECMA-262 gives it (_ecma_pattern), or refused. ECMA-262's classes: \d [0-9], \w [0-9A-Za-z_], \s the
# whitespace and line terminators below (Rust's \s is Unicode's White_Space: U+0085, not U+FEFF), `.`
# any character but a line terminator (Rust's takes \r, U+2028 and U+2029); \p{..} reads as under the
# `u` flag, which JSON Schema asks for.
_ECMA_SPACE = r"\t\n\x0B\x0C\r \xA0\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}\x{FEFF}"
_ECMA_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_", "s": _ECMA_SPACE}
_ECMA_DOT = r"[^\n\r\x{2028}\x{2029}]"
# Escapes of a letter that ECMA-262 defines (\c, \x, \u, \p take what follows; \k and \b are left to
# llguidance, which refuses backreferences and word boundaries).
_ECMA_LETTER_ESCAPES = frozenset("dDwWsSbBtnvfrcxupPk")
_INLINE_FLAGS = re.compile(r"\(\?[a-zA-Z-]*[sxU][a-zA-Z-]*[:)]")


class _PatternError(ValueError):
    """A pattern whose ECMA-262 meaning is not kept; the message says why."""


def _ecma_pattern(pattern: str) -> str:
    """pattern (ECMA-262) in Rust's regex syntax with the same meaning; _PatternError where it cannot be."""
    if _INLINE_FLAGS.search(pattern):
        raise _PatternError("inline flags s, x and U are not ECMA-262 (a JSON Schema pattern has no flags)")
    out, i, class_start = [], 0, None       # class_start: where the open character class's items begin
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            text, i = _ecma_escape(pattern, i, class_start is not None)
            out.append(text)
        elif class_start is None:
            if c == "[":
                class_start = i + 2 if pattern.startswith("[^", i) else i + 1
                if pattern.startswith("]", class_start):
                    if class_start == i + 1:
                        raise _PatternError("[] is an empty class, which matches no character in ECMA-262")
                    out.append(r"[\x{0}-\x{10FFFF}]")          # [^]: any character
                    i, class_start = class_start + 1, None
                    continue
                out.append(pattern[i:class_start])
                i = class_start
                continue
            out.append(_ECMA_DOT if c == "." else c)
            i += 1
        else:
            text, i, is_closed = _ecma_class_char(pattern, i)
            out.append(text)
            if is_closed:
                class_start = None
    return "".join(out)


def _ecma_class_char(pattern: str, i: int) -> tuple[str, int, bool]:
    """(Rust text, next index, whether it closed the class) for the unescaped character at i in a class."""
    c = pattern[i]
    if c == "]":
        return c, i + 1, True
    if pattern.startswith("[:", i):
        raise _PatternError("[: in a character class is a POSIX class ([[:alpha:]]) in some dialects, and "
                            "the characters [ and : in ECMA-262; write the class's characters (e.g. [A-Za-z])")
    if pattern.startswith("--", i):
        raise _PatternError("-- in a character class is a class difference in some dialects and a range "
                            "ending in - in ECMA-262; escape the - (\\-)")
    if c in "[&~":                                 # nesting and set operations in Rust, characters in ECMA-262
        return "\\" + c, i + 1, False
    return c, i + 1, False


def _ecma_escape(pattern: str, i: int, is_in_class: bool) -> tuple[str, int]:
    """(Rust text, next index) for the escape at pattern[i] (a backslash)."""
    e = pattern[i + 1] if i + 1 < len(pattern) else ""
    if e.lower() in _ECMA_CLASSES:
        members = _ECMA_CLASSES[e.lower()]
        negated = "^" if e.isupper() else ""
        return (members if is_in_class and not negated else f"[{negated}{members}]"), i + 2
    if e == "c" and i + 2 < len(pattern) and pattern[i + 2].isascii() and pattern[i + 2].isalpha():
        return f"\\x{ord(pattern[i + 2]) % 32:02X}", i + 3             # a control character
    if e == "0" and not pattern[i + 2:i + 3].isdigit():
        return r"\x00", i + 2
    if e == "b" and is_in_class:
        return r"\x08", i + 2                                          # backspace
    if e == "x" and not re.fullmatch(r"[0-9A-Fa-f]{2}", pattern[i + 2:i + 4]):
        raise _PatternError(f"\\x{pattern[i + 2:i + 3]} is not an ECMA-262 escape (\\x takes two hex digits)")
    if e in "pP" and not pattern.startswith("{", i + 2):
        raise _PatternError(f"\\{e}{pattern[i + 2:i + 3]} is not an ECMA-262 escape (\\{e} takes a {{name}})")
    if e.isascii() and e.isalpha() and e not in _ECMA_LETTER_ESCAPES:
        raise _PatternError(f"\\{e} is not an ECMA-262 escape (it reads as the letter {e}, or is an error)")
    return pattern[i:i + 2], i + 2

# pydantic writes a Decimal's string form with look-arounds, which llguidance does not take: a model
# with a Decimal field (a price) was refused whole. Its four patterns (by max_digits and
# decimal_places) are read back to those numbers and written without look-arounds: strings the
# pattern takes and pydantic reads, with a digit, at most max_digits of them past the leading zeros
# and at most decimal_places after the dot. The zeros pydantic drops (leading ones past the first,
# trailing ones past decimal_places) are left out where a bound is given: a model free to write
# zeros writes them on (".9000000..."), and the bounded string then ends.
_DECIMAL_HEAD = re.escape(r"^(?!^[-+.]*$)[+-]?0*")
_DECIMAL_BODIES = (
    re.escape(r"\d*\.?\d*$"),
    re.escape(r"\d*\.?\d{0,") + "(?P<places>[0-9]+)" + re.escape("}0*$"),
    (re.escape(r"(?:\d{0,") + "(?P<whole>[0-9]+)" + re.escape(r"}|(?=[\d.]{1,") + "(?P<width>[0-9]+)"
     + re.escape(r"}0*$)\d{0,") + "[0-9]+" + re.escape(r"}\.\d{0,") + "(?P<places>[0-9]+)" + re.escape("}0*$)")),
    (re.escape(r"(?:\d{0,") + "[0-9]+" + re.escape(r"}|(?=[\d.]{1,") + "(?P<width>[0-9]+)"
     + re.escape(r"}0*$)\d*\.\d*0*$)")),
)
_DECIMAL_FORMS = tuple(re.compile(_DECIMAL_HEAD + body) for body in _DECIMAL_BODIES)
# A max_digits alone is written as an alternative per count of digits before the dot.
MAX_DECIMAL_DIGITS = 64


def _decimal_pattern(pattern: str) -> str | None:
    """The pattern without look-arounds for one pydantic writes for a Decimal; None for any other."""
    match = next(filter(None, (form.fullmatch(pattern) for form in _DECIMAL_FORMS)), None)
    if match is None:
        return None
    found = {name: int(value) for name, value in match.groupdict().items() if value is not None}
    digits = found["width"] - 1 if "width" in found else None     # the look-ahead's width counts the dot
    if digits is not None and digits > MAX_DECIMAL_DIGITS:
        return None
    places = found.get("places")
    if digits is not None:
        places = digits if places is None else min(places, digits)
    if places is None:
        fraction, after_dot = "[0-9]*", "[0-9]+"
    else:
        fraction, after_dot = f"[0-9]{{0,{places}}}", f"[0-9]{{1,{places}}}" if places else "0"
    alternatives = []
    if digits is None:                                  # no max_digits
        alternatives.append(f"[0-9]+(?:\\.{fraction})?")
    elif "whole" in found:                              # max_digits and decimal_places
        if found["whole"]:
            alternatives.append(f"[0-9]{{1,{found['whole']}}}(?:\\.{fraction})?")
    else:                                               # max_digits alone: both sides of the dot share it
        alternatives += [f"[0-9]{{{j}}}(?:\\.[0-9]{{0,{digits - j}}})?" for j in range(1, digits + 1)]
    alternatives.append(f"\\.{after_dot}")
    zeros = "0*" if digits is None else "0?"
    return f"^[+-]?{zeros}(?:" + "|".join(alternatives) + ")$"


# pydantic writes dict[Literal[...], V] and dict[SomeEnum, V] as additionalProperties V with
# propertyNames an enum (through a $ref for an Enum), which llguidance does not implement (the whole
# schema was refused). Such an object with no properties of its own is the object whose optional
# properties are those keys, each a V, and no other: written so, it takes the same objects.
_NAME_KEYS = frozenset({"enum", "const", "type", "title", "description"})


def _property_name_keys(names: Any, root: Any) -> list[str] | None:
    """The keys a propertyNames schema lists (an enum or const of strings, itself or through a
    $ref into $defs or definitions); None for a schema of any other shape."""
    if isinstance(names, dict) and set(names) == {"$ref"} and isinstance(names["$ref"], str):
        where, _, name = names["$ref"].rpartition("/")
        defs = root.get(where[2:]) if where in ("#/$defs", "#/definitions") and isinstance(root, dict) else None
        names = defs.get(name) if isinstance(defs, dict) and not set(name) & set("~%") else None
    if not isinstance(names, dict) or not set(names) <= _NAME_KEYS or ("enum" in names) == ("const" in names):
        return None
    keys = names["enum"] if "enum" in names else [names["const"]]
    if names.get("type", "string") != "string" or not isinstance(keys, list) or not keys \
            or not all(isinstance(key, str) for key in keys):
        return None
    return list(dict.fromkeys(keys))


def _with_listed_names(node: dict, root: Any) -> bool:
    """Write an object schema's propertyNames enum as its properties (see _property_name_keys); whether it did."""
    keys = _property_name_keys(node.get("propertyNames"), root)
    if keys is None or node.get("properties") or node.get("patternProperties"):
        return False
    value = jsonlib.dumps(node.get("additionalProperties", True))
    node["properties"] = {key: jsonlib.loads(value) for key in keys}    # a copy each: later passes edit them
    node["additionalProperties"] = False
    del node["propertyNames"]
    return True


def _with_pattern_names(node: dict) -> bool:
    """Write an object schema's propertyNames that is a pattern alone (no properties or patternProperties of its
    own) as the one patternProperties name its keys must match, each key's value as additionalProperties says
    (llguidance does not implement propertyNames; vLLM's default backend, xgrammar, takes it); whether it did."""
    names = node.get("propertyNames")
    if (not isinstance(names, dict) or not isinstance(names.get("pattern"), str)
            or not set(names) <= {"pattern", "type", "title", "description"} or names.get("type", "string") != "string"
            or "properties" in node or "patternProperties" in node or "unevaluatedProperties" in node):
        return False
    node["patternProperties"] = {names["pattern"]: node.get("additionalProperties", True)}
    node["additionalProperties"] = False
    del node["propertyNames"]
    return True


def _with_dependencies(node: dict) -> bool:
    """Write dependentRequired and dependentSchemas as what they ask, in allOf: for each key named, the object
    has no such key, or has it with the keys it requires and matches its schema (llguidance does not implement
    the two; vLLM's default backend takes them); whether it did."""
    required = node.get("dependentRequired")
    schemas = node.get("dependentSchemas")
    parts = []
    if isinstance(required, dict) and all(isinstance(v, list) and all(isinstance(k, str) for k in v)
                                          for v in required.values()):
        parts += [{"anyOf": [{"properties": {name: False}}, {"required": [name, *keys]}]}
                  for name, keys in required.items()]
        del node["dependentRequired"]
    if isinstance(schemas, dict):
        parts += [{"anyOf": [{"properties": {name: False}}, {"allOf": [{"required": [name]}, schema]}]}
                  for name, schema in schemas.items()]
        del node["dependentSchemas"]
    if not parts:
        return False
    node["allOf"] = [*(node["allOf"] if isinstance(node.get("allOf"), list) else []), *parts]
    return True


# The most alternatives _with_listed_min_properties writes for one object's minProperties.
MAX_MIN_PROPERTIES_CHOICES = 64


def _with_listed_min_properties(node: dict) -> bool:
    """Write the minProperties of an object that takes only its listed properties (additionalProperties false,
    no patternProperties) as an anyOf of the sets of optional ones that meet it, at most
    MAX_MIN_PROPERTIES_CHOICES of them (llguidance takes minProperties only where every listed property is
    required; vLLM's default backend takes it); whether it did."""
    least = node.get("minProperties")
    listed = node.get("properties")
    if (not isinstance(least, int) or isinstance(least, bool) or node.get("additionalProperties") is not False
            or "patternProperties" in node or not isinstance(listed, dict)):
        return False
    required = set(_required_names(node))
    optional = [name for name, schema in listed.items() if name not in required and schema is not False]
    need = least - len(required & set(listed))
    if need > len(optional) or math.comb(len(optional), max(need, 0)) > MAX_MIN_PROPERTIES_CHOICES:
        return False                              # left to llguidance, which says why it is refused
    del node["minProperties"]
    if need > 0:
        choices = [{"required": list(names)} for names in itertools.combinations(optional, need)]
        node["allOf"] = [*(node["allOf"] if isinstance(node.get("allOf"), list) else []), {"anyOf": choices}]
    return True


def _with_client_patterns(key: StructuredOutputKey, error: str) -> str:
    """llguidance's error about a JSON schema with each pattern it quotes as the client wrote it, not as
    _ecma_pattern wrote it for llguidance."""
    if not error or key[0] is not StructuredOutputOptions.JSON or '"pattern' not in key[1]:
        return error
    written = {}
    for node in _subschemas(jsonlib.loads(key[1])):
        patterns = node.get("patternProperties") if isinstance(node.get("patternProperties"), dict) else {}
        for pattern in [node.get("pattern"), *patterns]:
            if isinstance(pattern, str) and _decimal_pattern(pattern) is None:
                try:
                    written[_ecma_pattern(pattern)] = pattern
                except _PatternError:
                    continue
    for ours in sorted(written, key=len, reverse=True):
        if ours != written[ours]:
            error = error.replace(ours, written[ours])
    return error


def _with_ecma_patterns(node: dict) -> bool:
    """Write a subschema's pattern and patternProperties names in Rust's syntax for their ECMA-262 meaning
    (pydantic's Decimal patterns without look-arounds); whether any changed. Each was checked already."""
    changed = False
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        plain = _decimal_pattern(pattern)
        node["pattern"] = _ecma_pattern(pattern) if plain is None else plain
        changed = node["pattern"] != pattern
    patterns = node.get("patternProperties")
    if isinstance(patterns, dict):
        written = {_ecma_pattern(name): schema for name, schema in patterns.items()}
        if list(written) != list(patterns):
            node["patternProperties"] = written
            changed = True
    return changed


def _with_known_formats(text: str) -> str:
    """The schema text with _FORMAT_SCHEMAS added (in allOf) to every subschema that names one of
    those formats, every format llguidance does not know left out, pydantic's Decimal patterns
    written without look-arounds (_decimal_pattern), its dicts keyed by an enum written with
    properties (_with_listed_names) or by a pattern with patternProperties (_with_pattern_names),
    dependentRequired and dependentSchemas written in allOf (_with_dependencies), a closed object's
    minProperties written as the sets of keys that meet it (_with_listed_min_properties), and unevaluatedProperties or unevaluatedItems that mean what
    additionalProperties or items mean written so (_with_plain_unevaluated); other text as it is. Done
    where the schema is serialised for llguidance, never in the constraint's key: the key's text is
    what an API server sends the engine core, which builds the constraint from it again (patterns
    added there would be added twice, and counted against the size bound as if the client had
    written them). Only subschemas are visited: a const or enum value that reads {"format": "date"}
    is data."""
    if '"format"' not in text and '"pattern' not in text and '"propertyNames"' not in text \
            and '"unevaluated' not in text and '"dependent' not in text and '"minProperties"' not in text:
        return text
    schema, changed = jsonlib.loads(text), False
    for node in _subschemas(schema):
        if "propertyNames" in node and (_with_listed_names(node, schema) or _with_pattern_names(node)):
            changed = True
        changed = _with_dependencies(node) or changed           # its schemas then visited through allOf
        changed = _with_listed_min_properties(node) or changed
        changed = _with_plain_unevaluated(node) or changed       # before a format's allOf is added
        changed = _with_ecma_patterns(node) or changed
        name = node.get("format")
        if not isinstance(name, str):
            continue
        if name in _FORMAT_SCHEMAS:
            all_of = node.get("allOf") if isinstance(node.get("allOf"), list) else []
            node["allOf"] = [*all_of, dict(_FORMAT_SCHEMAS[name])]
            changed = True
        elif name not in _LLGUIDANCE_FORMATS:
            del node["format"]
            changed = True
    return jsonlib.dumps(schema, ensure_ascii=False, separators=(",", ":")) if changed else text


# Keywords through which other subschemas evaluate an instance's members in place: beside any of them,
# unevaluatedProperties and unevaluatedItems also see what those evaluated.
_IN_PLACE_KEYS = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef", "dependentSchemas",
                  "dependencies", "contains")


def _with_plain_unevaluated(node: dict) -> bool:
    """Write unevaluatedProperties as additionalProperties, and unevaluatedItems as items (after
    prefixItems), where node has no in-place applicator (_IN_PLACE_KEYS) and not the other keyword:
    there they take the same members (vLLM's default backend reads them; llguidance refuses them).
    Whether any changed."""
    if any(name in node for name in _IN_PLACE_KEYS):
        return False
    changed = False
    if "unevaluatedProperties" in node and "additionalProperties" not in node:
        node["additionalProperties"] = node.pop("unevaluatedProperties")
        changed = True
    if "unevaluatedItems" in node and "items" not in node and "additionalItems" not in node:
        node["items"] = node.pop("unevaluatedItems")
        changed = True
    return changed


# The string formats vLLM's default backend leaves to xgrammar (a schema naming another goes to its fallback).
XGRAMMAR_STRING_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname",
                                     "uuid", "uri", "uri-reference", "uri-template", "json-pointer",
                                     "relative-json-pointer"})


def _schema_types(node: dict) -> set[str]:
    """The types node's "type" names (a string or a list of them), as vLLM's check reads them."""
    kind = node.get("type")
    return {kind} if isinstance(kind, str) else {k for k in kind if isinstance(k, str)} if isinstance(kind, list) \
        else set()


def _has_pattern_and_length_bounds(node: dict) -> bool:
    """A string schema that pairs a pattern or format with minLength or maxLength (xgrammar drops the bounds)."""
    return ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node)


def _is_unsupported_by_xgrammar(node: dict) -> bool:
    """Whether one object of a schema has a feature vLLM's default backend keeps from xgrammar."""
    kinds = _schema_types(node)
    names = node.get("propertyNames")
    patterns = node.get("patternProperties")
    return bool(
        (kinds & {"integer", "number"} and "multipleOf" in node)
        or ("array" in kinds and {"uniqueItems", "contains", "minContains", "maxContains"} & node.keys())
        or ("string" in kinds and "format" in node and node["format"] not in XGRAMMAR_STRING_FORMATS)
        or ("string" in kinds and _has_pattern_and_length_bounds(node))
        or ("object" in kinds and isinstance(names, dict) and _has_pattern_and_length_bounds(names))
        or ("object" in kinds and "propertyNames" in node
            and ("properties" in node or "patternProperties" in node or isinstance(node.get("additionalProperties"), dict)
                 or node.get("unevaluatedProperties", True) is not True))
        or ("object" in kinds and isinstance(patterns, dict) and ("properties" in node or len(patterns) > 1)))


def _any_object(schema: Any, test: Callable[[dict], bool]) -> bool:
    """Whether test holds for some object of the parsed schema, const and enum data too (as vLLM's checks
    walk it; _subschemas visits schemas alone)."""
    todo = [schema]
    while todo:                                   # a loop, not recursion: schemas nest deeply
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
        elif isinstance(node, dict):
            if test(node):
                return True
            todo.extend(node.values())
    return False


def has_xgrammar_unsupported_json_features(schema: Any) -> bool:
    """vLLM's check of a JSON schema for what its default backend ("auto") does not give xgrammar: multipleOf,
    uniqueItems and contains, a format xgrammar does not know, a pattern or format beside a length bound,
    propertyNames beside other keys' schemas, patternProperties beside properties or another."""
    return _any_object(schema, _is_unsupported_by_xgrammar)


def _has_pattern_properties(schema: Any) -> bool:
    """Whether some object of the schema has patternProperties (vLLM then falls back to outlines, not guidance)."""
    return _any_object(schema, lambda node: "patternProperties" in node)


def is_read_by_guidance(schema: Any) -> bool:
    """Whether vLLM's default backend hands the schema to its guidance fallback, which reads it as JSON Schema
    does (objects open, vLLM's disable_additional_properties false): xgrammar does not take it
    (has_xgrammar_unsupported_json_features) and it has no patternProperties (those go to outlines, which
    keeps an object to the keys it lists)."""
    return has_xgrammar_unsupported_json_features(schema) and not _has_pattern_properties(schema)


def _with_closed_objects(text: str) -> str:
    """The schema text read as vLLM's default backend (xgrammar, in its strict mode) reads it: an object
    schema with properties or patternProperties that says nothing of other keys takes none
    (additionalProperties false), and so does one with "type": "object" that lists no keys but says
    something besides (maxProperties, required [], ...: it takes only {}); the bare {"type": "object"},
    annotations (title, description, ...) aside, takes any object, as xgrammar's any-object rule does. An
    array with prefixItems (or draft 7's list of items) that says nothing of further items takes none,
    and so does one with "type": "array" that gives no items but says something besides (maxItems,
    uniqueItems, ...: it takes only []); the bare {"type": "array"} takes any array. A type that is a
    list (["object", "null"]) counts as each of its types, as xgrammar reads each apart: the object and
    array rules hold for the object and array it takes. Left as written: an object whose keys combine
    with another schema's (through allOf, a $ref beside its properties, or its properties beside an
    anyOf or oneOf whose schemas list properties), where each closed would refuse the other's keys, and
    so an array that gives no items whose items combine with another array schema's; an object that
    asks for a key or a number of keys (required, minProperties) it does not list; an array that asks
    for more items than it lists (minItems, or contains). const and enum values are data and left as
    they are."""
    schema = jsonlib.loads(text)
    if not isinstance(schema, dict):
        return text
    nodes = list(_subschemas(schema))
    combined, combined_arrays = _combined_objects(nodes, _resource_roots(schema, nodes), schema)
    changed = False
    for node in nodes:
        if id(node) not in combined and _can_close_object(node):
            node["additionalProperties"] = False
            changed = True
        if id(node) not in combined_arrays and _can_close_unlisted_array(node):
            node["items"] = False
            node.pop("uniqueItems", None)     # [] meets it; llguidance refuses the keyword
            changed = True
        rest = _open_tuple_rest(node)
        if rest is not None:
            node[rest] = False
            changed = True
    return jsonlib.dumps(schema, ensure_ascii=False, separators=(",", ":")) if changed else text


def _lists_keys(node: Any) -> bool:
    """Whether node is a schema that lists an object's keys (properties or patternProperties)."""
    return isinstance(node, dict) and (isinstance(node.get("properties"), dict)
                                       or isinstance(node.get("patternProperties"), dict))


# What xgrammar leaves out when it tells the bare {"type": "object"} (any object) from other object schemas.
_ANNOTATION_KEYS = frozenset({"title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly",
                              "$comment", "$schema"})
# Beside these a schema that lists no keys (or items) stays as written: they combine it with other schemas.
_COMBINING_KEYS = frozenset({"$ref", "const", "enum", "allOf", "anyOf", "oneOf", "not", "if", "then", "else"})
# ... and beside these an object schema: they say which other keys it takes.
_OPENING_KEYS = _COMBINING_KEYS | {"additionalProperties", "unevaluatedProperties", "propertyNames", "dependentSchemas",
                                   "dependentRequired"}
# ... and beside these an array schema: they say what its items are, or ask for one (contains).
_ARRAY_OPENING_KEYS = _COMBINING_KEYS | {"items", "prefixItems", "additionalItems", "unevaluatedItems", "contains"}


def _has_type(node: dict, name: str) -> bool:
    """Whether node's "type" is name, or a list of types that names it (xgrammar reads each of a list
    apart, as the schema with that one type)."""
    kind = node.get("type")
    return kind == name or (isinstance(kind, list) and name in kind)


def _says_more_than_its_type(node: dict) -> bool:
    """Whether node has a key besides "type" and annotations: xgrammar's basic any-object and any-array
    rules are for the schemas that have none."""
    return bool(node.keys() - _ANNOTATION_KEYS - {"type"})


def _is_unlisted_object(node: Any) -> bool:
    """Whether node is an object schema ("type": "object", or a list naming it) that lists no keys, names
    none of _OPENING_KEYS and says more than its type (annotations aside): xgrammar's strict mode closes
    it to {}, while the bare {"type": "object"} is its any-object rule."""
    return (isinstance(node, dict) and _has_type(node, "object") and not _lists_keys(node)
            and not _OPENING_KEYS & node.keys() and _says_more_than_its_type(node))


def _shapes_object(node: Any) -> bool:
    """Whether closing node would limit its object's keys (it lists them, or lists none: _is_unlisted_object)."""
    return _lists_keys(node) or _is_unlisted_object(node)


def _is_unlisted_array(node: Any) -> bool:
    """Whether node is an array schema ("type": "array", or a list naming it) that gives no items, names
    none of _ARRAY_OPENING_KEYS and says more than its type (annotations aside): xgrammar's strict mode
    closes it to [], while the bare {"type": "array"} is its any-array rule."""
    return (isinstance(node, dict) and _has_type(node, "array") and not _ARRAY_OPENING_KEYS & node.keys()
            and _says_more_than_its_type(node))


def _lists_items(node: Any) -> bool:
    """Whether node is a schema that says what its array's items are (items or prefixItems)."""
    return isinstance(node, dict) and ("items" in node or "prefixItems" in node)


def _shapes_array(node: Any) -> bool:
    """Whether node says what its array's items are, or closed would limit them (_is_unlisted_array)."""
    return _lists_items(node) or _is_unlisted_array(node)


def _can_close_unlisted_array(node: dict) -> bool:
    """Whether node is an _is_unlisted_array that [] meets (it asks for no items: minItems at most 0)."""
    least = node.get("minItems", 0)
    return _is_unlisted_array(node) and isinstance(least, int) and not isinstance(least, bool) and least <= 0


def _can_close_object(node: dict) -> bool:
    """Whether node lists its object's keys (or is an _is_unlisted_object), says nothing of others, and
    can be met with only those."""
    if not _shapes_object(node) or "additionalProperties" in node or "unevaluatedProperties" in node:
        return False
    listed = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    patterns = node.get("patternProperties") if isinstance(node.get("patternProperties"), dict) else {}
    if any(name not in listed and not _may_match_a_pattern(name, patterns) for name in _required_names(node)):
        return False
    least = node.get("minProperties")
    return patterns or not isinstance(least, int) or isinstance(least, bool) or least <= len(listed)


def _may_match_a_pattern(name: str, patterns: dict) -> bool:
    """Whether name may match one of patterns' names (a pattern Python cannot read counts as matching)."""
    for pattern in patterns:
        try:
            if re.search(pattern, name):
                return True
        except (re.error, TypeError):
            return True
    return False


def _open_tuple_rest(node: dict) -> str | None:
    """The keyword that closes node's tuple (items after prefixItems, additionalItems after a list of
    items) where node says nothing of further items and a closed tuple can meet its minItems; else None."""
    least = node.get("minItems")
    least = least if isinstance(least, int) and not isinstance(least, bool) else 0
    said = ("unevaluatedItems" in node, "additionalItems" in node)
    if isinstance(node.get("prefixItems"), list) and "items" not in node and not any(said):
        return "items" if least <= len(node["prefixItems"]) else None
    if isinstance(node.get("items"), list) and not any(said):
        return "additionalItems" if least <= len(node["items"]) else None
    return None


# Schemas one walk of _intersected visits at most; a walk past it leaves every object it met open.
_MAX_INTERSECTED = 64


def _combined_objects(nodes: list[dict], resources: dict[int, dict], root: dict) -> tuple[set[int], set[int]]:
    """The ids of the object schemas whose keys combine with another schema's, and of the array schemas
    whose items do (see _with_closed_objects)."""
    combined: set[int] = set()
    combined_arrays: set[int] = set()
    for node in nodes:
        if isinstance(node.get("dependentSchemas"), dict):   # each holds for the object itself, as allOf would
            for member in node["dependentSchemas"].values():
                combined.update(id(n) for n in _intersected(member, resources, root)[0] if _shapes_object(n))
        num_parts = (len(node["allOf"]) if isinstance(node.get("allOf"), list) else 0) + isinstance(node.get("$ref"), str)
        has_alternatives = any(isinstance(node.get(name), list) for name in ("anyOf", "oneOf"))
        lists = _lists_keys(node) or _lists_items(node)
        if not (num_parts >= 2 or (lists and (num_parts or has_alternatives))):
            continue                     # what it combines, if anything, its parts' own walks find
        held, is_whole = _intersected(node, resources, root)
        alternatives = []
        for name in ("anyOf", "oneOf"):
            for member in node.get(name) if isinstance(node.get(name), list) else ():
                found, whole = _intersected(member, resources, root)
                alternatives += found
                is_whole = is_whole and whole
        for shapes, ids in ((_shapes_object, combined), (_shapes_array, combined_arrays)):
            shaped = [n for n in held if shapes(n)]
            shaped_alternatives = [n for n in alternatives if shapes(n)]
            if not is_whole or len(shaped) >= 2 or (shaped and shaped_alternatives):
                ids.update(id(n) for n in shaped + shaped_alternatives)
    return combined, combined_arrays


def _intersected(schema: Any, resources: dict[int, dict], root: dict) -> tuple[list[dict], bool]:
    """(schema and the schemas its instance must match too, through allOf and local $refs, each once;
    whether that is all of them: False past _MAX_INTERSECTED)."""
    found: list[dict] = []
    seen: set[int] = set()
    todo = [schema]
    while todo:
        node = todo.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        if len(found) == _MAX_INTERSECTED:
            return found, False
        seen.add(id(node))
        found.append(node)
        if isinstance(node.get("$ref"), str):
            todo.append(_ref_target(node["$ref"], resources.get(id(node), root)))
        if isinstance(node.get("allOf"), list):
            todo.extend(node["allOf"])
    return found, True


def _subschemas(schema: Any):
    """Each object of a parsed schema that is a schema, the root first; what a caller adds to one
    before taking the next is visited too."""
    todo = [schema]
    while todo:                                   # a loop, not recursion: schemas nest deeply
        node = todo.pop()
        if not isinstance(node, dict):
            continue
        yield node
        todo.extend(_children(node))


def _children(node: dict) -> list[Any]:
    """The values of node's subschema keywords (not all of them dicts)."""
    children = [child for name in _SUBSCHEMA_MAPS if isinstance(node.get(name), dict)
                for child in node[name].values()]
    children.extend(node.get(name) for name in _SUBSCHEMA_KEYS)
    for name in _SUBSCHEMA_LISTS:
        if isinstance(node.get(name), list):
            children.extend(node[name])
    return children


def serialize_grammar(key: StructuredOutputKey, disable_any_whitespace: bool = False) -> str:
    """The llguidance grammar (its JSON text) for a constraint key."""
    kind, text = key
    if kind in _JSON_KINDS:
        text = _with_known_formats(_with_exact_bounds(_with_exact_integers(text)))
        return llguidance.LLMatcher.grammar_from_json_schema(
            text, defaults={"whitespace_flexible": not disable_any_whitespace})
    if kind is StructuredOutputOptions.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind is StructuredOutputOptions.CHOICE:
        # Each choice as a Lark string literal (JSON string syntax is Lark's), all in one terminal:
        # as alternatives of a rule, each is an item of the parser's row, and past 2,000 of them
        # (llguidance's max_items_in_row) the first token is refused mid-output.
        return llguidance.LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: "
                                                      + " | ".join(jsonlib.dumps(c) for c in jsonlib.loads(text)))
    # A grammar in llama.cpp's GBNF (`root ::= ...`, as vLLM's examples write them), turned into
    # Lark one character a lexeme (gbnf.py), or a Lark grammar. In a Lark grammar llguidance's forced
    # bytes ran on forever where a greedy lexeme could only grow (`start: A "ab"`, A: /a+/), inside
    # the step that consumed the token before: the model chooses the bytes there instead.
    if _is_gbnf(text):
        return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(text))
    return llguidance.LLMatcher.grammar_from_lark(text + _NO_FORCING)


# A Lark grammar has a line that opens its start rule, as Lark writes it (`start:`, or `?start:`
# inlined and `!start:` keeping its tokens, as in Lark's own grammars), or llguidance's %llguidance.
# llguidance's is_lark_syntax misses the prefixed forms, which then went to the GBNF conversion.
# Text with neither is GBNF only if it has a `::=` rule; else it is Lark (whose error says what is missing).
_LARK_START = re.compile(r"(?m)^\s*(?:%llguidance\b|[?!]?start\s*:)")


def _is_gbnf(text: str) -> bool:
    """Whether a grammar's text is GBNF (else it is Lark)."""
    return "::=" in text and not _LARK_START.search(text)


# A Lark grammar's start rule that matches no finite text (gbnf.py says the same of GBNF's root).
_NEVER_ENDS = ("start can never end: every text it starts goes on forever (a rule that always refers to "
               "itself again)")


# Appended to a Lark grammar (last, so that the lines of llguidance's errors are the client's).
_NO_FORCING = '\n%llguidance {"no_forcing": true}\n'


def _without_options_line(message: str) -> str:
    """llguidance's error for a Lark grammar, without the line of it that shows _NO_FORCING."""
    return re.sub(r'\n *[0-9]+ \| %llguidance \{"no_forcing": true\}(?:\n *[0-9]+ \|[ \t]*)?(?=\n|$)', "", message)


# ----------------------------------------------------------------------------- tokenizer

def ll_tokenizer_from_json(tokenizer_json: str, vocab_size: int,
                           eos_token_ids: Sequence[int] | None = None) -> llguidance.LLTokenizer:
    """llguidance's tokenizer from a tokenizer.json string, its vocabulary padded to vocab_size.

    vocab_size is the LM head's size; ids past the tokenizer's own vocabulary are never allowed.
    A tokenizer larger than vocab_size is a ValueError. Building one costs ~1 s at 150k tokens.
    """
    eos = [int(i) for i in eos_token_ids] if eos_token_ids else None
    try:
        return llguidance.LLTokenizer(tokenizer_json, n_vocab=int(vocab_size), eos_token=eos)
    except ValueError as e:
        raise ValueError(f"vocab_size {vocab_size} does not fit the tokenizer: {e}") from None


def ll_tokenizer_from(tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's tokenizer from minillm's Tokenizer (its tokenizers object and its EOS ids)."""
    return ll_tokenizer_from_json(tokenizer.backend.to_str(), vocab_size, tokenizer.eos_token_ids)


def warm_ll_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids) -> llguidance.LLTokenizer:
    """ll_tokenizer_from_json, with the token trie the first mask over it builds built now (not in a step)."""
    tok = ll_tokenizer_from_json(tokenizer_json, vocab_size, sorted(eos_token_ids))
    llguidance.LLMatcher(tok, serialize_grammar((StructuredOutputOptions.REGEX, "a")), log_level=_LOG_LEVEL).compute_bitmask()
    return tok


def default_fill_threads() -> int:
    """llguidance's threads for a step's masks: half the cores, at most 8 (vLLM's choice), so that
    a fill leaves cores to the engine thread it runs beside."""
    return max(1, min((os.cpu_count() or 2) // 2, 8))


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row: ceil(vocab_size / 32)."""
    return (int(vocab_size) + 31) // 32


def max_mask_rows(max_num_seqs: int, num_speculative_tokens: int = 0,
                  max_num_batched_tokens: int | None = None) -> int:
    """Mask rows a step may need: one per sampling sequence, and with speculation one per verified
    position (1 + drafts a sequence), which are tokens of the step and so within its token budget."""
    if not num_speculative_tokens:
        return max_num_seqs
    rows = max_num_seqs * (1 + num_speculative_tokens)
    return max(max_num_seqs, rows if max_num_batched_tokens is None else min(rows, max_num_batched_tokens))


def allocate_token_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """A bitmask [num_rows, ceil(vocab_size / 32)] int32 with every token allowed."""
    return np.full((num_rows, bitmask_words(vocab_size)), -1, dtype=np.int32)


# ----------------------------------------------------------------------------- grammars, matchers

@dataclass
class CompiledGrammar:
    """A constraint compiled for one tokenizer; new_matcher() copies its pristine matcher.

    The copies share the template's lexer states, and llguidance's lexer limits count all of them:
    one request that drives the lexer into a limit leaves every copy made after it unable to
    match. on_error (the manager's: drop this grammar from the cache) runs when a copy first
    reports an error, so the next request with the same constraint compiles it afresh.
    """

    key: StructuredOutputKey
    grammar: str                      # the llguidance grammar text
    compile_time_s: float
    _template: llguidance.LLMatcher = field(repr=False)
    _eos_token_ids: frozenset[int] = field(repr=False)
    on_error: Callable[[], None] | None = field(default=None, repr=False)
    empty_only: bool = False          # the empty output is the only sentence: EOS is the one token allowed at the start
    remote_id: tuple[int, int] | None = field(default=None, repr=False)   # (grammar process, its id there), once sent
    token_text: Callable[[int], str] | None = field(default=None, repr=False)  # a token's text (special ones too)

    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the output (a copy: microseconds, no recompilation)."""
        return GrammarMatcher(self._template.deep_copy(), self._eos_token_ids, self.on_error)


class GrammarMatcher:
    """One request's position in its grammar: fills its bitmask row, accepts tokens, rolls back.

    The state questions the engine asks (is_stopped, is_error, error, is_terminated) read flags
    cached when a token is accepted or rolled back, never the llguidance matcher: the engine thread
    asks them while the mask thread fills the matcher's next row (a fill leaves those flags as they
    are). can_terminate asks the matcher itself (not while a fill runs).
    """

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: frozenset[int],
                 on_error: Callable[[], None] | None = None) -> None:
        self._matcher = matcher
        self._eos = eos_token_ids
        self._on_error = on_error          # called once, when the matcher is first found in error
        self._num_tokens = 0              # tokens the llguidance matcher holds (what it can roll back)
        self._terminated = False          # an EOS was accepted
        self._eos_unrecorded = False      # that EOS came after the grammar stopped: the matcher did not record it
        self._read_state()

    def _read_state(self) -> None:
        """Cache the llguidance matcher's flags (after every change of its position); an error
        stops the matcher, so a running one is asked one question."""
        m = self._matcher
        self._is_stopped = m.is_stopped()
        self._is_error = self._is_stopped and m.is_error()
        self._error = _first_line(m.get_error()) if self._is_error else ""
        if self._is_error and self._on_error is not None:
            on_error, self._on_error = self._on_error, None
            on_error()

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (only EOS once stopped or in error)."""
        llg_numpy.fill_next_token_bitmask(self._matcher, bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and the matcher in error) if the grammar forbids it."""
        if self._terminated:
            return False
        token_id = int(token_id)
        if token_id in self._eos:
            # A fill that ran into one of llguidance's limits leaves the matcher in error, allowing
            # only EOS: that EOS is refused, so the sequence ends with the grammar's error, not a stop.
            self._read_state()
            if self._is_error:
                return False
            if self._is_stopped:       # llguidance takes an EOS after a stop without recording it
                self._terminated = self._eos_unrecorded = True
                return True
        ok = self._matcher.consume_token(token_id)
        if ok:
            self._num_tokens += 1
            self._terminated = token_id in self._eos
        self._read_state()
        return ok

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """accept_token for each id in order; stops at the first one refused."""
        return all(self.accept_until_refused(token_ids))

    def accept_until_refused(self, token_ids: Sequence[int]) -> list[bool]:
        """accept_token for each id in order, up to the first one refused; their answers."""
        answers = []
        for token in token_ids:
            answers.append(self.accept_token(token))
            if not answers[-1]:
                break
        return answers

    def validate_tokens(self, token_ids: Sequence[int]) -> list[int]:
        """The longest prefix of token_ids the grammar accepts from here, without advancing."""
        if self._terminated or not token_ids:
            return []
        ids = [int(t) for t in token_ids]
        return ids[:self._matcher.validate_tokens(ids)]

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (rejected draft tokens, later)."""
        if num_tokens <= 0:
            return
        recorded = num_tokens - int(self._eos_unrecorded)
        if recorded > self._num_tokens:
            raise ValueError(f"num_tokens {num_tokens} exceeds the {self.num_accepted} tokens accepted")
        if recorded:
            self._matcher.rollback(recorded)
        self._num_tokens -= recorded
        self._terminated = self._eos_unrecorded = False
        self._read_state()

    @property
    def num_accepted(self) -> int:
        """Tokens accepted so far (an EOS included)."""
        return self._num_tokens + int(self._eos_unrecorded)

    @property
    def num_fed(self) -> int:
        """Tokens given to it that it holds (a refused one is not held): num_accepted."""
        return self.num_accepted

    def is_terminated(self) -> bool:
        """An EOS has been accepted: the output is complete."""
        return self._terminated

    def is_stopped(self) -> bool:
        """Nothing but EOS can follow (the grammar is complete, or the matcher is in error)."""
        return self._terminated or self._is_stopped

    def can_terminate(self) -> bool:
        """EOS is allowed here: what was accepted so far is a complete sentence of the grammar."""
        return self._terminated or (self._matcher.is_accepting() and not self._is_error)

    def is_error(self) -> bool:
        """A forbidden token was consumed; the matcher then allows only EOS."""
        return self._is_error

    def is_complete(self) -> bool:
        """Nothing but EOS may follow (or EOS was taken), and not for an error: a whole sentence."""
        return (self._terminated or self._is_stopped) and not self._is_error

    @property
    def error(self) -> str:
        """llguidance's message for the error state ('' when none)."""
        return self._error


# ----------------------------------------------------------------------------- one sequence, one step

# llguidance's error for a sampled token outside the grammar. The grammar's mask is applied before
# sampling, so such a token means the request's other rules had masked every token it allows (a
# row of nothing but -inf samples id 0).
_TOKEN_REFUSED = "doesn't satisfy the grammar"
# llguidance's error when a special token was offered for forced text that holds its text (the
# tokenizer reads "<s>" in forced bytes as the special token; the grammar takes only its bytes).
# 'ÿ' is the byte that marks a special token there.
_SPECIAL_FORCED = "applying '\u00ff'"
# The text forced where it failed: a token sampled from a row with nothing left fails there too.
_FORCED_BYTES = re.compile(r"forced bytes: got '(.*?)'; applying")


# What StructuredOutputRequest records for a reasoning token taken ahead of the scheduler (no matcher's answer).
_REASONING = object()
# (is_complete, is_terminated) of a grammar that goes on.
_GOING = (False, False)


class StructuredOutputRequest:
    """One sequence's constraint: its grammar (a Future while the pool compiles it), then its matcher.

    A step's token reaches the matcher ahead of the scheduler (advance(), as soon as it is read
    back, so the next mask can be filled while the scheduler works); the scheduler's accept_token
    then takes the result recorded for that token.

    reasoning_end_id: the token that ends a thinking block (None: the grammar holds the output from its
    first token). Until it comes the sequence is no constrained row (no mask, no matcher work); the
    tokens up to it, itself included, never reach the matcher (vLLM's should_advance).

    prefix: the output's start the prompt already holds (output_prefix), taken by the matcher as it is made.
    """

    def __init__(self, grammar: Future, process: GrammarProcess | None = None, reasoning_end_id: int | None = None,
                 reasoning_epoch: list[int] | None = None, prefix: Sequence[int] = ()) -> None:
        self.grammar = grammar
        self.prefix = tuple(prefix)
        self._prefix_error: str | None = None      # why the matcher refused the prefix
        self.reasoning_end_id = reasoning_end_id
        self.reasoning_ended = reasoning_end_id is None   # by the tokens the scheduler has appended
        self.is_masked = self.reasoning_ended             # by every token taken (ahead of the scheduler too)
        self._num_reasoning = 0                           # output tokens taken as reasoning (the end one too)
        self._reasoning_epoch = reasoning_epoch           # [n]: bumped when a sequence's reasoning ends
        self.matcher: GrammarMatcher | RemoteMatcher | None = None
        self._process = process           # the grammar process that holds the matcher, if one does
        self._remote_error: str | None = None
        self._moved = False               # move_to was called once
        # Tokens taken ahead of accept_token: (token, accepted) here, (token, accepted, (is_complete,
        # is_terminated) after it) for a step's several tokens, (token, answer, row, k) for a grammar
        # process (the k-th token of its row in an advance whose answer may not be read yet).
        self._advanced: deque[tuple] = deque()
        # (is_complete, is_terminated) after the token accept_token last returned, while the matcher
        # holds tokens after it or where a clean answer of the grammar process told it (None: the
        # matcher's own flags hold)
        self._state_ahead: tuple[bool, bool] | None = None

    @property
    def is_ready(self) -> bool:
        """The grammar compiled (in the grammar process too, where one holds the matchers) and the
        sequence has its matcher, which took the prefix: it may be scheduled."""
        if self.matcher is None and self._prefix_error is None and self.grammar.done() \
                and not _has_failed(self.grammar):
            compiled = self.grammar.result()
            if self._process is None:
                self.matcher = compiled.new_matcher()
            elif self._remote_error is None:
                from minillm.grammar_process import GrammarProcessError
                try:
                    answer = self._process.compile(compiled)
                    if self._process.is_compiled(answer) and not self._process.failed:
                        self._remote_error = answer.result()
                        if self._remote_error is None:
                            self.matcher = self._process.new_matcher(compiled, compiled.on_error)
                except GrammarProcessError:     # the manager moves it to a new process (move_to)
                    pass
            if self.matcher is not None and self.prefix:
                self._take_prefix()
        return self.matcher is not None

    def _take_prefix(self) -> None:
        """Feed the new matcher the prefix; where it refuses a token, no matcher and the error to end with."""
        matcher, prefix = self.matcher, list(self.prefix)
        if self._process is None:
            num_taken = sum(matcher.accept_until_refused(prefix))
        else:
            answer = self._process.advance([matcher], [prefix])
            matcher.settle()
            num_taken = tokens_taken(answer, 0)
        if num_taken < len(prefix):
            self.matcher = None
            self._prefix_error = (f"structured_outputs.num_output_prefix_tokens: the grammar refuses token "
                                  f"{prefix[num_taken]} of the output's start, at {num_taken}")

    @property
    def is_at_prefix(self) -> bool:
        """The matcher holds the prefix alone: the sequence's first token is still to come."""
        return bool(self.prefix) and not self._advanced and self.matcher is not None \
            and self.matcher.num_fed == len(self.prefix)

    def move_to(self, process: GrammarProcess) -> None:
        """Wait for the grammar in a new process, the one it waited in having failed; once only (a
        grammar that takes a process down ends with the error then, not in a loop of new ones)."""
        if self.matcher is not None or self._remote_error is not None:
            return
        if self._moved:
            self._remote_error = f"the grammar process failed: {self._process.error}"
        else:
            self._process, self._moved = process, True

    @property
    def empty_only(self) -> bool:
        """The grammar allows nothing but EOS from its start (its one sentence is empty): EOS may not be banned."""
        return self.reasoning_ended and self.matcher is not None and self.grammar.result().empty_only

    @property
    def compile_error(self) -> str | None:
        """Why the grammar did not compile (or its matcher refused the prefix); None while it compiles or
        once it has."""
        if self._prefix_error is not None:
            return self._prefix_error
        if self._remote_error is not None:
            return f"structured_outputs: the grammar process did not take the grammar: {self._remote_error}"
        if not _has_failed(self.grammar):
            return None
        if self.grammar.cancelled():
            return "structured_outputs: the grammar's compile was cancelled"
        error = self.grammar.exception()
        if isinstance(error, StructuredOutputsError):
            return f"structured_outputs.{error}"
        return f"structured_outputs: {type(error).__name__}: {error}"

    def advance(self, token_ids: Sequence[int]) -> None:
        """Feed the matcher a step's tokens now, keeping each result for accept_token (stops at
        the first refused one: the scheduler ends the sequence there)."""
        token_ids = self.take_reasoning(token_ids)
        if len(token_ids) == 1:
            self._advanced.append((int(token_ids[0]), self.matcher.accept_token(token_ids[0])))
        elif token_ids:
            # Accepted drafts and the token after them: the grammar's state after each is kept too
            # (is_complete, is_terminated), as the scheduler's stop rules read it token by token.
            matcher = self.matcher
            for token in token_ids:
                accepted = matcher.accept_token(token)
                self._advanced.append((int(token), accepted, (matcher.is_complete(), matcher.is_terminated())))
                if not accepted:
                    break

    def take_reasoning(self, token_ids: Sequence[int]) -> Sequence[int]:
        """The tokens of a step the matcher takes: those after the reasoning's end (the reasoning
        ones are kept for accept_token, which lets them through)."""
        if self.is_masked:
            return token_ids
        for k, token in enumerate(token_ids):
            self._advanced.append((int(token), _REASONING))
            if self._take_reasoning_token(token):
                return token_ids[k + 1:]
        return ()

    def _take_reasoning_token(self, token_id: int) -> bool:
        """Count a reasoning token; True when it ends the reasoning (the next one is masked)."""
        self._num_reasoning += 1
        if token_id != self.reasoning_end_id:
            return False
        self.is_masked = True
        if self._reasoning_epoch is not None:
            self._reasoning_epoch[0] += 1
        return True

    @property
    def num_fed_expected(self) -> int:
        """Tokens the matcher holds once it has taken num_outputs + num_advanced output tokens, less the
        reasoning, and the prefix."""
        return len(self._advanced) - self._num_reasoning + len(self.prefix)

    @staticmethod
    def sent_rows(requests: Sequence[StructuredOutputRequest], tokens: Sequence[Sequence[int]], answer) -> None:
        """An advance's tokens went to the grammar process: requests[i] sent tokens[i] as its row i
        (answered by answer). One call a step, not one a row."""
        for row, request in enumerate(requests):
            ids = tokens[row]
            if len(ids) == 1:
                request._advanced.append((ids[0], answer, row, 0))
            else:
                request._advanced.extend((token, answer, row, k) for k, token in enumerate(ids))

    @staticmethod
    def settle_clean(requests: Sequence[StructuredOutputRequest], token_ids: Sequence[int], wait: bool = False) -> set:
        """accept_token(token_ids[i]) for each of requests whose token a grammar process's clean answer
        took (the grammar goes on), in one call a step; returns those requests. The others are left
        as they were: their tokens go through accept_token. wait: an answer not yet read is read first
        (as accept_token would wait for it; the rows of a step share their advance's answer)."""
        settled = set()
        for request, token in zip(requests, token_ids):
            advanced = request._advanced
            if not advanced or len(taken := advanced[0]) != 4 or taken[0] != token:
                continue
            answer = taken[1]
            if wait and not answer.is_read:
                tokens_taken(answer, taken[2])          # waits (a failed process's answer is not clean)
            if answer.clean:
                advanced.popleft()
                request._state_ahead = _GOING
                settled.add(request)
        return settled

    @property
    def is_settled(self) -> bool:
        """accept_token will not wait: every token taken ahead has its answer (a grammar process's may be pending)."""
        advanced = self._advanced
        return not advanced or len(first := advanced[0]) < 4 or first[1].is_read

    @property
    def num_advanced(self) -> int:
        """Tokens the matcher took ahead of the scheduler (not yet asked for by accept_token)."""
        return len(self._advanced)

    def accept_token(self, token_id: int) -> bool:
        """Advance the matcher by a sampled token; False when the grammar forbids it. A token
        advance() already fed returns its recorded result."""
        if self._advanced:
            taken = self._advanced.popleft()
            if taken[0] != token_id:
                raise RuntimeError(f"the matcher took token {taken[0]} ahead, the scheduler appends {token_id}")
            if len(taken) == 4:
                if not taken[1].is_read:
                    tokens_taken(taken[1], taken[2])    # wait for the answer (a failed process's has none)
                if taken[1].clean:                      # the grammar process took it, and the grammar goes on
                    self._state_ahead = _GOING
                    return True
            self._state_ahead = None
            if taken[1] is _REASONING:
                self.reasoning_ended = self.reasoning_ended or token_id == self.reasoning_end_id
                return True
            if len(taken) < 4:
                if len(taken) == 3 and self._advanced:
                    self._state_ahead = taken[2]
                return taken[1]
            answer, row, k = taken[1:]              # the grammar process's answer: (taken, ...) by row
            accepted = k < (tokens_taken(answer, row) if answer.value is None else answer.value[0][row])
            if accepted and self._advanced and answer.value is not None and row in answer.value[4]:
                flags = answer.value[4][row][k]
                self._state_ahead = (bool(flags & (TERMINATED | STOPPED)) and not flags & ERROR,
                                     bool(flags & TERMINATED))
            return accepted
        self._state_ahead = None
        if not self.is_masked:
            self.reasoning_ended = self._take_reasoning_token(token_id)
            return True
        return self.matcher.accept_token(token_id)

    def reasoning_drafts(self, token_ids: Sequence[int]) -> list[int] | None:
        """Drafts of a sequence still reasoning, cut before its reasoning's end (each verified row is
        then free, as the plain path's rows before that token); None when the grammar holds its
        output (validate_drafts asks the matcher). Only asked with all the sequence's tokens taken."""
        if self.is_masked:
            return None
        ids = [int(t) for t in token_ids]
        return ids[:ids.index(self.reasoning_end_id)] if self.reasoning_end_id in ids else ids

    @property
    def is_complete(self) -> bool:
        """Nothing but EOS may follow (or EOS was taken): the output is a whole sentence (never while it
        reasons). Asked after the scheduler's last accept_token, while the matcher may hold later tokens."""
        if self._state_ahead is not None:
            return self.reasoning_ended and self._state_ahead[0]
        return self.reasoning_ended and self.matcher.is_complete()

    @property
    def is_terminated(self) -> bool:
        """The last token accepted was an EOS (a sequence still reasoning stops on nothing else)."""
        if self._state_ahead is not None:
            return not self.reasoning_ended or self._state_ahead[1]
        return not self.reasoning_ended or self.matcher.is_terminated()

    def rejection(self, token_id: int) -> str:
        """The error message of a token the matcher refused (or could not take: its grammar process failed)."""
        error = self.matcher.error or "refused"
        if self._process is not None and self._process.failed:
            return f"structured_outputs: {error}; the output stops before its constraint is complete"
        message = f"structured_outputs: token {token_id} is not allowed by the grammar ({error})"
        if _SPECIAL_FORCED in error and self._is_forced_text(token_id, error):
            message += ("; the constraint's text holds the text of this special token of the tokenizer, which the "
                        "grammar's mask offers in its place and the grammar then refuses: such text cannot be matched")
        elif error == "refused" or _TOKEN_REFUSED in error:
            message += ("; with the grammar's mask applied, that happens when no token the grammar allows "
                        "is left to sample: the request's allowed_token_ids, bad_words or min_tokens excluded them all")
        return message

    def _is_forced_text(self, token_id: int, error: str) -> bool:
        """Whether the refused token's text and the text the grammar forced there begin alike: the mask
        offered that special token for it. A row left with no token samples id 0 whatever is forced."""
        forced = _FORCED_BYTES.search(error)
        token_text = self.grammar.result().token_text
        if forced is None or token_text is None:
            return True
        text = token_text(token_id)
        return text.startswith(forced.group(1)) or forced.group(1).startswith(text)


def validate_drafts(requests: Sequence[StructuredOutputRequest], drafts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each constrained sequence's drafts cut before the first token its grammar refuses from where its
    tokens put it (vLLM's validate_tokens; nothing is consumed), or before its reasoning's end while it
    reasons. Matchers in a grammar process are asked in one round trip per process; a process that
    fails to answer leaves its sequences no drafts."""
    valid: list[list[int] | None] = [request.reasoning_drafts(ids) for request, ids in zip(requests, drafts)]
    remote: dict[Any, list[int]] = {}
    for i, request in enumerate(requests):
        if valid[i] is not None:
            continue
        if request._process is None:
            valid[i] = request.matcher.validate_tokens(drafts[i])
        else:
            remote.setdefault(request._process, []).append(i)
    for process, indices in remote.items():
        from minillm.grammar_process import GrammarProcessError
        try:
            counts = process.validate([requests[i].matcher for i in indices], [drafts[i] for i in indices]).result()
        except GrammarProcessError:
            counts = [0] * len(indices)
        for i, n in zip(indices, counts):
            valid[i] = [int(t) for t in drafts[i][:n]]
    return valid


@dataclass
class GrammarBitmask:
    """One step's masks for its constrained sampling rows, filled on the host."""

    bitmask: np.ndarray      # [N, ceil(vocab / 32)] int32: row i is the mask of sampling row rows[i]
    rows: np.ndarray         # [N] int32: indices into the step's sampling sequences (both pinned on a GPU)
    # [N] int32: the verified position j of each mask row (the mask after the sequence's drafts[:j]);
    # None when no sequence of the step has drafts (every row is position 0)
    positions: np.ndarray | None = None

    def at_rows(self, rows) -> "GrammarBitmask":
        """The same masks for other logits rows (e.g. a verification step's rows)."""
        return GrammarBitmask(self.bitmask, np.asarray(rows, np.int32))

    def at_verify_rows(self, row_starts: np.ndarray) -> "GrammarBitmask":
        """The masks on a verification step's logits rows: row_starts[b] + j for mask row (b, j)
        (row_starts: [B] each sampling sequence's first logits row, SpecDecodeMetadata.row_starts)."""
        rows = np.asarray(row_starts)[self.rows]
        return self.at_rows(rows if self.positions is None else rows + self.positions)


class PendingBitmask:
    """A step's masks while the mask thread fills them; result() waits for them (on the engine thread)."""

    def __init__(self, manager: StructuredOutputManager, future: Future, mask: GrammarBitmask) -> None:
        self._manager, self._future = manager, future
        self._mask = mask
        self.fill_time_s: float | None = None     # set by result()

    def result(self) -> GrammarBitmask:
        """The filled masks (a fill's error is raised here); counts the fill in the stats once."""
        if self.fill_time_s is None:
            self.fill_time_s = self._future.result()
            self._manager._record_fill(self.fill_time_s)
        return self._mask

    def abandon(self) -> None:
        """Wait for the fill and drop it (a step that failed to launch): the matchers are free again."""
        try:
            self._future.result()
        except Exception:  # noqa: BLE001 - a dropped fill's error is nobody's
            pass

    @classmethod
    def failed(cls, error: BaseException) -> PendingBitmask:
        """A fill that could not start: result() raises error."""
        future: Future = Future()
        future.set_exception(error)
        return cls(None, future, GrammarBitmask(np.zeros((0, 0), np.int32), np.zeros(0, np.int32)))


def eos_words(eos_token_ids, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """([E] bitmask words holding EOS ids, [E] each word with those ids' bits cleared): forbid_eos's table."""
    eos = sorted(i for i in eos_token_ids if 0 <= i < vocab_size)
    words = sorted({i // 32 for i in eos})
    keep = np.full(len(words), -1, np.int32)
    for i in eos:
        keep[words.index(i // 32)] &= np.int32(~(1 << (i % 32)) if i % 32 != 31 else 0x7FFFFFFF)
    return np.asarray(words, np.intp), keep


def forbid_eos(bitmask: np.ndarray, rows: list[int], eos_table: tuple[np.ndarray, np.ndarray]) -> None:
    """ignore_eos under a grammar: EOS is not sampled while the grammar allows anything else
    (the sequence goes on to its max_tokens, or until the grammar is complete, where it stops
    without sampling EOS). A row that allows only EOS (a matcher in error) keeps it."""
    cols, keep = eos_table                               # [E] words holding EOS ids, [E] their masks
    rows = np.asarray(rows, np.intp)
    before = bitmask[np.ix_(rows, cols)]                  # [R, E]
    allowed = (before & ~keep).any(axis=1)                # [R] rows where the grammar may end here
    if not allowed.any():
        return
    rows, before = rows[allowed], before[allowed]
    bitmask[np.ix_(rows, cols)] = before & keep
    # [R'] nothing left: EOS was all there was. Most rows allow one of the first 2,048 tokens
    # (bytes, ASCII): only the others are scanned whole.
    only_eos = ~bitmask[rows, :64].any(axis=1)
    if only_eos.any():
        only_eos[only_eos] = ~bitmask[rows[only_eos]].any(axis=1)
    if only_eos.any():
        bitmask[np.ix_(rows[only_eos], cols)] = before[only_eos]


def fill_rows(executor: Callable[[], llguidance.LLExecutor], pairs: list[tuple[llguidance.LLMatcher, int]],
              out: np.ndarray) -> None:
    """llguidance fills out[row] for each (matcher, row), in parallel on executor()'s threads; the GIL
    is released while it does."""
    if len(pairs) == 1:
        llg_numpy.fill_next_token_bitmask(pairs[0][0], out, pairs[0][1])
    elif pairs:
        llg_numpy.fill_next_token_bitmask_par(executor(), pairs, out)


def fill_draft_rows(executor: Callable[[], llguidance.LLExecutor],
                    entries: list[tuple[llguidance.LLMatcher, int, list[int]]], out: np.ndarray) -> None:
    """For each (matcher, row, drafts): out[row + j] is the mask after drafts[:j], j = 0..len(drafts),
    filled in parallel by llguidance (which advances through the drafts and rolls back). A copy of a
    matcher with drafts walks them, so the matcher itself stays where its sequence's tokens put it,
    whatever the walk meets. Rows past a draft the grammar refuses, or past one that ends it, are never
    read (that draft is rejected, or ends the sequence): they allow every token."""
    walks, rows = [], []
    for matcher, row, drafts in entries:
        if drafts:
            out[row + 1:row + 1 + len(drafts)] = -1
            walks.append((matcher.deep_copy(), row, list(drafts)))
        else:                             # llguidance's walk takes only matchers with drafts
            rows.append((matcher, row))
    if walks:
        llg_numpy.fill_next_token_bitmask_par_with_draft_tokens(executor(), walks, out)
    fill_rows(executor, rows, out)


def mask_layout(drafts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Per filled sequence its drafts -> (first mask row of each [F], verified position of each mask
    row [N]): sequence i takes rows first[i] .. first[i] + len(drafts[i])."""
    counts = np.fromiter((1 + len(d) for d in drafts), np.int64, len(drafts))        # [F]
    first = np.cumsum(counts) - counts
    positions = np.arange(int(counts.sum())) - np.repeat(first, counts)               # [N]
    return first, positions.astype(np.int32)


def _drafts_of(seq_ids: list[int], spec_tokens: dict[int, list[int]] | None) -> list[list[int]] | None:
    """The drafts each filled sequence verifies this step; None when none of them has any."""
    if not spec_tokens:
        return None
    drafts = [spec_tokens.get(seq_id, []) for seq_id in seq_ids]
    return drafts if any(drafts) else None


def _rows_of(indices: list[int], first: np.ndarray, drafts: list[list[int]]) -> list[int]:
    """The mask rows of the filled sequences at indices (each 1 + its drafts, from first[i])."""
    return [int(first[i]) + j for i in indices for j in range(1 + len(drafts[i]))]


# ----------------------------------------------------------------------------- manager

# A compile that runs longer fails its requests and stops holding a compile worker. llguidance's
# lexer setup can take time that grows with the square of a regex's length (8,000 ".?" 4 s, a
# regex of 16,000 [abc]{0,3} items 23 s, on one core), and the entry check does not build it.
COMPILE_TIMEOUT_S = 10.0


# Constraints short enough to compile here without the grammar check process: the costliest text of
# this length found (1,000 characters of ".?" or "\w?" runs, a JSON pattern of them, a Lark grammar of
# 100 characters doubling a terminal seven times) compiles or fails in about 0.05 s and 60 MiB with
# stories260K's tokenizer. A Lark grammar's terminals can double one another, so its text counts more.
_CHECK_FREE_CHARS = {"json": 1000, "regex": 1000, "choice": 1000, "grammar": 100}


def _needs_check(key: StructuredOutputKey) -> bool:
    """Whether key's first compile goes through the grammar check process (minillm/grammar_check.py)."""
    free = _CHECK_FREE_CHARS.get(key[0].value)
    return free is not None and len(key[1]) > free


class _CompileFuture(Future):
    """A compile's Future, with the constraint it compiles."""

    def __init__(self, key: StructuredOutputKey) -> None:
        super().__init__()
        self.key = key


class _CompileRunner:
    """Compiles on threads of their own (with a large stack), at most num_workers of them counted
    at a time, the rest queued in order (cancellable until they start). One that runs past
    timeout_s is overdue and no longer counted: the queue moves on beside it (llguidance's work
    cannot be stopped; its thread runs on to its end, and its result is cached as any)."""

    def __init__(self, num_workers: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._num_workers = num_workers
        self._lock = threading.Lock()
        self._queue: deque[tuple[_CompileFuture, Callable, tuple]] = deque()
        self._running: dict[Future, float] = {}     # counted compiles -> when each started (monotonic)
        self._overdue: set[Future] = set()          # compiles past timeout_s, still running
        self._is_shut_down = False

    def submit(self, key: StructuredOutputKey, fn: Callable, *args) -> _CompileFuture:
        """A Future of fn(*args), run when a worker is free."""
        fut = _CompileFuture(key)
        with self._lock:
            if self._is_shut_down:
                raise RuntimeError("the compile pool is shut down")
            self._queue.append((fut, fn, args))
            self._start_queued()
        return fut

    def _start_queued(self) -> None:
        """Start queued compiles while fewer than num_workers are counted (under _lock)."""
        while self._queue and len(self._running) < self._num_workers and not self._is_shut_down:
            fut, fn, args = self._queue.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            self._running[fut] = time.monotonic()
            with _large_stack():
                threading.Thread(target=self._run, args=(fut, fn, args), name="minillm-grammar", daemon=True).start()

    def _run(self, fut: Future, fn: Callable, args: tuple) -> None:
        try:
            result = fn(*args)
        except BaseException as exc:         # the Future carries it to the requests
            fut.set_exception(exc)
        else:
            fut.set_result(result)
        with self._lock:
            self._overdue.discard(fut)
            if self._running.pop(fut, None) is not None:
                self._start_queued()

    def overdue(self) -> set[Future]:
        """The compiles running past timeout_s (those found now stop being counted)."""
        now = time.monotonic()
        with self._lock:
            for fut, started in list(self._running.items()):
                if now - started > self.timeout_s:
                    del self._running[fut]
                    self._overdue.add(fut)
            self._start_queued()
            return set(self._overdue)

    def shutdown(self) -> None:
        """Cancel the queued compiles; running ones end on their own threads."""
        with self._lock:
            self._is_shut_down = True
            queued, self._queue = self._queue, deque()
        for fut, _, _ in queued:
            fut.cancel()


def _has_failed(fut: Future) -> bool:
    """A finished compile that raised or was cancelled (a pending one has not failed yet)."""
    return fut.done() and (fut.cancelled() or fut.exception() is not None)


class StructuredOutputManager:
    """Owns the compile pool, the grammar cache, llguidance's tokenizer and the batch mask fill.

    The tokenizer is built lazily on the compile pool (about a second for 150k tokens), so the
    step loop never waits for it. fill_bitmask writes only the rows it is given.

    grammar_process: the requests' matchers live in a process of their own (grammar_process.py):
    the engine thread then only sends each step's tokens and takes the answers, and no mask thread
    shares its GIL; grammars are still compiled here first (errors, the cache), then there.
    register_host(array) page-locks the shared mask buffers on a GPU and returns how to undo it.
    num_speculative_tokens (with max_num_batched_tokens): the engine's drafts a sequence, whose
    verified positions each take a mask row (max_mask_rows sizes the buffers).
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 max_num_seqs: int, num_compile_workers: int = 2, num_fill_threads: int | None = None,
                 max_cached_grammars: int = 256, disable_any_whitespace: bool = True,
                 empty_host=np.empty, grammar_process: bool = False, register_host=None,
                 compile_timeout_s: float | None = None, num_speculative_tokens: int = 0,
                 max_num_batched_tokens: int | None = None) -> None:
        self.vocab_size = int(vocab_size)
        self.disable_any_whitespace = disable_any_whitespace   # for requests that leave it None
        self._tokenizer_json = tokenizer_json
        self._eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        self._pool = _CompileRunner(num_compile_workers,
                                    COMPILE_TIMEOUT_S if compile_timeout_s is None else compile_timeout_s)
        from minillm.grammar_check import GrammarChecker
        self._checker = GrammarChecker(tokenizer_json, vocab_size, eos_token_ids, self._pool.timeout_s)
        self._fill_threads = num_fill_threads if num_fill_threads is not None else default_fill_threads()
        self._executor: llguidance.LLExecutor | None = None
        self._mask_thread: ThreadPoolExecutor | None = None   # fills the step's masks beside the engine thread
        self._lock = threading.Lock()              # the cache
        self._tokenizer_lock = threading.Lock()    # the lazy tokenizer build (held for ~1 s)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[StructuredOutputKey, Future] = OrderedDict()
        self._max_cached = max_cached_grammars
        # Two host buffers [R, W] the steps' masks are filled into in turn (pinned memory from
        # empty_host, so the sampler's upload is a plain async copy): a step's fill never writes the
        # buffer the step before may still be uploading from. R: max_mask_rows.
        num_rows = max_mask_rows(max_num_seqs, num_speculative_tokens, max_num_batched_tokens)
        self._process: GrammarProcess | None = None
        if grammar_process:
            from minillm.grammar_process import GrammarProcess
            self._process = GrammarProcess(tokenizer_json, self.vocab_size, self._eos_token_ids, num_rows,
                                           self._fill_threads, register_host)
            self._bitmasks = self._process.bitmasks
        else:
            self._bitmasks = [empty_host((num_rows, bitmask_words(self.vocab_size)), np.int32) for _ in range(2)]
            for buffer in self._bitmasks:
                buffer[...] = -1
        self._mask_rows = [empty_host((num_rows,), np.int32) for _ in range(2)]   # each buffer's rows
        self._eos_words = eos_words(self._eos_token_ids, self.vocab_size)
        self._next_bitmask = 0
        self.bitmask = self._bitmasks[0]
        self.last_fill_time_s = 0.0
        self._compiling: list = []                 # sequences whose grammar is not done yet (engine thread)
        self._sent: list = []                      # the grammar process's answers to advance()'s last tokens
        self._fill_plan: tuple | None = None       # ((process, rows, epoch), filled, handles, no_eos) of the last remote fill
        self._reasoning_epoch = [0]                # how many sequences' reasoning has ended (a new constrained row)
        self._num_compiled = 0                     # written on the pool under _lock
        self._compile_time_s = 0.0
        self._num_fill_steps = 0
        self._fill_time_s = 0.0
        self._fill_samples: deque[float] = deque(maxlen=1024)   # recent steps' fill seconds

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int, max_num_seqs: int,
                       eos_token_ids: Sequence[int] | None = None, **kwargs) -> StructuredOutputManager:
        """A manager over minillm's Tokenizer; vocab_size is the LM head's (at least the tokenizer's);
        eos_token_ids default to the tokenizer's (the engine passes the model's too)."""
        if len(tokenizer) > vocab_size:       # added tokens included
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)}")
        eos = tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids
        return cls(tokenizer.backend.to_str(), vocab_size, eos, max_num_seqs, **kwargs)

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer, built (and warmed) on first use; blocks until then."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = warm_ll_tokenizer(self._tokenizer_json, self.vocab_size, self._eos_token_ids)
            return self._ll_tokenizer

    def grammar_init(self, params: StructuredOutputsParams) -> Future:
        """Future[CompiledGrammar] for params; compiled off the caller's thread, cached by its text."""
        no_whitespace = params.disable_any_whitespace
        if no_whitespace is None:
            no_whitespace = self.disable_any_whitespace
        if params.key[0] not in _JSON_KINDS:
            no_whitespace = False                  # only JSON has optional whitespace
        key = (params.key, no_whitespace)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not _has_failed(fut):
                self._cache.move_to_end(key)
                return fut
            if _needs_check(params.key):
                self._checker.prestart()
            fut = self._pool.submit(params.key, self._compile, params.key, no_whitespace)
            self._cache[key] = fut
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        fut.add_done_callback(lambda f: self._forget_failed(key, f))
        return fut

    def _forget_failed(self, key, fut: Future) -> None:
        """Drop a failed or cancelled compile from the cache, so its error is not served forever."""
        if not _has_failed(fut):
            return
        with self._lock:
            if self._cache.get(key) is fut:
                del self._cache[key]

    def _compile(self, key: StructuredOutputKey, disable_any_whitespace: bool) -> CompiledGrammar:
        tok = self.ll_tokenizer
        start = time.perf_counter()
        try:
            grammar = serialize_grammar(key, disable_any_whitespace)
        except StructuredOutputsError:
            raise
        except ValueError as e:           # a constraint the engine core took unchecked (from_checked)
            raise _invalid(key[0].value, str(e)) from None
        from minillm.grammar_check import GrammarTooCostly
        try:                              # first where it can be stopped (see minillm/grammar_check.py)
            if _needs_check(key):
                self._checker.check(grammar)
        except GrammarTooCostly as e:
            raise StructuredOutputsError(key[0].value, f"the {_WHAT[key[0].value]} {e}") from None
        template = llguidance.LLMatcher(tok, grammar, log_level=_LOG_LEVEL)
        if template.is_error():
            raise _invalid(key[0].value, _with_client_patterns(key, _without_options_line(template.get_error())))
        # Build the first lexer states on this thread. Copies share them and one of llguidance's
        # limits counts them all (a{1000000} passes the first mask and fails the next): two masks.
        for _ in range(2):
            probe = template.deep_copy()
            first_mask = np.frombuffer(probe.compute_bitmask(), np.uint8)
            if probe.is_error():
                error = _first_line(probe.get_error())
                if error == _NO_TOKEN_ALLOWED:
                    raise _matches_nothing_error(key[0].value)
                raise StructuredOutputsError(key[0].value, f"{_WHAT[key[0].value]} too large to match: {error}")
        self._probe_walk(template.deep_copy(), key)
        seconds = time.perf_counter() - start
        with self._lock:
            self._num_compiled += 1
            self._compile_time_s += seconds
        allowed = np.flatnonzero(np.unpackbits(first_mask, bitorder="little"))
        empty_only = 0 < len(allowed) <= len(self._eos_token_ids) and set(allowed.tolist()) <= self._eos_token_ids
        compiled = CompiledGrammar(key, grammar, seconds, template, self._eos_token_ids, empty_only=empty_only,
                                   token_text=lambda token: tok.decode_str([token]))
        # A weak reference: a closure over compiled itself would make a cycle, and an evicted grammar
        # (its native tables, about half a MiB for a schema of a few hundred enum values) would wait
        # for the cycle collector, which a busy server runs too seldom to bound its memory.
        ref = weakref.ref(compiled)
        compiled.on_error = lambda: self._forget_compiled((key, disable_any_whitespace), ref())
        return compiled

    def _probe_walk(self, probe: llguidance.LLMatcher, key: StructuredOutputKey) -> None:
        """Walk the first _PROBE_TOKENS tokens of an output (the lowest allowed id each time): a
        grammar whose parser outgrows one of llguidance's limits there (a row of more than 2,000
        items: a rule of thousands of alternatives, an object of hundreds of optional properties)
        would refuse every request's first tokens; it is a StructuredOutputsError now instead."""
        for _ in range(_PROBE_TOKENS):
            mask = np.unpackbits(np.frombuffer(probe.compute_bitmask(), np.uint8), bitorder="little")
            allowed = [t for t in np.flatnonzero(mask[:self.vocab_size]).tolist() if t not in self._eos_token_ids]
            if probe.is_error() or not allowed:
                break
            probe.consume_token(allowed[0])
            if probe.is_stopped():
                break
        error = _first_line(probe.get_error()) if probe.is_error() else ""
        if error and _SPECIAL_FORCED not in error:      # that one is the request's to report (rejection())
            raise StructuredOutputsError(key[0].value, f"{_WHAT[key[0].value]} too large to match: {error}")

    def _forget_compiled(self, cache_key, compiled: CompiledGrammar | None) -> None:
        """Drop compiled from the cache (one of its matchers ran into an error: see CompiledGrammar)."""
        if compiled is None:
            return
        with self._lock:
            fut = self._cache.get(cache_key)
            if fut is not None and fut.done() and not _has_failed(fut) and fut.result() is compiled:
                del self._cache[cache_key]

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher], rows: Sequence[int],
                     out: np.ndarray | None = None) -> np.ndarray:
        """Fill out[rows[i]] for matchers[i] (out defaults to self.bitmask); returns out.

        out: [R, ceil(vocab_size / 32)] int32, C-contiguous (a pinned host buffer works); rows
        not named are left as they are. Rows are filled in parallel by llguidance's threads.
        """
        out = self.bitmask if out is None else out
        if out.dtype != np.int32 or out.ndim != 2 or out.shape[1] != self.bitmask.shape[1] or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous int32 [R, {self.bitmask.shape[1]}], got "
                             f"{out.dtype} {out.shape}")
        if len(matchers) != len(rows):
            raise ValueError(f"{len(matchers)} matchers for {len(rows)} rows")
        if any(not 0 <= r < out.shape[0] for r in rows):
            raise ValueError(f"rows must lie in [0, {out.shape[0]}), got {list(rows)}")
        start = time.perf_counter()
        self._fill_rows([(m._matcher, int(r)) for m, r in zip(matchers, rows)], out)
        self.last_fill_time_s = time.perf_counter() - start
        return out

    def _fill_rows(self, pairs: list[tuple[llguidance.LLMatcher, int]], out: np.ndarray) -> None:
        fill_rows(self._fill_executor, pairs, out)

    def _fill_executor(self) -> llguidance.LLExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = llguidance.LLExecutor(self._fill_threads)
            return self._executor

    # ---- the engine's side (called on the engine thread) ------------------------------------
    def attach(self, seqs: Sequence, params: StructuredOutputsParams) -> None:
        """Give each sequence its StructuredOutputRequest (one compile, shared); the scheduler
        admits them once it is done."""
        reasoning = params.reasoning
        if reasoning is not None and max(reasoning) >= self.vocab_size:
            raise StructuredOutputsError("reasoning", f"token ids must be below the vocabulary's size {self.vocab_size}, "
                                         f"got {short_repr(reasoning)}")
        grammar = self.grammar_init(params)
        if self._process is not None:
            self._process.poll()          # one that died while idle is found gone now, not by these requests
            if self._process.failed:
                self._restart_process()
        count = params.num_output_prefix_tokens
        if any(count > len(seq.prompt_token_ids) for seq in seqs):
            raise StructuredOutputsError("num_output_prefix_tokens", f"must be at most the prompt's length "
                                         f"({len(seqs[0].prompt_token_ids)} tokens), got {count}")
        for seq in seqs:
            end = None if reasoning is None or prompt_ends_reasoning(seq.prompt_token_ids, reasoning) else reasoning[1]
            prefix = seq.prompt_token_ids[len(seq.prompt_token_ids) - count:]
            seq.structured_output = StructuredOutputRequest(grammar, self._process, end, self._reasoning_epoch,
                                                            output_prefix(prefix, reasoning, end))
        self._compiling.extend(seqs)

    def _restart_process(self) -> None:
        """A new grammar process for new requests and those waiting for their grammar (the requests
        whose matchers were in the one that failed end with its error)."""
        self._process = self._process.restarted()
        self._bitmasks = self._process.bitmasks
        for seq in self._compiling:
            seq.structured_output.move_to(self._process)

    def take_failed(self) -> list[tuple[Any, str]]:
        """(sequence, message) for the unfinished sequences whose grammar failed to compile, or
        whose compile has run past the compile timeout; the sequences whose grammar is done are
        forgotten, and a compile that no unfinished sequence waits for any more (its requests
        aborted) is cancelled if it has not started."""
        failed, still, dropped = [], [], set()
        if self._process is not None and self._process.failed and self._compiling:
            self._restart_process()
        overdue = self._pool.overdue() if self._compiling else set()
        for seq in self._compiling:
            request = seq.structured_output
            if seq.is_finished:
                dropped.add(request.grammar)
                continue
            if request.is_ready:
                continue
            error = request.compile_error
            if error is None and request.grammar in overdue:
                kind = request.grammar.key[0].value
                error = (f"structured_outputs.{kind}: the {_WHAT[kind]} took more than {self._pool.timeout_s:g} s "
                         "to compile")
            if error is not None:
                failed.append((seq, error))
            else:
                still.append(seq)
        self._compiling = still
        # Without this a client that sends many slow constraints and goes away keeps the pool busy
        # with them, and every later request's grammar waits behind the queue.
        for fut in dropped - {seq.structured_output.grammar for seq in still}:
            fut.cancel()
        return failed

    @property
    def num_compiling(self) -> int:
        """Sequences that wait for their grammar."""
        return len(self._compiling)

    def wait_for_compile(self, timeout: float) -> None:
        """Block until one of the pending compiles is done (here or in the grammar process), or timeout seconds."""
        futures = {seq.structured_output.grammar for seq in self._compiling}
        pending = {f for f in futures if not f.done()}
        if pending:
            concurrent.futures.wait(pending, timeout, return_when=concurrent.futures.FIRST_COMPLETED)
        elif futures and self._process is not None:     # compiled here: the grammar process's answer
            self._process.wait_readable(timeout)

    @staticmethod
    def has_token_in_flight(rows: Sequence[tuple[int, Any]]) -> bool:
        """True when a constrained sequence samples while its previous token is still on the
        device: its matcher must accept that token before its mask can be filled. rows: a step's
        (sampling index, sequence) pairs (SchedulerOutput.structured_rows); a sequence verifying d
        drafts counts d + 1 placeholders for this step alone."""
        return any(s.num_output_placeholders > 1 + len(s.spec_token_ids)
                   for _, s in rows if s.structured_output is not None)

    def advance(self, rows: Sequence[tuple[int, Any]], sampled: dict[int, list[int]]) -> None:
        """Feed a read-back step's tokens to the matchers of its constrained sampling sequences
        (those still waiting for them) before the scheduler appends them, so the next step's
        masks can be filled while the scheduler works; its accept_token takes the results.
        rows: the step's (sampling index, sequence) pairs; unconstrained ones are skipped. With a
        grammar process the tokens go there in one message and the answers are read when first asked for."""
        remote, tokens, process, is_mixed = [], [], self._process, False
        for _, seq in rows:
            request = seq.structured_output
            if request is not None and seq.num_output_placeholders and (ids := sampled.get(seq.seq_id)):
                if process is None:
                    request.advance(ids)
                elif ids := (ids if request.is_masked else request.take_reasoning(ids)):
                    remote.append(request)
                    tokens.append(ids)
                    is_mixed = is_mixed or request._process is not process
        self._sent = []
        if not remote:
            return
        processes = {request._process for request in remote} if is_mixed else (process,)
        for process in processes:                          # a restart leaves two
            requests, ids = remote, tokens
            if is_mixed:
                mine = [i for i, request in enumerate(remote) if request._process is process]
                requests, ids = [remote[i] for i in mine], [tokens[i] for i in mine]
            answer = process.advance([request.matcher for request in requests], ids)
            StructuredOutputRequest.sent_rows(requests, ids, answer)
            self._sent.append(answer)

    def answers_pending(self) -> bool:
        """Whether the grammar process's answer to the tokens advance() last sent is still out
        (the answers that have arrived are read, none waited for)."""
        pending = False
        for answer in self._sent:
            if not answer.is_read:
                answer._process.poll()
                pending = pending or not answer.is_read
        return pending

    def start_fill(self, rows: Sequence[tuple[int, Any]],
                   spec_tokens: dict[int, list[int]] | None = None) -> PendingBitmask | None:
        """Start filling, on the mask thread, the masks of one step's constrained sampling
        sequences that go on; None when there are none. rows: the step's (sampling index,
        sequence) pairs (SchedulerOutput.structured_rows; unconstrained ones are skipped);
        spec_tokens: seq_id -> the drafts it verifies (SchedulerOutput.scheduled_spec_decode_tokens),
        whose every position gets its mask (GrammarBitmask.positions).

        Each matcher must have taken its sequence's latest token (through the scheduler, or
        ahead of it through advance()). Until the result is taken, the engine thread asks those
        matchers only their cached flags. A sequence whose grammar is done (complete, or a token
        refused) is left out: the scheduler ends it when it appends that token (one whose prefix
        completed it is filled: EOS only). (In a grammar
        process the flags may be a token behind: a row whose grammar its last token ended is filled
        there with EOS only, and the scheduler still ends its sequence.)
        """
        if self._process is not None:
            return self._start_remote_fill(rows, spec_tokens)
        filled, matchers, no_eos, seq_ids = self._rows_to_fill(rows)
        if not matchers:
            return None
        drafts = _drafts_of(seq_ids, spec_tokens)
        slot, mask, first = self._next_mask(filled, drafts)
        if drafts is None:
            entries = [(m._matcher, i) for i, m in enumerate(matchers)]
        else:
            entries = [(m._matcher, row, d) for m, row, d in zip(matchers, first.tolist(), drafts)]
            no_eos = _rows_of(no_eos, first, drafts)
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minillm-mask")
        started = threading.Event()
        future = self._mask_thread.submit(self._fill_job, entries, mask.bitmask, no_eos, started, drafts is not None)
        # A thread that wants the GIL while this one runs Python gets it only after the switch
        # interval (5 ms): hand it over now, for the few lines up to llguidance's GIL-free fill.
        started.wait()
        return PendingBitmask(self, future, mask)

    @staticmethod
    def _rows_to_fill(rows: Sequence[tuple[int, Any]]) -> tuple[list[int], list, list[int], list[int]]:
        """(sampling indices, matchers, the indices of ignore_eos requests among them, seq_ids) of the
        constrained rows that go on (start_fill's rules); a matcher not at its sequence's latest token
        is a RuntimeError."""
        filled, matchers, no_eos, seq_ids = [], [], [], []
        for b, seq in rows:
            request = seq.structured_output
            if request is None or seq.is_finished or not request.is_masked:
                continue
            matcher = request.matcher
            # A prefix that completed the grammar still masks the first token: EOS only.
            if matcher is not None and matcher.is_stopped() and not request.is_at_prefix:
                continue
            expected = len(seq.token_ids) - len(seq.prompt_token_ids) + request.num_fed_expected
            if matcher is None or matcher.num_fed != expected:
                raise RuntimeError(f"request {seq.request_id}: its matcher is not at its latest token")
            if seq.params.ignore_eos:
                no_eos.append(len(filled))
            matchers.append(matcher)
            filled.append(b)
            seq_ids.append(seq.seq_id)
        return filled, matchers, no_eos, seq_ids

    def _next_mask(self, filled: list[int],
                   drafts: list[list[int]] | None = None) -> tuple[int, GrammarBitmask, np.ndarray | None]:
        """The next of the two mask buffers, its rows those of the sampling indices filled (with
        drafts, 1 + len(drafts[i]) rows for filled[i]), and the first mask row of each (None
        without drafts: row i)."""
        slot = self._next_bitmask
        first = positions = None
        if drafts is None:
            num_rows = len(filled)
        else:
            first, positions = mask_layout(drafts)
            num_rows = len(positions)
        rows = self._mask_rows[slot][:num_rows]
        rows[:] = filled if drafts is None else np.repeat(filled, [1 + len(d) for d in drafts])
        self._next_bitmask = 1 - slot
        return slot, GrammarBitmask(self._bitmasks[slot][:num_rows], rows, positions), first

    def _start_remote_fill(self, rows: Sequence[tuple[int, Any]],
                           spec_tokens: dict[int, list[int]] | None = None) -> PendingBitmask | None:
        """start_fill with the matchers in the grammar process. In a steady batch a step's constrained
        rows are the last step's: their plan (the rows to fill, the handles, the ignore_eos rows) is
        kept, so nothing is asked per row. A row that finished or whose grammar is done since is then
        filled all the same (EOS only for a done grammar); its token is dropped or ends it."""
        key = (self._process, rows, self._reasoning_epoch[0])
        plan = self._fill_plan
        if plan is None or plan[0][0] is not self._process or plan[0][1] != rows or plan[0][2] != key[2]:
            filled, matchers, no_eos, seq_ids = self._rows_to_fill(rows)
            self._fill_plan = plan = (key, filled, [m.handle for m in matchers], no_eos, seq_ids)
        _, filled, handles, no_eos, seq_ids = plan
        if not filled:
            return None
        drafts = _drafts_of(seq_ids, spec_tokens)
        slot, mask, first = self._next_mask(filled, drafts)
        if drafts is not None:
            no_eos = _rows_of(no_eos, first, drafts)
        return PendingBitmask(self, self._process.fill(slot, handles, no_eos, drafts), mask)

    def _fill_job(self, entries: list, bitmask: np.ndarray, no_eos: list[int], started: threading.Event,
                  has_drafts: bool = False) -> float:
        """The mask thread's fill: bitmask[i] for entries[i] = (matcher, i), or with drafts each
        (matcher, first row, drafts) fills its rows (fill_draft_rows); EOS taken out of the no_eos
        rows. Returns its wall seconds (up to when this thread has the GIL again)."""
        started.set()
        start = time.perf_counter()
        if has_drafts:
            fill_draft_rows(self._fill_executor, entries, bitmask)
        else:
            self._fill_rows(entries, bitmask)
        if no_eos:
            forbid_eos(bitmask, no_eos, self._eos_words)
        return time.perf_counter() - start

    def _record_fill(self, seconds: float) -> None:
        self._num_fill_steps += 1
        self._fill_time_s += seconds
        self._fill_samples.append(seconds)

    def stats(self) -> StructuredOutputStats:
        """Compile and fill figures so far."""
        samples = np.fromiter(self._fill_samples, float)
        p50, p99 = (float(np.percentile(samples, q)) for q in (50, 99)) if samples.size else (None, None)
        with self._lock:
            return StructuredOutputStats(self._num_compiled, self._compile_time_s, self._num_fill_steps,
                                         self._fill_time_s, p50, p99)

    def num_cached_grammars(self) -> int:
        """Compiled (or compiling) grammars held in the cache."""
        with self._lock:
            return len(self._cache)

    def shutdown(self) -> None:
        """Stop the compile pool (pending compiles are cancelled), the mask thread and the grammar
        check processes."""
        self._pool.shutdown()
        self._checker.close()
        if self._mask_thread is not None:
            self._mask_thread.shutdown(wait=True)
        if self._process is not None:
            self._process.shutdown()
