"""What the APIs served over the chat path share (/v1/responses, /v1/messages): a request becomes a
chat request, a ChatJob renders, samples and parses it, and its reply is reshaped, whole or as the
API's own event stream; errors raised on the chat side are renamed to the API's fields.
"""
from __future__ import annotations

import abc
import contextlib
import re
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.exceptions import RequestValidationError

from minillm.outputs import CompletionOutput, RequestOutput
from minillm.server.async_engine import RequestStream
from minillm.server.errors import APIError, _validation_to_api_error
from minillm.server.protocol import (
    CHAT_TOOL_CHOICES, ChatCompletionRequest, ToolChoiceNames, check_unsupported, lax_value, unknown_fields,
)
from minillm.server.serving import (
    ServingContext, answer, is_large_body, log_unknown_fields, merged_outputs, openai_failure_events,
    refuse_uncompiled_constraint, text_delta, validate_request,
)
from minillm.server.serving_chat import ChatJob
from minillm.server.streaming import FinalEvent

Rename = Callable[[APIError], APIError]


def tool_param(param: str | None, names: dict[str, str]) -> str | None:
    """A chat param inside a tool ("tools.2.function.parameters") as the API names it ("tools[2]." plus
    names[field], the field's name there); any other param as it is."""
    match = re.fullmatch(r"tools\.(\d+)\.function\.(\w+)(.*)", param or "")
    if match is None:
        return param
    return f"tools[{match[1]}].{names.get(match[2], match[2])}{match[3]}"


def field_of(obj: dict, key: str, where: str, kind: type, optional: bool = False) -> Any:
    """obj[key] read as a kind, as a request model reads its fields (lax_value: "true" is True), or None
    where absent or null and optional; else a 400 naming where.key as the API names it: checked while
    translating, so the chat request's names never reach the client."""
    value = obj.get(key)
    if optional and value is None:
        return value
    return lax_value(value, kind, f"{where}.{key}")


class TranslatedJob(ChatJob):
    """A chat job whose reply is another API's: response() reshapes the chat response; a stream is
    start_events(), a ReplyWriter's events per output, then end_events()."""

    rename: Rename
    tool_choices: ToolChoiceNames = CHAT_TOOL_CHOICES     # how the API spells tool_choice, for refusals
    reply_writer: ReplyWriter | None = None     # the stream's writer, once it has begun

    @abc.abstractmethod
    def writer(self) -> ReplyWriter:
        """The stream's writer of output events."""

    @abc.abstractmethod
    def start_events(self, first: RequestOutput) -> str:
        """The events that open the stream (sent with the reply's first output)."""

    @abc.abstractmethod
    def end_events(self, final: RequestOutput, writer: ReplyWriter) -> str:
        """The events that close it."""

    def failure_events(self, exc: BaseException) -> str:
        """The events that end the stream when its request fails after the first went out."""
        return openai_failure_events(exc)

    async def events(self, streams: list[RequestStream]) -> AsyncIterator[str]:
        """The API's event stream, from the reply's first output on (so a request the engine refuses
        is still an HTTP error)."""
        writer = self.reply_writer = self.writer()
        final: RequestOutput | None = None
        pending = ""
        async with contextlib.aclosing(merged_outputs(self.ctx, streams)) as batches:
            async for batch in batches:
                for _, output in batch:
                    if final is None:
                        try:
                            refuse_uncompiled_constraint(self.req, [output], self.constraint_param)
                        except APIError as exc:
                            raise type(self).rename(exc) from None
                        pending += self.start_events(output)
                    final = output
                    pending += writer.update(output.outputs[0])
                if pending and not all(s.finished for s in streams):
                    yield pending
                    pending = ""
        if final is not None:
            pending += self.end_events(final, writer)
        yield FinalEvent(pending)


class ReplyWriter(abc.ABC):
    """One streamed reply through its job's parsers: reasoning and content text, and whole tool calls,
    handed to text(), call() and close(), which write the API's events."""

    def __init__(self, job: TranslatedJob) -> None:
        self.job = job
        self.sent = ""                            # the reply's text already fed through
        self.finish_reason: str | None = None     # the chat finish reason, once finished ("tool_calls" with calls)
        self.stream = job.parsers.stream() if job.parsers is not None else None
        # tool_choice "required": the calls of the array as each is whole
        self.tool_stream = job.forced.stream() if job.forced is not None and job.forced.name is None else None
        # a forced call's text so far: the output's, or what follows the reasoning (None until it begins)
        self.call_text: str | None = None if self.stream is not None else ""

    def update(self, comp: CompletionOutput) -> str:
        """The events of comp's text since the last update (and, once finished, the closing ones)."""
        delta = text_delta(self.sent, comp.text)
        self.sent = comp.text
        finish = comp.finish_reason
        if self.job.forced is not None:           # a forced call: the output is the calls
            return self.reasoning_then_calls(delta, comp)
        if self.stream is not None:
            parts, finish = self.stream.delta(delta, finish)
        else:
            parts = {"content": delta} if delta else {}
        events = ""
        if parts.get("reasoning") and self.job.parsers.include_reasoning:
            events += self.text("reasoning", parts["reasoning"])
        if parts.get("content"):
            events += self.text("content", parts["content"])
        for call in parts.get("tool_calls") or []:
            events += self.close() + self.call(call)
        if finish is not None:
            self.finish_reason = finish
            events += self.close()
        return events

    def reasoning_then_calls(self, delta: str, comp: CompletionOutput) -> str:
        """The events of a forced call's output: its reasoning first, where the model reasons before the
        call (the reasoning parser splits it off), then forced_events of the call's text."""
        events = ""
        if self.stream is not None:
            parts, _ = self.stream.delta(delta, comp.finish_reason)
            if parts.get("reasoning") and self.job.parsers.include_reasoning:
                events += self.text("reasoning", parts["reasoning"])
            delta = parts.get("content", "")
            if delta or self.call_text is not None:
                self.call_text = (self.call_text or "") + delta
        else:
            self.call_text += delta
        if self.call_text is None:            # still reasoning: no call yet
            if comp.finish_reason is not None:
                self.finish_reason = self.job.forced.finish_reason(comp.finish_reason, comp.stop_reason)
                events += self.close()
            return events
        if delta or comp.finish_reason is not None:
            events += self.close()           # the reasoning item, before the call's
        return events + self.forced_events(delta, comp)

    def forced_events(self, delta: str, comp: CompletionOutput) -> str:
        """The events of a forced call's text (call_text, delta new): under "required" each call once it is
        whole, as chat streams them; a named call once the reply is whole."""
        forced, events = self.job.forced, ""
        if self.tool_stream is not None:
            events = "".join(self.call(call) for call in self.tool_stream.deltas(delta, self.call_text))
        if comp.finish_reason is None:
            return events
        self.finish_reason = forced.finish_reason(comp.finish_reason, comp.stop_reason)
        if forced.name is None:
            return events
        return self.close() + "".join(self.call(call) for call in forced.calls(self.call_text))

    @abc.abstractmethod
    def text(self, kind: str, delta: str) -> str:
        """Events for more text of a kind ("reasoning" or "content"), opening its item first."""

    @abc.abstractmethod
    def close(self) -> str:
        """The done events of the open item, if any."""

    @abc.abstractmethod
    def call(self, call: dict) -> str:
        """A whole tool call's events (no item is open)."""


@contextlib.contextmanager
def named_as(rename: Rename, indexed: bool = False):
    """Errors raised inside, a request's validation errors among them, as APIErrors renamed by rename
    (a validation error's list indices as the API names them, input[0].content, where indexed)."""
    try:
        yield
    except RequestValidationError as exc:
        raise rename(_validation_to_api_error(exc, indexed=indexed)) from None
    except APIError as exc:
        raise rename(exc) from None


async def translated_job(ctx: ServingContext, raw: Request, body: dict, request_model: type,
                         to_chat: Callable[[Any], dict], job_class: type[TranslatedJob],
                         check: bool = True) -> tuple[Any, TranslatedJob]:
    """(request, job): body validated as request_model and made the chat request to_chat(req) makes
    (check: refused where chat completions refuse it), served by job_class(ctx, req, chat, raw), not
    yet prepared. Every error is an APIError named as the API names its fields."""
    is_large = await is_large_body(raw)
    with named_as(lambda exc: exc, indexed=True):     # as the translation's own errors name items
        req = await ctx.run_blocking_if(is_large, validate_request, request_model, body)
    ctx.check_model(req.model)

    def make_job() -> TranslatedJob:
        chat = validate_request(ChatCompletionRequest, to_chat(req))
        if check:
            check_unsupported(chat, auto_tool_choice=ctx.tool_call_parser is not None,
                              tool_choices=job_class.tool_choices)
        return job_class(ctx, req, chat, raw)

    # Translating and validating the chat request walks every message: 1.5-2.5 s of a 10 MB body of
    # 300,000 small ones, which held every stream and /health on the event loop. In the pool if large.
    with named_as(job_class.rename):
        job = await ctx.run_blocking_if(is_large, make_job)
    return req, job


async def serve_translated(ctx: ServingContext, raw: Request, body: dict, request_model: type,
                           to_chat: Callable[[Any], dict], job_class: type[TranslatedJob],
                           ignored: Callable[[Any], list[str]] = lambda req: []):
    """Serve body as translated_job's job, and answer (JSON, or the job's events); ignored(req) names
    fields taken without effect (logged)."""
    req, job = await translated_job(ctx, raw, body, request_model, to_chat, job_class)
    with named_as(job_class.rename):
        await job.prepare()
    log_unknown_fields(unknown_fields(req) + ignored(req))
    with named_as(job_class.rename):     # e.g. a constraint the engine could not compile names the chat field
        return await answer(ctx, raw, job, [job.prompt_ids], [job.params], req.stream, job.failure_events)
