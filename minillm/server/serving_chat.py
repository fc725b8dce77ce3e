"""POST /v1/chat/completions: messages rendered with the model's chat template, n choices."""
from __future__ import annotations

import contextlib
import functools
import re
import time
from typing import AsyncIterator, Callable

from fastapi import Request

from minillm.chat_template import shape_content
from minillm.outputs import RequestOutput
from minillm.sampling_params import max_prompt_len, short_repr, truncate_prompt
from minillm.server.async_engine import RequestStream
from minillm.server.errors import SSE_DONE, APIError
from minillm.server.kv_transfer import apply_kv_transfer, release_claim
from minillm.server.limits import check_allowed_token_ids, check_fan_out, check_prompt_chars
from minillm.server.logprobs import LogprobCursor, TokenTexts, chat_logprobs, prompt_logprobs_json
from minillm.server.protocol import (
    ChatCompletionRequest, ConversationRequest, chat_logprobs as requested_top_logprobs, chat_max_tokens,
    chat_max_tokens_field, check_unsupported, message_chars, messages_as_dicts,
    requested_prompt_logprobs, template_tools, to_sampling_params, tool_choice_of, unknown_fields,
)
from minillm.server.serving import (
    ChoiceProgress, ChunkFormat, ServingContext, StreamChoice, all_finished, answer,
    client_response_id, content_choice_json, engine_request_id, is_large_body, json_dumps, log_unknown_fields,
    merged_outputs, new_request_id, refuse_uncompiled_constraint, sse, stream_events, tokenize_bad_words,
    UNSERVED_FIELDS, UNSERVED_TAIL_FIELDS, validate_request, whole_usage,
)
from minillm.server.serving_beam_search import answer_beam_search, check_beam_search, searches_no_tokens
from minillm.server.streaming import FinalEvent
from minillm.server.structured import asks_for_structure, structured_outputs_params
from minillm.server.output_parsers import OutputParsers, OutputStream
from minillm.server.reasoning_parsers import (
    ReasoningParser, count_reasoning_tokens, reasoning_ended_in_prompt, thinking_token_ids,
)
from minillm.server.tool_calls import ToolCallStream, forced_tool_calls
from minillm.server.tool_parsers import keeps_special_tokens

# Names render_chat takes itself: chat_template_kwargs may not set them (vLLM refuses chat_template
# and tokenize too).
RESERVED_TEMPLATE_KWARGS = ("messages", "template", "add_generation_prompt", "continue_final_message",
                            "content_parts", "chat_template", "tokenize")


def chat_template_for(ctx: ServingContext, req: ConversationRequest) -> str | None:
    """The template source to render with (None: the model's own); 400 when there is none to use."""
    if req.chat_template is not None:
        if not ctx.trust_request_chat_template:
            raise APIError(400, "this server does not render chat templates sent with a request; start it with "
                           "--trust-request-chat-template to allow them, or set one with --chat-template",
                           param="chat_template")
        return req.chat_template
    if ctx.chat_template is not None:
        return ctx.chat_template
    if not ctx.tokenizer.has_chat_template:
        raise APIError(400, f"The model `{ctx.model_name}` has no chat template, so chat completions are not "
                       "available; start the server with --chat-template FILE, or use /v1/completions with a "
                       "plain prompt.", param="messages", code="no_chat_template")
    return None


def check_default_template_kwargs(kwargs: dict | None) -> None:
    """ValueError naming default_chat_template_kwargs unless it is None or an object of variables the
    renderer does not set itself."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise ValueError(f"default_chat_template_kwargs must be a JSON object, got {short_repr(kwargs)}")
    clash = [k for k in RESERVED_TEMPLATE_KWARGS if k in kwargs]
    if clash:
        raise ValueError(f"default_chat_template_kwargs may not set {', '.join(clash)}")


def template_kwargs(req: ConversationRequest, defaults: dict | None = None) -> dict:
    """The server's default template variables under the request's chat_template_kwargs (refusing
    names that the renderer sets itself), plus the request's tools (chat_template_kwargs may replace
    them, as in vLLM) and its reasoning effort (see effort_kwargs; it overrides a default)."""
    own = dict(req.chat_template_kwargs or {})
    clash = [k for k in RESERVED_TEMPLATE_KWARGS if k in own]
    if clash:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(clash)}", param="chat_template_kwargs")
    kwargs = {**(defaults or {}), **own}
    kwargs.update(effort_kwargs(getattr(req, "reasoning_effort", None), own))
    tools = template_tools(req)
    if tools is not None:
        kwargs.setdefault("tools", tools)
    if req.documents is not None:
        kwargs.setdefault("documents", req.documents)
    return kwargs


def effort_kwargs(effort: str | None, kwargs: dict) -> dict:
    """The template variables a reasoning effort sets, as vLLM sets them: reasoning_effort (over
    chat_template_kwargs' own), and enable_thinking (false for "none") unless kwargs set it."""
    if effort is None:
        return {}
    out = {"reasoning_effort": effort}
    if "enable_thinking" not in kwargs:
        out["enable_thinking"] = effort != "none"
    return out


@contextlib.contextmanager
def naming_max_tokens_field(req: ChatCompletionRequest):
    """An error about max_tokens, or one that names it (min_tokens over it), names max_completion_tokens
    instead when that is the field sent."""
    try:
        yield
    except APIError as exc:
        field = chat_max_tokens_field(req)
        if field != "max_tokens":
            exc.message = re.sub(r"\bmax_tokens\b", field, exc.message)
            if exc.param == "max_tokens":
                exc.param = field
        raise


class ConversationPrompt:
    """A request's conversation, checked where it enters (its size, the template to use, the
    template's variables); token_ids() renders and tokenises it. Chat completions and /tokenize's
    chat form both go through it, so /tokenize counts what a chat completion feeds the engine."""

    def __init__(self, ctx: ServingContext, req: ConversationRequest) -> None:
        self.ctx, self.req = ctx, req
        self.messages = messages_as_dicts(req)
        check_prompt_chars(ctx.limits, message_chars(self.messages), "messages")
        self.template = chat_template_for(ctx, req)
        self.template_kwargs = template_kwargs(req, ctx.default_chat_template_kwargs)
        self.text: str | None = None        # the rendered prompt, once token_ids() has made it
        self.content_as_parts = False       # whether the template got content as a list of parts, once rendered

    def token_ids(self) -> list[int]:
        """Token ids of the conversation plus the assistant's turn opener (slow: run it in the pool)."""
        tok, req = self.ctx.tokenizer, self.req
        try:
            as_parts = tok.content_as_parts(self.template, self.ctx.chat_template_content_format,
                                            self.template_kwargs.get("tools"))
            text = tok.render_chat(self.messages, template=self.template,
                                   add_generation_prompt=req.add_generation_prompt,
                                   continue_final_message=req.continue_final_message,
                                   content_parts="openai" if as_parts else "string",
                                   **self.template_kwargs)
        except ValueError as exc:
            param = "chat_template" if req.chat_template is not None else "messages"
            raise APIError(400, str(exc), param=param) from None
        check_prompt_chars(self.ctx.limits, len(text), "messages")
        self.text, self.content_as_parts = text, as_parts
        # The template writes BOS itself where the model wants it (add_special_tokens adds more).
        return tok.encode_batch([text], add_special_tokens=req.add_special_tokens)[0]


def reply_role(ctx: ServingContext, req: ChatCompletionRequest, messages: list[dict]) -> str:
    """The reply's role, as vLLM names it: the server's --response-role when the request opens a new
    turn (add_generation_prompt), else the last message's role (the turn the reply continues)."""
    return ctx.response_role if req.add_generation_prompt else messages[-1]["role"]


def echoed_text(req: ChatCompletionRequest, conversation: ConversationPrompt, role: str) -> str:
    """What a reply starts with under vLLM's echo: the last message's content as the template got it
    (joined parts less the empty ones; parts handed over as a list joined whole, by newlines) when it
    has the reply's role (the message continue_final_message continues), else nothing."""
    last = conversation.messages[-1]
    if not req.echo or last["role"] != role:
        return ""
    content = shape_content([last], conversation.content_as_parts)[0]["content"]
    return content if isinstance(content, str) else "\n".join(part["text"] for part in content)


def whole_message(message: dict) -> dict:
    """A whole reply's message as vLLM's ChatMessage dumps it: its keys in vLLM's order, null where
    there is nothing; tool_calls only where there are some (vLLM drops an empty list); the
    reasoning's older name, reasoning_content, after it where a reasoning parser gives it."""
    whole = {"role": message["role"], "content": message.get("content"), "refusal": None, "annotations": None,
             "audio": None, "function_call": None}
    if message.get("tool_calls"):
        whole["tool_calls"] = message["tool_calls"]
    whole["reasoning"] = message.get("reasoning")
    if "reasoning_content" in message:
        whole["reasoning_content"] = message["reasoning_content"]
    return whole


class ChatJob:
    """One /v1/chat/completions call and how its outputs become OpenAI responses.

    The constructor does the cheap checks (limits, field values, the template to use); prepare()
    renders and tokenises, off the event loop.
    """

    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, response_id: str | None = None) -> None:
        self.ctx, self.req = ctx, req
        if keeps_special_tokens(ctx.tool_call_parser, req.tools, tool_choice_of(req)):
            req.skip_special_tokens = False       # a <tool_call> that is a special token stays in the text
        # The client's id (vLLM's chatcmpl-<X-Request-Id or request_id>) or a fresh one: the response's
        # (another API's job may name its response otherwise), and the stem of the engine's id.
        self.request_id = self.response_id = response_id or new_request_id("chatcmpl")
        self.created = int(time.time())
        self.num_top = requested_top_logprobs(req, ctx.engine.config.max_logprobs)
        check_fan_out(ctx.limits, req.n, 1, req.stop, req.stop_token_ids)
        check_allowed_token_ids(ctx.limits, req.allowed_token_ids, 1)
        # A beam search for no token builds its SamplingParams for one, which no step generates.
        self.max_tokens = 1 if searches_no_tokens(req) else chat_max_tokens(req)
        # Field errors first, so a bad value is named even on a model without a template.
        with naming_max_tokens_field(req):
            to_sampling_params(req, self.max_tokens, self.num_top, ctx.engine.vocab_size,
                               max_model_len=ctx.engine.max_model_len, defaults=ctx.sampling_defaults)
        limit = ctx.engine.max_model_len
        if req.max_tokens is not None and req.max_completion_tokens is not None and not 1 <= req.max_tokens <= limit:
            # max_completion_tokens wins, but a bad max_tokens beside it is still a bad request.
            raise APIError(400, f"max_tokens must be an integer in [1, {limit}] (the model's context), "
                                f"got {short_repr(req.max_tokens)}", param="max_tokens")
        asked = requested_prompt_logprobs(req, ctx.engine.config.max_logprobs, ctx.engine.vocab_size)
        self.prompt_logprobs = None if req.stream else asked    # a stream (asking for 0) has no place for them
        if asked is None and req.echo and not req.stream:
            # vLLM scores an echoed prompt: prompt_logprobs = top_logprobs (0 when not given)
            self.prompt_logprobs = self.num_top or 0
        self.as_token_ids = ctx.as_token_ids(req)
        self.conversation = ConversationPrompt(ctx, req)
        self.role = reply_role(ctx, req, self.conversation.messages)
        # tool_choice "required" or a named tool: the output is the call, carried as tool_calls
        self.forced = forced_tool_calls(tool_choice_of(req), template_tools(req) or [], req.parallel_tool_calls)
        self.tool_streams: dict[int, ToolCallStream] = {}
        self.constraint_param = self.forced.param if self.forced is not None else None   # what holds the output
        self._choose_parsers()
        self.output_streams: dict[int, OutputStream] = {}
        # include_reasoning false hides the reasoning the parser splits off; its tokens' logprobs and ids
        # would show it token by token, so neither is computed nor sent (as vLLM leaves them out)
        self.hides_reasoning = not req.include_reasoning and self.parsers is not None \
            and self.parsers.reasoning is not None
        if self.hides_reasoning:
            self.num_top = None
        self.prompt_ids: list[int] = []
        self.reasoning_ended = False     # whether the rendered prompt closed the thinking block
        self._text_ids: list[int] | None = None     # the ids whose text conversation.text is (not truncated)
        self.params = None
        self.texts = TokenTexts(ctx.tokenizer)
        self.kv_transfer_stats: dict | None = None   # what loading the prompt took (a decode server's)

    def _choose_parsers(self, reasoning_ended: bool = False) -> None:
        """reasoning_first and the reply's parsers, by what the template was told of thinking and
        (reasoning_ended) by a rendered prompt that closed the thinking block itself."""
        ctx, req, kwargs = self.ctx, self.req, self.conversation.template_kwargs
        constrained = self.forced is not None or asks_for_structure(req)
        # A structure (response_format, structured_outputs, a forced tool call) under --reasoning-parser: the
        # grammar holds what follows the thinking, unless --structured-outputs-config enable_in_reasoning
        self.reasoning_first = constrained and ctx.reasoning_parser is not None \
            and not ctx.structured_outputs_in_reasoning \
            and ReasoningParser.for_request(ctx.reasoning_parser, kwargs, reasoning_ended).thinking
        # --reasoning-parser and --tool-call-parser, for a reply that is free text (or a structure after the thinking);
        # no tools, no calls: an empty tools list with tool_choice "auto" leaves the output text, as vLLM reads it
        tool_choice = tool_choice_of(req) if req.tools else "none"
        self.parsers = OutputParsers.for_request(
            ctx.reasoning_parser, ctx.tool_call_parser, kwargs, tool_choice, constrained,
            req.include_reasoning, req.parallel_tool_calls, self.reasoning_first, reasoning_ended)

    @functools.cached_property
    def echo_text(self) -> str:
        """What each choice starts with (see echoed_text): read once the conversation is rendered."""
        return echoed_text(self.req, self.conversation, self.role)

    def engine_request_ids(self, num_prompts: int) -> list[str]:
        """The engine's id of the conversation (num_prompts is 1): request_id made unique by engine_request_id."""
        return [engine_request_id(self.request_id)]

    async def prepare(self) -> None:
        """Render and tokenise the conversation and check the output constraint (in the preprocessing
        pool); fit max_tokens to the prompt. A prompt that closed the thinking block leaves the whole
        reply the answer, as vLLM reads it (is_reasoning_end on the prompt): no reasoning split off, and
        a structure holds the reply from its first token."""
        self.prompt_ids = await self.ctx.run_blocking(self._render_prompt)
        if not self.prompt_ids:
            raise APIError(400, "the chat template rendered an empty prompt", param="messages")
        if self.reasoning_ended:
            self._choose_parsers(reasoning_ended=True)
        self.structured = await self.ctx.run_blocking_if(asks_for_structure(self.req) or self.forced is not None,
                                                         self._constraint)
        with naming_max_tokens_field(self.req):
            max_tokens = self.ctx.resolve_max_tokens(len(self.prompt_ids), self.max_tokens, "messages")
        self.params = to_sampling_params(self.req, max_tokens, self.num_top, self.ctx.engine.vocab_size,
                                         self.structured, self.prompt_logprobs, defaults=self.ctx.sampling_defaults)
        await tokenize_bad_words(self.ctx, [self.params])

    def _constraint(self):
        """The output's StructuredOutputsParams: the forced tool call's, or the request's own."""
        reasoning = self._thinking_token_ids() if self.reasoning_first else None
        asked = structured_outputs_params(self.req, reasoning, self.ctx.disable_additional_properties)
        if self.forced is None:
            return asked
        if asked is not None:
            field = "response_format" if self.req.response_format is not None else "structured_outputs"
            raise APIError(400, f"tool_choice holds the output to a tool call; {field} cannot constrain it too",
                           param=field)
        return self.forced.constraint(reasoning, self.ctx.disable_additional_properties)

    def _thinking_token_ids(self) -> tuple[int, int]:
        """The ids of <think> and </think>, which the engine watches for; a 400 when they are not single tokens."""
        ids = thinking_token_ids(self.ctx.tokenizer)
        if ids is None:
            field = "response_format" if self.req.response_format is not None else "structured_outputs"
            field = "tool_choice" if self.forced is not None else field
            raise APIError(400, f"{field} under --reasoning-parser {self.ctx.reasoning_parser} holds the output to "
                           "its structure after </think>, but <think> and </think> are not single tokens of this "
                           "model's tokenizer (--structured-outputs-config '{\"enable_in_reasoning\": true}' holds "
                           "it from the first token instead)", param=field)
        return ids

    def _render(self) -> list[int]:
        """Token ids of the conversation plus the assistant's turn opener, truncated as asked."""
        ids, req, limit = self.conversation.token_ids(), self.req, self.ctx.engine.max_model_len
        kept = truncate_prompt(ids, req.truncate_prompt_tokens, max_prompt_len(limit, chat_max_tokens(req)),
                               req.truncation_side)
        if req.truncate_prompt_tokens == -1 and len(kept) >= limit:
            raise APIError(400, f"truncate_prompt_tokens -1 keeps the prompt's last max_model_len - max_tokens tokens; "
                           f"with no max_tokens (or max_completion_tokens) given that is the whole context ({limit} "
                           f"tokens), which leaves no room for a completion: give max_tokens",
                           param="truncate_prompt_tokens")
        self._text_ids = kept if len(kept) == len(ids) else None
        return kept

    def _render_prompt(self) -> list[int]:
        """_render's token ids; under a reasoning parser, notes whether they close the thinking block
        (read from the rendered text, or from the ids' decoded text where truncation cut it)."""
        ids = self._render()
        if self.ctx.reasoning_parser is not None:
            text = self.conversation.text if ids is self._text_ids else self.ctx.tokenizer.decode(ids)
            self.reasoning_ended = reasoning_ended_in_prompt(text, bool(self.req.continue_final_message))
        return ids

    def _cursor(self) -> LogprobCursor | None:
        if self.num_top is None:
            return None
        return LogprobCursor(self.texts, self.prompt_ids, 0, self.req.skip_special_tokens, self.as_token_ids)

    def response(self, finals: list[RequestOutput]) -> dict:
        """The non-streaming response body (a chat request has one prompt)."""
        final = finals[0]
        choices = []
        for comp in final.outputs:
            logprobs = None
            cursor = self._cursor()
            if cursor is not None:
                logprobs = chat_logprobs(cursor.advance(comp.token_ids, comp.logprobs or [], self.num_top))
            message = {"role": self.role, "content": self.echo_text + comp.text}
            finish_reason = comp.finish_reason
            if self.parsers is not None:
                message, finish_reason = self.parsers.message(self.role, self.echo_text, comp.text, finish_reason)
            if self.forced is not None:
                message, finish_reason = self._forced_message(comp)
            choice = {"index": comp.index, "message": whole_message(message), "logprobs": logprobs,
                      "finish_reason": finish_reason, "stop_reason": comp.stop_reason}
            choice["token_ids"] = None
            if self.req.return_token_ids and not self.hides_reasoning:
                choice["token_ids"] = list(comp.token_ids)
            choice["routed_experts"] = None       # vLLM's MoE routing (--enable-return-routed-experts)
            choices.append(choice)
        # vLLM's keys, in its order, null where there is nothing (its whole response is its model_dump)
        body = {"id": self.response_id, "object": "chat.completion", "created": self.created,
                "model": self.ctx.model_name, "choices": choices, **UNSERVED_FIELDS,
                "usage": whole_usage(self.usage(final)), "prompt_logprobs": None, "prompt_token_ids": None,
                "prompt_text": None, "kv_transfer_params": None, **UNSERVED_TAIL_FIELDS}
        if final.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs, final.prompt_token_ids,
                                                           self.prompt_logprobs, self.ctx.tokenizer)
        if self.req.return_token_ids:
            body["prompt_token_ids"] = list(final.prompt_token_ids)
        if self.req.return_prompt_text:
            body["prompt_text"] = self.conversation.text
        self.kv_transfer_stats = final.kv_transfer_stats
        body["kv_transfer_params"] = final.kv_transfer_params     # a prefill server's, for the decode server
        return body

    def reasoning_tokens(self, final: RequestOutput) -> int | None:
        """How many of the outputs' tokens are reasoning, where a reasoning parser splits the reply (else None)."""
        if self.parsers is None or self.parsers.reasoning is None:
            return None
        return sum(count_reasoning_tokens(self.parsers.reasoning, comp.token_ids, self.ctx.tokenizer)
                   for comp in final.outputs)

    def usage(self, final: RequestOutput, is_stream: bool = False) -> dict:
        """The reply's usage, with vLLM's completion_tokens_details.reasoning_tokens under a reasoning parser."""
        block = self.ctx.usage([final], sum(len(c.token_ids) for c in final.outputs), is_stream)
        num_reasoning = self.reasoning_tokens(final)
        if num_reasoning is not None:
            block["completion_tokens_details"] = {"reasoning_tokens": num_reasoning}
        return block

    def _forced_message(self, comp) -> tuple[dict, str | None]:
        """(message, finish reason) of a forced call's output: the calls, after the reasoning where the
        model reasons first (none while it never left the reasoning)."""
        message, text = {"role": self.role, "content": self.echo_text}, comp.text
        if self.parsers is not None:
            reasoning, text = self.parsers.reasoning.split(comp.text)
            if self.parsers.include_reasoning:
                message["reasoning"] = message["reasoning_content"] = reasoning
        message["tool_calls"] = self.forced.calls(text) if text is not None else []
        return message, self.forced.finish_reason(comp.finish_reason, comp.stop_reason)

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {"id": self.response_id, "object": "chat.completion.chunk", "created": self.created,
                 "model": self.ctx.model_name, "choices": choices}
        if self.req.include_usage:
            chunk["usage"] = None
        return chunk

    def _choice(self, index: int, delta: dict, rows: list | None, finish: str | None, stop_reason=None,
                token_ids: list[int] | None = None) -> str:
        if rows is None and finish is None and token_ids is None and len(delta) == 1 and "content" in delta:
            # A token's chunk: only the text is new.
            return content_choice_json(index, delta["content"])
        choice = {"index": index, "delta": delta, "logprobs": chat_logprobs(rows) if rows is not None else None,
                  "finish_reason": finish, "stop_reason": stop_reason}
        if token_ids is not None:        # vLLM's return_token_ids: the tokens since the last chunk
            choice["token_ids"] = token_ids
        return json_dumps(choice)

    def events(self, streams: list[RequestStream]) -> AsyncIterator[str]:
        """Server-sent events of the engine's streams: the role, then content deltas, the finish, usage and [DONE]."""
        return self.output_events(merged_outputs(self.ctx, streams, self.req.stream_interval),
                                  lambda: all_finished(streams))

    async def output_events(self, outputs: AsyncIterator[list[tuple[int, RequestOutput]]],
                            is_finished: Callable[[], bool]) -> AsyncIterator[str]:
        """Server-sent events of batches of (prompt index, output); is_finished: whether the last
        batch has come (its events then go out with the usage and [DONE], in one write)."""
        progress: dict[int, ChoiceProgress] = {}
        final: RequestOutput | None = None
        chunks = ChunkFormat(self.response_id, "chat.completion.chunk", self.created, self.ctx.model_name,
                             self.req.include_usage)
        last = ""      # the final wake-up's events: sent with the usage and [DONE], in one write
        sent = False   # nothing sent yet: the status line is still ours to choose
        async with contextlib.aclosing(outputs) as batches:
            async for batch in batches:
                for _, output in batch:
                    if not sent:
                        refuse_uncompiled_constraint(self.req, [output], self.constraint_param)
                    choices = self._choices(output, progress)
                    if final is None:      # the first output: every choice's opening chunks go first
                        choices = self._openers(output) + choices
                    final = output
                    self.kv_transfer_stats = output.kv_transfer_stats
                    events = stream_events(chunks, choices, output, self.req.continuous_usage,
                                           with_completion_details=True)
                    if events:
                        last = "".join(events)   # one write per wake-up, however many choices moved
                        if not is_finished():
                            sent = True
                            yield last
                            last = ""
        if self.req.include_usage and final is not None:
            chunk = self._chunk([])
            chunk["usage"] = self.usage(final, is_stream=True)
            last += sse(chunk)
        yield FinalEvent(last + SSE_DONE)

    def _openers(self, output: RequestOutput) -> list[StreamChoice]:
        """A stream's first chunks, sent with its first output as vLLM sends them (its first_iteration):
        the n choices' roles (content ""), each with the prompt's ids and text where asked, then the
        n choices' echo of the last message where echo repeats one."""
        num_choices, num_reasoning = self.req.n, self._num_reasoning(())
        prompt_ids = list(output.prompt_token_ids) if self.req.return_token_ids else None
        prompt_text = self.conversation.text if self.req.return_prompt_text else None
        openers = [StreamChoice(opening_choice_json(i, {"role": self.role, "content": ""}), 0, prompt_ids,
                                prompt_text, is_opener=True, num_reasoning=num_reasoning) for i in range(num_choices)]
        if self.echo_text:
            openers += [StreamChoice(opening_choice_json(i, {"content": self.echo_text}), 0,
                                     num_reasoning=num_reasoning) for i in range(num_choices)]
        return openers

    def _choices(self, output: RequestOutput, progress: dict[int, ChoiceProgress]) -> list[StreamChoice]:
        """Stream choices (content delta, finish) for the completions that moved."""
        # With return_token_ids each chunk carries its new tokens (the prompt's are in the openers).
        choices = []
        with_output_ids = bool(self.req.return_token_ids) and not self.hides_reasoning
        for comp in output.outputs:
            state = progress.get(comp.index)
            if state is None:
                state = progress[comp.index] = ChoiceProgress(comp.index, self._cursor(), self.num_top or 0)
            update = state.update(comp.text, comp.token_ids, comp.logprobs, comp.finish_reason)
            if update is None:
                continue
            delta, rows, finish = update
            content = {"content": delta} if delta else {}
            if self.parsers is not None:
                stream = self.output_streams.setdefault(comp.index, self.parsers.stream())
                content, finish = stream.delta(delta, finish)
                if not content and finish is None and not (state.cursor is not None and rows):
                    continue       # held back (a tag may be forming): nothing to send yet
            if self.forced is not None:
                stream = self.tool_streams.setdefault(comp.index, self.forced.stream())
                if self.parsers is None:
                    calls = stream.deltas(delta, comp.text)
                    content = {}           # the output is the calls' text: no content beside them
                else:       # the reasoning first: the calls are what follows it
                    call_text = content.pop("content", "")
                    calls = stream.feed(call_text) if call_text else []
                if calls:
                    content["tool_calls"] = calls
                finish = self.forced.finish_reason(finish, comp.stop_reason)
                if not content and finish is None and not (state.cursor is not None and rows):
                    continue       # a required array's call not whole yet: nothing to send
            choices.append(StreamChoice(self._choice(
                comp.index, content, rows if state.cursor is not None else None, finish,
                comp.stop_reason if finish else None, state.new_token_ids(comp.token_ids) if with_output_ids else None),
                len(comp.token_ids), num_reasoning=self._num_reasoning(comp.token_ids)))
        return choices

    def _num_reasoning(self, token_ids) -> int | None:
        """The reasoning tokens among a choice's tokens so far, for a chunk's continuous usage (None
        without a reasoning parser, or without continuous usage stats to carry it)."""
        if not self.req.continuous_usage or self.parsers is None or self.parsers.reasoning is None:
            return None
        return count_reasoning_tokens(self.parsers.reasoning, token_ids, self.ctx.tokenizer)


def opening_choice_json(index: int, delta: dict) -> str:
    """A choice of a stream's first chunks as vLLM writes it (exclude_unset: no stop_reason)."""
    return json_dumps({"index": index, "delta": delta, "logprobs": None, "finish_reason": None})


async def create_chat_completion(ctx: ServingContext, body: dict, raw: Request):
    """Validate, render, submit and answer (JSON, or an event stream); a large body is read as a
    request in the preprocessing pool (its messages are walked there too)."""
    is_large = await is_large_body(raw)
    req = await ctx.run_blocking_if(is_large, validate_request, ChatCompletionRequest, body)
    ctx.check_model(req.model)
    if ctx.enable_force_include_usage:
        req.force_usage()
    check_unsupported(req, auto_tool_choice=ctx.tool_call_parser is not None)   # refused, so not logged as ignored
    # unknown_fields walks every message (110 ms for a 10 MB body of 300,000 small ones): in the pool if large.
    log_unknown_fields(await ctx.run_blocking_if(is_large, unknown_fields, req) + check_beam_search(ctx, req))
    job = await ctx.run_blocking_if(is_large, ChatJob, ctx, req, client_response_id("chatcmpl", raw, req.request_id))
    await job.prepare()
    if req.use_beam_search:
        return await answer_beam_search(ctx, raw, job, [job.prompt_ids], [job.params])
    [job.params], lease = await apply_kv_transfer(ctx, req.kv_transfer_params, [job.prompt_ids], [job.params],
                                                  req.n, req.stream)
    try:
        response = await answer(ctx, raw, job, [job.prompt_ids], [job.params], req.stream,
                                on_handed_over=lease.hand_over if lease is not None else None,
                                on_output=lease.on_output if lease is not None else None)
    except BaseException:
        release_claim(ctx, lease)
        raise
    if lease is not None:
        lease.answered(raw, response, job.kv_transfer_stats)
    return response
