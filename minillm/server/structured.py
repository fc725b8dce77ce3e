"""A request's output constraint: OpenAI's response_format or vLLM's structured_outputs object,
turned into StructuredOutputsParams, or a 400 whose param names the bad field.

    response_format: {"type": "text"}                          no constraint (the default)
                     {"type": "json_object"}                   any JSON object
                     {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
    structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object": ...,
                         "disable_any_whitespace": bool,
                         "disable_additional_properties": bool,
                         "whitespace_pattern": null, "structural_tag": null}
                                                               vLLM's names, exactly one constraint

The schema is always enforced (strict or not), its objects closed as vLLM's default backend closes
them (StructuredOutputsParams.disable_additional_properties; a server configured with vLLM's guidance
backend reads them as that backend does, see resolved_closing, as offline). Nothing about structure is ignored: an
unknown type or key, or vLLM's older guided_* fields, is a 400 too.
"""
from __future__ import annotations

import re
from typing import Any

from minillm.sampling_params import short_repr
from minillm.server.errors import APIError
from minillm.server.protocol import lax_value
from minillm.structured_outputs_config import resolved_closing

_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace", "disable_additional_properties",
         "whitespace_pattern", "structural_tag")
_LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar", "guided_json_object": "json_object"}
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")
_BOOL_OPTIONS = ("disable_any_whitespace", "disable_additional_properties")     # read as a bool field reads them


def asks_for_structure(req: Any) -> bool:
    """True when the request sets a field that structured_outputs_params() must check (a grammar or a
    schema to compile in the pool); without one it returns None at once, or refuses a legacy field."""
    return req.response_format is not None or req.structured_outputs is not None


def structured_outputs_params(req: Any, reasoning: tuple[int, int] | None = None,
                              disable_additional_properties: bool | None = None):
    """StructuredOutputsParams for a completions or chat request, or None when it asks for none;
    reasoning: the (start, end) ids of a thinking block the grammar holds the output only after;
    disable_additional_properties: the server's default of that option (ServingContext's, see resolved_closing)."""
    extra = req.model_extra or {}
    for name, key in _LEGACY.items():
        if extra.get(name) is not None:
            raise APIError(400, f"{name} is not supported; send structured_outputs: {{\"{key}\": ...}}", param=name)
    from_format = (_from_response_format(req.response_format, reasoning, disable_additional_properties)
                   if req.response_format is not None else None)
    if req.structured_outputs is None:
        return from_format
    if from_format is not None:
        raise APIError(400, "response_format and structured_outputs both constrain the output; give one",
                       param="response_format")
    unknown = [k for k in req.structured_outputs if k not in _KEYS]
    if unknown:
        key = unknown[0]
        named = _SCHEMA_NAME.fullmatch(key) is not None          # a long or odd key is quoted, cut short
        param = f"structured_outputs.{key}" if named else "structured_outputs"
        what = param if named else f"structured_outputs: {short_repr(key)}"
        raise APIError(400, f"{what} is not supported (structured_outputs takes {', '.join(_KEYS)})", param=param)
    options = _lax_options(req.structured_outputs)
    options["disable_additional_properties"] = resolved_closing(options.get("disable_additional_properties"),
                                                                disable_additional_properties)
    return checked_params(lambda field: "structured_outputs" if field == "structured_outputs"
                          else f"structured_outputs.{field}", **options, reasoning=reasoning)


def _lax_options(options: dict) -> dict:
    """structured_outputs with its boolean options read as a request model reads a bool field ("true", 1)."""
    return {**options, **{name: lax_value(options[name], bool, f"structured_outputs.{name}")
                          for name in _BOOL_OPTIONS if options.get(name) is not None}}


def _from_response_format(fmt: dict, reasoning: tuple[int, int] | None, disable_additional_properties: bool | None):
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        _refuse_unknown_keys(fmt, "response_format", ("type",))
    if kind == "text":
        return None
    if kind == "json_object":
        return checked_params(lambda field: "response_format", json_object=True, reasoning=reasoning)
    if kind != "json_schema":
        raise APIError(400, "response_format.type must be 'text', 'json_object' or 'json_schema', got "
                       f"{short_repr(kind)}",
                       param="response_format.type")
    _refuse_unknown_keys(fmt, "response_format", ("type", "json_schema"))
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise APIError(400, "response_format.json_schema must be an object with a name and a schema",
                       param="response_format.json_schema")
    _refuse_unknown_keys(spec, "response_format.json_schema", _JSON_SCHEMA_KEYS)
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise APIError(400, "response_format.json_schema.name must be 1 to 64 letters, digits, '_' or '-'",
                       param="response_format.json_schema.name")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise APIError(400, "response_format.json_schema.description must be a string",
                       param="response_format.json_schema.description")
    if spec.get("strict") is not None:
        lax_value(spec["strict"], bool, "response_format.json_schema.strict")
    if spec.get("schema") is None:
        raise APIError(400, "response_format.json_schema.schema is required", param="response_format.json_schema.schema")
    if not isinstance(spec["schema"], dict):     # OpenAI's and vLLM's models take an object, not its text
        raise APIError(400, "response_format.json_schema.schema must be a JSON object (the schema itself), got "
                       f"{_json_type(spec['schema'])}", param="response_format.json_schema.schema")
    return checked_params(lambda field: "response_format.json_schema.schema", json=spec["schema"], reasoning=reasoning,
                          disable_additional_properties=disable_additional_properties)


def _json_type(value: Any) -> str:
    """The JSON type of a parsed value, as a message names it."""
    kinds = ((bool, "a boolean"), (str, "a string"), (list, "an array"), ((int, float), "a number"))
    return next((name for kind, name in kinds if isinstance(value, kind)), type(value).__name__)


def _refuse_unknown_keys(obj: dict, where: str, known: tuple[str, ...]) -> None:
    """A 400 for a key of obj outside known (a schema sent as {"type": "json_object", "schema": ...} is not dropped)."""
    for key in obj:
        if key not in known:
            named = _SCHEMA_NAME.fullmatch(key) is not None
            param = f"{where}.{key}" if named else where
            what = param if named else f"{where}: {short_repr(key)}"
            raise APIError(400, f"{what} is not supported here ({where} takes {', '.join(known)})", param=param)


def checked_params(param_of, **fields):
    """StructuredOutputsParams(**fields); its ValueError (which names a field) becomes a 400 whose
    param is param_of(that field)."""
    from minillm.structured_output import StructuredOutputsError, StructuredOutputsParams
    try:
        return StructuredOutputsParams(**fields)
    except StructuredOutputsError as exc:
        param = param_of(exc.field)
        raise APIError(400, f"{param}: {str(exc).split(': ', 1)[-1]}", param=param) from None
