"""The API key as vLLM's AuthenticationMiddleware reads it: of several `Authorization` (or `x-api-key`)
headers the first is the one checked, so a wrong key first is refused whatever follows it."""
from __future__ import annotations

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from minillm.server.middleware import APIKeyMiddleware

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
