"""vLLM's POST /tokenize and POST /detokenize: the engine's tokenizer, in this API server process.

/tokenize takes a prompt (tokenised as /v1/completions tokenises it) or messages (rendered and
tokenised by the ConversationPrompt that /v1/chat/completions uses), so its ids are the ones a
completion would feed the engine. Nothing here reaches the engine core.

A large body is read as a request, and a long list of ids checked, decoded and written as JSON, in
the preprocessing pool: millions of ids held the event loop (and every stream, /health) for seconds.
"""
from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from minillm.server.errors import APIError
from minillm.server.limits import check_prompt_chars
from minillm.server.protocol import (
    DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest, check_rendering, unknown_fields,
)
from minillm.server.serving import ServingContext, is_large_body, json_dumps, log_unknown_fields, validate_request
from minillm.server.serving_chat import ConversationPrompt
from minillm.tokenizer import REPLACEMENT_CHAR

# Token ids past which checking and decoding them runs in the preprocessing pool, off the event loop.
MANY_TOKEN_IDS = 4096
# /detokenize decodes this many ids at a time: the tokenizer holds the GIL through a decode (two
# million ids: about a second, with the event loop stalled even off it), and lets it go between pieces.
DECODE_PIECE_IDS = 16384
# Ids before a piece decoded with it, their own text taken off after: rules that look at a
# neighbour (sentencepiece's leading-space strip) then apply as in one decode.
PIECE_CONTEXT_IDS = 8


def tokenize_request(body: dict[str, Any]) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The body as vLLM's TokenizeRequest: the chat form when it carries messages, else the
    completion form; a bad field is the same 400 a completion's would be."""
    has_messages, has_prompt = body.get("messages") is not None, body.get("prompt") is not None
    if has_messages and has_prompt:
        raise APIError(400, "send either prompt (text to tokenize) or messages (a conversation to render "
                       "and tokenize), not both", param="messages")
    return validate_request(TokenizeChatRequest if has_messages else TokenizeCompletionRequest, body)


async def create_tokenize(ctx: ServingContext, body: dict[str, Any], raw: Request) -> Response:
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

    def tokenize() -> str:
        ids = encode()
        token_strs = ctx.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        # No context-length check, as in vLLM: the client compares count with max_model_len itself.
        return json_dumps({"count": len(ids), "max_model_len": ctx.engine.max_model_len, "tokens": ids,
                           "token_strs": token_strs})

    return Response(await ctx.run_blocking(tokenize), media_type="application/json")


async def create_detokenize(ctx: ServingContext, body: dict[str, Any], raw: Request) -> Response:
    """vLLM's DetokenizeResponse: the ids' text, special tokens included (as vLLM decodes them)."""
    req = await ctx.run_blocking_if(await is_large_body(raw), validate_request, DetokenizeRequest, body)
    ctx.check_model(req.model)
    log_unknown_fields(unknown_fields(req))

    def detokenize() -> str:
        ctx.check_token_ids(req.tokens, param="tokens")
        return json_dumps({"prompt": decode_in_pieces(ctx.tokenizer, req.tokens)})

    return Response(await ctx.run_blocking_if(len(req.tokens) > MANY_TOKEN_IDS, detokenize),
                    media_type="application/json")


def decode_in_pieces(tok: Any, ids: list[int], skip_special_tokens: bool = False) -> str:
    """tok.decode(ids), DECODE_PIECE_IDS at a time: each piece decoded after PIECE_CONTEXT_IDS of
    context, the context's text taken off. Where that cannot hold (a cut inside a character, a
    decoder whose text of the context changes with what follows), one decode of the whole."""
    def decode(part: list[int]) -> str:
        return tok.decode(part, skip_special_tokens=skip_special_tokens)

    pieces = [decode(ids[:DECODE_PIECE_IDS])]
    for start in range(DECODE_PIECE_IDS, len(ids), DECODE_PIECE_IDS):
        begin = start - PIECE_CONTEXT_IDS
        context, text = decode(ids[begin:start]), decode(ids[begin:start + DECODE_PIECE_IDS])
        if context.endswith(REPLACEMENT_CHAR) or not text.startswith(context):
            return decode(ids)
        pieces.append(text[len(context):])
    return "".join(pieces)
