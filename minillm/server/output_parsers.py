"""A chat reply's text as vLLM's parsers shape it: reasoning split off first (--reasoning-parser),
then tool calls out of what is left (--enable-auto-tool-choice --tool-call-parser).

Only requests that can use them pay for them: a server without parsers, a request held to a
structure from its first token (response_format, structured_outputs or a forced tool call without
--reasoning-parser, or with --structured-outputs-config enable_in_reasoning), or tools not asked for
(tool_choice "none", no tools) leave the reply as the plain text. A structure held after the reasoning
(reasoning_first) goes through the reasoning parser alone: the reasoning, then the structure as the
content (a forced call's: its tool calls).
"""
from __future__ import annotations

from dataclasses import dataclass

from minillm.server.reasoning_parsers import ReasoningParser, ReasoningStream
from minillm.server.tool_parsers import ToolCallStream, ToolParser


def calls_finish_reason(finish_reason: str | None) -> str | None:
    """The finish reason of a reply that made calls: "tool_calls" where the model ended it; any other
    ("length": max_tokens cut it, perhaps inside a call) as it is, so a client sees the turn was cut."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


@dataclass(frozen=True)
class OutputParsers:
    """One chat request's parsers (at least one set)."""

    reasoning: ReasoningParser | None
    tools: ToolParser | None
    include_reasoning: bool = True      # the request's include_reasoning: false drops the reasoning
    max_calls: int | None = None        # 1 with parallel_tool_calls false: the calls after the first are dropped

    @classmethod
    def for_request(cls, reasoning_parser: str | None, tool_call_parser: str | None, template_kwargs: dict | None,
                    tool_choice, constrained: bool, include_reasoning: bool,
                    parallel_tool_calls: bool | None = None, reasoning_first: bool = False,
                    reasoning_ended: bool = False) -> OutputParsers | None:
        """The parsers a request's reply goes through (reasoning_ended: its prompt closed the thinking
        block); None when it goes through none."""
        if constrained and not (reasoning_first and reasoning_parser):
            return None
        reasoning = ReasoningParser.for_request(reasoning_parser, template_kwargs, reasoning_ended) \
            if reasoning_parser else None
        tools = ToolParser(tool_call_parser) if tool_call_parser and tool_choice == "auto" and not constrained else None
        if reasoning is None and tools is None:
            return None
        return cls(reasoning, tools, include_reasoning, 1 if parallel_tool_calls is False else None)

    def message(self, role: str, echo: str, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(message, finish reason) of a whole reply: "tool_calls" when it made calls and ended itself."""
        reasoning, content = self.reasoning.split(text) if self.reasoning is not None else (None, text)
        calls = []
        if self.tools is not None and content is not None:
            content, calls = self.tools.split(content)
            calls = calls[:self.max_calls]
        if echo:
            content = echo + (content or "")
        message = {"role": role, "content": content}
        if self.include_reasoning and self.reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
            finish_reason = calls_finish_reason(finish_reason)
        return message, finish_reason

    def stream(self) -> OutputStream:
        """A choice's parsers while it streams."""
        return OutputStream(self)


class OutputStream:
    """One streamed choice through the parsers: each text delta becomes a chat delta."""

    def __init__(self, parsers: OutputParsers) -> None:
        self.parsers = parsers
        self.reasoning: ReasoningStream | None = parsers.reasoning.stream() if parsers.reasoning else None
        self.tools: ToolCallStream | None = parsers.tools.stream() if parsers.tools else None

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(chat delta, finish reason) for text new since the last call; at the finish, what the
        parsers held back goes too, and a choice that made calls and ended itself finishes with "tool_calls"."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        if finish_reason is not None and self.reasoning is not None:
            more_reasoning, more_content = self.reasoning.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        calls = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if finish_reason is not None:
                more_content, more_calls = self.tools.finish()
                content, calls = content + more_content, calls + more_calls
        if self.parsers.max_calls is not None:
            calls = [c for c in calls if c["index"] < self.parsers.max_calls]
        delta = {}
        if reasoning and self.parsers.include_reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        if finish_reason is not None and self.tools is not None and self.tools.num_calls:
            finish_reason = calls_finish_reason(finish_reason)
        return delta, finish_reason
