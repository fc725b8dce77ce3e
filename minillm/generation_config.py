"""The model's recommended sampling defaults, from its generation_config.json (vLLM's
--generation-config auto): what a request that leaves temperature, top_p, top_k, min_p,
repetition_penalty or max_tokens unset gets, instead of the library's neutral defaults.

Qwen3's file, for example, asks for temperature 0.6, top_p 0.95 and top_k 20. "vllm" ignores the
file (the neutral defaults: temperature 1.0, no truncation). vLLM's override_generation_config
(--override-generation-config) sets some of them by the file's names over either: merged into the
file's under "auto", alone under "vllm"; its max_new_tokens also caps a server request's max_tokens.
As vLLM's, generation_config may also be a folder holding a generation_config.json, read in place of
the model's for these defaults; its eos_token_id (an id or a list, as Llama 3's) joins the stop token
ids of every request that does not ignore EOS (folder_eos_token_ids).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from minillm.model_store import expand_user, read_json_object
from minillm.sampling_params import SamplingParams, short_repr

logger = logging.getLogger("minillm")

GENERATION_CONFIG_CHOICES = ("auto", "vllm")

# generation_config.json key -> SamplingParams field.
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def check_generation_config(value) -> None:
    """ValueError unless value is one of GENERATION_CONFIG_CHOICES or, as vLLM takes it, a folder
    holding a generation_config.json (read in place of the model's), which must be a JSON object."""
    if isinstance(value, str) and value in GENERATION_CONFIG_CHOICES:
        return
    if not isinstance(value, (str, os.PathLike)) or not value:
        raise ValueError(f"generation_config must be 'auto' (the model's generation_config.json), 'vllm' (ignore "
                         f"it) or a folder holding a generation_config.json, got {short_repr(value)}")
    folder = expand_user(value)
    if not folder.is_dir():
        raise ValueError(f"generation_config {short_repr(os.fspath(value), 300)} is neither 'auto', 'vllm' nor a "
                         f"folder (give a folder holding a generation_config.json)")
    if not (folder / "generation_config.json").is_file():
        raise ValueError(f"generation_config folder {os.fspath(value)} holds no generation_config.json")
    read_json_object(folder / "generation_config.json")


def generation_config_file(value) -> Path | None:
    """The generation_config.json a generation_config folder names (None for 'auto' and 'vllm')."""
    if isinstance(value, str) and value in GENERATION_CONFIG_CHOICES:
        return None
    return expand_user(value) / "generation_config.json"


def token_id_list(value, where: str) -> list[int]:
    """An eos_token_id field (None, an id or a list of ids) as a list of ids; ValueError naming WHERE
    (the file and field) for anything else (a float raised TypeError, a negative id was taken)."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise ValueError(f"{where} must be a token id or a list of them, got {short_repr(value)}")
    return ids


def folder_eos_token_ids(value) -> list[int]:
    """The eos_token_id of the generation_config.json a generation_config folder names, as a list;
    [] for 'auto' and 'vllm' (the model's own file is the tokenizer's to read, under either, as vLLM
    reads the model's for EOS under both). vLLM adds these ids to every request's stop_token_ids."""
    path = generation_config_file(value)
    if path is None:
        return []
    return token_id_list(read_json_object(path).get("eos_token_id"), f"{path} field 'eos_token_id'")


def folder_stop_token_ids(value, primary_eos: int | None, vocab_size: int) -> list[int]:
    """The ids a generation_config folder's eos_token_id adds to every request's stop token ids (as
    vLLM's update_from_generation_config): the tokenizer's own EOS left out (it ends a request as EOS
    already), and ids past the vocabulary (never sampled, they would fail every request's check)
    left out and logged. [] for 'auto' and 'vllm'."""
    eos_ids = folder_eos_token_ids(value)
    outside = [t for t in eos_ids if t >= vocab_size]
    if outside:
        logger.warning("generation_config eos_token_id %s lies outside the vocabulary of %d tokens; left out",
                       outside, vocab_size)
    return [t for t in dict.fromkeys(eos_ids) if t != primary_eos and t < vocab_size]


def sampling_defaults(generation_config: dict) -> dict:
    """The SamplingParams fields a generation_config.json sets, by their SamplingParams names; a
    value SamplingParams would refuse is left out (and logged)."""
    out = {}
    for key, name in _KEYS.items():
        value = generation_config.get(key)
        if value is None:
            continue
        try:
            out[name] = sampling_default(name, value)
        except ValueError:
            logger.warning("generation_config.json %s=%r is not a usable %s; left out", key, value, name)
    return out


def sampling_default(name: str, value):
    """A generation config's value for SamplingParams field `name`, as SamplingParams takes it; a
    ValueError saying why for one it would refuse."""
    if name in ("top_k", "max_tokens") and isinstance(value, float) and value.is_integer():
        value = int(value)                     # JSON writers may give 20.0 for 20
    try:
        SamplingParams(**{name: value}).validate()
    except (ValueError, TypeError) as exc:
        raise ValueError(str(exc)) from None
    return -1 if name == "top_k" and value == 0 else value         # transformers' top_k 0: off


def override_sampling_defaults(override) -> dict:
    """vLLM's override_generation_config as SamplingParams fields: {name: value}, None where it
    unsets the model's value (as a null does in vLLM). Other keys are ignored, as vLLM's
    get_diff_sampling_param merges the object into the file's and reads only the sampling keys
    (describe_ignored_override_keys names them). A ValueError saying what is wrong (the caller
    names the option) for anything but a JSON object, or for a sampling key's unusable value."""
    if override is None:
        return {}
    if not isinstance(override, dict):
        raise ValueError(f"it must be a JSON object of generation_config.json sampling keys, such as "
                         f'{{"temperature": 0.5}}, got {short_repr(override)}')
    out = {}
    for key, value in override.items():
        name = _KEYS.get(key)
        if name is None:
            continue
        try:
            out[name] = None if value is None else sampling_default(name, value)
        except ValueError as exc:
            raise ValueError(f"{key} (SamplingParams' {name}): {exc}" if key != name else str(exc)) from None
    return out


def describe_ignored_override_keys(override) -> str | None:
    """A warning naming the keys of an override_generation_config object that set no sampling
    default (vLLM ignores them), or None."""
    ignored = [key for key in override if key not in _KEYS] if isinstance(override, dict) else []
    if not ignored:
        return None
    return (f"ignoring {', '.join(short_repr(k) for k in ignored)}: as vLLM, it reads only the sampling keys "
            f"{', '.join(_KEYS)}")


def override_max_tokens(config) -> int | None:
    """The cap on a server request's max_tokens, as vLLM's server applies it (None: no cap): under
    "auto" and "vllm" the max_new_tokens of override_generation_config; for a generation_config folder
    that of its generation_config.json, the override's over it (vLLM caps by all the defaults then)."""
    if generation_config_file(config.generation_config) is None:
        return override_sampling_defaults(config.override_generation_config).get("max_tokens")
    return model_sampling_defaults(config, None).get("max_tokens")


def describe(defaults: dict) -> str:
    """One line for the start-up log: which defaults the model's file sets."""
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in defaults.items())


def defaults_source(config) -> str:
    """Where the start-up log says an engine's sampling defaults came from."""
    folder_file = generation_config_file(config.generation_config)
    from_file = config.generation_config == "auto" or folder_file is not None
    source = "the model's generation_config.json" if folder_file is None else str(folder_file)
    override = bool(config.override_generation_config)
    if from_file and override:
        return f"{source} with override_generation_config over it"
    if override:
        return "override_generation_config"
    return f"{source} (generation_config 'vllm' ignores them)" if folder_file is None else source


def model_sampling_defaults(config, tokenizer) -> dict:
    """The defaults an engine (or API server) built from `config` applies: the model's file's under
    generation_config "auto", none under "vllm", a folder's generation_config.json's for a folder;
    override_generation_config's over them."""
    folder_file = generation_config_file(config.generation_config)
    if folder_file is not None:
        defaults = sampling_defaults(read_json_object(folder_file))
    else:
        defaults = dict(tokenizer.generation_defaults) if config.generation_config == "auto" else {}
    for name, value in override_sampling_defaults(config.override_generation_config).items():
        if value is None:
            defaults.pop(name, None)
        else:
            defaults[name] = value
    return defaults
