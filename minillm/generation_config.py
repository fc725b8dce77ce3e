"""The model's recommended sampling defaults, from its generation_config.json (vLLM's
--generation-config auto): what a request that leaves temperature, top_p, top_k, min_p,
repetition_penalty or max_tokens unset gets, instead of the library's neutral defaults.

Qwen3's file, for example, asks for temperature 0.6, top_p 0.95 and top_k 20. "vllm" ignores the
file (the neutral defaults: temperature 1.0, no truncation).
"""
from __future__ import annotations

import logging
import math
import numbers

logger = logging.getLogger("minillm")

GENERATION_CONFIG_CHOICES = ("auto", "vllm")

# generation_config.json key -> SamplingParams field, with the values the field takes.
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def check_generation_config(value) -> None:
    """ValueError unless value is one of GENERATION_CONFIG_CHOICES."""
    if value not in GENERATION_CONFIG_CHOICES:
        raise ValueError(f"generation_config must be 'auto' (the model's generation_config.json) or 'vllm' "
                         f"(ignore it), got {value!r}")


def sampling_defaults(generation_config: dict) -> dict:
    """The SamplingParams fields a generation_config.json sets, by their SamplingParams names;
    a value of the wrong kind or out of range is left out (and logged)."""
    out = {}
    for key, name in _KEYS.items():
        value = generation_config.get(key)
        if value is None:
            continue
        if _valid(name, value):
            out[name] = int(value) if name in ("top_k", "max_tokens") else float(value)
        else:
            logger.warning("generation_config.json %s=%r is not a usable %s; left out", key, value, name)
    if out.get("top_k") == 0:        # transformers' "no top-k"
        out["top_k"] = -1
    return out


def _valid(name: str, value) -> bool:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return False
    if name in ("top_k", "max_tokens"):
        return float(value).is_integer() and (value >= 1 if name == "max_tokens" else value >= -1)
    if name == "temperature":
        return value >= 0
    if name == "top_p":
        return 0 < value <= 1
    if name == "min_p":
        return 0 <= value <= 1
    return value > 0                 # repetition_penalty


def describe(defaults: dict) -> str:
    """One line for the start-up log: which defaults the model's file sets."""
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in defaults.items())


def model_sampling_defaults(config, tokenizer) -> dict:
    """The defaults an engine (or API server) built from `config` applies: the model's file's under
    generation_config "auto", none under "vllm"."""
    return dict(tokenizer.generation_defaults) if config.generation_config == "auto" else {}
