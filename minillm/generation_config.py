"""The model's recommended sampling defaults, from its generation_config.json (vLLM's
--generation-config auto): what a request that leaves temperature, top_p, top_k, min_p,
repetition_penalty or max_tokens unset gets, instead of the library's neutral defaults.

Qwen3's file, for example, asks for temperature 0.6, top_p 0.95 and top_k 20. "vllm" ignores the
file (the neutral defaults: temperature 1.0, no truncation).
"""
from __future__ import annotations

import logging

from minillm.sampling_params import SamplingParams

logger = logging.getLogger("minillm")

GENERATION_CONFIG_CHOICES = ("auto", "vllm")

# generation_config.json key -> SamplingParams field.
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def check_generation_config(value) -> None:
    """ValueError unless value is one of GENERATION_CONFIG_CHOICES."""
    if value not in GENERATION_CONFIG_CHOICES:
        raise ValueError(f"generation_config must be 'auto' (the model's generation_config.json) or 'vllm' "
                         f"(ignore it), got {value!r}")


def sampling_defaults(generation_config: dict) -> dict:
    """The SamplingParams fields a generation_config.json sets, by their SamplingParams names; a
    value SamplingParams would refuse is left out (and logged)."""
    out = {}
    for key, name in _KEYS.items():
        value = generation_config.get(key)
        if value is None:
            continue
        if name in ("top_k", "max_tokens") and isinstance(value, float) and value.is_integer():
            value = int(value)                 # JSON writers may give 20.0 for 20
        try:
            SamplingParams(**{name: value}).validate()
        except (ValueError, TypeError):
            logger.warning("generation_config.json %s=%r is not a usable %s; left out", key, value, name)
            continue
        out[name] = -1 if name == "top_k" and value == 0 else value     # transformers' top_k 0: off
    return out


def describe(defaults: dict) -> str:
    """One line for the start-up log: which defaults the model's file sets."""
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in defaults.items())


def model_sampling_defaults(config, tokenizer) -> dict:
    """The defaults an engine (or API server) built from `config` applies: the model's file's under
    generation_config "auto", none under "vllm"."""
    return dict(tokenizer.generation_defaults) if config.generation_config == "auto" else {}
