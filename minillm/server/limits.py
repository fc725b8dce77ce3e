"""What one request may ask for, and how long the server waits on a client (each a `minillm serve` option).

Every limit is checked where the request enters, before any tokenising or rendering, and an excess
is a 400 that names the field.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from minillm.server.errors import APIError


@dataclass(frozen=True)
class ServerLimits:
    """Per-request fan-out and size limits, and the server's timeouts on slow clients."""

    max_n: int = 128                        # completions per prompt (OpenAI's own limit on n)
    max_prompts_per_request: int = 256      # prompts in one /v1/completions call, and n x prompts
    max_stop_strings: int = 64
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 256
    # allowed_token_ids, counted once per prompt: each prompt's params validate the whole list, here
    # and in the engine core's loop (a whole vocabulary of the largest models fits).
    max_allowed_token_ids: int = 262_144
    max_prompt_chars: int = 1_000_000       # prompt text (or message text) of one request, before tokenising
    max_body_bytes: int = 16 * 1024 * 1024
    max_stats_streams: int = 128            # open /v1/stats/stream connections
    stream_timeout_s: float = 30.0          # a stream whose client reads nothing this long is cut off
    header_timeout_s: float = 10.0          # to send a request's headers (from connect or the last response)
    body_timeout_s: float = 60.0            # to send a request's body once its headers are in
    timeout_keep_alive_s: float = 5.0       # an idle keep-alive connection is closed after this

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            check_limit(name, value)


def check_limit(name: str, value: object) -> None:
    """ValueError naming NAME unless VALUE is a finite number > 0 (an infinite timeout or size is no
    limit at all: one idle or slow client could hold its connection for ever)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def check_fan_out(limits: ServerLimits, n: int, num_prompts: int, stop: str | list[str] | None,
                  stop_token_ids: list[int] | None) -> None:
    """400 naming the field when a request asks for more completions, prompts or stop conditions than allowed."""
    if n < 1:      # vLLM's words; SamplingParams' own error would name its offline bound, not --max-n
        raise APIError(400, f"n must be at least 1, got {n}", param="n")
    if n > limits.max_n:
        raise APIError(400, f"n must be at most {limits.max_n}, got {n}", param="n")
    if num_prompts > limits.max_prompts_per_request:
        raise APIError(400, f"a request may hold at most {limits.max_prompts_per_request} prompts, "
                       f"got {num_prompts}", param="prompt")
    if n * num_prompts > limits.max_prompts_per_request:
        raise APIError(400, f"n={n} for {num_prompts} prompts asks for {n * num_prompts} completions; a request "
                       f"may ask for at most {limits.max_prompts_per_request}", param="n")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > limits.max_stop_strings:
        raise APIError(400, f"stop may hold at most {limits.max_stop_strings} strings, got {len(stops)}",
                       param="stop")
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_string_chars:
        raise APIError(400, f"each stop string may be at most {limits.max_stop_string_chars} characters, "
                       f"got one of {longest}", param="stop")
    if stop_token_ids is not None and len(stop_token_ids) > limits.max_stop_token_ids:
        raise APIError(400, f"stop_token_ids may hold at most {limits.max_stop_token_ids} ids, "
                       f"got {len(stop_token_ids)}", param="stop_token_ids")


def check_allowed_token_ids(limits: ServerLimits, allowed: list[int] | None, num_prompts: int) -> None:
    """400 naming allowed_token_ids when the list, repeated for each prompt, holds more ids than allowed."""
    if allowed is None or len(allowed) * num_prompts <= limits.max_allowed_token_ids:
        return
    per_prompt = f" for each of {num_prompts} prompts" if num_prompts > 1 else ""
    raise APIError(400, f"allowed_token_ids may hold at most {limits.max_allowed_token_ids} ids in one request "
                   f"(counted once per prompt), got {len(allowed)}{per_prompt}", param="allowed_token_ids")


def check_prompt_chars(limits: ServerLimits, num_chars: int, param: str) -> None:
    """400 naming `param` when a request's text is too long to be worth tokenising."""
    if num_chars > limits.max_prompt_chars:
        raise APIError(400, f"{param} holds {num_chars} characters; a request may hold at most "
                       f"{limits.max_prompt_chars}", param=param, code="prompt_too_long")
