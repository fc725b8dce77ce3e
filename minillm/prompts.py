"""vLLM's prompt forms, read once for LLM.generate and LLMEngine.add_request alike: a string, a list
(or 1-D NumPy array) of token ids, {"prompt": text} or {"prompt_token_ids": ids} (either dict with
vLLM's "cache_salt")."""
from __future__ import annotations

import functools
from typing import Annotated, TypedDict

import msgspec
import numpy as np

from minillm.sampling_params import short_repr
from minillm.tokenizer import check_unicode


class _PromptOptions(TypedDict, total=False):
    """What vLLM's prompt dicts may carry besides the prompt."""

    cache_salt: str     # prefix-cache blocks are shared only with requests of the same salt


class TextPrompt(_PromptOptions):
    """vLLM's TextPrompt: {"prompt": text}."""

    prompt: str


class TokensPrompt(_PromptOptions, total=False):
    """vLLM's TokensPrompt: {"prompt_token_ids": ids}, with the ids' text as "prompt" if known."""

    prompt_token_ids: list[int]
    prompt: str


# What LLM.generate and LLMEngine.add_request take as one prompt.
PromptType = str | list[int] | TextPrompt | TokensPrompt | dict


# vLLM's prompt-dict keys for inputs minillm does not take: taken only as None (the multimodal ones,
# dicts in vLLM, also empty), else named with the reason.
_MULTIMODAL_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids")
VLLM_PROMPT_KEYS = {
    **dict.fromkeys(_MULTIMODAL_KEYS, "minillm runs text-only models"),
    "token_type_ids": "minillm runs decoder-only generative models, which read no token types",
    "prompt_embeds": "minillm takes text or token ids, not embeddings",
    **dict.fromkeys(("encoder_prompt", "decoder_prompt"), "minillm runs decoder-only models, which take no "
                                                          "encoder-decoder prompt (give the prompt alone)"),
}


def unpack_prompt(prompt) -> tuple[str | None, str | list[int]]:
    """(text or None, the text or the token ids) of one prompt in any of vLLM's forms; ValueError
    naming the key of a prompt dict that is malformed. The ids are checked where they are tokens."""
    if isinstance(prompt, np.ndarray):
        return None, array_ids(prompt, "prompt")
    if not isinstance(prompt, dict):
        if not isinstance(prompt, (str, list, tuple)):
            raise ValueError(f"prompt must be a string, a list of token ids or a prompt dict, got {short_repr(prompt)}")
        return (prompt if isinstance(prompt, str) else None), prompt
    unknown = {k for k in prompt
               if k not in ("prompt", "prompt_token_ids", "cache_salt") and not _asks_nothing(k, prompt[k])}
    if unknown:
        why = "".join(f" ({k}: {VLLM_PROMPT_KEYS[k]})" for k in sorted(unknown, key=repr) if k in VLLM_PROMPT_KEYS)
        raise ValueError(f"prompt dict has unsupported key(s) {sorted(unknown, key=repr)}; "
                         f"give 'prompt' (text) or 'prompt_token_ids', and 'cache_salt' if any{why}")
    cache_salt_of(prompt)
    if not isinstance(prompt.get("prompt"), (str, type(None))):   # the text, or the output's prompt
        raise ValueError(f"a prompt dict's 'prompt' must be a string, got {short_repr(prompt['prompt'])}")
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if isinstance(ids, np.ndarray):
            ids = array_ids(ids, "prompt_token_ids")
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids must be a list of token ids, got {short_repr(ids)}")
        if not ids:
            raise ValueError("prompt_token_ids must not be empty")
        return prompt.get("prompt"), list(ids)
    if isinstance(prompt.get("prompt"), str):
        return prompt["prompt"], prompt["prompt"]
    raise ValueError("a prompt dict needs 'prompt' (a string) or 'prompt_token_ids' (a list of ids)")


def _asks_nothing(key, value) -> bool:
    """Whether a vLLM prompt-dict key minillm has no input for holds what minillm does anyway."""
    if key not in VLLM_PROMPT_KEYS:
        return False
    return value is None or (key in _MULTIMODAL_KEYS and isinstance(value, dict) and not value)


def cache_salt_of(prompt, cache_salt: str | None = None) -> str | None:
    """A request's cache salt: a prompt dict's "cache_salt" (vLLM's key), else cache_salt; ValueError
    naming cache_salt unless it is a non-empty string, or when the two are given and differ."""
    salt = cache_salt
    if isinstance(prompt, dict) and "cache_salt" in prompt:
        salt = prompt["cache_salt"]
        if cache_salt is not None and salt != cache_salt:
            raise ValueError(f"cache_salt is given twice, {short_repr(salt)} in the prompt dict and "
                             f"{short_repr(cache_salt)} as an argument")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {short_repr(salt)}")
    return salt


def text_token_ids(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """A text prompt's token ids: "" is the tokenizer's BOS alone, as vLLM's engine takes it; ValueError
    when it holds a lone surrogate or tokenizes to nothing (an empty one without a BOS token)."""
    check_unicode(text, "prompt")
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if not ids and not text:
        raise ValueError("prompt must not be empty: an empty text has no tokens without a BOS token "
                         "(add_special_tokens false, or a tokenizer that adds none)")
    if not ids:
        raise ValueError(f"prompt {short_repr(text)} tokenizes to no tokens")
    return ids


@functools.lru_cache(maxsize=8)
def _token_ids_type(vocab_size: int) -> type:
    return list[Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]]


def checked_token_ids(ids, vocab_size: int) -> list[int]:
    """A token-id prompt as a new list of ints; ValueError unless it is a non-empty list (or tuple)
    of integers (NumPy's too) in [0, vocab_size)."""
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
    # The common case, plain ints in range, checked (and copied) by msgspec in C: 7 us for 500
    # ids, against 28 us for a type set and min/max in Python.
    try:
        return msgspec.convert(ids, _token_ids_type(vocab_size))
    except msgspec.ValidationError:
        pass
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}), got {t!r}")
    return [int(t) for t in ids]


def array_ids(ids: np.ndarray, name: str) -> list[int]:
    """A 1-D NumPy array of integers as a list of ids; ValueError naming the prompt otherwise."""
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{name} must be a 1-D array of integer token ids, got an array of shape "
                         f"{ids.shape} and dtype {ids.dtype}")
    return ids.tolist()


# ---- vLLM's per-request arguments that minillm takes only at what it does ----------------------------

def check_lora_request(lora_request) -> None:
    """ValueError unless vLLM's lora_request is None (or a list of Nones, one a prompt)."""
    if lora_request is None or (isinstance(lora_request, (list, tuple)) and all(r is None for r in lora_request)):
        return
    raise ValueError(f"lora_request={short_repr(lora_request)} is not supported: minillm runs the base model's own "
                     f"weights and loads no LoRA adapters (merge the adapter into a copy of the model and load "
                     f"that, or leave lora_request None)")


def tokenization_add_special_tokens(tokenization_kwargs) -> bool:
    """add_special_tokens from vLLM's tokenization_kwargs, the one key minillm takes (default True);
    ValueError naming any other key."""
    if tokenization_kwargs is None:
        return True
    if not isinstance(tokenization_kwargs, dict):
        raise ValueError(f"tokenization_kwargs must be a dict, got {short_repr(tokenization_kwargs)}")
    other = sorted(set(tokenization_kwargs) - {"add_special_tokens"}, key=repr)
    if other:
        raise ValueError(f"tokenization_kwargs {', '.join(map(short_repr, other))}: not supported, minillm takes "
                         f"only add_special_tokens there (SamplingParams(truncate_prompt_tokens=k) keeps a "
                         f"prompt's last k tokens)")
    value = tokenization_kwargs.get("add_special_tokens", True)
    if not isinstance(value, bool):
        raise ValueError(f"tokenization_kwargs['add_special_tokens'] must be true or false, got {short_repr(value)}")
    return value


def request_add_special_tokens(lora_request=None, tokenization_kwargs=None, trace_headers=None) -> bool:
    """vLLM's per-request arguments of LLMEngine.add_request and AsyncLLM.generate, taken where minillm
    does what they ask (lora_request None, trace_headers None) and named by a ValueError otherwise;
    whether the prompt's text gets special tokens (tokenization_kwargs). Their priority is
    request_queue.check_priority's."""
    if lora_request is not None:
        check_lora_request(lora_request)
    add_special_tokens = tokenization_kwargs is None or tokenization_add_special_tokens(tokenization_kwargs)
    if trace_headers:
        raise ValueError(f"trace_headers={short_repr(trace_headers)} is not supported: minillm has no "
                         f"OpenTelemetry tracing (leave them None)")
    return add_special_tokens
