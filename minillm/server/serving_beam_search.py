"""use_beam_search on /v1/completions and /v1/chat/completions, as vLLM's server runs it.

n is the beam width; the search is minillm/beam_search.py's (LLM.beam_search's), each step one
engine request a live beam (max_tokens 1, 2 * n log-probabilities) beside the others the engine
serves. The answer's choices are the n best beams, best first: finish_reason "stop" (stop_reason
the EOS id) or "length", a final EOS in token_ids only with include_stop_str_in_output, each
choice's logprobs from its steps' candidates, usage counting the choices' tokens. A chat stream
(vLLM's) sends them once the search is over: each choice's role, then its whole text with its finish.

Read as vLLM reads them: n, max_tokens (max_completion_tokens), temperature, ignore_eos,
length_penalty, include_stop_str_in_output; the prompt's and the answer's shaping fields (echo,
logprobs, return_token_ids, ...). prompt_logprobs (and the prompt logprobs of echo with logprobs)
are the first step's: its request is the prompt alone. The sampling fields beam search does not
read (stop, top_p, seed, ...) are taken and ignored, as vLLM's server ignores them, and logged as
ignored. An output constraint (response_format, structured_outputs) holds every beam, as
LLM.beam_search's structured_outputs does (vLLM's server drops it). Refused with a 400 naming the
field: a completions stream (as vLLM's completions refuse it), a forced tool call, kv_transfer_params,
and a width whose 2 * n log-probabilities pass max_logprobs.

max_tokens 0 (max_completion_tokens 0) grows no beam, as vLLM's search: each prompt's answer is its one
beam, the prompt alone, so one empty choice with finish_reason "length". Its prompt_logprobs (and the
echo's with logprobs) are scored still, by the one step a search's first would be, its tokens dropped.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minillm.beam_search import BeamSearchInstance, beam_completions, run_steps_async
from minillm.beam_search import step_params as beam_step_params
from minillm.outputs import CompletionOutput, RequestOutput
from minillm.sampling_params import BeamSearchParams, SamplingParams
from minillm.server.errors import APIError
from minillm.server.protocol import (
    ChatCompletionRequest, CompletionRequest, chat_max_tokens, chat_max_tokens_field, tool_choice_of,
)
from minillm.server.serving import (
    LARGE_RESPONSE_ENTRIES, ServingContext, build_without_collections, engine_request_id, final_outputs,
    forced_token_params, json_in_pieces, log_received, response_entries, streaming_response, submit, until_disconnected,
)

# The request's sampling fields beam search does not read (vLLM's server ignores them too).
IGNORED_FIELDS = ("top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
                  "stop", "stop_token_ids", "min_tokens", "logit_bias", "allowed_token_ids", "bad_words",
                  "skip_special_tokens", "spaces_between_special_tokens", "vllm_xargs", "repetition_detection",
                  "max_repetition_pattern_size", "min_repetition_pattern_size", "repetition_min_count")
# A step that ends so carries no candidates: the search ends there, its answer one choice that says so.
FAILED_STEP_REASONS = ("abort", "error")


class StepFailed(Exception):
    """A step's request ended without a token (aborted, or failed in the engine)."""

    def __init__(self, completion: CompletionOutput) -> None:
        super().__init__(completion.finish_reason)
        self.completion = completion


def check_beam_search(ctx: ServingContext, req: CompletionRequest | ChatCompletionRequest) -> list[str]:
    """For a request with use_beam_search: a 400 naming the field it cannot have; else the names of
    the fields it sets that beam search ignores (to log). [] for any other request."""
    if not req.use_beam_search:
        return []
    if req.stream and isinstance(req, CompletionRequest):
        raise APIError(400, "Streaming is not currently supported with beam search", param="stream")
    width_bound = ctx.engine.config.max_logprobs // 2
    if req.n > width_bound:
        raise APIError(400, f"n (the beam width) must be at most {width_bound} with use_beam_search: each step asks "
                       f"for 2 * n log-probabilities, and this server's max_logprobs is "
                       f"{ctx.engine.config.max_logprobs}, got {req.n}", param="n")
    if isinstance(req, ChatCompletionRequest) and req.tools and tool_choice_of(req) not in ("none", "auto"):
        raise APIError(400, "tool_choice that forces a call is not supported with beam search", param="tool_choice")
    if req.kv_transfer_params is not None:
        raise APIError(400, "kv_transfer_params is not supported with beam search: its steps run on this "
                       "server's engine", param="kv_transfer_params")
    return [name for name in IGNORED_FIELDS
            if name in req.model_fields_set and getattr(req, name) != type(req).model_fields[name].default]


def searches_no_tokens(req: CompletionRequest | ChatCompletionRequest) -> bool:
    """A beam search asked for no token (max_tokens 0): vLLM's runs no step, and the request's
    SamplingParams (which take at least 1) are built for one token that no step generates."""
    asked = chat_max_tokens(req) if isinstance(req, ChatCompletionRequest) else req.max_tokens
    return bool(req.use_beam_search) and type(asked) is int and asked == 0


def beam_search_params(req: CompletionRequest | ChatCompletionRequest, params: SamplingParams) -> BeamSearchParams:
    """The search's parameters from the request and its prompt's SamplingParams (max_tokens fitted to
    the prompt, temperature defaulted as vLLM's: the model's default, else 1.0); a 400 naming the field."""
    names = {"beam_width": "n", "max_tokens": "max_tokens", "temperature": "temperature",
             "length_penalty": "length_penalty"}
    if isinstance(req, ChatCompletionRequest):
        names["max_tokens"] = chat_max_tokens_field(req)
    max_tokens = 0 if searches_no_tokens(req) else params.max_tokens
    try:
        return BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                temperature=params.temperature, length_penalty=req.length_penalty,
                                include_stop_str_in_output=req.include_stop_str_in_output,
                                structured_outputs=params.structured_outputs)
    except ValueError as exc:
        name, _, why = str(exc).partition(" ")
        field = names.get(name, name)
        raise APIError(400, f"{field} {why}", param=field) from None


async def answer_beam_search(ctx: ServingContext, raw: Request, job, prompts: list[list[int]],
                             params: list[SamplingParams]) -> Response:
    """Search the beams of each prompt on the engine (a hang-up aborts the step in flight), then
    answer with the job's JSON response over the n best beams of each."""
    beam_params = beam_search_params(job.req, params[0])
    log_received(ctx, job, job.engine_request_ids(len(prompts)), prompts, [beam_params] * len(prompts))
    searched = search(ctx, job, prompts, beam_params, params[0].prompt_logprobs)
    if job.req.stream:        # a chat stream: its first event waits for the search (a hang-up cancels it)
        return await streaming_response(ctx, raw, job.output_events(final_batch(searched), lambda: True))
    finals = await until_disconnected(raw, searched)
    if response_entries(finals) < LARGE_RESPONSE_ENTRIES:
        return JSONResponse(job.response(finals))
    body = await asyncio.to_thread(build_without_collections, lambda: json_in_pieces(job.response(finals)))
    return Response(body, media_type="application/json")


async def final_batch(searched: Awaitable[list[RequestOutput]]) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
    """The search's final outputs as one batch of (prompt index, output), as a stream's events take them."""
    yield list(enumerate(await searched))


async def search(ctx: ServingContext, job, prompts: list[list[int]], params: BeamSearchParams,
                 num_prompt_logprobs: int | None = None) -> list[RequestOutput]:
    """Each prompt's final output: its best beams as completions, or one that tells of a failed step.
    With num_prompt_logprobs the first step (each prompt alone) scores the prompts: their prompt_logprobs."""
    instances = [BeamSearchInstance.from_prompt(ids) for ids in prompts]
    eos = ctx.tokenizer.eos_token_id
    step_params = [SamplingParams(logprobs=2 * params.beam_width, max_tokens=1, temperature=params.temperature,
                                  detokenize=False, prompt_logprobs=k) for k in (num_prompt_logprobs, None)]
    scored: dict[tuple[int, ...], list] = {}       # a prompt's ids -> its prompt_logprobs

    async def step(beam_prompts: list[dict], num_generated: int) -> list[RequestOutput]:
        is_first = not scored and num_prompt_logprobs is not None
        outputs = await run_step(ctx, job, [p["prompt_token_ids"] for p in beam_prompts],
                                 beam_step_params(step_params[not is_first], params, num_generated))
        if is_first:
            scored.update((tuple(out.prompt_token_ids), out.prompt_logprobs) for out in outputs)
        return outputs

    try:
        if params.max_tokens == 0 and num_prompt_logprobs is not None:
            # No beam grows, but the prompts are scored as a search's first step scores them (its tokens dropped).
            fits = [ids for ids in prompts if len(ids) < ctx.engine.max_model_len]
            if fits:
                await step([{"prompt_token_ids": ids} for ids in fits], 0)
            for ids in (ids for ids in prompts if len(ids) >= ctx.engine.max_model_len):
                scored[tuple(ids)] = await score_full_context(ctx, job, ids, step_params[0])
        else:
            await run_steps_async(instances, step, params, eos, ctx.engine.max_model_len)
    except StepFailed as failed:
        return [RequestOutput(job.request_id, None, ids, None, [failed.completion], finished=True) for ids in prompts]
    decode = ctx.tokenizer.decode
    return [RequestOutput(job.request_id, None, ids, scored.get(tuple(ids)),
                          beam_completions(inst, params, eos, len(ids), decode), finished=True)
            for ids, inst in zip(prompts, instances)]


async def score_full_context(ctx: ServingContext, job, ids: list[int], base: SamplingParams) -> list | None:
    """The prompt_logprobs of a prompt of max_model_len tokens, which the engine cannot take whole (it keeps
    room for a token): all but its last token scored, and the last sampled as the only token allowed, its
    raw log-probabilities (taken before the mask) its entry, as a completions echo without generation does."""
    params = forced_token_params(dataclasses.replace(base, logprobs=base.prompt_logprobs), ids[-1])
    [output] = await run_step(ctx, job, [ids[:-1]], params)
    sampled = output.outputs[0].logprobs
    return None if output.prompt_logprobs is None or not sampled else [*output.prompt_logprobs, sampled[0]]


async def run_step(ctx: ServingContext, job, beam_ids: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
    """One engine request a beam, under the job's cache salt and priority; their final outputs in order."""
    engine_ids = [engine_request_id(f"{job.request_id}-beam-{i}") for i in range(len(beam_ids))]
    streams = await submit(ctx, engine_ids, beam_ids, [params] * len(beam_ids), job.req.cache_salt,
                           priority=job.req.priority or 0)
    outputs = await final_outputs(ctx, streams)      # leaving early (a hang-up) aborts those still running
    for output in outputs:
        completion = output.outputs[0]
        if completion.finish_reason in FAILED_STEP_REASONS:
            raise StepFailed(CompletionOutput(0, "", [], finish_reason=completion.finish_reason,
                                              stop_reason=completion.stop_reason))
    return outputs
