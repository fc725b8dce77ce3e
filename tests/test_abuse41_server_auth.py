"""The API key as vLLM's AuthenticationMiddleware reads it: of several `Authorization` (or `x-api-key`)
headers the first is the one checked, so a wrong key first is refused whatever follows it; and a Responses
request's metadata within OpenAI's bounds (16 pairs, keys of 64 characters, values of 512), vLLM's
Metadata type setting none; and `minillm bench`'s options read by an unambiguous prefix, as `vllm bench`'s."""
from __future__ import annotations

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from minillm.server.errors import APIError
from minillm.server.middleware import APIKeyMiddleware
from minillm.server.serving_responses import ResponsesRequest

KEY = "sk-right"


def _guarded_app() -> Starlette:
    """A one-route app behind APIKeyMiddleware with KEY."""
    async def models(request):
        return JSONResponse({"object": "list", "data": []})
    app = Starlette(routes=[Route("/v1/models", models), Route("/health", models)])
    app.add_middleware(APIKeyMiddleware, api_keys=(KEY,))
    return app


def _get(headers: list[tuple[str, str]], path: str = "/v1/models") -> httpx.Response:
    """GET PATH with HEADERS as a list (a name may repeat, in order)."""
    transport = httpx.ASGITransport(app=_guarded_app())

    async def go():
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get(path, headers=headers)
    return anyio.run(go)


@pytest.mark.parametrize("headers", [
    [("Authorization", "Bearer sk-wrong"), ("Authorization", f"Bearer {KEY}")],
    [("Authorization", "Basic abc"), ("Authorization", f"Bearer {KEY}")],
    [("x-api-key", "sk-wrong"), ("x-api-key", KEY)],
    [("Authorization", "Bearer sk-wrong"), ("x-api-key", "sk-wrong"), ("Authorization", f"Bearer {KEY}"),
     ("x-api-key", KEY)],
], ids=["authorization", "other-scheme-first", "x-api-key", "both"])
def test_a_wrong_first_header_is_refused_whatever_follows(headers):
    answer = _get(headers)
    assert answer.status_code == 401
    error = answer.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "authentication_error"
    assert answer.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("headers", [
    [("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer sk-wrong")],
    [("x-api-key", KEY), ("x-api-key", "sk-wrong")],
    [("Authorization", "Bearer sk-wrong"), ("x-api-key", KEY)],     # either header may carry it
], ids=["authorization", "x-api-key", "x-api-key-beside-a-wrong-bearer"])
def test_the_right_key_first_is_served(headers):
    assert _get(headers).status_code == 200


def test_unguarded_paths_need_no_key():
    assert _get([("Authorization", "Bearer sk-wrong")], path="/health").status_code == 200


# ---- Responses metadata: OpenAI's bounds (vLLM's Metadata type sets none) ---------------------------------

def _responses_error(metadata: dict) -> APIError:
    with pytest.raises(APIError) as caught:
        ResponsesRequest.model_validate({"model": "m", "input": "hi", "metadata": metadata})
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize("metadata, param, code", [
    ({f"k{i}": "v" for i in range(17)}, "metadata", "object_above_max_properties"),
    ({"k" * 65: "v"}, "metadata", "string_above_max_length"),
    ({"k": "v" * 513}, "metadata.k", "string_above_max_length"),
    ({"k": "é" * 513}, "metadata.k", "string_above_max_length"),
], ids=["17 pairs", "65-character key", "513-character value", "513 two-byte characters"])
def test_metadata_past_openais_bounds_is_a_400_naming_it(metadata, param, code):
    error = _responses_error(metadata)
    assert (error.param, error.code) == (param, code)
    assert len(error.message) < 200        # the long key or value is not echoed back whole


def test_metadata_at_openais_bounds_is_taken():
    metadata = {f"{i:02d}" + "k" * 62: "é" * 512 for i in range(16)}
    request = ResponsesRequest.model_validate({"model": "m", "input": "hi", "metadata": metadata})
    assert request.metadata == metadata


# ---- `minillm bench`: an unambiguous option prefix is that option, as `vllm bench` reads it -------------------

def test_bench_reads_an_unambiguous_option_prefix_as_the_option():
    from benchmarks import latency
    args = latency.parse_args(["--input-l", "16", "--output_l=8", "--batch", "2", "--num-iters-w", "1"])
    assert (args.input_len, args.output_len, args.batch_size, args.num_iters_warmup) == (16, 8, 2, 1)
    args = latency.parse_args(["--output-json", "out.json", "--see", "3"])
    assert (args.output_json, args.seed) == ("out.json", 3)


@pytest.mark.parametrize("argv, message", [
    (["--num-i", "2"], "ambiguous option: --num-i could match --num-iters, --num-iters-warmup"),
    (["--bogus", "1"], "unrecognized arguments: --bogus 1"),
])
def test_bench_refuses_an_ambiguous_prefix_naming_what_it_could_match(argv, message):
    from benchmarks import latency
    from minillm.benchmarks.cli_args import BenchUsageError
    with pytest.raises(BenchUsageError) as caught:
        latency.parse_args(argv)
    assert caught.value.message.startswith(message)
