"""StructuredOutputsConfig: vLLM's engine-wide structured outputs settings, validated and frozen.

The same keys as vLLM's `structured_outputs_config` (LLM, EngineArgs) and `--structured-outputs-config`
(serve, run-batch), each taken where minillm does what it asks, and named by a ValueError otherwise:

    backend                        auto (JSON schemas read as vLLM's default backend, xgrammar in its strict
                                   mode: objects closed) or guidance (JSON Schema's reading: objects open)
    disable_additional_properties  under guidance, true closes the objects again (a constraint's own
                                   StructuredOutputsParams.disable_additional_properties, when set, wins
                                   there; under auto a constraint's value changes nothing, as in vLLM)
    reasoning_parser               deepseek_r1 or qwen3: a constraint holds only what follows </think>
    enable_in_reasoning            true: it holds the thinking too, from the first token
    disable_fallback               taken either way (there is one backend: nothing to fall back to)
    disable_any_whitespace         true only (minillm's JSON grammars write no whitespace unless a
                                   request's disable_any_whitespace is false)
    reasoning_parser_plugin        "" only
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from minillm.sampling_params import short_repr
from minillm.server.reasoning_parsers import REASONING_PARSERS, thinking_token_ids

if TYPE_CHECKING:
    from minillm.structured_output import StructuredOutputsParams

VLLM_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")
# vLLM's StructuredOutputsConfig keys, each with the values minillm serves as vLLM does (None: any) and
# why the others are refused.
STRUCTURED_OUTPUTS_KEYS: dict[str, tuple[type, tuple | None, str]] = {
    "backend": (str, ("auto", "guidance"), "minillm's grammars are always llguidance's (vLLM's guidance "
                "backend): give auto or guidance, or leave the key out"),
    "disable_fallback": (bool, None, ""),                  # one backend: there is nothing to fall back to
    "disable_any_whitespace": (bool, (True,), "minillm's JSON grammars leave whitespace out by default; a "
                               "request that wants it sets structured_outputs.disable_any_whitespace false"),
    "disable_additional_properties": (bool, None, ""),      # the guidance backend's default (see closing)
    "reasoning_parser": (str, ("", *REASONING_PARSERS), f"it must be one of {', '.join(REASONING_PARSERS)} "
                         "(--reasoning-parser's names)"),
    "reasoning_parser_plugin": (str, ("",), "minillm loads no reasoning parser plugins: --reasoning-parser "
                                f"takes {', '.join(REASONING_PARSERS)}"),
    "enable_in_reasoning": (bool, None, ""),
}


def check_structured_outputs_config(config: Any) -> str:
    """vLLM's structured_outputs_config checked key by key (a ValueError naming the key minillm does not
    serve as vLLM does); the reasoning parser it names, "" for none."""
    if not isinstance(config, dict):
        raise ValueError(f"structured_outputs_config must be a JSON object, got {short_repr(config)}")
    for key, value in config.items():
        if key not in STRUCTURED_OUTPUTS_KEYS:
            raise ValueError(f"structured_outputs_config.{key} is not a key of vLLM's structured outputs config "
                             f"({', '.join(STRUCTURED_OUTPUTS_KEYS)})")
        kind, served, why = STRUCTURED_OUTPUTS_KEYS[key]
        if not isinstance(value, kind):
            raise ValueError(f"structured_outputs_config.{key} must be a {'boolean' if kind is bool else 'string'}, "
                             f"got {short_repr(value)}")
        if key == "backend" and value not in VLLM_BACKENDS:
            raise ValueError(f"structured_outputs_config.backend must be one of {', '.join(VLLM_BACKENDS)}, "
                             f"got {short_repr(value)}")
        if served is not None and value not in served:
            shown = json.dumps(value) if isinstance(value, bool) else short_repr(value)
            raise ValueError(f"structured_outputs_config.{key} {shown} is not supported: {why}")
    return config.get("reasoning_parser", "")


def resolved_closing(asked: bool | None, default: bool | None) -> bool | None:
    """A constraint's disable_additional_properties as vLLM reads it, given closing()'s default: under its
    default backend (default None) objects are closed whatever the constraint says (false is vLLM's own
    default there, and true asks for what is done anyway); under the guidance backend the constraint's
    value where set, else the config's."""
    return None if default is None else default if asked is None else asked


def closing(config: dict | None) -> bool | None:
    """The disable_additional_properties a constraint that leaves it unset takes under config: None under
    vLLM's default backend (objects closed, as xgrammar's strict mode reads them); under its guidance
    backend, the config's own (false, its default: JSON Schema's reading, objects open)."""
    config = config or {}
    if config.get("backend") != "guidance":
        return None
    return bool(config.get("disable_additional_properties", False))


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's structured outputs config for the whole engine (the module docstring says what each field
    does); built from a dict with from_any. disable_any_whitespace defaults to minillm's True."""

    backend: str = "auto"
    disable_fallback: bool = False
    disable_any_whitespace: bool = True
    disable_additional_properties: bool = False
    reasoning_parser: str = ""
    reasoning_parser_plugin: str = ""
    enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        check_structured_outputs_config(self.to_dict())

    @classmethod
    def from_any(cls, value: StructuredOutputsConfig | dict | str | None) -> StructuredOutputsConfig | None:
        """None, a config, its dict or its JSON text -> a config (None: none given); a ValueError
        naming the key that is not taken."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs_config is not valid JSON: {exc}") from None
        check_structured_outputs_config(value)
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        """The fields by vLLM's names (what --structured-outputs-config takes)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def holds_after_thinking(self) -> bool:
        """Whether a constraint holds only what follows </think> (a reasoning parser, not enable_in_reasoning)."""
        return bool(self.reasoning_parser) and not self.enable_in_reasoning

    def thinking_token_ids(self, tokenizer) -> tuple[int, int] | None:
        """The (<think>, </think>) ids constraints watch for (None where they hold from the first token); a
        ValueError naming reasoning_parser when the tags are not single tokens of the tokenizer."""
        if not self.holds_after_thinking:
            return None
        ids = thinking_token_ids(tokenizer)
        if ids is None:
            raise ValueError(f"structured_outputs_config.reasoning_parser {self.reasoning_parser!r} holds "
                             "constrained outputs to their structure after </think>, but <think> and </think> are "
                             "not single tokens of this model's tokenizer (enable_in_reasoning true holds them "
                             "from the first token instead)")
        return ids

    def applied(self, params: StructuredOutputsParams, thinking: tuple[int, int] | None) -> StructuredOutputsParams:
        """params as this config reads them: a JSON schema's disable_additional_properties as
        resolved_closing reads it under the backend (a false under the default backend closes the objects,
        as vLLM's does), a constraint that leaves reasoning unset takes the thinking tags' ids
        (thinking_token_ids); params themselves when nothing changes."""
        changes: dict[str, Any] = {}
        asked = params.disable_additional_properties
        resolved = resolved_closing(asked, closing(self.to_dict()))
        if params.json is not None and (asked is False) != (resolved is False):    # False alone opens objects
            changes["disable_additional_properties"] = resolved
        if thinking is not None and params.reasoning is None:
            changes["reasoning"] = thinking
        return dataclasses.replace(params, **changes) if changes else params


def offline_config(value: StructuredOutputsConfig | dict | str | None) -> StructuredOutputsConfig | dict | str:
    """An offline engine's structured_outputs_config (LLM, EngineArgs): vLLM's defaults where none is given,
    so that each constraint is read as vLLM's engine reads it (EngineConfig's None leaves constraints as
    given: an API server's engine core, whose server has read them so already)."""
    return StructuredOutputsConfig() if value is None else value
