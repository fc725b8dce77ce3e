"""Request bodies of the OpenAI API (pydantic) and their translation into SamplingParams.

Values are read as vLLM's request models read them, in pydantic's lax mode: "5" and 5.0 are the
integer 5, "0.7" and 1 are numbers, 0, 1, "true", "false" (and pydantic's other spellings) are
booleans; 5.5 or "abc" for an integer, 2 for a boolean, and a number for a string are errors naming
the field. The counts of log-probabilities (logprobs, top_logprobs, prompt_logprobs) are numbers only:
vLLM's models refuse them as text ("5" too). Floats are finite, and every string must be valid
Unicode (JSON can carry a lone surrogate such as "\\ud800", which no tokenizer takes).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError, field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from minillm.repetition import (
    FIELDS as REPETITION_DETECTION_FIELDS, RepetitionDetectionParams, check_scan_work, renamed,
)
from minillm.sampling_params import (
    MAX_LOGIT_BIAS, MAX_LOGPROBS, VLLM_REPETITION_FIELDS, SamplingParams, check_truncate_prompt_tokens, short_repr,
)
from minillm.server.errors import APIError, bad_request_from_value_error, json_error_reason
from minillm.server.tool_calls import check_named_tool_choice
from minillm.tokenizer import TEXT_PART_KEYS

MAX_TOKEN_ID_DIGITS = 20        # a logit_bias key longer than this is no token id of any vocabulary
LAX = ConfigDict(extra="allow", allow_inf_nan=False)
KIND_WORDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "an object",
              list: "a list"}


@functools.cache
def _lax_adapter(kind: type) -> TypeAdapter:
    return TypeAdapter(kind, config=ConfigDict(allow_inf_nan=False))


def lax_value(value: Any, kind: type, param: str) -> Any:
    """value read as a request model reads a field of type kind (KIND_WORDS' types: "5" is 5, 0 is
    False; a string is valid Unicode, as a Text field is); a 400 naming param where it cannot be. For
    fields read by hand from free JSON objects."""
    if type(value) is not kind or kind is float:      # a float may be NaN, which the adapter refuses
        try:
            value = _lax_adapter(kind).validate_python(value)
        except ValidationError:
            raise APIError(400, f"{param} must be {KIND_WORDS[kind]}, got {short_repr(value)}", param=param) from None
    if kind is str:
        try:
            check_text(value)
        except PydanticCustomError as exc:
            raise APIError(400, f"{param}: {exc.message()}", param=param) from None
    return value


def check_text(value: str) -> str:
    """value itself when it encodes as UTF-8; a lone surrogate is an error naming where it is."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PydanticCustomError("invalid_text", "text is not valid Unicode: a lone surrogate at index "
                                      "{index}", {"index": exc.start}) from None
    return value


Text = Annotated[str, AfterValidator(check_text)]


def _number_not_text(value: Any) -> Any:
    """A count of log-probabilities as vLLM's request models take it (their check_logprobs runs before
    pydantic's lax reading): a JSON number, never text, "5" included."""
    if isinstance(value, str):
        raise PydanticCustomError("integer_text", "must be an integer, got a string ({value})",
                                  {"value": short_repr(value)})
    return value


def _check_json_text(value: Any) -> Any:
    """Walk JSON data (dicts, lists, strings) and check every string and key with check_text."""
    if isinstance(value, str):
        check_text(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key)
            _check_json_text(item)
    elif isinstance(value, list):
        for item in value:
            _check_json_text(item)
    return value


class _OpenAIModel(BaseModel):
    """A request object whose optional fields take null as "the default", as OpenAI's API (and vLLM's)
    do: `"n": null` is n 1, not a type error. A field whose own value may be None keeps the null
    (a chat's max_tokens null asks for the rest of the context)."""

    model_config = LAX

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        defaulted = _fields_without_none(cls)
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}


@functools.cache
def _fields_without_none(cls: type[BaseModel]) -> frozenset[str]:
    """Names of cls's optional fields whose type does not admit None."""
    names = []
    for name, info in cls.model_fields.items():
        annotation = info.annotation
        admits_none = annotation is Any or annotation is type(None) or type(None) in get_args(annotation)
        if not info.is_required() and not admits_none:
            names.append(name)
    return frozenset(names)


class StreamOptions(_OpenAIModel):
    """stream_options: whether a final chunk carries the usage, and (vLLM's) every chunk too. As in
    vLLM, include_usage is true unless the object says otherwise ({} and {"continuous_usage_stats":
    true} ask for the usage); null, like false, leaves it out."""

    include_usage: bool | None = True
    continuous_usage_stats: bool = False


class _ModelRequest(_OpenAIModel):
    """A request that may name the model it is for (every request of the API)."""

    model: Text | None = None

    @field_validator("model")
    @classmethod
    def _empty_model_is_ours(cls, value: str | None) -> str | None:
        # vLLM serves its model for "model": "" as for no model (clients with the name left blank send it).
        return value or None


class RepetitionDetection(_OpenAIModel):
    """vLLM's repetition_detection object (minillm/repetition.py); each field 0 unless given."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0


class _GenerationRequest(_ModelRequest):
    """Fields completions and chat completions share (OpenAI names plus vLLM's extensions)."""

    # Clients send fields we do not use (metadata, ...): accept them and log their names.

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True        # vLLM's, as SamplingParams takes it
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[Text, float] | None = None
    user: Text | None = None
    response_format: dict[Text, Any] | None = None      # read by server/structured.py
    structured_outputs: dict[Text, Any] | None = None   # vLLM's; read by server/structured.py
    kv_transfer_params: dict[Text, Any] | None = None   # vLLM's; read by server/kv_transfer.py
    truncate_prompt_tokens: int | None = None           # vLLM's: keep the prompt's last k tokens (-1: context - max_tokens)
    truncation_side: Literal["left", "right"] | None = None   # vLLM's: "right" keeps the first k instead
    allowed_token_ids: list[int] | None = None          # vLLM's: only these tokens may be sampled
    bad_words: list[Text] | None = None                 # vLLM's: words the completion must not contain
    prompt_logprobs: int | None = None                  # vLLM's: each prompt token's logprob and top k
    return_tokens_as_token_ids: bool | None = None      # vLLM's: logprobs name tokens "token_id:<id>"
    return_token_ids: bool | None = None                # vLLM's: the prompt's and the completion's token ids
    request_id: Text | None = None                      # vLLM's: names the response (X-Request-Id wins)
    best_of: int | None = None                          # only n: every completion sampled is returned
    # vLLM's beam search (server/serving_beam_search.py): n beams, scored by cumulative logprob / length ** this
    use_beam_search: bool = False
    length_penalty: float = 1.0
    cache_salt: Text | None = None                      # vLLM's: prefix-cache blocks shared only with the same salt
    # vLLM's: with --scheduling-policy priority a lower value is served first; under fcfs only 0 (or null)
    priority: int | None = None
    # vLLM's: a stream sends a chunk once a completion has this many new tokens (and its first and last at once)
    stream_interval: int | None = None
    # vLLM's: plain data for engine extensions, carried to the engine as SamplingParams.extra_args
    vllm_xargs: dict[Text, Text | int | float | list[Text | int | float]] | None = None
    # vLLM's: stop once the output ends in a pattern repeated min_count times (minillm/repetition.py)
    repetition_detection: RepetitionDetection | None = None
    # vLLM's earlier spelling of it, as three fields of the request (all 0: no detection)
    max_repetition_pattern_size: int = 0
    min_repetition_pattern_size: int = 0
    repetition_min_count: int = 0

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, value: str | None) -> str | None:
        if value == "":       # as vLLM refuses it: an unset variable must not quietly mean "no salt"
            raise PydanticCustomError("empty_salt", "cache_salt must be a non-empty string if provided")
        return value

    @field_validator("prompt_logprobs", mode="before")
    @classmethod
    def _prompt_logprobs_number(cls, value: Any) -> Any:
        return _number_not_text(value)

    @field_validator("vllm_xargs")
    @classmethod
    def _xargs_not_the_connectors(cls, value: dict | None) -> dict | None:
        # extra_args' kv_transfer_params is the KV connector's, checked where kv_transfer_params is read
        # (server/kv_transfer.py): through vllm_xargs it would reach the connector unchecked.
        if value is not None and "kv_transfer_params" in value:
            raise PydanticCustomError("xargs_kv", "must not carry kv_transfer_params (the KV connector's): send "
                                      "it as the request's own kv_transfer_params")
        return value

    @field_validator("stream_interval")
    @classmethod
    def _interval_positive(cls, value: int | None) -> int | None:
        if value is not None and value < 1:     # vLLM's Field(ge=1)
            raise PydanticCustomError("stream_interval", "stream_interval must be an integer >= 1, got {value}",
                                      {"value": value})
        return value

    @field_validator("response_format", "structured_outputs", "kv_transfer_params")
    @classmethod
    def _constraint_text(cls, value: dict | None) -> dict | None:
        return _check_json_text(value)

    @property
    def include_usage(self) -> bool:
        """True when a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def force_usage(self) -> None:
        """Make a stream end with a usage chunk whatever its stream_options say (vLLM's
        --enable-force-include-usage); continuous_usage_stats is kept as asked."""
        if self.stream:
            every = bool(self.stream_options and self.stream_options.continuous_usage_stats)
            self.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=every)

    @property
    def continuous_usage(self) -> bool:
        """True when every streamed chunk carries the usage so far (vLLM's continuous_usage_stats,
        which takes effect with include_usage only)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions."""

    prompt: Text | list[int] | list[Text] | list[list[int]]
    max_tokens: int = 16                         # null means 16 too, as in vLLM
    logprobs: int | None = None
    echo: bool = False
    suffix: Text | None = None
    add_special_tokens: bool = True              # vLLM's: BOS (and such) before a text prompt
    vllm_xargs: dict[Text, Text | int | float] | None = None     # vLLM's completions take no lists here

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_number(cls, value: Any) -> Any:
        return _number_not_text(value)

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_form(cls, value: Any, handler):
        # The union's own error names one member ("should be a valid string" for [1.0]): say which form
        # the prompt took and where it broke it. A lone surrogate keeps its own error.
        try:
            return handler(value)
        except ValidationError as exc:
            if any(e["type"] == "invalid_text" for e in exc.errors()):
                raise
            raise PydanticCustomError("prompt_form", prompt_form_error(value)) from None


PROMPT_FORMS = "a string, a list of strings, a list of token ids (integers) or a list of token id lists"


def _json_kind(value: Any) -> str:
    """What a JSON value is, in words."""
    if value is None:
        return "null"
    kinds = ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"), (list, "a list"),
             (dict, "an object"))
    return next((name for kind, name in kinds if isinstance(value, kind)), type(value).__name__)


def _first_not(items: list, kind: str) -> int | None:
    """Index of the first item that is not of kind ("an integer", "a string"), or None."""
    return next((i for i, item in enumerate(items) if _json_kind(item) != kind), None)


def prompt_form_error(value: Any) -> str:
    """Why a completion's prompt is none of its forms: which form it took, and its first item that breaks it."""
    if not isinstance(value, list):
        return f"must be {PROMPT_FORMS}, got {_json_kind(value)}"
    first = _json_kind(value[0])
    if first in ("an integer", "a string"):
        form = "token ids" if first == "an integer" else "strings"
        i = _first_not(value, first)
        return f"a list of {form} holds {_json_kind(value[i])} at index {i} (must be {PROMPT_FORMS})"
    if first == "a list":
        for i, ids in enumerate(value):
            j = _first_not(ids, "an integer") if isinstance(ids, list) else None
            if not isinstance(ids, list) or j is not None:
                where, kind = (f"{i}", _json_kind(ids)) if j is None else (f"{i}.{j}", _json_kind(ids[j]))
                return f"a list of token id lists holds {kind} at index {where} (must be {PROMPT_FORMS})"
    return f"must be {PROMPT_FORMS}, got a list whose first item is {first}"


class ContentPart(BaseModel):
    """One part of a multi-part message content; only text parts (TEXT_PART_KEYS) are supported."""

    model_config = LAX
    type: Text
    text: Text | None = None
    refusal: Text | None = None                  # an assistant's refusal part
    thinking: Text | None = None                 # a thinking part (vLLM's), read as text


def _part_kind(value: Any) -> str:
    return "str" if isinstance(value, str) else "dict"


# A content part: a plain string (text, as vLLM takes it) or a part object; tagged by kind, so that an
# error names the part's own field (the tags are left out of the path as type names).
Part = Annotated[Annotated[Text, Tag("str")] | Annotated[ContentPart, Tag("dict")], Discriminator(_part_kind)]


class ToolCallFunction(_OpenAIModel):
    """The function an earlier assistant turn called: its name and its arguments as JSON text."""

    name: Text
    arguments: Text | None = None


class ToolCall(_OpenAIModel):
    """One tool call of an earlier assistant turn."""

    id: Text | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class FunctionDefinition(_OpenAIModel):
    """A tool's function: its name, what it does and its parameters' JSON schema."""

    name: Text
    description: Text | None = None
    parameters: dict[Text, Any] | None = None

    @field_validator("parameters")
    @classmethod
    def _schema_text(cls, value: dict | None) -> dict | None:
        return _check_json_text(value)


class Tool(_OpenAIModel):
    """One entry of a chat request's tools."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatMessage(_OpenAIModel):
    """One chat message; any role, as vLLM takes custom roles. tool_calls and reasoning are read on
    an assistant's message, tool_call_id on a tool's, tools on a developer's, name and task on any, as
    vLLM reads them."""

    role: Annotated[Text, Field(min_length=1)]
    content: Text | list[Part] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None
    reasoning: Text | None = None
    reasoning_content: Text | None = None       # the older name of reasoning
    tools: list[Tool] | None = None             # a developer's tools (vLLM's), for the template
    task: Text | None = None                    # a model's task marker (vLLM's, for DeepSeek V4)


class ConversationRequest(_OpenAIModel):
    """The fields that say how a conversation becomes a prompt: chat completions and /tokenize's chat
    form share them, so both render the same token ids."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    # vLLM's: documents for retrieval-augmented templates, each a dict of strings ("title", "text").
    documents: list[dict[Text, Text]] | None = None
    chat_template: Text | None = None            # vLLM's: a Jinja template for this request only
    chat_template_kwargs: dict[Text, Any] | None = None   # extra variables for the template
    # vLLM's: how the conversation is rendered (the assistant's turn opened, or the last message
    # continued), and whether the tokenizer adds its special tokens on top of what the template writes.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False

    @field_validator("chat_template_kwargs")
    @classmethod
    def _kwargs_text(cls, value: dict | None) -> dict | None:
        return _check_json_text(value)


# OpenAI's reasoning efforts, as vLLM takes them ("max": DeepSeek V4's).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


class ChatCompletionRequest(ConversationRequest, _GenerationRequest):
    """POST /v1/chat/completions."""

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    functions: list[dict] | None = None          # the legacy form of tools
    function_call: Any = None
    echo: bool = False                           # vLLM's: the reply starts with the last message's text
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True               # vLLM's: false drops the reasoning a --reasoning-parser splits off
    # OpenAI's: the template's reasoning_effort, and its enable_thinking ("none": false) as vLLM renders it
    reasoning_effort: Literal[REASONING_EFFORTS] | None = None
    return_prompt_text: bool | None = None       # vLLM's: the prompt the template rendered, as prompt_text

    @field_validator("top_logprobs", mode="before")
    @classmethod
    def _top_logprobs_number(cls, value: Any) -> Any:
        return _number_not_text(value)


class TokenizeCompletionRequest(_ModelRequest):
    """POST /tokenize with a prompt (vLLM's TokenizeCompletionRequest)."""

    prompt: Text
    add_special_tokens: bool = True              # BOS (and such) before the text, as completions add them
    return_token_strs: bool = False              # also each token's vocabulary string


class TokenizeChatRequest(ConversationRequest, _ModelRequest):
    """POST /tokenize with messages (vLLM's TokenizeChatRequest): rendered as a chat completion's are."""

    return_token_strs: bool = False


class DetokenizeRequest(_ModelRequest):
    """POST /detokenize (vLLM's DetokenizeRequest)."""

    tokens: list[int]


def unknown_fields(req: _ModelRequest) -> list[str]:
    """Names of the fields a request carried that this server ignores (nested ones as a dotted path)."""
    names = list(req.model_extra or {})
    # Only a generation request declares stream_options; elsewhere it is an unknown field, of any type.
    stream_options = req.stream_options if isinstance(req, _GenerationRequest) else None
    if stream_options is not None:
        names += [f"stream_options.{k}" for k in stream_options.model_extra or {}]
    detection = req.repetition_detection if isinstance(req, _GenerationRequest) else None
    if detection is not None:
        names += [f"repetition_detection.{k}" for k in detection.model_extra or {}]
    if isinstance(req, ConversationRequest):
        for i, message in enumerate(req.messages):
            names += [f"messages.{i}.{k}" for k in message.model_extra or {}]
    return names


# vLLM's request fields that change what comes back and that this server does not implement: refused
# when set (a false or empty value, or the field's neutral value, changes nothing and passes), where
# an unknown field is only logged.
VLLM_UNSUPPORTED = ("logits_processors", "prompt_embeds", "structural_tag", "guided_whitespace_pattern",
                    "logprob_token_ids", "thinking_token_budget", "watermarking")
# vLLM's defaults, which clients that send every field send (a thinking budget of -1 is none), with the
# type vLLM's model reads each as ("-1" is no budget)
NEUTRAL_VALUES = {"thinking_token_budget": (int, -1)}
# vLLM's fields that take no effect on a text model (logged as ignored), with the type vLLM's model reads
# each as: another type is a 400 naming the field, as vLLM's is.
IGNORED_VLLM_TYPES = {"mm_processor_kwargs": dict}


def check_unsupported(req: _GenerationRequest, auto_tool_choice: bool = False,
                      tool_choices: ToolChoiceNames | None = None) -> None:
    """Refuse options this server does not implement instead of silently ignoring them
    (auto_tool_choice: the server has a tool call parser, so tool_choice "auto" is served;
    tool_choices: how the API the request came through spells tool_choice, for the refusal)."""
    extra = req.model_extra or {}
    for name in VLLM_UNSUPPORTED:
        value = extra.get(name)
        if value is not None and value is not False and value not in ([], {}, "") and not _is_neutral(name, value):
            raise APIError(400, f"{name} is not supported", param=name)
    check_ignored_types(extra, IGNORED_VLLM_TYPES)
    options = req.stream_options
    # OpenAI and vLLM refuse options without a stream; vLLM lets an empty object ({}) by, as here.
    if options is not None and (options.model_fields_set or options.model_extra) and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of must equal n (every completion sampled is returned; use_beam_search with n "
                       "beams returns the n best)", param="best_of")
    if not req.use_beam_search and req.length_penalty != 1.0:
        raise APIError(400, "length_penalty weighs beam search only: set use_beam_search true (or leave "
                       "length_penalty 1.0)", param="length_penalty")
    if isinstance(req, CompletionRequest) and req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if isinstance(req, ChatCompletionRequest):
        check_tool_choice(req, auto_tool_choice, tool_choices or CHAT_TOOL_CHOICES)
        if req.functions:
            raise APIError(400, "functions (the legacy form of tools) are not supported", param="functions")
        if req.function_call not in (None, "none"):
            raise APIError(400, "function_call is not supported", param="function_call")
        check_rendering(req)


def check_ignored_types(extra: dict[str, Any], kinds: dict[str, type]) -> None:
    """A 400 naming the field for a value of extra (a request's unknown fields) that is not of the
    type kinds gives its name; null passes."""
    for name, kind in kinds.items():
        value = extra.get(name)
        if value is not None:
            lax_value(value, kind, name)


def _is_neutral(name: str, value: Any) -> bool:
    """Whether value is vLLM's default of the unsupported field name, read as vLLM's model reads it (a
    value of another type is a 400 naming the field)."""
    if name not in NEUTRAL_VALUES:
        return False
    kind, neutral = NEUTRAL_VALUES[name]
    return lax_value(value, kind, name) == neutral


def check_rendering(req: ConversationRequest) -> None:
    """400 for rendering fields that exclude each other."""
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true "
                       "(set add_generation_prompt to false to continue the last message)",
                       param="continue_final_message")


def tool_choice_of(req: ChatCompletionRequest) -> Any:
    """tool_choice, defaulted as vLLM defaults it: "auto" when tools are given, else "none"."""
    if req.tool_choice is not None:
        return req.tool_choice
    return "auto" if req.tools else "none"


@dataclasses.dataclass(frozen=True)
class ToolChoiceNames:
    """How an API spells tool_choice's values, for the messages that name them."""

    auto: str
    none: str
    forced: str         # the choices that force a call
    required: str = '"required"'     # the one that forces a call of any of the tools


CHAT_TOOL_CHOICES = ToolChoiceNames('"auto"', '"none"', '"required" or a named tool '
                                    '({"type": "function", "function": {"name": ...}})')


def check_tool_choice(req: ChatCompletionRequest, auto_tool_choice: bool = False,
                      names: ToolChoiceNames = CHAT_TOOL_CHOICES) -> None:
    """400 for a tool_choice that needs a tool call parser ("auto" on a server started without
    --enable-auto-tool-choice, told in names' spelling), names no tools or a tool not among them.
    "required" and a named tool are served as vLLM serves them without a parser (server/tool_calls.py)."""
    if isinstance(req.tool_choice, dict) and req.tool_choice.get("type") == "allowed_tools":
        req.tools, req.tool_choice = allowed_tools(req.tool_choice, req.tools)
    choice = tool_choice_of(req)
    if choice == "none":
        return
    if req.tools is None:
        raise APIError(400, "When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if choice == "required":
        if not req.tools:       # OpenAI refuses an empty tools array; a call must be of one of them
            raise APIError(400, f"tool_choice {names.required} needs a tool to call, and tools is empty (send the "
                           f"tools, or tool_choice {names.none})", param="tool_choice")
        return
    if isinstance(choice, dict):
        check_named_tool_choice(choice, [tool.function.name for tool in req.tools])
        return
    if choice == "auto":
        if auto_tool_choice:
            return
        raise APIError(400, f'{names.auto} tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                       f'to be set (this server has no tool call parser: tool_choice {names.forced} holds the '
                       f'output to a call, {names.none} renders the tools into the prompt; tool_choice defaults '
                       f'to {names.auto} when tools are given)', param="tool_choice")
    raise APIError(400, f'tool_choice must be "none", "auto", "required" or a named tool '
                   f'({{"type": "function", "function": {{"name": ...}}}}), got {short_repr(choice)}',
                   param="tool_choice")


ALLOWED_TOOLS_MODES = ("auto", "required")


def allowed_tools(choice: dict, tools: list[Tool] | None) -> tuple[list[Tool], str]:
    """OpenAI's tool_choice {"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required", "tools":
    [{"type": "function", "function": {"name": N}}, ...]}} as (the tools it allows, in the request's order;
    tool_choice mode over them): the others are neither rendered nor called. A 400 naming the part at fault."""
    where = "tool_choice.allowed_tools"
    _refuse_other_keys(choice, "tool_choice", ("type", "allowed_tools"))
    allowed = choice.get("allowed_tools")
    if not isinstance(allowed, dict):
        raise APIError(400, f'{where} must be an object {{"mode": "auto" | "required", "tools": [{{"type": '
                       f'"function", "function": {{"name": ...}}}}, ...]}}, got {short_repr(allowed)}', param=where)
    _refuse_other_keys(allowed, where, ("mode", "tools"))
    mode = allowed.get("mode")
    if mode not in ALLOWED_TOOLS_MODES:
        raise APIError(400, f'{where}.mode must be "auto" or "required", got {short_repr(mode)}', param=f"{where}.mode")
    entries = allowed.get("tools")
    if not isinstance(entries, list) or not entries:
        raise APIError(400, f"{where}.tools must be a non-empty list of the tools that may be called, got "
                       f"{short_repr(entries)}", param=f"{where}.tools")
    if tools is None:
        raise APIError(400, "When using `tool_choice`, `tools` must be set.", param="tool_choice")
    names = {tool.function.name for tool in tools}
    chosen = set()
    for i, entry in enumerate(entries):
        at = f"{where}.tools.{i}"
        kind = entry.get("type") if isinstance(entry, dict) else None
        if kind != "function":
            served = "custom tools are not served" if kind == "custom" else "only function tools are served"
            raise APIError(400, f'{at} must be {{"type": "function", "function": {{"name": ...}}}} ({served}), got '
                           f"{short_repr(entry)}", param=f"{at}.type")
        function = entry.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or name not in names:
            raise APIError(400, f"{at}.function.name must name one of the request's tools, got {short_repr(name)}",
                           param=f"{at}.function.name")
        chosen.add(name)
    return [tool for tool in tools if tool.function.name in chosen], mode


def _refuse_other_keys(obj: dict, where: str, keys: tuple[str, ...]) -> None:
    """A 400 naming where.key for a key of obj outside keys (one this server would otherwise drop)."""
    other = next((key for key in obj if key not in keys), None)
    if other is not None:
        raise APIError(400, f"{where} takes only {', '.join(keys)}, got {short_repr(other)}", param=f"{where}.{other}")


def template_tools(req: ConversationRequest) -> list[dict] | None:
    """The tools the chat template renders, as vLLM passes them: under every tool_choice of a chat
    completion that is served (none, required, a named tool); /tokenize has no tool_choice."""
    if req.tools is None:
        return None
    return [tool.model_dump() for tool in req.tools]


def to_sampling_params(req: _GenerationRequest, max_tokens: int | None, logprobs: int | None,
                       vocab_size: int | None = None, structured_outputs=None,
                       prompt_logprobs: int | None = None, max_model_len: int | None = None,
                       defaults: dict | None = None) -> SamplingParams:
    """Build validated SamplingParams; a bad value becomes a 400 naming the field.

    structured_outputs: the request's StructuredOutputsParams (server/structured.py), or None;
    prompt_logprobs: completions with echo and logprobs score the prompt too; max_model_len: the
    context, which truncate_prompt_tokens may not exceed (vLLM's rule); defaults: the model's
    sampling defaults (minillm/generation_config.py) for the fields the request leaves unset."""
    defaults = defaults or {}
    repetition_detection = repetition_detection_of(req)

    def pick(value, name: str, neutral):
        """The request's value; else the model's default for the field; else the neutral one."""
        return value if value is not None else defaults.get(name, neutral)

    try:
        params = SamplingParams(
            n=req.n,
            temperature=pick(req.temperature, "temperature", 1.0),
            top_p=pick(req.top_p, "top_p", 1.0),
            top_k=pick(req.top_k, "top_k", -1),     # past the vocabulary: all of it (sampler_top_k)
            min_p=pick(req.min_p, "min_p", 0.0),
            seed=req.seed,
            presence_penalty=pick(req.presence_penalty, "presence_penalty", 0.0),
            frequency_penalty=pick(req.frequency_penalty, "frequency_penalty", 0.0),
            repetition_penalty=pick(req.repetition_penalty, "repetition_penalty", 1.0),
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            structured_outputs=structured_outputs,
            logit_bias=logit_bias_ids(req.logit_bias),
            prompt_logprobs=prompt_logprobs,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words,
            extra_args=dict(req.vllm_xargs) if req.vllm_xargs else None,
            repetition_detection=repetition_detection,
        )
        if vocab_size is not None:
            params.validate_for_vocab(vocab_size)
        if max_model_len is not None:
            check_truncate_prompt_tokens(params.truncate_prompt_tokens, max_model_len)
    except ValueError as exc:
        raise bad_request_from_value_error(exc) from None
    return params


def repetition_detection_of(req: _GenerationRequest) -> RepetitionDetectionParams | None:
    """The request's repetition_detection (vLLM's object, or its earlier three fields: all 0 is none),
    checked as vLLM checks it; a 400 naming the field at fault, as the request spelled it."""
    flat = {new: getattr(req, old) for old, new in VLLM_REPETITION_FIELDS.items()}
    given = req.repetition_detection
    if given is not None:
        old = next((old for old, new in VLLM_REPETITION_FIELDS.items() if flat[new]), None)
        if old is not None:
            raise APIError(400, f"{old} is vLLM's earlier spelling of repetition_detection, which is given too: "
                           f"give one", param=old)
        values, names = given.model_dump(include=set(REPETITION_DETECTION_FIELDS)), {
            name: f"repetition_detection.{name}" for name in REPETITION_DETECTION_FIELDS}
    elif any(flat.values()):
        values, names = flat, {new: old for old, new in VLLM_REPETITION_FIELDS.items()}
    else:
        return None
    try:
        detection = RepetitionDetectionParams(**values)
    except ValueError as exc:
        message = renamed(str(exc), names)
        raise APIError(400, message, param=message.split(" ", 1)[0]) from None
    try:
        check_scan_work(detection)
    except ValueError as exc:
        raise APIError(400, str(exc), param="repetition_detection" if given is not None
                       else "max_repetition_pattern_size") from None
    return detection


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON object keys) keyed by int, each bias clamped to
    [-100, 100] as vLLM clamps it; None when empty."""
    if not bias:
        return None
    bad = [k for k in bias if not (k.isascii() and k.isdigit())]
    if bad:
        raise APIError(400, f"logit_bias keys must be token ids (decimal integers), got {short_repr(bad)}",
                       param="logit_bias")
    # int() refuses over 4300 digits, with a ValueError that names no field.
    long = [k for k in bias if len(k) > MAX_TOKEN_ID_DIGITS]
    if long:
        raise APIError(400, f"logit_bias keys must be token ids, got one of {len(long[0])} digits", param="logit_bias")
    out: dict[int, float] = {}
    named: dict[int, str] = {}                 # token id -> the key that named it
    for k, v in bias.items():
        token = int(k)
        if token in named:                     # "5" and "0005": which bias was meant?
            raise APIError(400, f"logit_bias names token {token} twice ({named[token]!r} and {k!r})",
                           param="logit_bias")
        named[token], out[token] = k, min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, v))
    return out


def chat_max_tokens(req: ChatCompletionRequest) -> int | None:
    """max_completion_tokens wins over the deprecated max_tokens."""
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def chat_max_tokens_field(req: ChatCompletionRequest) -> str:
    """The field chat_max_tokens read (what an error about the completion's length names)."""
    return "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"


def chat_logprobs(req: ChatCompletionRequest, max_logprobs: int = MAX_LOGPROBS) -> int | None:
    """The number of top log-probabilities to compute for a chat request, or None; max_logprobs: the
    server's bound (a count past it is a 400 naming top_logprobs, the field that asked for it)."""
    # top_logprobs 0 asks for nothing, so it passes without logprobs (vLLM's default value of the field)
    if req.top_logprobs is not None and req.top_logprobs != 0 and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    if not req.logprobs:
        return None
    top = req.top_logprobs or 0
    if not 0 <= top <= max_logprobs:
        bound = "" if max_logprobs == MAX_LOGPROBS else " (the server's max_logprobs)"
        raise APIError(400, f"top_logprobs must be an integer in [0, {max_logprobs}]{bound}, got {top}",
                       param="top_logprobs")
    return top


def requested_prompt_logprobs(req: _GenerationRequest, max_logprobs: int, vocab_size: int) -> int | None:
    """vLLM's prompt_logprobs (-1: the whole vocabulary) as a count, or None; a 400 where vLLM refuses it."""
    # vLLM refuses a value past max_logprobs, one below -1, and one above 0 on a stream (whose chunks
    # have no place for them).
    value = req.prompt_logprobs
    if value is None:
        return None
    if req.stream and (value > 0 or value == -1):
        raise APIError(400, "prompt_logprobs are not available when stream is true", param="prompt_logprobs")
    if value < -1:
        raise APIError(400, f"prompt_logprobs must be a non-negative integer, or -1 for the whole vocabulary, "
                       f"got {short_repr(value)}", param="prompt_logprobs")
    num_top = vocab_size if value == -1 else value
    if num_top > max_logprobs:
        raise APIError(400, f"Requested prompt logprobs of {short_repr(num_top)}, which is greater than max "
                       f"allowed: {max_logprobs}", param="prompt_logprobs")
    return num_top


def messages_as_dicts(req: ConversationRequest) -> list[dict]:
    """Messages as the plain dicts a chat template reads, as vLLM passes them: multi-part content as
    a list of text parts {"type": "text", "text": ...} (render_chat joins them by newlines, or keeps
    them for a template that reads parts), no content as ""; an assistant's tool_calls (arguments
    parsed from JSON) and reasoning (also as reasoning_content); a tool's tool_call_id; a developer's
    tools; any message's name and task."""
    out = []
    for i, msg in enumerate(req.messages):
        content = msg.content
        if isinstance(content, list):
            content = [{"type": "text", "text": _part_text(part, f"messages.{i}.content.{j}")}
                       for j, part in enumerate(content)]
        item = {"role": msg.role, "content": "" if content is None else content}
        if msg.name is not None:
            item["name"] = msg.name
        if msg.task is not None:
            item["task"] = msg.task
        if msg.role == "developer" and msg.tools is not None:
            item["tools"] = [tool.model_dump(exclude_none=True) for tool in msg.tools]
        if msg.role == "assistant":
            if msg.tool_calls:          # an empty list is left out: the template takes its plain path
                item["tool_calls"] = [_tool_call_dict(call, f"messages.{i}.tool_calls.{j}")
                                      for j, call in enumerate(msg.tool_calls)]
            reasoning = msg.reasoning if msg.reasoning is not None else msg.reasoning_content
            if reasoning is not None:
                item["reasoning"] = item["reasoning_content"] = reasoning
        elif msg.role == "tool" and msg.tool_call_id is not None:
            item["tool_call_id"] = msg.tool_call_id
        out.append(item)
    return out


def _tool_call_dict(call: ToolCall, param: str) -> dict:
    """A tool call as templates read it: arguments as data, parsed from their JSON text ({} for none)."""
    item = call.model_dump(exclude_none=True)
    text = call.function.arguments
    try:
        item["function"]["arguments"] = _check_json_text(json.loads(text)) if text else {}
    except (ValueError, RecursionError) as exc:     # PydanticCustomError (a lone surrogate) is a ValueError
        raise APIError(400, f"tool call arguments must be JSON text: {json_error_reason(exc)}",
                       param=f"{param}.function.arguments") from None
    return item


def _part_text(part: str | ContentPart, param: str) -> str:
    """The text of one content part (param: where it is); 400 for a part that holds no text."""
    if isinstance(part, str):
        return part
    key = TEXT_PART_KEYS.get(part.type)
    if key is None:
        raise APIError(400, f"content part type {short_repr(part.type)} is not supported (only text parts: "
                       f"{', '.join(map(repr, TEXT_PART_KEYS))})", param=f"{param}.type")
    text = getattr(part, key)
    if text is None:
        raise APIError(400, f"a {part.type} content part needs its {key}", param=f"{param}.{key}")
    return text


def message_chars(messages: list[dict]) -> int:
    """Characters of text in a conversation (what rendering and tokenising will have to read)."""
    return sum(_text_chars(value) for m in messages for key, value in m.items() if key != "role")


def _text_chars(value: Any) -> int:
    """Characters of the strings in JSON data, keys included (a loop: tool arguments nest deep)."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The prompt field as a list of prompts (a string, a token list, or a batch of either)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and isinstance(prompt[0], int):     # validated as one of the union's lists: all ints
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    # As vLLM: a prompt that is "" is refused, and token lists of nothing; "" in a batch is BOS alone
    # (as LLM.generate takes it), or no tokens, refused once tokenized.
    if prompt == "" or not prompts or any(isinstance(p, list) and not p for p in prompts):
        raise APIError(400, "prompt must not be empty", param="prompt")
    return prompts
