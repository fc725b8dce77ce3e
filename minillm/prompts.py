"""vLLM's prompt forms, read once for LLM.generate and LLMEngine.add_request alike: a string, a list
(or 1-D NumPy array) of token ids, {"prompt": text} or {"prompt_token_ids": ids} (either dict with
vLLM's "cache_salt")."""
from __future__ import annotations

from typing import TypedDict

import numpy as np

from minillm.sampling_params import short_repr


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


def unpack_prompt(prompt) -> tuple[str | None, str | list[int]]:
    """(text or None, the text or the token ids) of one prompt in any of vLLM's forms; ValueError
    naming the key of a prompt dict that is malformed. The ids are checked where they are tokens."""
    if isinstance(prompt, np.ndarray):
        return None, array_ids(prompt, "prompt")
    if not isinstance(prompt, dict):
        if not isinstance(prompt, (str, list, tuple)):
            raise ValueError(f"prompt must be a string, a list of token ids or a prompt dict, got {short_repr(prompt)}")
        return (prompt if isinstance(prompt, str) else None), prompt
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
    if unknown:
        raise ValueError(f"prompt dict has unsupported key(s) {sorted(unknown, key=repr)}; "
                         f"give 'prompt' (text) or 'prompt_token_ids', and 'cache_salt' if any")
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


def array_ids(ids: np.ndarray, name: str) -> list[int]:
    """A 1-D NumPy array of integers as a list of ids; ValueError naming the prompt otherwise."""
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{name} must be a 1-D array of integer token ids, got an array of shape "
                         f"{ids.shape} and dtype {ids.dtype}")
    return ids.tolist()
