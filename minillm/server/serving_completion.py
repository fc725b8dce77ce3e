"""POST /v1/completions: one engine request per prompt, n completions each."""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import AsyncIterator

from fastapi import Request

from minillm.outputs import CompletionOutput, RequestOutput
from minillm.sampling_params import SamplingParams, max_prompt_len, truncate_prompt
from minillm.server.async_engine import RequestStream
from minillm.server.errors import SSE_DONE, APIError
from minillm.server.kv_transfer import apply_kv_transfer, release_claim
from minillm.server.logprobs import (
    LogprobCursor, TokenTexts, completion_logprobs, prompt_logprob_rows, prompt_logprobs_json,
)
from minillm.server.limits import check_allowed_token_ids, check_fan_out, check_prompt_chars
from minillm.server.protocol import (
    CompletionRequest, check_unsupported, completion_prompts, requested_prompt_logprobs, to_sampling_params,
    unknown_fields,
)
from minillm.server.serving import (
    ChoiceProgress, ChunkFormat, ServingContext, StreamChoice, all_finished, answer,
    client_response_id, engine_request_id, forced_token_params, is_large_body, json_dumps, log_unknown_fields, merged_outputs,
    new_request_id, refuse_uncompiled_constraint, sse, stream_events, text_choice_json, tokenize_bad_words,
    UNSERVED_FIELDS, UNSERVED_TAIL_FIELDS, validate_request, whole_usage,
)
from minillm.server.serving_beam_search import answer_beam_search, check_beam_search, searches_no_tokens
from minillm.server.streaming import FinalEvent
from minillm.server.structured import asks_for_structure, structured_outputs_params


class CompletionJob:
    """One /v1/completions call: its prompts, and how its outputs become OpenAI responses.

    The constructor does the cheap checks (limits, field values, token ids); prepare() tokenises,
    off the event loop.
    """

    def __init__(self, ctx: ServingContext, req: CompletionRequest, response_id: str | None = None) -> None:
        self.ctx, self.req = ctx, req
        # The client's id (vLLM's cmpl-<X-Request-Id or request_id>) or a fresh one: the response's, and
        # the stem of each prompt's engine id (engine_request_ids).
        self.request_id = self.response_id = response_id or new_request_id("cmpl")
        self.created = int(time.time())
        self.prompts = completion_prompts(req)
        check_fan_out(ctx.limits, req.n, len(self.prompts), req.stop, req.stop_token_ids)
        check_allowed_token_ids(ctx.limits, req.allowed_token_ids, len(self.prompts))
        check_prompt_chars(ctx.limits, sum(len(p) for p in self.prompts if isinstance(p, str)), "prompt")
        for prompt in self.prompts:
            if not isinstance(prompt, str):
                ctx.check_token_ids(prompt)
        # echo with max_tokens 0 (vLLM's echo without generation): the prompt back, scored when
        # logprobs are asked; one token is generated and dropped.
        self.echo_only = req.echo and req.max_tokens == 0
        self.max_tokens = 1 if self.echo_only or searches_no_tokens(req) else req.max_tokens
        if self.echo_only and isinstance(req.min_tokens, int) and req.min_tokens > 0:
            # checked against the 0 sent, not the 1 generated and dropped (which the error named)
            raise APIError(400, f"min_tokens must not exceed max_tokens (0), got {req.min_tokens}",
                           param="min_tokens")
        to_sampling_params(req, self.max_tokens, req.logprobs, ctx.engine.vocab_size,   # field errors first
                           max_model_len=ctx.engine.max_model_len, defaults=ctx.sampling_defaults)
        asked = requested_prompt_logprobs(req, ctx.engine.config.max_logprobs, ctx.engine.vocab_size)
        # As in vLLM: echo with logprobs scores the prompt with logprobs alternatives unless
        # prompt_logprobs says how many; the choices carry the prompt's logprobs either way. A stream's
        # chunks have no place for them (a stream may ask for 0): scored there only for echo to show.
        scored = asked if asked is not None else req.logprobs if req.echo else None
        is_shown = not req.stream or (req.echo and req.logprobs is not None)
        self.prompt_logprobs = scored if is_shown else None     # what the engine computes
        self.as_token_ids = ctx.as_token_ids(req)
        self.prompt_ids: list[list[int]] = []
        self.prompt_texts: list[str] = []
        # Prompts of an echo without generation that fill the whole context: the engine scores all but
        # their last token and is made to "generate" that one (see _full_context_echo_params).
        self.full_context_echoes: set[int] = set()
        self.params: list = []
        self.texts = TokenTexts(ctx.tokenizer)
        self._prompt_row_cache: dict[int, list] = {}   # prompt index -> its echoed logprob rows
        self._prompt_logprobs_json: dict[int, list] = {}   # prompt index -> its choices' prompt_logprobs
        self.kv_transfer_stats: dict | None = None   # what loading the prompt took (a decode server's)

    def engine_request_ids(self, num_prompts: int) -> list[str]:
        """The engine's id of each prompt: vLLM's request_id-i, made unique by engine_request_id."""
        return [engine_request_id(f"{self.request_id}-{i}") for i in range(num_prompts)]

    async def prepare(self, is_large: bool = False) -> None:
        """Check the output constraint and tokenise the prompts (in the preprocessing pool); fit max_tokens to each."""
        self.structured = await self.ctx.run_blocking_if(asks_for_structure(self.req), structured_outputs_params,
                                                         self.req, None, self.ctx.disable_additional_properties)
        # Token ids not echoed need no tokenizer: no hop through the pool (two thread hand-overs a request),
        # unless the body is large (is_large): copying a 10 MB body's ids held the event loop for 5-25 ms.
        text_work = self.req.echo or any(isinstance(p, str) for p in self.prompts)
        self.prompt_ids, self.prompt_texts = await self.ctx.run_blocking_if(text_work or is_large, self._tokenize)
        if any(not ids for ids in self.prompt_ids):     # e.g. add_special_tokens false on text of no tokens
            raise APIError(400, "prompt must not be empty: it tokenizes to no tokens", param="prompt")
        self.params = []
        for pi, ids in enumerate(self.prompt_ids):
            if self.echo_only and len(ids) == self.ctx.engine.max_model_len:
                self.full_context_echoes.add(pi)
                self.params.append(self._full_context_echo_params(ids))
                continue
            self.params.append(to_sampling_params(
                self.req, self.ctx.resolve_max_tokens(len(ids), self.max_tokens), self.req.logprobs,
                self.ctx.engine.vocab_size, self.structured, self.prompt_logprobs, defaults=self.ctx.sampling_defaults))
        await tokenize_bad_words(self.ctx, self.params)

    def _full_context_echo_params(self, ids: list[int]) -> SamplingParams:
        """An echo without generation of a prompt of max_model_len tokens, which vLLM serves (a prompt
        that fits, nothing generated) and the engine cannot take whole (it keeps room for a token): the
        engine gets all but the last token, scores them, and samples the last one, the only one allowed;
        its raw log-probabilities (taken before any mask) are the last prompt token's."""
        params = to_sampling_params(self.req, self.ctx.resolve_max_tokens(len(ids) - 1, 1), self.prompt_logprobs,
                                    self.ctx.engine.vocab_size, None, self.prompt_logprobs,
                                    defaults=self.ctx.sampling_defaults)
        return forced_token_params(params, ids[-1])

    @property
    def engine_prompt_ids(self) -> list[list[int]]:
        """The prompts as the engine gets them (a full-context echo less its last token)."""
        return [ids[:-1] if pi in self.full_context_echoes else ids for pi, ids in enumerate(self.prompt_ids)]

    def _whole_prompt(self, prompt_index: int, output: RequestOutput) -> RequestOutput:
        """output as if the engine had taken a full-context echo's whole prompt: its last token back in
        the prompt, that token's sampled log-probabilities as its prompt entry."""
        if prompt_index not in self.full_context_echoes:
            return output
        entries = output.prompt_logprobs
        sampled = next((c.logprobs for c in output.outputs if c.logprobs), None)
        if entries is not None and output.finished and sampled:
            entries = [*entries, sampled[0]]
        return dataclasses.replace(output, prompt_token_ids=list(self.prompt_ids[prompt_index]),
                                   prompt_logprobs=entries)

    def _tokenize(self) -> tuple[list[list[int]], list[str]]:
        tok = self.ctx.tokenizer
        texts = [p for p in self.prompts if isinstance(p, str)]
        encoded = iter(tok.encode_batch(texts, add_special_tokens=self.req.add_special_tokens) if texts else [])
        ids, shown = [], []
        limit = self.ctx.engine.max_model_len
        for prompt in self.prompts:
            given = next(encoded) if isinstance(prompt, str) else list(prompt)
            kept = truncate_prompt(given, self.req.truncate_prompt_tokens, max_prompt_len(limit, self.req.max_tokens),
                                   self.req.truncation_side)
            ids.append(kept)
            # echo shows the prompt the model saw: the text as sent, or the kept ids decoded
            shown.append(prompt if isinstance(prompt, str) and len(kept) == len(given)
                         else tok.decode(kept, skip_special_tokens=True) if self.req.echo else "")
        return ids, shown

    def _cursor(self, prompt_index: int) -> LogprobCursor | None:
        if self.req.logprobs is None:
            return None
        base = len(self.prompt_texts[prompt_index]) if self.req.echo else 0
        return LogprobCursor(self.texts, self.prompt_ids[prompt_index], base, self.req.skip_special_tokens,
                             self.as_token_ids, self.req.spaces_between_special_tokens)

    def _prompt_rows(self, prompt_index: int, output: RequestOutput) -> list:
        """The echoed prompt's logprob rows (echo with logprobs), before the completion's; made
        once a prompt, for all its n choices."""
        if not self.req.echo or output.prompt_logprobs is None:
            return []
        rows = self._prompt_row_cache.get(prompt_index)
        if rows is None:
            # The echoed text shows no special token (BOS), whatever skip_special_tokens: the rows'
            # text_offset index it as if they were skipped.
            rows = prompt_logprob_rows(self.texts, self.prompt_ids[prompt_index], output.prompt_logprobs,
                                       self.req.logprobs, True, self.as_token_ids)
            if len(rows) == len(self.prompt_ids[prompt_index]):     # every entry is in: final
                self._prompt_row_cache[prompt_index] = rows
        return rows

    def _prompt_fields(self, prompt_index: int, output: RequestOutput, completion: CompletionOutput) -> dict:
        """vLLM's token_ids, prompt_logprobs, prompt_token_ids and routed_experts of a choice, in vLLM's order:
        null where not asked (vLLM's whole response is its model_dump, every field there)."""
        fields = {"token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None}
        if self.req.return_token_ids:        # echo without generation: no token of the text was generated
            fields["token_ids"] = [] if self.echo_only else list(completion.token_ids)
        if output.prompt_logprobs is not None:
            entries = self._prompt_logprobs_json.get(prompt_index)
            if entries is None:
                entries = self._prompt_logprobs_json[prompt_index] = prompt_logprobs_json(
                    output.prompt_logprobs, output.prompt_token_ids, self.prompt_logprobs, self.ctx.tokenizer)
            fields["prompt_logprobs"] = entries
        if self.req.return_token_ids:
            fields["prompt_token_ids"] = list(output.prompt_token_ids)
        fields["routed_experts"] = None       # vLLM's MoE routing (--enable-return-routed-experts)
        return fields

    def _choice_index(self, prompt_index: int, completion: CompletionOutput) -> int:
        return prompt_index * self.req.n + completion.index

    def _usage(self, finals: list[RequestOutput], is_stream: bool = False) -> dict:
        num_generated = 0 if self.echo_only else sum(len(c.token_ids) for o in finals for c in o.outputs)
        return self.ctx.usage(finals, num_generated, is_stream)

    def _echo_only_choice(self, pi: int, output: RequestOutput, comp: CompletionOutput) -> dict:
        """A choice of an echo without generation: the prompt, its logprobs, finish 'length' (or the
        request's 'error' and why, e.g. a constraint that failed to compile before the prompt was scored)."""
        logprobs = completion_logprobs(self._prompt_rows(pi, output)) if self.req.logprobs is not None else None
        failed = comp.finish_reason == "error"
        return {"index": self._choice_index(pi, comp), "text": self.prompt_texts[pi], "logprobs": logprobs,
                "finish_reason": "error" if failed else "length", "stop_reason": comp.stop_reason if failed else None}

    def response(self, finals: list[RequestOutput]) -> dict:
        """The non-streaming response body."""
        finals = [self._whole_prompt(pi, final) for pi, final in enumerate(finals)]
        choices = []
        for pi, final in enumerate(finals):
            for comp in final.outputs:
                if self.echo_only:
                    choices.append({**self._echo_only_choice(pi, final, comp),
                                    **self._prompt_fields(pi, final, comp)})
                    continue
                text = (self.prompt_texts[pi] if self.req.echo else "") + comp.text
                cursor = self._cursor(pi)
                logprobs = None
                if cursor is not None:
                    logprobs = completion_logprobs(self._prompt_rows(pi, final) + cursor.advance(
                        comp.token_ids, comp.logprobs or [], self.req.logprobs))
                choices.append({"index": self._choice_index(pi, comp), "text": text, "logprobs": logprobs,
                                "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason,
                                **self._prompt_fields(pi, final, comp)})
        choices.sort(key=lambda c: c["index"])
        body = {"id": self.response_id, "object": "text_completion", "created": self.created,
                "model": self.ctx.model_name, "choices": choices, **UNSERVED_FIELDS,
                "usage": whole_usage(self._usage(finals)), "kv_transfer_params": None, **UNSERVED_TAIL_FIELDS}
        if finals:
            self.kv_transfer_stats = finals[0].kv_transfer_stats
            body["kv_transfer_params"] = finals[0].kv_transfer_params     # a prefill server's, for the decode server
        return body

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {"id": self.response_id, "object": "text_completion", "created": self.created,
                 "model": self.ctx.model_name, "choices": choices}
        if self.req.include_usage:
            chunk["usage"] = None
        return chunk

    async def events(self, streams: list[RequestStream]) -> AsyncIterator[str]:
        """Server-sent events: a chunk per completion whose text moved, then usage and [DONE]."""
        progress: dict[int, ChoiceProgress | None] = {}   # None: an echo without generation, sent
        finals: dict[int, RequestOutput] = {}
        chunks = ChunkFormat(self.response_id, "text_completion", self.created, self.ctx.model_name,
                             self.req.include_usage)
        last = ""      # the final wake-up's events: sent with the usage and [DONE], in one write
        sent = False   # nothing sent yet: the status line is still ours to choose
        outputs = merged_outputs(self.ctx, streams, self.req.stream_interval)
        async with contextlib.aclosing(outputs) as batches:
            async for batch in batches:
                events = []
                for pi, output in batch:
                    if not sent:
                        refuse_uncompiled_constraint(self.req, [output])
                    output = finals[pi] = self._whole_prompt(pi, output)
                    self.kv_transfer_stats = output.kv_transfer_stats
                    events.extend(stream_events(chunks, self._choices(pi, output, progress), output,
                                                self.req.continuous_usage))
                if events:
                    last = "".join(events)   # one write per wake-up, however many choices moved
                    if not all_finished(streams):
                        sent = True
                        yield last
                        last = ""
        if self.req.include_usage:
            chunk = self._chunk([])
            chunk["usage"] = self._usage([finals[i] for i in sorted(finals)], is_stream=True)
            last += sse(chunk)
        yield FinalEvent(last + SSE_DONE)

    def _choices(self, pi: int, output: RequestOutput, progress: dict[int, ChoiceProgress | None]
                 ) -> list[StreamChoice]:
        """Stream choices, as JSON, for the completions of one output that have something new, each with
        its completion's tokens so far."""
        choices = []
        for comp in output.outputs:
            index = self._choice_index(pi, comp)
            if self.echo_only:            # one chunk a choice, once its (dropped) token is there
                if comp.finish_reason is not None and index not in progress:
                    progress[index] = None
                    choice = self._echo_only_choice(pi, output, comp)
                    if self.req.return_token_ids:
                        choice.update(prompt_token_ids=list(output.prompt_token_ids), token_ids=[])
                    choices.append(StreamChoice(json_dumps(choice), 0))
                continue
            state = progress.get(index)
            if state is None:
                state = progress[index] = ChoiceProgress(index, self._cursor(pi), self.req.logprobs or 0)
            update = state.update(comp.text, comp.token_ids, comp.logprobs, comp.finish_reason)
            if update is None:
                continue
            delta, rows, finish = update
            is_first = not state.is_started
            if is_first:
                state.is_started = True
                if self.req.echo:
                    delta = self.prompt_texts[pi] + delta
                    if state.cursor is not None:
                        rows = self._prompt_rows(pi, output) + rows
            if state.cursor is None and finish is None and not self.req.return_token_ids:
                choices.append(StreamChoice(text_choice_json(index, delta), len(comp.token_ids)))   # text alone
                continue
            choice = {"index": index, "text": delta,
                      "logprobs": completion_logprobs(rows) if state.cursor is not None else None,
                      "finish_reason": finish, "stop_reason": comp.stop_reason if finish else None}
            if self.req.return_token_ids:      # vLLM's: the prompt's ids in a choice's first chunk, null after
                choice["prompt_token_ids"] = list(output.prompt_token_ids) if is_first else None
                choice["token_ids"] = state.new_token_ids(comp.token_ids)
            choices.append(StreamChoice(json_dumps(choice), len(comp.token_ids)))
        return choices


async def create_completion(ctx: ServingContext, body: dict, raw: Request):
    """Validate, submit and answer (JSON, or an event stream); a large body is read as a request in the
    preprocessing pool (its token ids are walked there too)."""
    is_large = await is_large_body(raw)
    req = await ctx.run_blocking_if(is_large, validate_request, CompletionRequest, body)
    ctx.check_model(req.model)
    if ctx.enable_force_include_usage:
        req.force_usage()
    check_unsupported(req)                   # a refused field is not also logged as ignored
    log_unknown_fields(unknown_fields(req) + check_beam_search(ctx, req))
    job = await ctx.run_blocking_if(is_large, CompletionJob, ctx, req, client_response_id("cmpl", raw, req.request_id))
    await job.prepare(is_large)
    prompt_ids = job.engine_prompt_ids
    if req.use_beam_search:      # its search takes a prompt of max_model_len tokens whole (it scores it so)
        return await answer_beam_search(ctx, raw, job, job.prompt_ids, job.params)
    job.params, lease = await apply_kv_transfer(ctx, req.kv_transfer_params, prompt_ids, job.params, req.n,
                                                req.stream)
    try:
        response = await answer(ctx, raw, job, prompt_ids, job.params, req.stream,
                                on_handed_over=lease.hand_over if lease is not None else None,
                                on_output=lease.on_output if lease is not None else None)
    except BaseException:
        release_claim(ctx, lease)
        raise
    if lease is not None:
        lease.answered(raw, response, job.kv_transfer_stats)
    return response
