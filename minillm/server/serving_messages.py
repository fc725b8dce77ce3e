"""POST /v1/messages: Anthropic's Messages API over the chat path, as vLLM and llama.cpp serve it.

A request's `system` (its text blocks joined as they are; empty, no system message, as vLLM renders it)
and `messages` (text, tool_use, tool_result and thinking blocks) become a chat conversation;
`max_tokens`, `stop_sequences`, `temperature`, `top_p`, `top_k`, `tools` (`input_schema`, of type
"object", which vLLM sets where absent) and `tool_choice` (auto, any, tool, none) the chat request's
fields, `thinking` {"type": "disabled"} the template's enable_thinking false (an enabled one's
budget_tokens, fewer than max_tokens, is not enforced; vLLM's `chat_template_kwargs` are passed on),
`output_config.format` (a JSON schema; the beta's `output_format` too) the response_format, and
`output_config.effort` the template's reasoning_effort (as vLLM passes it on). A final assistant message
is a prefill, continued (continue_final_message) instead of answered; an empty one asks for a new turn,
and consecutive messages of one role are one turn, as Anthropic's API takes them; a tool_result block
must answer a tool_use block of an earlier assistant message, and no two tool_use blocks share an id.
The chat job renders, samples and parses (--reasoning-parser, --tool-call-parser, forced tool calls; no
tools, no calls) as for /v1/chat/completions, and its reply comes back as content blocks: `thinking`,
`text`, `tool_use`, with stop_reason end_turn, max_tokens, stop_sequence or tool_use (a call whose
arguments are JSON but no object, which no tool_use input holds, is a text block {"name": ...,
"arguments": ...}, not a tool_use with its arguments dropped; a forced call that max_tokens or a stop
sequence cut is a tool_use block of its input so far, under {"type": "any"} as under a named tool). A
stream sends Anthropic's events (message_start, content_block_start / _delta / _stop, message_delta,
message_stop).

Errors are Anthropic's shape ({"type": "error", "error": {"type", "message"}}) with the OpenAI
fields `param` and `code` in the same object, so either kind of client reads them: those of the
handlers here and those raised before them (errors.install_error_handlers and the middleware choose
the shape by the route), and a stream's failure after its first event, sent as Anthropic's `error`
event.
"""
from __future__ import annotations

import functools
import json
import math
import re
import uuid
from contextvars import ContextVar
from typing import Any

import jiter
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import field_validator

from minillm.outputs import CompletionOutput, RequestOutput
from minillm.sampling_params import short_repr
from minillm.server.errors import APIError, anthropic_error_event
from minillm.server.protocol import ChatCompletionRequest, Text, ToolChoiceNames, _check_json_text, _ModelRequest
from minillm.server.serving import ServingContext, json_dumps, stream_failure
from minillm.server.tool_calls import TOOL_CALL_ID_PREFIX, ArrayItems, arguments_text, is_utf8, tool_call
from minillm.server.translated_api import (
    ReplyWriter, TranslatedJob, field_of, named_as, serve_translated, tool_param, translated_job,
)

# Chat fields (as errors raised on the chat side name them) -> the Messages field they came from.
CHAT_PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "messages": "messages"}
THINKING_TYPES = ("enabled", "adaptive", "disabled")
TOOL_CHOICES = ToolChoiceNames('{"type": "auto"}', '{"type": "none"}',
                               '{"type": "any"} or {"type": "tool", "name": ...}', '{"type": "any"}')
EFFORTS = ("low", "medium", "high", "xhigh", "max")     # output_config.effort's values, as vLLM takes them
MEDIA_BLOCKS = ("image", "document")      # what Anthropic's models read besides text; refused here
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn", "error": "end_turn"}


class MessagesRequest(_ModelRequest):
    """POST /v1/messages (Anthropic's fields a text model can serve; others are logged)."""

    model: Text | None       # required, as Anthropic's API and vLLM's require it ("" is this server's model)
    max_tokens: int
    messages: list[dict[str, Any]]
    system: Text | list[dict[str, Any]] | None = None
    stop_sequences: list[Text] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None     # the structured-outputs beta's name of output_config.format
    chat_template_kwargs: dict[str, Any] | None = None      # vLLM's, passed on to the template

    @field_validator("messages", "system", "tools", "tool_choice", "output_config", "output_format")
    @classmethod
    def _json_text(cls, value: Any) -> Any:
        """Text deep in the blocks is checked here, so an error names this API's field."""
        return _check_json_text(value)


# ---- the request as a chat request ------------------------------------------------------------------

def _text_of(blocks: Any, where: str, joiner: str = "\n") -> str:
    """The text of a string or of a list of text blocks (system, tool_result content), joined by joiner."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise APIError(400, f"{where} must be a string or a list of text blocks", param=where)
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise APIError(400, f"{where}[{j}] must be a text block", param=f"{where}[{j}]")
        texts.append(block["text"])
    return joiner.join(texts)


def _message(i: int, message: dict, tool_use_ids: set[str]) -> list[dict]:
    """One Anthropic message as chat messages (tool results become tool messages). tool_use_ids: the
    ids of the earlier messages' tool_use blocks, which this message's tool_use blocks join and its
    tool_result blocks must name."""
    where = f"messages[{i}]"
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise APIError(400, f"{where}.role must be user or assistant, got {role!r}", param=f"{where}.role")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of content blocks", param=f"{where}.content")
    out, parts, calls, reasoning = [], [], [], None
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text":
            parts.append({"type": "text", "text": field_of(block, "text", at, str)})
        elif kind in MEDIA_BLOCKS:
            _refuse_media(kind, at)
        elif kind == "tool_use" and role == "assistant":
            arguments = field_of(block, "input", at, dict, optional=True) or {}
            calls.append({"id": _new_call_id(block, at, tool_use_ids), "type": "function", "function": {
                "name": field_of(block, "name", at, str), "arguments": json.dumps(arguments, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            field_of(block, "is_error", at, bool, optional=True)      # taken without effect, but a boolean
            result = block.get("content", "")
            for k, item in enumerate(result if isinstance(result, list) else []):
                if isinstance(item, dict) and item.get("type") in MEDIA_BLOCKS:
                    _refuse_media(item["type"], f"{at}.content[{k}]")
            out.append({"role": "tool", "tool_call_id": _answered_call(block, at, tool_use_ids),
                        "content": _text_of(result, f"{at}.content")})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            field_of(block, "signature" if kind == "thinking" else "data", at, str, optional=True)   # not read
            reasoning = field_of(block, "thinking", at, str) if kind == "thinking" else reasoning
        else:
            article = "an" if role == "assistant" else "a"
            raise APIError(400, f"{at}.type {kind!r} is not a content block {article} {role} message takes here",
                           param=f"{at}.type")
    if parts or calls or not out:
        chat = {"role": role, "content": parts or (None if calls else "")}
        if calls:
            chat["tool_calls"] = calls
        if reasoning is not None:
            chat["reasoning"] = reasoning
        out.append(chat)
    return out


def _new_call_id(block: dict, at: str, tool_use_ids: set[str]) -> str:
    """A tool_use block's id, added to tool_use_ids; one an earlier tool_use block has is a 400, as Anthropic's
    API refuses it (which call would a tool_result with that id answer?)."""
    call_id = field_of(block, "id", at, str)
    if call_id in tool_use_ids:
        raise APIError(400, f"{at}.id: tool_use ids must be unique ({short_repr(call_id)} is the id of an earlier "
                       f"tool_use block)", param=f"{at}.id")
    tool_use_ids.add(call_id)
    return call_id


def _answered_call(block: dict, at: str, tool_use_ids: set[str]) -> str:
    """A tool_result block's tool_use_id, which must name a tool_use block of an earlier assistant
    message, as Anthropic's API requires (a result that answers no call is a 400 there)."""
    tool_use_id = field_of(block, "tool_use_id", at, str)
    if tool_use_id not in tool_use_ids:
        raise APIError(400, f"{at}.tool_use_id: unexpected tool_use_id {short_repr(tool_use_id)} in a tool_result "
                       f"block: each tool_result block must answer a tool_use block of an earlier assistant "
                       f"message, and none has this id", param=f"{at}.tool_use_id")
    return tool_use_id


def _refuse_media(kind: str, at: str) -> None:
    """The 400 of an image or document block (in a message, or in a tool_result's content)."""
    raise APIError(400, f"{at}: {kind} blocks are not supported: this server's model reads text only",
                   param=f"{at}.type")


def _tool_choice(choice: dict | None) -> Any:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        name = field_of(choice, "name", "tool_choice", str)
        if not name:
            raise APIError(400, "tool_choice.name must be the name of one of the tools, got ''",
                           param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    raise APIError(400, f"tool_choice.type must be auto, any, tool or none, got {kind!r}", param="tool_choice.type")


def _parallel_tool_calls(choice: dict | None) -> bool | None:
    """tool_choice.disable_parallel_tool_use as the chat request's parallel_tool_calls (at most one call)."""
    disable = None if choice is None else field_of(choice, "disable_parallel_tool_use", "tool_choice", bool,
                                                     optional=True)
    return None if disable is None else not disable


def chat_body(req: MessagesRequest, counting: bool = False) -> dict:
    """The chat completion request that serves req (counting: for count_tokens, which takes no max_tokens)."""
    system = _text_of(req.system, "system", joiner="") if req.system is not None else ""
    # No system message where the text is empty ("", [], empty blocks), its blocks' texts joined as they
    # are: as vLLM renders `system`.
    messages = [{"role": "system", "content": system}] if system else []
    turns: list[dict] = []
    tool_use_ids: set[str] = set()
    for i, message in enumerate(req.messages):
        turns += _message(i, message, tool_use_ids)
    messages += _without_empty_prefill(_combined(turns))
    body = {"model": req.model, "messages": messages, "stream": req.stream, "max_completion_tokens": req.max_tokens}
    if _is_prefill(messages):
        body.update(add_generation_prompt=False, continue_final_message=True)
    tools = None
    if req.tools is not None:
        tools, names = [], set()
        for i, tool in enumerate(req.tools):
            if not isinstance(tool.get("name"), str) or tool.get("type") not in (None, "custom"):
                raise APIError(400, f"tools[{i}] must be a custom tool with a name and an input_schema (server tools "
                               f"are not served)", param=f"tools[{i}]")
            field_of(tool, "description", f"tools[{i}]", str, optional=True)
            schema = _input_schema(tool, i)
            if tool["name"] in names:        # Anthropic's API refuses it: which tool would a call name?
                raise APIError(400, f"tools: Tool names must be unique ({short_repr(tool['name'])} is tools[{i}] "
                               f"and an earlier tool)", param=f"tools[{i}].name")
            names.add(tool["name"])
            tools.append({"type": "function", "function": {
                "name": tool["name"], "description": tool.get("description"), "parameters": schema}})
    thinking = _thinking_type(req.thinking, None if counting else req.max_tokens)
    fields = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "stop": req.stop_sequences,
              "tools": tools, "tool_choice": _tool_choice(req.tool_choice),
              "parallel_tool_calls": _parallel_tool_calls(req.tool_choice),
              "chat_template_kwargs": _template_kwargs(req.chat_template_kwargs, thinking),
              "response_format": _response_format(req), "reasoning_effort": _effort(req.output_config)}
    body.update({k: v for k, v in fields.items() if v is not None})
    return body


def _input_schema(tool: dict, i: int) -> dict:
    """tools[i]'s input_schema, an object schema as Anthropic's API takes it (its type "object", which vLLM
    sets where absent): a tool_use block's input is an object, so a schema of other values is a 400."""
    schema = field_of(tool, "input_schema", f"tools[{i}]", dict)
    if "type" not in schema:
        return dict(schema, type="object")
    if schema["type"] != "object":
        raise APIError(400, f'tools[{i}].input_schema.type must be "object" (a tool_use block\'s input is an object), '
                       f"got {short_repr(schema['type'])}", param=f"tools[{i}].input_schema")
    return schema


def _combined(messages: list[dict]) -> list[dict]:
    """Consecutive user (or assistant) messages as one, as Anthropic's API combines consecutive turns of
    one role: a template that requires alternating roles (Llama 2's, Mistral's) renders them."""
    runs: list[list[dict]] = []
    for message in messages:
        if runs and message["role"] in ("user", "assistant") and runs[-1][0]["role"] == message["role"]:
            runs[-1].append(message)
        else:
            runs.append([message])
    return [run[0] if len(run) == 1 else _joined(run) for run in runs]


def _joined(run: list[dict]) -> dict:
    """Chat messages of one role as one: their text parts, tool calls and reasoning in order (joined
    once per run: joining pairwise copied the parts so far each time, quadratic in the run's length)."""
    parts = [part for message in run for part in _parts(message)]
    calls = [call for message in run for call in message.get("tool_calls", [])]
    joined = {"role": run[0]["role"], "content": parts or (None if calls else "")}
    if calls:
        joined["tool_calls"] = calls
    reasoning = [message["reasoning"] for message in run if message.get("reasoning") is not None]
    if reasoning:
        joined["reasoning"] = "\n".join(reasoning)
    return joined


def _parts(message: dict) -> list[dict]:
    """A chat message's content as text parts (an empty string as none)."""
    content = message["content"]
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    return content or []


def _without_empty_prefill(messages: list[dict]) -> list[dict]:
    """messages without a final assistant message that holds no text (nor tool calls) after others:
    Anthropic's API takes an empty one there and answers with a new turn, as without it."""
    last = messages[-1] if len(messages) > 1 else {}
    if last.get("role") == "assistant" and "tool_calls" not in last \
            and not any(part["text"] for part in _parts(last)):
        return messages[:-1]
    return messages


def _is_prefill(messages: list[dict]) -> bool:
    """Whether the conversation ends with an assistant's text, which Anthropic's API continues (a
    prefill: the reply goes on from it) instead of answering with a new turn."""
    last = messages[-1] if messages else {}
    return last.get("role") == "assistant" and "tool_calls" not in last and bool(last.get("content"))


# Where this request's format came from: output_config.format, or the beta's output_format (an error
# about the schema, raised on the chat side as response_format's, is named by it).
_FORMAT_FIELD: ContextVar[str] = ContextVar("messages_format_field", default="output_config.format")


def _response_format(req: MessagesRequest) -> dict | None:
    """output_config.format ({"type": "json_schema", "schema": ...}, Anthropic's structured outputs; the
    beta's output_format likewise) as the chat request's response_format; None without one."""
    fmt = field_of(req.output_config, "format", "output_config", dict, optional=True) if req.output_config else None
    where = "output_config.format"
    if req.output_format is not None:
        if fmt is not None:
            raise APIError(400, "give output_config.format or output_format (its beta name), not both",
                           param="output_format")
        fmt, where = req.output_format, "output_format"
    _FORMAT_FIELD.set(where)
    if fmt is None:
        return None
    if fmt.get("type") != "json_schema":
        raise APIError(400, f"{where}.type must be 'json_schema', got {short_repr(fmt.get('type'))}",
                       param=f"{where}.type")
    schema = field_of(fmt, "schema", where, dict)
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def _effort(output_config: dict | None) -> str | None:
    """output_config.effort (the chat request's reasoning_effort), a 400 naming it for a value vLLM refuses."""
    effort = (output_config or {}).get("effort")
    if effort is not None and effort not in EFFORTS:
        raise APIError(400, f"output_config.effort must be one of {', '.join(EFFORTS)}, got {short_repr(effort)}",
                       param="output_config.effort")
    return effort


def _template_kwargs(kwargs: dict | None, thinking: str | None) -> dict | None:
    """The chat template's variables: the request's chat_template_kwargs, with enable_thinking as
    `thinking` says where it is given."""
    if thinking is not None:
        return {**(kwargs or {}), "enable_thinking": thinking != "disabled"}
    return kwargs


def _thinking_type(thinking: dict | None, max_tokens: int | None) -> str | None:
    """thinking.type: enabled, adaptive or disabled. An enabled one's budget_tokens is required, at
    least 1 and less than max_tokens (thinking counts toward them; None, as count_tokens has, holds it to
    none), as Anthropic's API requires; it is not enforced. Anthropic's floor of 1024 is not required: a
    local model's context is often too short for it and the answer."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in THINKING_TYPES:
        raise APIError(400, f"thinking.type must be {', '.join(THINKING_TYPES)}, got {short_repr(kind)}",
                       param="thinking.type")
    budget = field_of(thinking, "budget_tokens", "thinking", int, optional=True)
    if kind == "enabled":
        _check_thinking_budget(budget, max_tokens)
    return kind


def _check_thinking_budget(budget: int | None, max_tokens: int | None) -> None:
    """The 400 of an enabled thinking's budget_tokens that is missing or leaves no room in max_tokens
    (a max_tokens below 1 is told as such by the chat side)."""
    if budget is None:
        raise APIError(400, "thinking.budget_tokens is required when thinking.type is 'enabled' (the tokens "
                       "the reply may spend thinking, fewer than max_tokens)", param="thinking.budget_tokens")
    if budget < 1:
        raise APIError(400, f"thinking.budget_tokens must be at least 1, got {budget}", param="thinking.budget_tokens")
    if max_tokens is not None and max_tokens >= 1 and budget >= max_tokens:
        raise APIError(400, f"max_tokens must be greater than thinking.budget_tokens (thinking counts toward "
                       f"max_tokens), got max_tokens {max_tokens} and thinking.budget_tokens {short_repr(budget)}",
                       param="thinking.budget_tokens")


def _renamed(exc: APIError) -> APIError:
    """A chat-side error with its param as the Messages request names it."""
    param = tool_param(exc.param, {"parameters": "input_schema"})
    if param is not None and param.startswith("response_format"):
        param = re.sub(r"^response_format(\.json_schema)?", _FORMAT_FIELD.get(), param)
    message = exc.message.replace(exc.param, param) if param != exc.param else exc.message
    if param is not None:
        head, dot, rest = param.partition(".")
        if head in CHAT_PARAMS:
            param = CHAT_PARAMS[head] + ("" if head == "messages" else dot + rest)
            message = _field_renamed(message, head, CHAT_PARAMS[head])
    message = message.replace("max_completion_tokens", "max_tokens")
    return APIError(exc.status, message, param, exc.code, exc.type)


def _field_renamed(message: str, chat_name: str, name: str) -> str:
    """message with the chat field it names ("stop must be ...", "each stop string ...") named as
    this API names it; a quoted value that holds the word is left as it is."""
    return re.sub(rf"^{chat_name}\b|(?<=^each ){chat_name}\b", name, message)


# ---- the reply as content blocks --------------------------------------------------------------------

def _stop(finish_reason: str | None, comp: CompletionOutput, calls: list[dict],
          cut: bool = False) -> tuple[str, str | None]:
    """(Anthropic stop_reason, stop_sequence) of a chat finish: "tool_use" when every call is whole
    (a forced array cut after a whole call too), "max_tokens" or "stop_sequence" for an output cut
    short (a call's input among it; cut: a call of a forced array whose input had not begun), as
    Anthropic reads them."""
    if calls and not cut and all(_input_of(call) is not None for call in calls):
        return "tool_use", None
    if comp.finish_reason == "length":
        return "max_tokens", None
    if comp.finish_reason == "stop" and isinstance(comp.stop_reason, str):
        return "stop_sequence", comp.stop_reason
    if calls:
        return "tool_use", None
    if finish_reason == "tool_calls":     # its calls are text blocks (_call_text): the model ended its turn
        return "end_turn", None
    return STOP_REASONS.get(finish_reason, "end_turn"), None


def _input_of(call: dict) -> dict | None:
    """A call's arguments as a tool_use block's input; None where they are no JSON object (cut short)."""
    try:
        arguments = _INPUT_DECODER.decode(call["function"]["arguments"] or "{}")
        if isinstance(arguments, dict) and not is_utf8(json.dumps(arguments, ensure_ascii=False)):
            arguments = _well_formed(arguments)    # a lone surrogate ("\ud800"): the response's UTF-8 holds none
    except (ValueError, RecursionError):
        return None
    return arguments if isinstance(arguments, dict) else None


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _well_formed(value: Any) -> Any:
    """value with each lone surrogate in its strings (keys too) as U+FFFD, as a UTF-8 encoder replaces it."""
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_well_formed(item) for item in value]
    if isinstance(value, dict):
        return {_well_formed(key): _well_formed(item) for key, item in value.items()}
    return value


def _finite_or_null(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


def _int_or_null(number: str | int) -> int | None:
    try:
        return int(str(number))
    except ValueError:          # past Python's digit limit for int(str) and str(int)
        return None


# A number the JSON of a response cannot hold as Python reads it (1e400 is an infinite float; an
# integer past 4300 digits is refused) is null in a tool_use input, as JSON.stringify and pydantic
# (vLLM's responses) write a number that is not finite: the response stays JSON. The chat and
# Responses APIs pass the arguments on as the text the model wrote.
_INPUT_DECODER = json.JSONDecoder(parse_float=_finite_or_null, parse_int=_int_or_null, parse_constant=lambda _: None)


def _partial_input(arguments: str) -> dict | None:
    """The input of arguments cut short as Anthropic's SDK reads a streamed tool_use's partial JSON (jiter's
    partial mode: whole members kept, a member whose value was cut dropped); None where no object parses."""
    try:
        value = jiter.from_json(arguments.encode("utf-8", "surrogatepass"), partial_mode=True)
    except ValueError:
        return None
    return _json_safe(value) if isinstance(value, dict) else None


def _json_safe(value: Any) -> Any:
    """value with each number the response's JSON cannot hold (not finite, past Python's digit limit) as
    null, as _INPUT_DECODER reads them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, int) and not isinstance(value, bool):
        return _int_or_null(value)
    if isinstance(value, list):
        return [_json_safe(item) for item in value]
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    return value


def _call_input(call: dict) -> tuple[dict, str | None]:
    """A call's tool_use input, and the arguments as generated where max_tokens cut them and Anthropic's SDK
    reads them as a JSON prefix (else None): the object it reads from them then ({} where none parses)."""
    whole = _input_of(call)
    if whole is not None:
        return whole, None
    arguments = call["function"]["arguments"] or ""
    partial = _partial_input(arguments)
    return (partial, arguments) if partial is not None else ({}, None)


def _cut_call(text: str | None) -> tuple[dict, bool] | None:
    """(call, whether its input had not begun) of the item that tool_choice "any"'s array (text: the calls'
    output) was writing when the output ended, after its whole items: a call whose arguments are its
    "parameters" as generated so far, as a named tool's call cut short keeps them (and as vLLM streams a
    required call's arguments while they grow); None where no item was begun or its name is not whole."""
    if not text:
        return None
    items = ArrayItems()
    items.new_items(text)
    if items.item_start is None:
        return None
    name, arguments, is_whole = _cut_item_members(text, items.item_start)
    if name is None:
        return None
    return tool_call(name, arguments_text(arguments) if is_whole else arguments or ""), arguments is None


_WHITESPACE = re.compile(r"[ \t\n\r]*")


def _cut_item_members(text: str, start: int) -> tuple[str | None, str | None, bool]:
    """(name, parameters as generated, whether they are whole) of the array item text[start:] (its "{" at
    start) that the output's end cut short: the name where it is whole, the parameters None where they had
    not begun."""
    decoder, name, arguments, is_whole = json.JSONDecoder(), None, None, False
    i = _WHITESPACE.match(text, start + 1).end()
    try:
        while text.startswith('"', i):
            key, i = decoder.raw_decode(text, i)
            i = _WHITESPACE.match(text, i).end()
            if not text.startswith(":", i):
                break
            begin = _WHITESPACE.match(text, i + 1).end()
            if key == "parameters":
                arguments = text[begin:] or None      # cut inside them, unless they are whole
            value, i = decoder.raw_decode(text, begin)
            if key == "parameters":
                arguments, is_whole = text[begin:i], True
            elif key == "name" and isinstance(value, str):
                name = value
            i = _WHITESPACE.match(text, i).end()
            if not text.startswith(",", i):
                break
            i = _WHITESPACE.match(text, i + 1).end()
    except (ValueError, RecursionError):       # the member the output's end cut
        pass
    return name, arguments, is_whole


def _call_text(call: dict) -> str | None:
    """A call whose arguments are whole JSON but no object (a list, a string, a number, null) as the text
    {"name": ..., "arguments": ...} (its arguments as generated), which a text block holds: a tool_use
    block's input is an object, and {} would drop the arguments unseen. None for any other call."""
    arguments = call["function"]["arguments"] or "{}"
    try:
        value = _INPUT_DECODER.decode(arguments)
    except (ValueError, RecursionError):
        return None
    if isinstance(value, dict):
        return None
    name = call["function"]["name"]
    return f'{{"name": {json.dumps(name, ensure_ascii=not is_utf8(name))}, "arguments": {arguments}}}'


def _content_block(call: dict) -> dict:
    """A call as a content block: tool_use, or text where its arguments are no object (_call_text)."""
    text = _call_text(call)
    return _tool_use(call) if text is None else {"type": "text", "text": text}


def _tool_use(call: dict, tool_input: dict | None = None) -> dict:
    """A call as a tool_use block holding tool_input (by default the call's own, _call_input)."""
    if tool_input is None:
        tool_input = _call_input(call)[0]
    return {"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"], "input": tool_input}


def tool_use_id(call_id: str) -> str:
    """A chat tool call's id as Anthropic's tool_use ids read (toolu_...: clients pass it back as a
    tool_result's tool_use_id, and some check the prefix); the same call, whole or streamed, has one."""
    return "toolu_" + call_id.removeprefix(TOOL_CALL_ID_PREFIX)


class MessagesJob(TranslatedJob):
    """A chat job whose reply is an Anthropic message (or its event stream)."""

    rename = staticmethod(_renamed)
    tool_choices = TOOL_CHOICES

    def __init__(self, ctx: ServingContext, req: MessagesRequest, chat: ChatCompletionRequest,
                 raw: Request | None = None) -> None:
        super().__init__(ctx, chat)
        # The message's id is also the stem of the engine's (msg_<hex>-<8 hex>): /v1/stats shows it.
        self.request_id = self.response_id = f"msg_{uuid.uuid4().hex}"

    def _message(self, content: list[dict], stop: tuple[str | None, str | None], usage: dict) -> dict:
        return {"id": self.response_id, "type": "message", "role": "assistant", "model": self.ctx.model_name,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    @staticmethod
    def _usage(final: RequestOutput, num_output: int) -> dict:
        """Anthropic's usage: input_tokens are the prompt tokens not read from the cache (clients add
        cache_read_input_tokens to them for the whole input)."""
        num_cached = final.num_cached_tokens or 0
        return {"input_tokens": len(final.prompt_token_ids) - num_cached, "output_tokens": num_output,
                "cache_read_input_tokens": num_cached}

    def response(self, finals: list[RequestOutput]) -> dict:
        """The message of a finished reply."""
        chat = super().response(finals)
        choice = chat["choices"][0]
        message = choice["message"]
        content = []
        if message.get("reasoning"):
            content.append({"type": "thinking", "thinking": message["reasoning"], "signature": ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        comp = finals[0].outputs[0]
        cut = self._cut(comp)
        calls = (message.get("tool_calls") or []) + ([cut[0]] if cut is not None else [])
        content += [_content_block(call) for call in calls]
        stop = _stop(choice["finish_reason"], comp, [call for call in calls if _call_text(call) is None],
                     cut is not None and cut[1])
        return self._message(content, stop, self._usage(finals[0], len(comp.token_ids)))

    def _cut(self, comp: CompletionOutput) -> tuple[dict, bool] | None:
        """_cut_call of a tool_choice "any" output that ended inside a call (None for any other output)."""
        if self.forced is None or self.forced.name is not None:
            return None
        text = comp.text if self.parsers is None else self.parsers.reasoning.split(comp.text)[1]
        return _cut_call(text)

    def event(self, kind: str, **fields) -> str:
        """One server-sent event of Anthropic's stream."""
        return f"event: {kind}\ndata: {json_dumps({'type': kind, **fields})}\n\n"

    def failure_events(self, exc: BaseException) -> str:
        """Anthropic's error event."""
        return anthropic_error_event(stream_failure(exc))

    def writer(self) -> _BlockWriter:
        return _BlockWriter(self)

    def start_events(self, first: RequestOutput) -> str:
        start = self._message([], (None, None), self._usage(first, 0))
        return self.event("message_start", message=start) + self.event("ping")

    def end_events(self, final: RequestOutput, writer: _BlockWriter) -> str:
        comp = final.outputs[0]
        reason, sequence = _stop(writer.finish_reason, comp, writer.calls, writer.cut)
        return (self.event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                           usage={"output_tokens": len(comp.token_ids)})
                + self.event("message_stop"))


class _BlockWriter(ReplyWriter):
    """Content blocks and their events: thinking, text, tool_use."""

    def __init__(self, job: MessagesJob) -> None:
        super().__init__(job)
        self.index = 0                    # the next block's index
        self.open: str | None = None      # "thinking" or "text": the block being streamed
        self.calls: list[dict] = []       # the tool calls sent as tool_use blocks
        self.cut = False                  # the last is a call of a forced array whose input had not begun

    def text(self, kind: str, delta: str) -> str:
        job, events = self.job, ""
        kind = "thinking" if kind == "reasoning" else "text"
        if self.open is not None and self.open != kind:
            events += self.close()
        if self.open is None:
            self.open = kind
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            events += job.event("content_block_start", index=self.index, content_block=block)
        body = {"type": "thinking_delta", "thinking": delta} if kind == "thinking" else \
            {"type": "text_delta", "text": delta}
        return events + job.event("content_block_delta", index=self.index, delta=body)

    def close(self) -> str:
        if self.open is None:
            return ""
        events = ""
        if self.open == "thinking":
            events += self.job.event("content_block_delta", index=self.index,
                                     delta={"type": "signature_delta", "signature": ""})
        events += self.job.event("content_block_stop", index=self.index)
        self.open, self.index = None, self.index + 1
        return events

    def forced_events(self, delta: str, comp: CompletionOutput) -> str:
        """A forced call's events; under tool_choice "any", a call the output's end cut short is sent
        once it ends, as in the whole reply (MessagesJob._cut)."""
        events = super().forced_events(delta, comp)
        cut = _cut_call(self.call_text) if comp.finish_reason is not None and self.tool_stream is not None \
            else None
        if cut is not None:
            events += self.call(cut[0])
            self.cut = cut[1]
        return events

    def call(self, call: dict) -> str:
        text = _call_text(call)
        if text is not None:          # a block of its own, as in the whole reply
            return self.text("content", text) + self.close()
        tool_input, partial_json = _call_input(call)
        job, block = self.job, _tool_use(call, {})
        events = job.event("content_block_start", index=self.index, content_block=block)
        events += job.event("content_block_delta", index=self.index,
                            delta={"type": "input_json_delta", "partial_json": partial_json or json.dumps(tool_input)})
        events += job.event("content_block_stop", index=self.index)
        self.index += 1
        self.calls.append(call)
        return events


def _ignored(req: MessagesRequest) -> list[str]:
    """Fields taken without effect: a thinking budget is not enforced, nor output_config's keys other than
    format and effort."""
    ignored = ["thinking.budget_tokens"] if "budget_tokens" in (req.thinking or {}) else []
    return ignored + [f"output_config.{key}" for key in req.output_config or {}
                     if key not in ("format", "effort")]


async def create_message(ctx: ServingContext, body: dict, raw: Request):
    """Validate, translate into a chat request, submit and answer (JSON, or Anthropic's events); an
    error raised here reaches the client in Anthropic's shape (errors.install_error_handlers)."""
    return await serve_translated(ctx, raw, body, MessagesRequest, chat_body, MessagesJob, _ignored)


async def count_message_tokens(ctx: ServingContext, body: dict, raw: Request):
    """POST /v1/messages/count_tokens: the prompt tokens a request would take ({"input_tokens": N})."""
    _, job = await translated_job(ctx, raw, {"max_tokens": 1, **body, "stream": False}, MessagesRequest,
                                  functools.partial(chat_body, counting=True), MessagesJob, check=False)
    with named_as(_renamed):
        prompt_ids = await ctx.run_blocking(job._render)
    return JSONResponse({"input_tokens": len(prompt_ids)})
