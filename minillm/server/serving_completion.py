"""POST /v1/completions: one engine request per prompt, n completions each."""
from __future__ import annotations

import contextlib
from typing import AsyncIterator

from fastapi import Request

from minillm.outputs import CompletionOutput, RequestOutput
from minillm.server.async_engine import RequestStream
from minillm.server.logprobs import LogprobCursor, TokenTexts, completion_logprobs
from minillm.server.protocol import CompletionRequest, check_unsupported, completion_prompts, to_sampling_params
from minillm.server.serving import (
    SSE_DONE, ChoiceProgress, ServingContext, answer, merged_outputs, new_request_id, sse, usage,
)
from minillm.server.structured import structured_outputs_params


class CompletionJob:
    """One /v1/completions call: its prompts, and how its outputs become OpenAI responses."""

    def __init__(self, ctx: ServingContext, req: CompletionRequest) -> None:
        self.ctx, self.req = ctx, req
        self.request_id = new_request_id("cmpl")
        structured = structured_outputs_params(req)
        tok = ctx.tokenizer
        self.prompt_ids: list[list[int]] = []
        self.prompt_texts: list[str] = []
        for prompt in completion_prompts(req):
            if isinstance(prompt, str):
                self.prompt_ids.append(tok.encode(prompt, add_special_tokens=True))
                self.prompt_texts.append(prompt)
            else:
                ctx.check_token_ids(prompt)
                self.prompt_ids.append(list(prompt))
                self.prompt_texts.append(tok.decode(prompt) if req.echo else "")
        self.params = [to_sampling_params(req, ctx.resolve_max_tokens(len(ids), req.max_tokens), req.logprobs,
                                          structured) for ids in self.prompt_ids]
        self.texts = TokenTexts(tok)

    def _cursor(self, prompt_index: int) -> LogprobCursor | None:
        if self.req.logprobs is None:
            return None
        base = len(self.prompt_texts[prompt_index]) if self.req.echo else 0
        return LogprobCursor(self.texts, self.prompt_ids[prompt_index], base, self.req.skip_special_tokens)

    def _choice_index(self, prompt_index: int, completion: CompletionOutput) -> int:
        return prompt_index * self.req.n + completion.index

    def _usage(self, finals: list[RequestOutput]) -> dict:
        return usage(sum(len(o.prompt_token_ids) for o in finals),
                     sum(len(c.token_ids) for o in finals for c in o.outputs))

    def response(self, finals: list[RequestOutput]) -> dict:
        """The non-streaming response body."""
        choices = []
        for pi, final in enumerate(finals):
            for comp in final.outputs:
                text = (self.prompt_texts[pi] if self.req.echo else "") + comp.text
                cursor = self._cursor(pi)
                logprobs = None
                if cursor is not None:
                    logprobs = completion_logprobs(cursor.advance(comp.token_ids, comp.logprobs or [],
                                                                  self.req.logprobs))
                choices.append({"index": self._choice_index(pi, comp), "text": text, "logprobs": logprobs,
                                "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason})
        choices.sort(key=lambda c: c["index"])
        return {"id": self.request_id, "object": "text_completion", "created": self.ctx.created,
                "model": self.ctx.model_name, "choices": choices, "usage": self._usage(finals)}

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {"id": self.request_id, "object": "text_completion", "created": self.ctx.created,
                 "model": self.ctx.model_name, "choices": choices}
        if self.req.include_usage:
            chunk["usage"] = None
        return chunk

    async def events(self, streams: list[RequestStream]) -> AsyncIterator[str]:
        """Server-sent events: a chunk per completion whose text moved, then usage and [DONE]."""
        progress: dict[int, ChoiceProgress] = {}
        finals: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(merged_outputs(self.ctx, streams)) as batches:
            async for batch in batches:
                events = []
                for pi, output in batch:
                    finals[pi] = output
                    events.extend(sse(self._chunk([choice])) for choice in self._choices(pi, output, progress))
                if events:
                    yield "".join(events)   # one write per wake-up, however many choices moved
        if self.req.include_usage:
            chunk = self._chunk([])
            chunk["usage"] = self._usage([finals[i] for i in sorted(finals)])
            yield sse(chunk)
        yield SSE_DONE

    def _choices(self, pi: int, output: RequestOutput, progress: dict[int, ChoiceProgress]) -> list[dict]:
        """Stream choices for the completions of one output that have something new."""
        choices = []
        for comp in output.outputs:
            index = self._choice_index(pi, comp)
            state = progress.setdefault(index, ChoiceProgress(index, self._cursor(pi), self.req.logprobs or 0))
            update = state.update(comp.text, comp.token_ids, comp.logprobs, comp.finish_reason)
            if update is None:
                continue
            delta, rows, finish = update
            if not state.is_started:
                state.is_started = True
                if self.req.echo:
                    delta = self.prompt_texts[pi] + delta
            choices.append({"index": index, "text": delta,
                            "logprobs": completion_logprobs(rows) if state.cursor is not None else None,
                            "finish_reason": finish, "stop_reason": comp.stop_reason if finish else None})
        return choices


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request):
    """Validate, submit and answer (JSON, or an event stream)."""
    ctx.check_model(req.model)
    check_unsupported(req)
    job = CompletionJob(ctx, req)
    return await answer(ctx, raw, job, job.prompt_ids, job.params, req.stream)
