"""Per-request sampling parameters, with vLLM's names and validation."""
from __future__ import annotations

import copy
import dataclasses
import math
import numbers
import struct
import sys
from dataclasses import KW_ONLY, dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from minillm.seeds import REQUEST_SEED_RANGE, is_request_seed

if TYPE_CHECKING:
    import numpy as np

    from minillm.allowed_tokens import MaskedRowCheck
    from minillm.bad_words import BadWordIds
    from minillm.repetition import RepetitionDetectionParams
    from minillm.structured_output import StructuredOutputsParams


def __getattr__(name: str):
    # StructuredOutputsParams lives beside SamplingParams in vLLM; importing it loads llguidance,
    # so only on request.
    if name == "StructuredOutputsParams":
        from minillm.structured_output import StructuredOutputsParams
        return StructuredOutputsParams
    if name == "GuidedDecodingParams":      # vLLM's earlier name, with its options
        from minillm.guided_decoding import GuidedDecodingParams
        return GuidedDecodingParams
    if name == "RepetitionDetectionParams":     # beside SamplingParams in vLLM; minillm/repetition.py
        from minillm.repetition import RepetitionDetectionParams
        return RepetitionDetectionParams
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# A request's seed (minillm.seeds): the sampler's generator takes the unsigned 64-bit value of each
# sequence's seed (engine.sequence_seed).
MAX_LOGPROBS = 20
# Completions of one request: each is a sequence the engine tracks (the server's --max-n is lower).
MAX_N = 4096
# logit_bias: OpenAI's range for a bias (the server's clamp, as vLLM's server clamps it; offline any
# bias is taken, as by vLLM's SamplingParams), and a bound on the entries the sampler adds each step.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
# allowed_token_ids travel as int32 (the vocabulary bounds them further).
_MAX_TOKEN_ID = 2**31 - 1
# bad_words: each word is tokenized (twice) where the request is added, and every step scans them.
MAX_BAD_WORDS = 128
# The sampler holds temperature and repetition_penalty as float32: past its largest value a
# temperature is inf (a masked logit over it is NaN, and the row falls back to the argmax), and a
# penalty below its smallest normal value divides logits into inf.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_MIN_NORMAL = 1.1754943508222875e-38
# vLLM raises a temperature in (0, 0.01) to 0.01 (its _MAX_TEMP, against NaN and inf in the tempered
# logits) before it asks whether a request is greedy: only 0 takes the argmax.
MIN_TEMPERATURE = 0.01
# SamplingParams' numeric fields, which a caller may give as NumPy scalars (_normalize_numbers).
_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
               "truncate_prompt_tokens")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize",
                "spaces_between_special_tokens")


def truncate_prompt(ids: list[int], keep: int | None, max_prompt_len: int, side: str | None = "left") -> list[int]:
    """ids as truncate_prompt_tokens keeps them: the last `keep` (-1: max_prompt_len; None: all), or
    the first under vLLM's truncation_side "right"."""
    if keep is None:
        return ids
    keep = max_prompt_len if keep == -1 else keep
    return ids[:keep] if side == "right" else ids[-keep:]


def check_truncate_prompt_tokens(keep: int | None, max_model_len: int) -> None:
    """ValueError naming truncate_prompt_tokens when it keeps more tokens than the context holds, as
    vLLM refuses it offline and on its server (past 64 bits it could not even reach an engine core)."""
    if keep is not None and keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens must be at most max_model_len ({max_model_len}), or -1, "
                         f"got {short_repr(keep)}")


def max_prompt_len(max_model_len: int, max_tokens: int | None) -> int:
    """The prompt tokens truncate_prompt_tokens -1 keeps, as vLLM keeps them: the context less the
    max_tokens asked for (none: the whole context); at least one."""
    return max(max_model_len - (max_tokens or 0), 1)


def short_repr(value: object, limit: int = 60) -> str:
    """repr(value) cut to about `limit` characters, so an error never echoes a huge input back."""
    if _is_int(value) and abs(int(value)).bit_length() > 128:   # int(): NumPy integers have no bit_length
        return f"an integer of {abs(int(value)).bit_length()} bits"   # str() of a huge int is slow, or refused
    if isinstance(value, (list, tuple)) and len(value) > 8:
        head = ", ".join(short_repr(v, 16) for v in value[:5])
        return f"[{head}, ...] ({len(value)} items)"
    text = repr(value[:limit + 1] if isinstance(value, str) else value)   # repr escapes lone surrogates
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(value) if isinstance(value, str) else len(text)} chars)"


def _is_int(value: object) -> bool:
    """An integer, and not a bool (True is not 1 here)."""
    if type(value) is int:          # the common case, before the slower abstract-class check
        return True
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    """A real number (not a bool) that is neither NaN nor infinite (nor an integer past float's range)."""
    if type(value) is not float and type(value) is not int and (
            not isinstance(value, numbers.Real) or isinstance(value, bool)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _is_number(value: object) -> bool:
    """A real number (not a bool) that is not NaN: finite, infinite, or an integer past float's range."""
    if type(value) is float or type(value) is int:
        return value == value
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not _is_nan(value)


def _is_nan(value: numbers.Real) -> bool:
    """math.isnan, False for an integer past float's range."""
    try:
        return math.isnan(value)
    except OverflowError:
        return False


def _as_float(value: numbers.Real) -> float:
    """value as Python's float; an integer past float's range as the infinity of its sign."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _float32_bits(values: list[float]) -> list[int]:
    """Biases as float32 bit patterns (struct refuses a value past float32's range). One below its
    range is -inf, which bans the token; one above (inf too) is float32's largest value, which
    forces it: a token that allowed_token_ids or a grammar masked to -inf stays there (+inf would
    make it NaN, which the sampler took)."""
    values = [min(v, FLOAT32_MAX) if v >= -FLOAT32_MAX else -math.inf for v in values]
    n = len(values)
    return list(struct.unpack(f"<{n}i", struct.pack(f"<{n}f", *values)))


def _is_numpy_bool(value: object) -> bool:
    """A NumPy bool (np.True_ or np.False_); False without NumPy loaded, as none can exist then."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.bool_)


def _plain(value: object) -> object:
    """A NumPy integer, float or string as Python's int, float or str; anything else as it is."""
    if type(value) in (int, float, str):
        return value
    if isinstance(value, str):
        return str(value)
    if _is_int(value):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return value


def _are_plain(values, kind: type) -> bool:
    """Whether every item of values is exactly of type kind (no NumPy scalar or other subclass)."""
    for value in values:
        if type(value) is not kind:
            return False
    return True


def _plain_list(values) -> list:
    """values as a list with each item _plain."""
    return [_plain(value) for value in values]


def _id_list(values):
    """A set or a 1-D NumPy array of token ids as a list (vLLM takes any collection there); else values."""
    if isinstance(values, (set, frozenset)):
        return _plain_list(sorted(values, key=lambda v: (not _is_int(v), v if _is_int(v) else 0)))
    if type(values).__name__ == "ndarray" and getattr(values, "ndim", None) == 1:
        return values.tolist()
    return values


class RequestOutputKind(Enum):
    """What LLMEngine.step() reports of a request, as vLLM's enum: CUMULATIVE, everything so far each
    time it changes; DELTA, only what is new since the last report (token ids, text, log-probabilities;
    the prompt's log-probabilities once, whole); FINAL_ONLY, one report when it finishes.
    LLM.generate returns finished outputs whatever the kind, as vLLM's does."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop."""

    n: int = 1
    # vLLM's SamplingParams takes its fields in another order (n, presence_penalty, frequency_penalty, ...):
    # by name only after n, so SamplingParams(1, 0.5) is a TypeError, not another field set
    _: KW_ONLY
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                 # -1 or 0: off; past the vocabulary: all of it
    min_p: float = 0.0
    seed: int | None = None         # -1: none, as None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16     # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None     # number of top log-probabilities per generated token
    prompt_logprobs: int | None = None   # the same for each prompt token (the first has none)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None   # a JSON schema, regex, choice or grammar
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit before sampling (-inf: a ban)
    # vLLM's left truncation: keep only the prompt's last k tokens (-1: as many as the context holds)
    truncate_prompt_tokens: int | None = None
    # vLLM's extra_args: plain data for engine extensions; "kv_transfer_params" is the KV connector's
    extra_args: dict | None = None
    allowed_token_ids: list[int] | None = None   # only these token ids may be sampled
    bad_words: list[str] | None = None   # words the output must not contain (minillm/bad_words.py); None: []
    # vLLM's: stop once the output ends in a pattern repeated min_count times (minillm/repetition.py)
    repetition_detection: RepetitionDetectionParams | None = None
    detokenize: bool = True         # False: token ids only (text "", no decoded tokens in logprobs)
    # vLLM's: False reads an added token right after another as its bare text (no space the decoder puts between)
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE   # what LLMEngine.step() reports
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)
    # logit_bias as the sampler uploads it, made when it is validated: (token ids, float32 bit patterns)
    _logit_bias_entries: tuple[list[int], list[int]] | None = field(default=None, init=False, repr=False,
                                                                     compare=False)
    # allowed_token_ids as the sampler uploads them, made when they are validated: distinct, ascending
    _allowed_entries: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)   # [A] int32
    # bad_words as token-id sequences, made where the tokenizer is known (update_from_tokenizer)
    _bad_word_ids: BadWordIds | None = field(default=None, init=False, repr=False, compare=False)
    # set where the engine takes the request (check_masks) when its bans may leave a row nothing to sample
    _masked_row_check: MaskedRowCheck | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_optional(cls, **kwargs) -> "SamplingParams":
        """vLLM's SamplingParams.from_optional: None for a field with a default (max_tokens aside, whose
        None is no limit) takes that default; logit_bias keys may be strings and biases are clipped to [-100, 100]
        (its server's path: SamplingParams itself takes a bias of any size)."""
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.init and f.default is not None
                    and f.default is not dataclasses.MISSING and f.name != "max_tokens"}
        args = {k: defaults[k] if v is None and k in defaults else v for k, v in kwargs.items()}
        bias = args.get("logit_bias")
        if isinstance(bias, dict):
            try:
                args["logit_bias"] = {int(k) if isinstance(k, str) else k:
                                      min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, v)) if _is_number(v) else v
                                      for k, v in bias.items()}
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {short_repr(list(bias))}") from None
        return cls(**args)

    @classmethod
    def from_fields(cls, fields: dict) -> "SamplingParams":
        """SamplingParams(**fields) for a dict of its init fields (the engine core's AddRequest),
        validated as the constructor validates: the defaults and the fields go into a new
        instance's __dict__ in two updates, not through a call of 27 keywords, twice unpacked
        (11.5 -> 6.5 us on the development CPU). TypeError naming any other key."""
        if not fields.keys() <= _INIT_FIELDS:
            raise TypeError(f"SamplingParams has no field(s) {sorted(map(str, fields.keys() - _INIT_FIELDS))}")
        params = object.__new__(cls)
        state = params.__dict__
        state.update(_FIELD_DEFAULTS)
        state.update(fields)
        for name, factory in _FIELD_FACTORIES:
            if name not in state:
                state[name] = factory()
        params.__post_init__()
        return params

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's clone); a structured-output constraint, fixed once built, is shared."""
        memo = {} if self.structured_outputs is None else {id(self.structured_outputs): self.structured_outputs}
        return copy.deepcopy(self, memo)

    def _normalize_stops(self) -> None:
        """stop as the list the engine reads, stop_token_ids as a list; done again by every validate(),
        so fields changed after construction (params.stop = [...]) are what the engine uses."""
        if isinstance(self.stop, str):
            self._stop_list = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self._stop_list = list(self.stop)
        elif self.stop is None:
            self._stop_list = []
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {short_repr(self.stop)}")
        if type(self.stop) is not list:     # as vLLM's: a list ([] for None, [s] for one string)
            self.stop = list(self._stop_list)
        self.stop_token_ids = _id_list(self.stop_token_ids)
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {short_repr(self.stop_token_ids)}")
        self.stop_token_ids = list(self.stop_token_ids or [])

    def _normalize_numbers(self) -> None:
        """NumPy integers and floats in the numeric fields as Python's own: the engine does Python
        arithmetic on them (a NumPy seed overflowed int64 in seed % 2**64, a float16 temperature
        overflowed against the float32 bound), and the server's JSON gives Python numbers anyway.
        (NumPy bools in the flag fields become Python's where validate checks them.)"""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if type(value) is not int and _is_int(value):
                setattr(self, name, int(value))
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if type(value) is not float and type(value) is not int and isinstance(value, numbers.Real) \
                    and not isinstance(value, bool):
                setattr(self, name, float(value))

    @property
    def stop_strings(self) -> list[str]:
        """The stop strings as a list."""
        return self._stop_list

    @property
    def is_greedy(self) -> bool:
        """True when the argmax is taken: temperature 0 (vLLM's test is below 1e-5, which only 0 is once
        validate() raised the temperatures under MIN_TEMPERATURE)."""
        return self.temperature < 1e-5

    @property
    def needs_output_counts(self) -> bool:
        """True when a penalty reads the counts of earlier tokens."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def needs_output_tokens(self) -> bool:
        """True when sampling reads earlier output tokens: a penalty's counts, or a bad word of
        several tokens (its ban depends on the tokens before)."""
        return self.needs_output_counts or (self._bad_word_ids is not None and self._bad_word_ids.max_prefix_len > 0)

    @property
    def bad_words_token_ids(self) -> tuple[tuple[int, ...], ...] | None:
        """bad_words as token-id sequences (vLLM's name); None before update_from_tokenizer or without bad words."""
        return None if self._bad_word_ids is None else self._bad_word_ids.sequences

    def update_from_tokenizer(self, tokenizer, vocab_size: int | None = None) -> None:
        """Tokenize bad_words (vLLM's name for the step); ValueError naming bad_words when a word
        cannot be banned in a vocabulary of vocab_size (default: the tokenizer's)."""
        if not self.bad_words:
            self._bad_word_ids = None
            return
        from minillm.bad_words import bad_word_ids
        self._bad_word_ids = bad_word_ids(tuple(self.bad_words), tokenizer,
                                          len(tokenizer) if vocab_size is None else vocab_size)

    def validate(self) -> None:
        """Raise ValueError naming the first field that is out of range or of the wrong type."""
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name} {why}, got {short_repr(getattr(self, name))}")

        self._normalize_stops()
        self._normalize_numbers()
        if _is_int(self.seed) and self.seed == -1:     # vLLM: -1 is no seed
            self.seed = None
        for name in ("logprobs", "prompt_logprobs"):     # vLLM: True (NumPy's too) asks for 1
            value = getattr(self, name)
            if value is not None and type(value) is not int and _is_numpy_bool(value):
                value = bool(value)
                setattr(self, name, value)
            if value is True:
                setattr(self, name, 1)

        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}]")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            if not _is_finite(getattr(self, name)):
                bad(name, "must be a finite number")
        if self.temperature < 0:
            bad("temperature", "must be non-negative")
        if self.temperature > FLOAT32_MAX:
            bad("temperature", f"must be at most {FLOAT32_MAX:.4g} (the sampler's float32)")
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be -1 (off), 0 (off) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be positive")
        if not FLOAT32_MIN_NORMAL <= self.repetition_penalty <= FLOAT32_MAX:
            bad("repetition_penalty", f"must be in [{FLOAT32_MIN_NORMAL:.4g}, {FLOAT32_MAX:.4g}] "
                                      f"(the sampler's float32)")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be a non-negative integer")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                whole = " (vLLM's -1, the whole vocabulary, is not supported)" if value == -1 else ""
                bad(name, f"must be an integer in [0, {MAX_LOGPROBS}]{whole}")
        if self.seed is not None and not is_request_seed(self.seed):
            bad("seed", f"must be {REQUEST_SEED_RANGE}")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                if not _is_numpy_bool(getattr(self, name)):
                    bad(name, "must be true or false")
                setattr(self, name, bool(getattr(self, name)))
        if any(not isinstance(s, str) or not s for s in self._stop_list):
            raise ValueError(f"stop must be non-empty strings, got {short_repr(self.stop)}")
        if any("\ufffd" in s for s in self._stop_list):
            # The decoder's mark for bytes that are no UTF-8, shown only once it gives up on them (a
            # few tokens later, or at the end): such a stop would match some runs of them, not others.
            bad("stop", "must not contain U+FFFD (the replacement character), which stands for bytes that are not "
                        "UTF-8, not for text the model writes")
        if self._stop_list and not self.detokenize:
            bad("stop", "strings are only supported when detokenize is true (stop_token_ids are not text)")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if len(set(self.stop_token_ids)) < len(self.stop_token_ids):     # as vLLM's: first of each, in order
            self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        if self.truncate_prompt_tokens is not None and (not _is_int(self.truncate_prompt_tokens)
                                                        or self.truncate_prompt_tokens == 0
                                                        or self.truncate_prompt_tokens < -1):
            bad("truncate_prompt_tokens", "must be an integer >= 1, or -1 for the model's context length")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            bad("extra_args", "must be a dict")
        if not isinstance(self.output_kind, RequestOutputKind):
            if not _is_int(self.output_kind) or self.output_kind not in (0, 1, 2):   # msgpack carries the value
                bad("output_kind", "must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
            self.output_kind = RequestOutputKind(self.output_kind)
        self._validate_token_rules()
        self._plain_containers()
        self._logit_bias_entries = None
        if self.logit_bias is not None:
            self._validate_logit_bias()
            self._logit_bias_entries = (list(self.logit_bias), _float32_bits(list(self.logit_bias.values())))
        if self.structured_outputs is not None:
            from minillm.structured_output import StructuredOutputsParams
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", "must be a StructuredOutputsParams")
        if self.repetition_detection is not None:
            self._validate_repetition_detection()

    def _validate_repetition_detection(self) -> None:
        """repetition_detection's fields (again: they may have changed since it was made) and its scan work."""
        from minillm.repetition import RepetitionDetectionParams, check_scan_work
        detection = self.repetition_detection
        if not isinstance(detection, RepetitionDetectionParams):
            raise ValueError(f"repetition_detection must be a RepetitionDetectionParams, got {short_repr(detection)}")
        try:
            detection.validate()
        except ValueError as exc:
            raise ValueError(f"repetition_detection.{exc}") from None
        check_scan_work(detection)

    def _plain_containers(self) -> None:
        """NumPy integers, floats and strings in the list and dict fields (checked or still to be) as
        Python's own: msgpack, which carries a request to an engine core (AsyncLLM), refused them
        ("Encoding objects of type int64 is unsupported") where LLMEngine ran them."""
        if type(self.stop) is not str and isinstance(self.stop, str):
            self.stop = str(self.stop)
            self._stop_list = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and not _are_plain(self.stop, str):
            self.stop = _plain_list(self.stop)
            self._stop_list = list(self.stop)
        if not _are_plain(self.stop_token_ids, int):
            self.stop_token_ids = _plain_list(self.stop_token_ids)
        for name in ("allowed_token_ids", "bad_words"):
            values = getattr(self, name)
            if isinstance(values, (list, tuple)) and not _are_plain(values, str if name == "bad_words" else int):
                setattr(self, name, _plain_list(values))
        bias = self.logit_bias
        if isinstance(bias, dict) and not all(type(k) is int and type(v) in (float, int) for k, v in bias.items()):
            self.logit_bias = {_plain(k): _plain(v) for k, v in bias.items()}

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {short_repr(bias)}")
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias may name at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(bias)}")
        bad_ids = [t for t in bias if not _is_int(t) or t < 0]
        if bad_ids:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {short_repr(bad_ids)}")
        # Any size, as vLLM's SamplingParams takes it: -1e9 or -inf bans a token, 1e9 or inf forces it.
        # NaN would make the token's logit NaN, which no rule orders.
        bad_values = [v for v in bias.values() if not _is_number(v)]
        if bad_values:
            raise ValueError(f"logit_bias values must be numbers (not NaN), got {short_repr(bad_values)}")
        if not all(type(v) is float for v in bias.values()):
            self.logit_bias = {k: _as_float(v) for k, v in bias.items()}

    def _validate_token_rules(self) -> None:
        """allowed_token_ids and bad_words: their types and sizes (the vocabulary is checked later)."""
        self._allowed_entries = None
        allowed = self.allowed_token_ids = _id_list(self.allowed_token_ids)
        if allowed is not None:
            if (not isinstance(allowed, (list, tuple)) or not allowed
                    or any(not _is_int(t) or not 0 <= t <= _MAX_TOKEN_ID for t in allowed)):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {short_repr(allowed)}")
            import numpy as np      # here, not at import: the CLI starts without numpy

            self._allowed_entries = np.unique(np.array(allowed, dtype=np.int32))
        words = self.bad_words
        if words is None:           # a list, as vLLM makes it ([] for None), as stop and stop_token_ids
            self.bad_words = []
            return
        if not isinstance(words, (list, tuple)) or any(not isinstance(w, str) for w in words):
            raise ValueError(f"bad_words must be a list of strings, got {short_repr(words)}")
        if len(words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words may hold at most {MAX_BAD_WORDS} words, got {len(words)}")
        if not all(words):
            raise ValueError(f"bad_words cannot contain an empty string, got {short_repr(words)}")
        if len(set(words)) < len(words):    # as vLLM's: first of each, in order
            self.bad_words = list(dict.fromkeys(words))
        elif type(words) is not list:
            self.bad_words = list(words)

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Raise ValueError naming a field whose token ids or counts fall outside a vocabulary of vocab_size.

        The sampler indexes [batch, vocab] arrays with these values, so they are checked where the
        vocabulary is known (LLMEngine.add_request) as well as where requests enter. A top_k past the
        vocabulary keeps all of it, as in vLLM (sampling_metadata.sampler_top_k).
        """
        outside = [t for t in self.stop_token_ids if t >= vocab_size]
        if outside:
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab_size}), got {short_repr(outside)}")
        outside = [t for t in (self.logit_bias or ()) if t >= vocab_size]
        if outside:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {short_repr(outside)}")
        allowed = self._allowed_entries
        outside = [] if allowed is None else allowed[allowed >= vocab_size].tolist()
        if outside:
            raise ValueError(f"allowed_token_ids must be token ids in [0, {vocab_size}), got {short_repr(outside)}")
        for name in ("logprobs", "prompt_logprobs"):     # the top k of a row of vocab_size
            if (value := getattr(self, name)) is not None and value > vocab_size:
                raise ValueError(f"{name} must be at most the vocabulary's size ({vocab_size}), got {value}")

    def check_masks(self, eos_token_ids, vocab_size: int) -> None:
        """Raise ValueError naming allowed_token_ids (or the banning field) when bans leave the first
        token nothing to sample."""
        # Called as the engine takes the request: bad_words tokenized, stop_token_ids complete. Bans
        # that may leave a later token nothing set _masked_row_check: the scheduler then checks each
        # token of the request (masked_out_error).
        self._masked_row_check = None
        if self._bad_word_ids is None and self.min_tokens == 0 and not self.logit_bias:
            return
        from minillm.allowed_tokens import first_token_error, masked_row_check
        error = first_token_error(self, eos_token_ids, vocab_size)
        if error is not None:
            raise ValueError(error)
        self._masked_row_check = masked_row_check(self, eos_token_ids, vocab_size)


# What from_fields puts in a new instance's __dict__ besides the given fields, as the dataclass's
# __init__ would: each init field's default, or a new value from its default factory (an init=False
# field with a plain default is read from the class until something sets it).
_INIT_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams) if f.init)
_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)
                   if f.init and f.default is not dataclasses.MISSING}
_FIELD_FACTORIES = tuple((f.name, f.default_factory) for f in dataclasses.fields(SamplingParams)
                         if f.default_factory is not dataclasses.MISSING)


# vLLM's SamplingParams fields (of one version or another) that minillm has no field for, taken where
# the value given is what minillm does anyway: name -> (whether the value is that, what minillm does).
# Any other value is a ValueError naming the field; the field itself is not kept.
VLLM_FIXED_FIELDS = {
    "best_of": (lambda v, n: v is None or (_is_int(v) and v == n),
                "minillm returns all n completions it samples (no best-of selection): give best_of None or n"),
    "use_beam_search": (lambda v, n: v is False, "minillm has no beam search in SamplingParams (n samples n "
                                                 "completions; LLM.beam_search takes a BeamSearchParams)"),
    "length_penalty": (lambda v, n: _is_finite(v) and v == 1.0,
                       "only beam search reads it (BeamSearchParams.length_penalty, for LLM.beam_search)"),
    "early_stopping": (lambda v, n: v is False, "only beam search reads it (LLM.beam_search runs max_tokens steps, "
                                                "as vLLM's)"),
    "logits_processors": (lambda v, n: v is None or v == [],
                          "minillm runs no Python logits processors (logit_bias, allowed_token_ids, bad_words and "
                          "structured_outputs shape the logits)"),
    "guided_decoding": (lambda v, n: v is None, "give a GuidedDecodingParams (or StructuredOutputsParams) "
                                                "from minillm.sampling_params, or vLLM's later name "
                                                "structured_outputs=StructuredOutputsParams(json=..., ...)"),
    "flat_logprobs": (lambda v, n: v is False, "minillm gives logprobs as a list of {token id: Logprob} dicts"),
    "stream_interval": (lambda v, n: v is None or (_is_int(v) and v == 1), "LLMEngine.step() reports every step"),
    "skip_clone": (lambda v, n: isinstance(v, bool), "minillm always takes the request's own copy"),
    "skip_reading_prefix_cache": (lambda v, n: v is None or v is False,
                                  "minillm skips the prefix cache for prompt_logprobs requests alone (they need "
                                  "every prompt token's logits) and reads it for the others; a cache_salt of "
                                  "the request's own keeps it from blocks other requests computed"),
    # vLLM's -1 is no budget, as None
    "thinking_token_budget": (lambda v, n: v is None or (_is_int(v) and v == -1),
                              "minillm has no thinking budget (max_tokens bounds the output): give None or -1"),
    "logprob_token_ids": (lambda v, n: v is None, "logprobs=k gives the top k and the sampled token"),
    "prompt_logprob_token_ids": (lambda v, n: v is None, "prompt_logprobs=k gives the top k and the prompt's token"),
    "prompt_logprob_start": (lambda v, n: v is None or (_is_int(v) and v == 0),
                             "prompt_logprobs covers the whole prompt"),
    "trace_decode_token_ids": (lambda v, n: v is None, "minillm samples every token"),
}

# vLLM's earlier SamplingParams fields of its repetition stop, taken as repetition_detection's (all 0: none).
VLLM_REPETITION_FIELDS = {"max_repetition_pattern_size": "max_pattern_size",
                          "min_repetition_pattern_size": "min_pattern_size", "repetition_min_count": "min_count"}
_VLLM_ONLY_FIELDS = frozenset(VLLM_FIXED_FIELDS) | frozenset(VLLM_REPETITION_FIELDS)
_dataclass_init = SamplingParams.__init__


def _init_taking_vllm_fields(self, *args, **kwargs) -> None:
    """SamplingParams' own __init__, after VLLM_FIXED_FIELDS are checked and left out (and vLLM's
    earlier repetition fields made repetition_detection)."""
    if not kwargs.keys().isdisjoint(_VLLM_ONLY_FIELDS):
        _take_guided_decoding(kwargs)
        _take_repetition_fields(kwargs)
        n = kwargs.get("n", args[0] if args else 1)
        for name in [k for k in kwargs if k in VLLM_FIXED_FIELDS]:
            value = kwargs.pop(name)
            is_done, does = VLLM_FIXED_FIELDS[name]
            if not is_done(value, n):
                raise ValueError(f"{name}={short_repr(value)} is not supported: {does}")
    _dataclass_init(self, *args, **kwargs)


def _take_repetition_fields(kwargs: dict) -> None:
    """vLLM's earlier max_repetition_pattern_size, min_repetition_pattern_size and repetition_min_count
    become repetition_detection; a ValueError names the one at fault."""
    given = {new: kwargs.pop(old) for old, new in VLLM_REPETITION_FIELDS.items() if old in kwargs}
    if not given:
        return
    old_names = {new: old for old, new in VLLM_REPETITION_FIELDS.items()}
    if kwargs.get("repetition_detection") is not None:
        raise ValueError(f"{next(old_names[k] for k in given)} is vLLM's earlier spelling of repetition_detection, "
                         f"which is given too: give one")
    from minillm.repetition import RepetitionDetectionParams, renamed
    try:
        detection = RepetitionDetectionParams(**given)
    except ValueError as exc:
        raise ValueError(renamed(str(exc), old_names)) from None
    if detection.is_enabled:
        kwargs["repetition_detection"] = detection


def _take_guided_decoding(kwargs: dict) -> None:
    """vLLM's guided_decoding (its earlier name) given a constraint: it becomes structured_outputs."""
    constraint = kwargs.get("guided_decoding")
    module = sys.modules.get("minillm.structured_output")     # loaded wherever a constraint was made
    if constraint is None or module is None or not isinstance(constraint, module.StructuredOutputsParams):
        return
    if kwargs.get("structured_outputs") is not None:
        raise ValueError("guided_decoding and structured_outputs are the same setting under vLLM's two names: "
                         "give one")
    kwargs["structured_outputs"] = kwargs.pop("guided_decoding")


_init_taking_vllm_fields.__wrapped__ = _dataclass_init    # inspect.signature shows the fields
SamplingParams.__init__ = _init_taking_vllm_fields


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters (LLM.beam_search): beam_width beams of up to max_tokens tokens
    (max_tokens 0 runs no step: the output is the prompt's one beam, as vLLM's).

    temperature picks each step's sampled token, one more candidate beside the likeliest ones;
    length_penalty divides a beam's score by its length to that power. include_stop_str_in_output
    is taken as vLLM's offline search takes it, where it changes nothing (a beam that ends on EOS
    keeps it). structured_outputs (vLLM's) holds every beam to a constraint: each step's request for a
    beam carries it with the beam's tokens as the output's start (num_output_prefix_tokens), so its
    candidates come from the masked distribution; a beam ends ("stop") on the EOS its complete sentence
    allows, even with ignore_eos, as the grammar takes nothing after it.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field that is out of range or of the wrong type."""
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name} {why}, got {short_repr(getattr(self, name))}")

        for name in ("beam_width", "max_tokens", "temperature", "length_penalty"):
            setattr(self, name, _plain(getattr(self, name)))
        if not _is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            bad("beam_width", f"must be an integer in [1, {MAX_LOGPROBS // 2}] (each step asks for "
                              f"2 * beam_width log-probabilities, at most {MAX_LOGPROBS})")
        if not _is_int(self.max_tokens) or self.max_tokens < 0:     # 0: no step, the prompt's beam alone (vLLM's)
            bad("max_tokens", "must be an integer >= 0")
        if not _is_finite(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:
            bad("temperature", f"must be a finite number in [0, {FLOAT32_MAX:.4g}]")
        if not _is_finite(self.length_penalty):
            bad("length_penalty", "must be a finite number")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if _is_numpy_bool(getattr(self, name)):
                setattr(self, name, bool(getattr(self, name)))
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be true or false")
        if self.structured_outputs is not None:
            from minillm.structured_output import StructuredOutputsParams
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", "must be a StructuredOutputsParams or None")
            if self.structured_outputs.num_output_prefix_tokens:
                bad("structured_outputs", "must leave num_output_prefix_tokens 0 (each step sets it to its beam's "
                                          "tokens)")
