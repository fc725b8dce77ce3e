"""SpeculativeConfig: vLLM's `speculative_config` for the n-gram method, validated and frozen."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from minillm.sampling_params import short_repr

# vLLM's spellings of the n-gram method ("[ngram]" is its older alias).
_NGRAM_NAMES = ("ngram", "[ngram]")
# vLLM's default when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5
# Drafts a step verifies per sequence: the verification step's buffers scale with it (n-gram
# drafts past a few dozen tokens are never all accepted).
MAX_SPECULATIVE_TOKENS = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """How many tokens to propose per step and how proposals are found (vLLM's field names)."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int | None = None   # None: prompt_lookup_min, or 5 when both are None
    prompt_lookup_min: int | None = None   # None: prompt_lookup_max, or 5 when both are None
    disable_by_batch_size: int | None = None  # no proposals while more requests than this are running
    model: str | None = None               # vLLM accepts model="ngram" in place of method

    def __post_init__(self) -> None:
        method = self._resolve_method()
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {short_repr(value)}")
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if lo > hi:
            raise ValueError(f"prompt_lookup_min ({short_repr(lo)}) must be <= prompt_lookup_max ({short_repr(hi)})")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {short_repr(k)}")
        d = self.disable_by_batch_size
        if d is not None and (not _is_int(d) or d < 2):
            raise ValueError(f"disable_by_batch_size must be an integer >= 2, got {short_repr(d)}")
        # Frozen: the resolved values are set once here, never later.
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "model", None)
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    def _resolve_method(self) -> str:
        return _ngram_method(self.method, self.model)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        """Build from the dict `LLM(..., speculative_config={...})` takes; unknown keys are errors."""
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        # Sorted as text: a dict from Python may have keys of several types, which do not compare.
        unknown = sorted(set(d) - known, key=repr)
        if unknown:
            raise ValueError(f"speculative_config has unknown field {', '.join(map(repr, unknown))}; "
                             f"expected some of {sorted(known)}")
        if "num_speculative_tokens" not in d:
            # a method not taken is named first: giving the count would not make it run
            _ngram_method(d.get("method", "ngram"), d.get("model"))
            raise ValueError("num_speculative_tokens must be given in speculative_config")
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "SpeculativeConfig":
        """Build from the JSON object `--speculative-config` takes."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        return cls.from_dict(d)

    @classmethod
    def from_any(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """None, a config, a dict or a JSON string -> a config (or None: speculation off)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls.from_json(value)
        return cls.from_dict(value)

    def to_dict(self) -> dict[str, Any]:
        """The resolved fields, as vLLM names them (round-trips through from_dict)."""
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_max": self.prompt_lookup_max, "prompt_lookup_min": self.prompt_lookup_min,
                "disable_by_batch_size": self.disable_by_batch_size}


def _ngram_method(method: Any, model: Any) -> str:
    """"ngram", from vLLM's method (or model="ngram"); a ValueError naming a method or draft model not taken."""
    if model is not None and model not in _NGRAM_NAMES:
        raise ValueError(f"model must be 'ngram' (draft models are not supported), got {short_repr(model)}")
    if method not in _NGRAM_NAMES:
        raise ValueError(f"method must be 'ngram', got {short_repr(method)}")
    return "ngram"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
