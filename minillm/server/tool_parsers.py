"""`--enable-auto-tool-choice --tool-call-parser NAME`: tool calls the model wrote in its own format
returned as OpenAI tool_calls, for tool_choice "auto" (the default when a request gives tools).

    hermes        <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number of them, after
                  optional text (Hermes 2 Pro, Qwen 2.5, Qwen3); the text before the first call is the
                  content, and a call cut short at the end still counts if its JSON is whole and
                  nothing but whitespace follows it (a half-written </tool_call> after it leaves
                  the output as content, as vLLM reads the text after an unclosed <tool_call>)
    llama3_json   an output that is JSON objects {"name": ..., "parameters" (or "arguments"): {...}}
                  separated by ";", after an optional <|python_tag|> (Llama 3.1-3.3). Only an output
                  that opens with a call (after whitespace) is read for calls, whole or streamed, as
                  vLLM's stream reads it; vLLM's non-streamed path takes a call's JSON anywhere in
                  the text ("Sure: {...}"), which its stream sends as content.

A call whose JSON does not parse, or lacks its name or arguments, leaves the whole output as
content with no calls, as vLLM's parsers do (a stream, which has sent the calls before such a
call, sends its text as content). With calls, the finish reason is "tool_calls" where the model
ended the reply ("length" stays: max_tokens cut it). A stream sends content as it comes (holding
back what could begin a call) and each call whole, in one delta, once its closing tag (or the end
of the output) shows it complete.

hermes decodes the output of a request that may call tools with its special tokens, as vLLM's
parser does (adjust_request): some models' <tool_call> is a special token, which
skip_special_tokens would drop from the text, leaving the call's JSON as content.
"""
from __future__ import annotations

import abc
import json
from dataclasses import dataclass

from minillm.server.reasoning_parsers import partial_tag_len
from minillm.server.tool_calls import JsonEnd, is_utf8, tool_call

TOOL_PARSERS = ("hermes", "llama3_json")
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def keeps_special_tokens(parser: str | None, tools: list | None, tool_choice) -> bool:
    """Whether a request's output keeps its special tokens for the parser: hermes, tools given, tool_choice not "none"."""
    return parser == "hermes" and bool(tools) and tool_choice != "none"


class NotACall(ValueError):
    """Text that does not hold a well-formed call."""


def _call(obj, arguments_keys: tuple[str, ...]) -> dict:
    """An OpenAI tool call from a parsed {"name", <arguments>} object (NotACall if it is not one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise NotACall("no name")
    for key in arguments_keys:
        if key in obj:
            try:      # NaN, Infinity (or a number past a float's range) that Python's json read: no JSON
                arguments = json.dumps(obj[key], ensure_ascii=False, allow_nan=False)
            except (ValueError, RecursionError) as exc:
                raise NotACall(str(exc)) from None
            if not arguments.isascii() and not is_utf8(arguments):    # a lone surrogate ("\ud800") stays escaped
                arguments = json.dumps(obj[key], allow_nan=False)
            return tool_call(obj["name"], arguments)
    raise NotACall("no arguments")


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _hermes_call_at(text: str, pos: int) -> tuple[dict, int, bool]:
    """The call whose <tool_call> opens at text[pos]: (call, where the text after it starts, whether
    its </tool_call> arrived). The JSON is read whole first, so a tag inside one of its strings is
    text. NotACall if it is no call (or not yet: a stream waits for more)."""
    i = _skip_space(text, pos + len(HERMES_START))
    try:
        obj, j = _DECODER.raw_decode(text, i)
    except (ValueError, RecursionError) as exc:     # nested past the reader's depth: no call either
        raise NotACall(str(exc)) from None
    call = _call(obj, ("arguments",))
    k = _skip_space(text, j)
    if text.startswith(HERMES_END, k):
        return call, k + len(HERMES_END), True
    if k == len(text):                            # the output ended before its </tool_call>
        return call, len(text), False
    raise NotACall("text after the call's JSON")


def _llama_calls(text: str) -> list[dict]:
    """The calls of an output that is JSON objects separated by ';' (NotACall otherwise)."""
    pos, calls = 0, []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        try:
            obj, pos = _DECODER.raw_decode(text, pos)
        except (ValueError, RecursionError) as exc:
            raise NotACall(str(exc)) from None
        calls.append(_call(obj, ("arguments", "parameters")))
        rest = text[pos:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            raise NotACall("text after a call")
        pos = len(text) - len(rest) + 1


def _llama_body(text: str) -> str | None:
    """The JSON part of an output that opens as a call (after whitespace and <|python_tag|>), else None."""
    stripped = text.lstrip()
    if stripped.startswith(PYTHON_TAG):
        stripped = stripped[len(PYTHON_TAG):].lstrip()
    return stripped if stripped.startswith("{") else None


@dataclass(frozen=True)
class ToolParser:
    """A --tool-call-parser: whole outputs through split(), streams through stream()."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in TOOL_PARSERS:
            raise ValueError(f"tool call parser must be one of {', '.join(TOOL_PARSERS)}, got {self.name!r}")

    def split(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a whole output; the content is None where it is empty."""
        try:
            content, calls = self._split(text)
        except NotACall:
            return text, []
        return (content or None), calls

    def _split(self, text: str) -> tuple[str, list[dict]]:
        if self.name == "llama3_json":
            body = _llama_body(text)
            return (text, []) if body is None else ("", _llama_calls(body))
        first = text.find(HERMES_START)
        if first < 0:
            return text, []
        calls, pos = [], first
        while pos >= 0:
            call, pos, closed = _hermes_call_at(text, pos)
            calls.append(call)
            pos = text.find(HERMES_START, pos) if closed else -1
        return text[:first], calls

    def stream(self) -> ToolCallStream:
        """A choice's state while it streams."""
        return LlamaJsonStream() if self.name == "llama3_json" else HermesStream()


class ToolCallStream(abc.ABC):
    """One choice's streamed content split into content deltas and whole tool calls."""

    def __init__(self) -> None:
        self.num_calls = 0

    def _numbered(self, calls: list[dict]) -> list[dict]:
        """Calls as stream deltas: each with its index among the choice's calls."""
        out = []
        for call in calls:
            out.append({"index": self.num_calls, **call})
            self.num_calls += 1
        return out

    @abc.abstractmethod
    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """(content, tool call deltas) that delta adds."""

    @abc.abstractmethod
    def finish(self) -> tuple[str, list[dict]]:
        """(content, tool call deltas) of what was held back, once the output has ended."""


class HermesStream(ToolCallStream):
    """hermes: content up to the first <tool_call>, then each call once its </tool_call> arrives.
    An open call's text is read once as it comes (JsonEnd) and decoded once, when its JSON is whole."""

    def __init__(self) -> None:
        super().__init__()
        self._text = ""          # not yet sent, outside a call: what could begin a <tool_call>
        self._in_calls = False   # the first <tool_call> was seen: content is over
        self._call: _OpenCall | None = None
        self._not_a_call: list[str] | None = None   # from a call that is none on: the content at the end

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        if self._not_a_call is not None:
            self._not_a_call.append(delta)
            return "", []
        content = ""
        if self._call is None:
            text = self._text + delta
            if not self._in_calls:
                first = text.find(HERMES_START)
                if first < 0:
                    keep = partial_tag_len(text, HERMES_START)
                    self._text = text[len(text) - keep:]
                    return text[:len(text) - keep], []
                content, self._in_calls = text[:first], True
            delta = text
        calls = []
        while True:
            if self._call is None:
                start = delta.find(HERMES_START)
                if start < 0:        # no call open: what could not begin one is dropped, as split() drops it
                    self._text = delta[len(delta) - partial_tag_len(delta, HERMES_START):]
                    break
                self._call, self._text, delta = _OpenCall(), "", delta[start + len(HERMES_START):]
            call, rest = self._call.feed(delta)
            if call is None:
                if rest is not None:     # no call: it and all after it are content, at the end
                    self._not_a_call, self._call = [self._call.text()], None
                break
            calls.append(call)
            self._call, delta = None, rest
        return content, self._numbered(calls)

    def finish(self) -> tuple[str, list[dict]]:
        text, self._text = self._text, ""
        if not self._in_calls:
            return text, []
        if self._not_a_call is not None:
            return "".join(self._not_a_call), []
        call, self._call = self._call, None
        if call is None:
            return "", []
        if call.call is None or call.after:     # its JSON never ended, or its </tool_call> came in part
            return call.text(), []
        return "", self._numbered([call.call])    # whole, its </tool_call> never came: a call


class _OpenCall:
    """A hermes call being streamed, from its <tool_call> on."""

    def __init__(self) -> None:
        self.pieces = [HERMES_START]    # its text so far
        self.json_end = JsonEnd()
        self.call: dict | None = None   # once its JSON is whole
        self.after = ""                 # after its JSON, less the whitespace: what could be its </tool_call>

    def text(self) -> str:
        return "".join(self.pieces)

    def feed(self, delta: str) -> tuple[dict | None, str | None]:
        """(the call, the text after its </tool_call>) once it is closed; (None, None) while it is
        open; (None, "") where it is no call (it is kept as text)."""
        self.pieces.append(delta)
        if self.call is None:
            end = self.json_end.feed(delta, 0)
            if self.json_end.is_container is False:     # no object, array or string: no call
                return None, ""
            if end is None:
                return None, None
            body = self.text()
            body_end = len(body) - (len(delta) - end)
            try:
                obj, obj_end = _DECODER.raw_decode(body[:body_end], _skip_space(body, len(HERMES_START)))
                if obj_end != body_end:
                    raise NotACall("text after the call's JSON")
                self.call = _call(obj, ("arguments",))
            except (NotACall, ValueError, RecursionError):
                return None, ""
            delta = delta[end:]
        self.after = (self.after + delta).lstrip(" \t\r\n")
        if self.after.startswith(HERMES_END):
            return self.call, self.after[len(HERMES_END):]
        if HERMES_END.startswith(self.after):
            return None, None
        return None, ""


class LlamaJsonStream(ToolCallStream):
    """llama3_json: an output that opens with JSON is held (its deltas as they came) and parsed whole
    at the end; any other is content as it comes."""

    def __init__(self) -> None:
        super().__init__()
        self._pieces: list[str] = []
        self._head = ""                        # the output so far less its whitespace: what decides
        self._decided: bool | None = None      # None: too early to say; True: calls; False: content

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        if self._decided is False:
            return delta, []
        self._pieces.append(delta)
        if self._decided:
            return "", []
        head = (self._head + delta).lstrip()
        if head.startswith(PYTHON_TAG):
            head = PYTHON_TAG + head[len(PYTHON_TAG):].lstrip()
        self._head = head
        if not head or (PYTHON_TAG.startswith(head) and len(head) < len(PYTHON_TAG)) or head == PYTHON_TAG:
            return "", []
        self._decided = head.removeprefix(PYTHON_TAG).startswith("{")
        if not self._decided:
            text, self._pieces = "".join(self._pieces), []
            return text, []
        return "", []

    def finish(self) -> tuple[str, list[dict]]:
        text, self._pieces = "".join(self._pieces), []
        body = _llama_body(text)
        if body is None:
            return text, []
        try:
            return "", self._numbered(_llama_calls(body))
        except NotACall:
            return text, []
