"""Abuse of the ops routes, the router and the monitor's client: what a client sends gets an
OpenAI-shaped 4xx naming the field, never a 500, a wedged process or another request disturbed."""
from __future__ import annotations

import httpx
import pytest
from test_server_helpers import running_server

from minillm.router import RouterConfig, create_router_app

pytestmark = pytest.mark.anyio

MODEL = "stories"


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def server(stories_path):
    """One real server, both the router's prefill and its decode backend (bad input fails before either role matters)."""
    with running_server(stories_path, served_model_name=MODEL, engine_core="thread") as (url, engine):
        yield url


async def router_request(config: RouterConfig, method: str, path: str, **kwargs) -> httpx.Response:
    """One request to a router app in-process."""
    app = create_router_app(config)
    await app.state.router.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router",
                                     timeout=60) as client:
            return await client.request(method, path, **kwargs)
    finally:
        await app.state.router.close()


def check_error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"], error
    return error


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
async def test_router_passes_non_finite_numbers_on_for_the_servers_400(server, literal):
    # httpx's json= refuses NaN: re-encoding the body raised inside the router, a bare 500.
    body = f'{{"model": "{MODEL}", "prompt": "Once", "max_tokens": 2, "temperature": {literal}}}'
    response = await router_request(RouterConfig((server,), (server,)), "POST", "/v1/completions",
                                    content=body, headers={"content-type": "application/json"})
    check_error(response, 400, "temperature")


async def test_router_answers_a_too_deeply_nested_body_with_a_400(server):
    body = '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"    # RecursionError in json.loads: was a 500
    response = await router_request(RouterConfig((server,), (server,)), "POST", "/v1/completions",
                                    content=body, headers={"content-type": "application/json"})
    error = check_error(response, 400, None)
    assert "nested too deeply" in error["message"]
    # A well-formed body still reaches the server (which, without --kv-role producer, refuses the KV
    # transfer: the router's 502 says so).
    after = await router_request(RouterConfig((server,), (server,)), "POST", "/v1/completions",
                                 json={"model": MODEL, "prompt": "Once", "max_tokens": 2})
    assert "refused the KV transfer" in check_error(after, 502, None)["message"]


@pytest.mark.parametrize("method, path, status", [("GET", "/v1/completions", 405), ("PUT", "/v1/chat/completions", 405),
                                                  ("GET", "/v1/nothing", 404), ("POST", "/v1/stats", 405)])
async def test_router_answers_unknown_paths_and_methods_openai_shaped(method, path, status):
    # FastAPI's own {"detail": "Not Found"} before; no backend is reached for these.
    response = await router_request(RouterConfig(("http://127.0.0.1:9",), ("http://127.0.0.1:9",)), method, path)
    check_error(response, status, None)


@pytest.mark.parametrize("chunked", [False, True])
async def test_router_refuses_a_body_over_the_limit_before_reading_it_whole(chunked):
    # Before, the router read and parsed any body and sent it on twice; the backends (unreachable
    # here: a body that got through would be a 503) are never asked.
    config = RouterConfig(("http://127.0.0.1:9",), ("http://127.0.0.1:9",), max_body_bytes=1000)
    body = b'{"prompt": "' + b"a" * 2000 + b'"}'

    async def trickle():
        for i in range(0, len(body), 100):
            yield body[i:i + 100]
    response = await router_request(config, "POST", "/v1/completions", content=trickle() if chunked else body,
                                    headers={"content-type": "application/json"})
    error = check_error(response, 413, None)
    assert error["code"] == "request_too_large"
    small = await router_request(config, "POST", "/v1/completions", json={"prompt": "a"})
    assert small.status_code == 503, small.text


@pytest.mark.parametrize("field, value", [("max_body_bytes", 0), ("max_body_bytes", float("inf")),
                                          ("body_timeout_s", float("nan"))])
def test_router_config_refuses_a_body_limit_that_is_no_limit(field, value):
    with pytest.raises(ValueError, match=field):
        RouterConfig(("http://a",), ("http://b",), **{field: value})


async def test_router_health_answers_head_as_the_server_does(server):
    config = RouterConfig((server,), (server,))
    head = await router_request(config, "HEAD", "/health")
    assert head.status_code == 200 and head.content == b""
    down = await router_request(RouterConfig(("http://127.0.0.1:9",), (server,)), "HEAD", "/health")
    assert down.status_code == 503


async def test_monitor_gives_up_on_an_event_that_never_ends():
    # A "server" that sends data lines and never the blank line ending the event: the monitor
    # gathered them without end (its memory the limit).
    from minillm.tui.client import MAX_EVENT_CHARS, StatsFormatError, iter_sse_data
    sent = 0

    async def endless():
        nonlocal sent
        yield "data: {}"
        yield ""
        while True:
            sent += 1
            yield "data: " + "x" * 1000

    events = []
    with pytest.raises(StatsFormatError, match="not a minillm server"):
        async for data in iter_sse_data(endless()):
            events.append(data)
    assert events == ["{}"] and sent <= MAX_EVENT_CHARS // 1000 + 1
