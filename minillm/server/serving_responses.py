"""POST /v1/responses: OpenAI's Responses API over the chat path, as vLLM serves it for text models.

A request's `instructions` and `input` (a string, or items: messages, function calls and their
outputs, reasoning) become a chat conversation; `tools` (function tools), `tool_choice`,
`text.format`, `max_output_tokens`, `temperature`, `top_p` and `reasoning.effort` become the chat
request's fields; the chat job renders, samples and parses (structured outputs, --reasoning-parser, --tool-call-parser,
forced tool calls) as it does for /v1/chat/completions, and its reply becomes output items:
`reasoning`, a `message` of `output_text`, and `function_call`s. A stream sends the Responses
events (response.created, output_item.added, output_text.delta, ..., response.completed, or
response.incomplete when max_output_tokens cut it; response.failed, with the response's error and its
output as far as it came, when the request fails after the stream began). The terminal event carries
the whole response, as OpenAI's API sends it (vLLM ends every stream with response.completed, an
incomplete one included); the openai SDK's stream helper's get_final_response reads only
response.completed, so after a cut stream the response is the response.incomplete event's.

An input that ends with an assistant message left incomplete or in progress is continued (chat's
continue_final_message), as vLLM continues it. A function_call_output answers a function_call item
before it in input (one whose call_id no such item has is a 400 naming input, as OpenAI refuses it).

Responses are not stored: `store` is answered false, a `previous_response_id` is a 404 (none is
found, as on a vLLM server without its response store), and `background` and `conversation` are 400s.
An assistant message's `refusal` part sent back is read as its words.

`truncation` "auto" drops the conversation's earliest messages (never a system message or the instructions,
and a tool's output only with its call) until the prompt and max_output_tokens fit the context, as OpenAI's
API drops input items; "disabled", the default, leaves a prompt past the context a 400.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any

from fastapi import Request
from pydantic import Field, create_model, field_validator, model_validator
from pydantic_core import PydanticCustomError

from minillm.outputs import CompletionOutput, RequestOutput
from minillm.sampling_params import short_repr
from minillm.server.errors import APIError, json_error_reason, response_failed_event
from minillm.server.logprobs import LogprobRow, chat_logprobs
from minillm.server.protocol import (
    ALLOWED_TOOLS_MODES, REASONING_EFFORTS, ChatCompletionRequest, Text, ToolChoiceNames, _check_json_text,
    _ModelRequest, chat_max_tokens, check_ignored_types, check_text, lax_value,
)
from minillm.server.serving import ServingContext, client_response_id, json_dumps, stream_failure
from minillm.server.structured import _refuse_unknown_keys
from minillm.server.tool_calls import TOOL_CALL_ID_PREFIX, tool_call
from minillm.server.translated_api import ReplyWriter, TranslatedJob, field_of, serve_translated, tool_param

# Chat fields (as errors raised on the chat side name them) -> the Responses field they came from;
# the longest prefix of a param that is listed is replaced.
CHAT_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
               "response_format.json_schema": "text.format", "response_format": "text.format"}
# vLLM's extensions a Responses request may carry, taken as a chat request takes them.
CHAT_EXTRAS = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
               "chat_template_kwargs", "structured_outputs", "include_reasoning", "cache_salt",
               "priority", "logit_bias", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
               "vllm_xargs")
# vLLM's fields that a text model takes without effect (logged as ignored), with the type vLLM's request
# model reads each as (another is a 400 naming the field), and OpenAI's safety_identifier; the response
# echoes max_tool_calls and service_tier, and prompt_cache_key and safety_identifier as OpenAI's does.
IGNORED_TYPES = {"max_tool_calls": int, "prompt_cache_key": str, "mm_processor_kwargs": dict,
                 "media_io_kwargs": dict, "previous_input_messages": list, "safety_identifier": str}
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
TOOL_CHOICES = ToolChoiceNames('"auto"', '"none"', '"required" or {"type": "function", "name": ...}')
# reasoning's and text's values as vLLM takes them (OpenAI's Reasoning and ResponseTextConfig types); effort
# and verbosity change nothing for a model without such settings, but a value outside these is a client's
# mistake, refused as vLLM refuses it.
TEXT_VALUES = {"verbosity": ("low", "medium", "high")}
REASONING_VALUES = {"effort": REASONING_EFFORTS,
                    "summary": ("auto", "concise", "detailed"), "generate_summary": ("auto", "concise", "detailed")}
# text.format's keys for each of its types (OpenAI's ResponseFormatText, ...JSONObject, ...TextJSONSchemaConfig).
TEXT_FORMAT_KEYS = {"text": ("type",), "json_object": ("type",),
                    "json_schema": ("type", "name", "schema", "strict", "description")}
# include values there is nothing to include for (no encrypted reasoning is made): taken, changing nothing.
INCLUDE_NOTHING = ("reasoning.encrypted_content",)
# include's value that asks for each output_text's logprobs (top_logprobs alternatives a token), as vLLM serves it.
OUTPUT_LOGPROBS = "message.output_text.logprobs"
TRUNCATIONS = ("auto", "disabled")
# The request's fields of free JSON that the response carries back as they came.
ECHOED_AS_SENT = ("tools", "tool_choice", "reasoning", "text")
# OpenAI's bounds on metadata (vLLM's Metadata type maps strings to strings and bounds nothing): the
# response, and every event of a stream, carries it back.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def check_json_value(value: Any, where: str) -> None:
    """A 400 naming the place in value (where, as this API names fields) of a string with a lone
    surrogate or a number that is NaN or infinite: neither can be written back as JSON. Iterative, so
    that a value as deep as the JSON reader takes does not exhaust the stack."""
    pending = [(value, where)]
    while pending:
        item, at = pending.pop()
        if isinstance(item, str):
            try:
                check_text(item)
            except PydanticCustomError as exc:
                raise APIError(400, f"{at}: {exc.message()}", param=at) from None
        elif isinstance(item, float) and not math.isfinite(item):
            raise APIError(400, f"{at}: Input should be a finite number, got {json.dumps(item)}", param=at)
        elif isinstance(item, dict):
            for key in item:
                try:
                    check_text(key)
                except PydanticCustomError:
                    raise APIError(400, f"{at} has a key that is not valid Unicode (a lone surrogate such as "
                                   f"\\ud800)", param=at) from None
            pending += reversed([(member, f"{at}.{key}") for key, member in item.items()])
        elif isinstance(item, list):
            pending += reversed([(member, f"{at}[{i}]") for i, member in enumerate(item)])


# vLLM's sampling extensions (CHAT_EXTRAS): declared, so that none is logged as ignored, and passed on as
# the chat request's fields, which check them.
_WithChatExtras = create_model("_WithChatExtras", __base__=_ModelRequest, **{name: (Any, None) for name in CHAT_EXTRAS})


class ResponsesRequest(_WithChatExtras):
    """POST /v1/responses (the fields of OpenAI's that a text model can serve; others are logged)."""

    input: Text | list[dict[str, Any]]
    instructions: Text | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    previous_response_id: Text | None = None
    background: bool = False
    truncation: Text | None = None
    metadata: dict[Text, Text] | None = None          # OpenAI's (and vLLM's) metadata: strings to strings
    user: Text | None = None
    include: list[Text] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)    # as OpenAI bounds it; used with include's OUTPUT_LOGPROBS
    request_id: Text | None = None
    # vLLM's: the response also holds the prompt and the output as raw text and token ids
    enable_response_messages: bool = False
    prompt: Any = None                  # OpenAI's stored prompt template (refused)
    conversation: Any = None            # OpenAI's stored conversation (refused: none is stored)

    @field_validator("input")
    @classmethod
    def _json_text(cls, value: Any) -> Any:
        """Text deep in the items is checked here, so an error names this API's field."""
        return _check_json_text(value)

    @model_validator(mode="after")
    def _echoed_as_json(self) -> ResponsesRequest:
        """The fields the response echoes as sent hold only what JSON can carry back (a 400 naming
        where one does not: a 500, or a stream cut after its headers, otherwise)."""
        for name in ECHOED_AS_SENT:
            check_json_value(getattr(self, name), name)
        check_metadata(self.metadata)
        return self


def check_metadata(metadata: dict[str, str] | None) -> None:
    """A 400 naming metadata for more pairs, or a longer key or value, than OpenAI's bounds."""
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise APIError(400, f"metadata holds at most {MAX_METADATA_PAIRS} key-value pairs, got {len(metadata)}",
                       param="metadata", code="object_above_max_properties")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise APIError(400, f"metadata's keys are at most {MAX_METADATA_KEY_CHARS} characters, got "
                           f"{short_repr(key)}", param="metadata",
                           code="string_above_max_length")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise APIError(400, f"metadata.{key}: a value is at most {MAX_METADATA_VALUE_CHARS} characters, got "
                           f"{len(value)}", param=f"metadata.{key}", code="string_above_max_length")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _check_unserved(req: ResponsesRequest) -> None:
    """400 (404 for a previous response) for what a server without a response store, or a text model,
    cannot do."""
    if req.previous_response_id is not None:
        # None is stored, so none is found: a 404, as OpenAI and vLLM (without its store) answer an unknown id.
        raise APIError(404, f"Previous response with id {short_repr(req.previous_response_id)} not found: this "
                       f"server does not store responses (send the conversation in input)",
                       param="previous_response_id", code="previous_response_not_found",
                       type="invalid_request_error")
    if req.conversation is not None:
        raise APIError(400, f"conversation is not supported: this server does not store conversations (send the "
                       f"conversation in input), got {short_repr(req.conversation)}", param="conversation")
    if req.background:
        raise APIError(400, "background is not supported: this server does not store responses", param="background")
    if req.prompt is not None:      # as vLLM refuses it: the template it names is not here to use
        raise APIError(400, "prompt templates are not supported: send the conversation in input", param="prompt")
    if req.truncation not in (None, *TRUNCATIONS):
        raise APIError(400, f'truncation must be "auto" (the earliest input items dropped until the rest fits the '
                       f'context) or "disabled" (a prompt past the context is a 400), got {short_repr(req.truncation)}',
                       param="truncation")
    for name in req.include or []:
        if name not in (*INCLUDE_NOTHING, OUTPUT_LOGPROBS):
            raise APIError(400, f"include: {name!r} is not supported", param="include")
    _check_values(req.reasoning, "reasoning", REASONING_VALUES)
    _check_values(req.text, "text", TEXT_VALUES)
    extra = req.model_extra or {}
    check_ignored_types(extra, IGNORED_TYPES)
    tier = extra.get("service_tier")
    if tier is not None and tier not in SERVICE_TIERS:
        raise APIError(400, f"service_tier must be one of {', '.join(SERVICE_TIERS)}, got {short_repr(tier)}",
                       param="service_tier")
    if extra.get("kv_transfer_params") is not None:      # the chat path's KV transfer is not wired here
        raise APIError(400, "kv_transfer_params is not supported on /v1/responses (send the request to "
                       "/v1/chat/completions)", param="kv_transfer_params")


def _check_values(obj: dict | None, where: str, choices: dict[str, tuple[str, ...]]) -> None:
    """400 naming where.key (reasoning.effort, text.verbosity) for a value OpenAI's API does not take."""
    for key, values in choices.items():
        value = (obj or {}).get(key)
        if value is not None and value not in values:
            raise APIError(400, f"{where}.{key} must be one of {', '.join(values)}, got {short_repr(value)}",
                           param=f"{where}.{key}")


# ---- the request as a chat request ------------------------------------------------------------------

def _content_parts(content: Any, where: str) -> Any:
    """Content of a Responses message (or a function_call_output's output, where names it) as chat
    content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content parts", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": field_of(part, "text", f"{where}[{j}]", str)})
        elif kind == "refusal":        # an assistant's earlier refusal sent back: its words, as chat reads them
            parts.append({"type": "text", "text": field_of(part, "refusal", f"{where}[{j}]", str)})
        elif kind in ("input_image", "input_file"):
            raise APIError(400, f"{where}[{j}]: {kind} parts are not supported: this server's model reads text "
                           f"only", param=f"{where}[{j}].type")
        else:
            raise APIError(400, f"{where}[{j}].type must be input_text, output_text or refusal, got {kind!r}",
                           param=f"{where}[{j}].type")
    return parts


def _reasoning_text(item: dict, where: str) -> str:
    """The text of a reasoning input item: its content's reasoning_text parts, else its summary's."""
    texts = []
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts is not None and not isinstance(parts, list):
            raise APIError(400, f"{where}.{key} must be a list of parts", param=f"{where}.{key}")
        texts = texts or [p.get("text") for p in parts or [] if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return "\n".join(texts)


def _arguments(item: dict, where: str) -> str:
    """A function_call item's arguments: JSON text (a 400 naming them otherwise)."""
    arguments = field_of(item, "arguments", where, str)
    try:
        json.loads(arguments)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"{where}.arguments must be JSON text: {json_error_reason(exc)}",
                       param=f"{where}.arguments") from None
    return arguments


def _messages(req: ResponsesRequest) -> list[dict]:
    """The chat conversation of instructions and input."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    reasoning, reasoning_at = None, ""    # a reasoning item goes with the assistant turn after it
    call_ids: set[str] = set()            # the function_call items' so far
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role must be user, system, developer or assistant, got {role!r}",
                               param=f"{where}.role")
            message = {"role": "system" if role == "developer" else role,
                       "content": _content_parts(item.get("content"), f"{where}.content")}
            if role == "assistant" and reasoning is not None:
                message["reasoning"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call_id = field_of(item, "call_id", where, str)
            call_ids.add(call_id)
            call = {"id": call_id, "type": "function",
                    "function": {"name": field_of(item, "name", where, str), "arguments": _arguments(item, where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    message["reasoning"], reasoning = reasoning, None
                messages.append(message)
        elif kind == "function_call_output":
            call_id = field_of(item, "call_id", where, str)
            content = _content_parts(item.get("output"), f"{where}.output")
            if call_id not in call_ids:       # as OpenAI refuses it: which call would it answer?
                shown = call_id if len(call_id) <= 64 else short_repr(call_id)
                raise APIError(400, f"No tool call found for function call output with call_id {shown} ({where}: "
                               f"no function_call item before it has that call_id)", param="input")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif kind == "reasoning":
            reasoning, reasoning_at = _reasoning_text(item, where), where
        else:
            raise APIError(400, f"{where}.type must be message, function_call, function_call_output or reasoning, "
                           f"got {kind!r}", param=f"{where}.type")
    if not messages and reasoning is not None:
        # Only reasoning items: the chat request would have no messages ("at least 1 item", of an input that has some).
        raise APIError(400, f"{reasoning_at} is a reasoning item with no message after it, and input has no message "
                       f"to answer (a reasoning item goes with the assistant message or function_call after it)",
                       param=reasoning_at)
    if reasoning is not None:           # it ends the input: an assistant turn of that reasoning, as vLLM renders it
        messages.append({"role": "assistant", "content": "", "reasoning": reasoning})
    return messages


def _tools(tools: list[dict] | None) -> list[dict] | None:
    """Function tools in the chat shape ({"type": "function", "function": {...}})."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(400, f"tools[{i}].type must be function ({_unserved_tools(tool.get('type'))}), got "
                           f"{tool.get('type')!r}", param=f"tools[{i}].type")
        field_of(tool, "name", f"tools[{i}]", str)
        field_of(tool, "description", f"tools[{i}]", str, optional=True)
        field_of(tool, "parameters", f"tools[{i}]", dict, optional=True)
        field_of(tool, "strict", f"tools[{i}]", bool, optional=True)
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def _unserved_tools(kind: Any) -> str:
    """What is not served of a tool (or tool_choice) type other than function."""
    if kind == "custom":
        return "custom tools, which take free-form text, are not served"
    return "built-in tools are not served"


def _tool_choice(choice: Any, tools: list[dict] | None) -> Any:
    """tool_choice ("none", "auto", "required", {"type": "function", "name": N} or {"type": "allowed_tools",
    ...}) in the chat shape; a 400 in this API's terms for any other (the chat request's would show its own
    shape). tools: the request's (checked by _tools), which allowed_tools names from."""
    usage = 'use {"type": "function", "name": "my_function"}'
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if not isinstance(choice, dict):
        raise APIError(400, f'tool_choice must be "none", "auto", "required" or a function tool ({usage}), got '
                       f"{short_repr(choice)}", param="tool_choice")
    if choice.get("type") == "allowed_tools":
        return _allowed_tools(choice, tools)
    if choice.get("type") != "function":
        unserved = _unserved_tools(choice.get("type"))
        raise APIError(400, f"tool_choice.type must be function or allowed_tools ({unserved}): {usage}, got "
                       f"{short_repr(choice.get('type'))}", param="tool_choice.type")
    name = choice.get("name")
    if not isinstance(name, str) or not name:
        raise APIError(400, f"tool_choice.name must be a tool's name: {usage}", param="tool_choice.name")
    return {"type": "function", "function": {"name": name}}


def _allowed_tools(choice: dict, tools: list[dict] | None) -> dict:
    """OpenAI's {"type": "allowed_tools", "mode": "auto" | "required", "tools": [{"type": "function", "name":
    N}, ...]} in the chat shape (which serves it as tool_choice mode over those tools alone); a 400 naming
    the part at fault as this API names it."""
    _refuse_unknown_keys(choice, "tool_choice", ("type", "mode", "tools"))
    mode = choice.get("mode")
    if mode not in ALLOWED_TOOLS_MODES:
        raise APIError(400, f'tool_choice.mode must be "auto" or "required", got {short_repr(mode)}',
                       param="tool_choice.mode")
    entries = choice.get("tools")
    if not isinstance(entries, list) or not entries:
        raise APIError(400, f"tool_choice.tools must be a non-empty list of the tools that may be called, got "
                       f"{short_repr(entries)}", param="tool_choice.tools")
    names = {tool.get("name") for tool in tools or []}
    chosen = []
    for i, entry in enumerate(entries):
        at = f"tool_choice.tools[{i}]"
        kind = entry.get("type") if isinstance(entry, dict) else None
        if kind != "function":
            raise APIError(400, f'{at} must be {{"type": "function", "name": ...}} ({_unserved_tools(kind)}), got '
                           f"{short_repr(entry)}", param=f"{at}.type")
        name = entry.get("name")
        if not isinstance(name, str) or name not in names:
            raise APIError(400, f"{at}.name must name one of the request's tools, got {short_repr(name)}",
                           param=f"{at}.name")
        chosen.append({"type": "function", "function": {"name": name}})
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": chosen}}


def _response_format(text: dict | None) -> dict | None:
    """text.format as a chat response_format (None for plain text)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, "text.format.type must be text, json_object or json_schema", param="text.format")
    # A key this server would drop (a schema sent with json_object, a misspelt name) is refused, as chat
    # refuses one in response_format.
    _refuse_unknown_keys(fmt, "text.format", TEXT_FORMAT_KEYS[fmt["type"]])
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def asks_for_logprobs(req: ResponsesRequest) -> bool:
    """Whether req's include asks for the output_text parts' logprobs."""
    return OUTPUT_LOGPROBS in (req.include or [])


def chat_body(req: ResponsesRequest) -> dict:
    """The chat completion request that serves req (a 400 for what this server does not do)."""
    _check_unserved(req)
    body = {"model": req.model, "messages": _messages(req), "stream": req.stream}
    fields = {"max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
              "tools": _tools(req.tools), "tool_choice": _tool_choice(req.tool_choice, req.tools),
              "parallel_tool_calls": req.parallel_tool_calls, "response_format": _response_format(req.text),
              "user": req.user, "reasoning_effort": (req.reasoning or {}).get("effort")}
    if asks_for_logprobs(req):      # vLLM's top_logprobs defaults to 0: each token's own logprob only
        fields.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    body.update({k: v for k, v in fields.items() if v is not None})
    body.update({name: getattr(req, name) for name in CHAT_EXTRAS if name in req.model_fields_set})
    if ends_with_partial_message(req):
        body.update(continue_final_message=True, add_generation_prompt=False)
    return body


def ends_with_partial_message(req: ResponsesRequest) -> bool:
    """Whether input ends with an assistant message left incomplete or in progress (an output fed back
    to go on with), which the reply continues, as vLLM continues it."""
    last = req.input[-1] if isinstance(req.input, list) and req.input else None
    return isinstance(last, dict) and last.get("type", "message") == "message" and last.get("role") == "assistant" \
        and last.get("status") in ("incomplete", "in_progress")


def _renamed(exc: APIError) -> APIError:
    """A chat-side error with its param, and the fields its message names, as the Responses request
    names them (a message's index in input differs from its index in messages: the param is input)."""
    param = tool_param(exc.param, {})
    message = exc.message.replace(exc.param, param) if param != exc.param else exc.message
    for chat_name, name in CHAT_PARAMS.items():
        if param is not None and (param == chat_name or param.startswith(chat_name + ".")):
            param = name if chat_name == "messages" else name + param[len(chat_name):]
        if chat_name != "messages":          # a word of prose too: only where it leads, as a field
            message = message.replace(chat_name, name)
        elif message.startswith("messages"):
            message = "input" + message[len("messages"):]
    return APIError(exc.status, message, param, exc.code, exc.type)


# ---- the reply as output items ------------------------------------------------------------------------

def _raw_message(text: str, token_ids) -> dict:
    """vLLM's raw_message_tokens entry: a text and the token ids it came from."""
    return {"message": text, "tokens": list(token_ids), "type": "raw_message_tokens"}


def _text_part(text: str, logprobs: list[dict] | None = None) -> dict:
    """An output_text part; logprobs: its tokens' (chat's logprobs content, OpenAI's Logprob shape)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message_item(item_id: str, text: str, status: str = "completed", logprobs: list[dict] | None = None) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [_text_part(text, logprobs)] if text else []}


def _event_logprobs(logprobs: list[dict]) -> list[dict]:
    """Logprobs in the shape of output_text's delta and done events (OpenAI's ResponseTextDeltaEvent: no bytes)."""
    return [{"token": lp["token"], "logprob": lp["logprob"],
             "top_logprobs": [{"token": top["token"], "logprob": top["logprob"]} for top in lp["top_logprobs"]]}
            for lp in logprobs]


def _reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call: dict) -> dict:
    """A chat tool call as a function_call output item; its call_id is OpenAI's shape (call_...),
    which the client sends back in the function_call_output item. Arguments that are no whole JSON (a
    named call that max_output_tokens cut) make the item "incomplete", as OpenAI marks a cut item."""
    arguments = call["function"]["arguments"]
    return {"type": "function_call", "id": _new_id("fc"), "call_id": "call_" + call["id"].removeprefix(TOOL_CALL_ID_PREFIX),
            "name": call["function"]["name"], "arguments": arguments,
            "status": "completed" if _is_json(arguments) else "incomplete"}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _kept_from(messages: list[dict], start: int) -> list[dict]:
    """The messages truncation keeps when the conversation resumes at start: those from start on, and every
    system message before it."""
    return [message for message in messages[:start] if message["role"] == "system"] + messages[start:]


def response_status(comp: CompletionOutput) -> str:
    """A finished reply's status, whole or streamed: "incomplete" when max_output_tokens cut the output
    (by the output's own finish, so a call the parser found in an output cut short is incomplete too)."""
    return "incomplete" if comp.finish_reason == "length" else "completed"


class ResponsesJob(TranslatedJob):
    """A chat job whose reply is a Responses object (or its event stream)."""

    rename = staticmethod(_renamed)
    tool_choices = TOOL_CHOICES

    def __init__(self, ctx: ServingContext, req: ResponsesRequest, chat: ChatCompletionRequest,
                 raw: Request | None = None) -> None:
        super().__init__(ctx, chat)
        self.responses_req = req
        chosen = client_response_id("resp", raw, req.request_id) if raw is not None else None
        # The response's id is also the stem of the engine's (resp-<id>-<8 hex>), as chat's is: /v1/stats shows it.
        self.request_id = self.response_id = chosen or _new_id("resp")
        self.sequence = 0

    def _render(self) -> list[int]:
        """The conversation's token ids; under truncation "auto", those of its latest messages that fit the
        context with max_output_tokens."""
        ids = super()._render()
        max_prompt_tokens = self.ctx.engine.max_model_len - (chat_max_tokens(self.req) or 1)
        if self.responses_req.truncation != "auto" or len(ids) <= max_prompt_tokens:
            return ids
        messages = self.conversation.messages
        # Where the kept messages may begin: not at a system message (all are kept) nor at a tool's output.
        starts = [i for i, message in enumerate(messages) if message["role"] not in ("system", "tool")]
        fitting: tuple[int, list[int], str] | None = None     # (the earliest start found to fit, its ids, its text)
        low, high = 0, len(starts)
        while low < high:     # a binary search: a few renderings, however long the conversation
            middle = (low + high) // 2
            self.conversation.messages = _kept_from(messages, starts[middle])
            ids = super()._render()
            if len(ids) <= max_prompt_tokens:
                fitting, high = (middle, ids, self.conversation.text), middle
            else:
                low = middle + 1
        if fitting is None:       # ids: the last message's (the last start tried)
            raise APIError(400, f"This model's maximum context length is {self.ctx.engine.max_model_len} tokens: "
                           f"input's last message ({len(ids)} tokens with the instructions) and "
                           f"max_output_tokens ({chat_max_tokens(self.req) or 1}) do not fit it, even with the "
                           f"items before it dropped (truncation auto)", param="input", code="context_length_exceeded")
        self.conversation.messages = _kept_from(messages, starts[fitting[0]])
        self.conversation.text = fitting[2]      # the prompt sent, not the last one tried
        return fitting[1]

    def _usage(self, final: RequestOutput) -> dict:
        # cache_write_tokens: OpenAI's (its SDK's InputTokensDetails requires it); the prefix cache
        # keeps blocks on its own, no request writes a cache entry it is billed for.
        num_in, num_out = len(final.prompt_token_ids), sum(len(c.token_ids) for c in final.outputs)
        details = {"cached_tokens": final.num_cached_tokens or 0, "cache_write_tokens": 0}
        num_reasoning = self.reasoning_tokens(final) or 0      # the reasoning item's tokens (vLLM's count)
        return {"input_tokens": num_in, "input_tokens_details": details,
                "output_tokens": num_out, "output_tokens_details": {"reasoning_tokens": num_reasoning},
                "total_tokens": num_in + num_out}

    def _response(self, status: str, output: list[dict], final: RequestOutput | None) -> dict:
        req = self.responses_req
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        # completed_at: OpenAI's, set only on a completed response (an incomplete or failed one has none).
        completed_at = int(time.time()) if status == "completed" else None
        body = {"id": self.response_id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": completed_at, "error": None, "incomplete_details": incomplete, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "model": self.ctx.model_name, "output": output,
                "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
                "reasoning": req.reasoning, "store": False, "temperature": self.params.temperature,
                "text": {**(req.text or {}), "format": (req.text or {}).get("format") or {"type": "text"}},
                "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "top_logprobs": req.top_logprobs,
                "top_p": self.params.top_p, "truncation": req.truncation or "disabled",
                "usage": self._usage(final) if final is not None else None, "user": req.user,
                "metadata": req.metadata or {}, **self._echoed_extras()}
        if req.enable_response_messages and final is not None:
            body.update(self._raw_messages(final))
        return body

    def _echoed_extras(self) -> dict:
        """background, max_tool_calls and service_tier as vLLM's response echoes them, prompt_cache_key and
        safety_identifier as OpenAI's does (checked in _check_unserved)."""
        extra = self.responses_req.model_extra or {}
        calls = extra.get("max_tool_calls")
        return {"background": False, "max_tool_calls": None if calls is None else lax_value(calls, int, "max_tool_calls"),
                "service_tier": extra.get("service_tier") or "auto", "prompt_cache_key": extra.get("prompt_cache_key"),
                "safety_identifier": extra.get("safety_identifier")}

    def _raw_messages(self, final: RequestOutput) -> dict:
        """vLLM's input_messages and output_messages (enable_response_messages): the rendered prompt and
        the whole output, each as its text and its token ids."""
        comp = final.outputs[0]
        return {"input_messages": [_raw_message(self.conversation.text or "", final.prompt_token_ids)],
                "output_messages": [_raw_message(comp.text, comp.token_ids)]}

    def response(self, finals: list[RequestOutput]) -> dict:
        """The Responses object of a finished reply."""
        chat = super().response(finals)
        choice = chat["choices"][0]
        message = choice["message"]
        output = []
        if message.get("reasoning"):
            output.append(_reasoning_item(_new_id("rs"), message["reasoning"]))
        if message.get("content"):
            logprobs = (choice["logprobs"] or {}).get("content")     # all the reply's tokens, as vLLM gives them
            output.append(_message_item(_new_id("msg"), message["content"], logprobs=logprobs))
        output += [_call_item(call) for call in message.get("tool_calls") or []]
        status = response_status(finals[0].outputs[0])
        if status == "incomplete" and output and output[-1]["type"] != "function_call":
            output[-1]["status"] = "incomplete"         # the item max_output_tokens cut, as OpenAI marks it
        return self._response(status, output, finals[0])

    def event(self, kind: str, **fields) -> str:
        """One server-sent event of the Responses stream, numbered."""
        self.sequence += 1
        return f"event: {kind}\ndata: {json_dumps({'type': kind, 'sequence_number': self.sequence - 1, **fields})}\n\n"

    def writer(self) -> _EventWriter:
        return _EventWriter(self)

    def start_events(self, first: RequestOutput) -> str:
        opening = self._response("in_progress", [], None)
        return self.event("response.created", response=opening) + self.event("response.in_progress", response=opening)

    def end_events(self, final: RequestOutput, writer: _EventWriter) -> str:
        status = response_status(final.outputs[0])
        return self.event(f"response.{status}", response=self._response(status, writer.items, final))

    def failure_events(self, exc: BaseException) -> str:
        """response.failed, numbered next: the response with its error and its output so far."""
        output = self.reply_writer.output_so_far() if self.reply_writer is not None else []
        number, self.sequence = self.sequence, self.sequence + 1
        return response_failed_event(stream_failure(exc), self._response("failed", output, None), number)


class _EventWriter(ReplyWriter):
    """Output items and their events: a reasoning item, a message item, function calls.

    With logprobs asked for, each output_text.delta carries the logprobs of the tokens since the last
    one (a reasoning item's tokens go with the message's first delta, as the whole reply's message holds
    every token's); those of tokens whose text never came (held back by a stop string) go in a last
    delta of no text before output_text.done."""

    def __init__(self, job: ResponsesJob) -> None:
        super().__init__(job)
        self.items: list[dict] = []       # the output items, done
        self.open: dict | None = None     # the reasoning or message item being streamed
        self.text_so_far = ""             # the open item's text so far
        self.cursor = job._cursor()       # None unless logprobs were asked for
        self.pending_rows: list[LogprobRow] = []    # tokens no delta has carried yet
        self.logprobs_so_far: list[dict] = []      # the open message's logprobs
        self.open_call: dict | None = None         # a forced named call's item, its arguments streaming

    def update(self, comp: CompletionOutput) -> str:
        if self.cursor is not None:
            self.pending_rows += self.cursor.advance(comp.token_ids, comp.logprobs or [], self.job.num_top)
        return super().update(comp)

    def _text_delta(self, delta: str) -> str:
        """An output_text.delta of the open message, with the logprobs of the tokens pending."""
        rows, self.pending_rows = self.pending_rows, []
        logprobs = chat_logprobs(rows)["content"]
        self.logprobs_so_far += logprobs
        return self.job.event("response.output_text.delta", item_id=self.open["id"], output_index=len(self.items),
                              content_index=0, delta=delta, logprobs=_event_logprobs(logprobs))

    def text(self, kind: str, delta: str) -> str:
        job, events = self.job, ""
        kind = "reasoning" if kind == "reasoning" else "message"
        if self.open is not None and self.open["type"] != kind:
            events += self.close()
        index = len(self.items)
        if self.open is None:
            item_id = _new_id("rs" if kind == "reasoning" else "msg")
            self.open = {"type": kind, "id": item_id}
            if kind == "reasoning":
                events += job.event("response.output_item.added", output_index=index,
                                    item={**_reasoning_item(item_id, ""), "status": "in_progress", "content": []})
            else:
                events += job.event("response.output_item.added", output_index=index,
                                    item=_message_item(item_id, "", "in_progress"))
                events += job.event("response.content_part.added", item_id=item_id, output_index=index,
                                    content_index=0, part={"type": "output_text", "text": "", "annotations": []})
        self.text_so_far += delta
        if kind == "reasoning":
            return events + job.event("response.reasoning_text.delta", item_id=self.open["id"], output_index=index,
                                      content_index=0, delta=delta)
        return events + self._text_delta(delta)

    def forced_events(self, delta: str, comp: CompletionOutput) -> str:
        """A forced named call's item opened with the output's first text, its arguments streamed as
        they are generated (function_call_arguments.delta), and closed as the whole reply has it."""
        forced, job = self.job.forced, self.job
        if forced.name is None:
            return super().forced_events(delta, comp)
        events, index = "", len(self.items)
        if self.open_call is None and (delta or comp.finish_reason is not None):
            self.open_call = _call_item(tool_call(forced.name, ""))
            events += job.event("response.output_item.added", output_index=index,
                                item={**self.open_call, "status": "in_progress"})
        if delta:
            events += job.event("response.function_call_arguments.delta", item_id=self.open_call["id"],
                                output_index=index, delta=delta)
        if comp.finish_reason is None:
            return events
        self.finish_reason = forced.finish_reason(comp.finish_reason, comp.stop_reason)
        [call] = forced.calls(self.call_text)
        item = {**self.open_call, "arguments": call["function"]["arguments"]}
        item["status"] = "completed" if _is_json(item["arguments"]) else "incomplete"
        self.items.append(item)
        self.open_call = None
        return events + (job.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   arguments=item["arguments"])
                         + job.event("response.output_item.done", output_index=index, item=item))

    def output_so_far(self) -> list[dict]:
        """The items done, and the open one as far as it came (status incomplete)."""
        if self.open_call is not None:
            return [*self.items, {**self.open_call, "arguments": self.call_text, "status": "incomplete"}]
        if self.open is None:
            return list(self.items)
        item_id, text = self.open["id"], self.text_so_far
        if self.open["type"] == "reasoning":
            item = _reasoning_item(item_id, text)
        else:
            item = _message_item(item_id, text, logprobs=self.logprobs_so_far)
        return [*self.items, {**item, "status": "incomplete"}]

    def close(self) -> str:
        if self.open is None:
            return ""
        job, item_id, index, text = self.job, self.open["id"], len(self.items), self.text_so_far
        status = "incomplete" if self.finish_reason == "length" else "completed"   # cut by max_output_tokens
        if self.open["type"] == "reasoning":
            item = {**_reasoning_item(item_id, text), "status": status}
            events = job.event("response.reasoning_text.done", item_id=item_id, output_index=index,
                               content_index=0, text=text)
        else:
            events = self._text_delta("") if self.pending_rows else ""
            part = _text_part(text, self.logprobs_so_far)
            item = _message_item(item_id, text, status, logprobs=self.logprobs_so_far)
            events += (job.event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                                 text=text, logprobs=_event_logprobs(self.logprobs_so_far))
                       + job.event("response.content_part.done", item_id=item_id, output_index=index,
                                   content_index=0, part=part))
        events += job.event("response.output_item.done", output_index=index, item=item)
        self.items.append(item)
        self.open, self.text_so_far, self.logprobs_so_far = None, "", []
        return events

    def call(self, call: dict) -> str:
        job, item, index = self.job, _call_item(call), len(self.items)
        events = (job.event("response.output_item.added", output_index=index,
                            item={**item, "arguments": "", "status": "in_progress"})
                  + job.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                              delta=item["arguments"])
                  + job.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              arguments=item["arguments"])
                  + job.event("response.output_item.done", output_index=index, item=item))
        self.items.append(item)
        return events


async def create_response(ctx: ServingContext, body: dict, raw: Request):
    """Validate, translate into a chat request, submit and answer (JSON, or the Responses events)."""
    return await serve_translated(ctx, raw, body, ResponsesRequest, chat_body, ResponsesJob)
