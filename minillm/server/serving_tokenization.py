"""vLLM's POST /tokenize and POST /detokenize: the engine's tokenizer, in this API server process.

/tokenize takes a prompt (tokenised as /v1/completions tokenises it) or messages (rendered and
tokenised by the ConversationPrompt that /v1/chat/completions uses), so its ids are the ones a
completion would feed the engine. Nothing here reaches the engine core.
"""
from __future__ import annotations

from typing import Any

from fastapi import Request

from minillm.server.errors import APIError
from minillm.server.limits import check_prompt_chars
from minillm.server.protocol import (
    DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest, check_rendering, unknown_fields,
)
from minillm.server.serving import ServingContext, is_large_body, log_unknown_fields, validate_request
from minillm.server.serving_chat import ConversationPrompt

# Token ids past which checking and decoding them runs in the preprocessing pool, off the event loop.
MANY_TOKEN_IDS = 4096


def tokenize_request(body: dict[str, Any]) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The body as vLLM's TokenizeRequest: the chat form when it carries messages, else the
    completion form; a bad field is the same 400 a completion's would be."""
    has_messages, has_prompt = body.get("messages") is not None, body.get("prompt") is not None
    if has_messages and has_prompt:
        raise APIError(400, "send either prompt (text to tokenize) or messages (a conversation to render "
                       "and tokenize), not both", param="messages")
    return validate_request(TokenizeChatRequest if has_messages else TokenizeCompletionRequest, body)


async def create_tokenize(ctx: ServingContext, body: dict[str, Any], raw: Request) -> dict:
    """vLLM's TokenizeResponse: count, max_model_len, tokens and (return_token_strs) token_strs."""
    is_large = await is_large_body(raw)
    req = await ctx.run_blocking_if(is_large, tokenize_request, body)
    ctx.check_model(req.model)
    log_unknown_fields(unknown_fields(req))
    if isinstance(req, TokenizeChatRequest):
        check_rendering(req)
        encode = (await ctx.run_blocking_if(is_large, ConversationPrompt, ctx, req)).token_ids
    else:
        check_prompt_chars(ctx.limits, len(req.prompt), "prompt")

        def encode() -> list[int]:
            return ctx.tokenizer.encode_batch([req.prompt], add_special_tokens=req.add_special_tokens)[0]

    def tokenize() -> tuple[list[int], list[str] | None]:
        ids = encode()
        return ids, ctx.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None

    ids, token_strs = await ctx.run_blocking(tokenize)
    # No context-length check, as in vLLM: the client compares count with max_model_len itself.
    return {"count": len(ids), "max_model_len": ctx.engine.max_model_len, "tokens": ids, "token_strs": token_strs}


async def create_detokenize(ctx: ServingContext, req: DetokenizeRequest) -> dict:
    """vLLM's DetokenizeResponse: the ids' text, special tokens included (as vLLM decodes them)."""
    ctx.check_model(req.model)
    log_unknown_fields(unknown_fields(req))

    def detokenize() -> str:
        ctx.check_token_ids(req.tokens, param="tokens")
        return ctx.tokenizer.decode(req.tokens, skip_special_tokens=False)

    return {"prompt": await ctx.run_blocking_if(len(req.tokens) > MANY_TOKEN_IDS, detokenize)}
