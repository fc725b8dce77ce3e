"""Clients that hang up at every moment of a request, on two API servers over one engine core.

Each client closes its connection at a point set by what it has seen (part of its body sent, the
response headers, the first event, a few events, the finishing event, a place in the queue),
across /v1/completions, /v1/chat/completions, /v1/responses and /v1/messages, with n > 1,
logprobs, structured outputs, stop strings and n-gram speculative decoding. Afterwards the engine
is idle, its KV pool holds only cached blocks, a greedy request reads as before, nothing was
logged at warning level or above, and every sequence is counted once under request_success:
"abort" for those left unfinished, as vLLM counts them.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re

import httpx
import pytest
from core_hooks import install
from test_server_helpers import api_servers_on_one_core, chat_model_dir, get_stats, wait_for

from minillm.config import EngineConfig

MODEL = "stories"
LONG = 480                  # tokens a hung-up client asked for: far more than it can see before it leaves
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
# What ends each endpoint's finishing event: the request is over in the engine once a client reads it.
FINISHED = re.compile(rb'"finish_reason": ?"|"type": ?"message_delta"|"type": ?"response\.output_text\.done"')


@pytest.fixture(scope="module")
def servers(stories_path, tmp_path_factory):
    """Two API servers in this process on one engine core process: two sequences at a time, n-gram drafts."""
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    config = EngineConfig(model=str(model), device="cpu", max_num_seqs=2, speculative_config=NGRAM)
    with api_servers_on_one_core(config, 2, install, MODEL) as (urls, engines):
        yield urls, engines


def _requests(max_tokens: int, stream: bool, stop: str = "zzz") -> list[tuple[str, dict, int]]:
    """(path, body, sequences) for each endpoint, with n > 1, logprobs, structured outputs and a stop string."""
    user = [{"role": "user", "content": "Once upon a time"}]
    common = {"model": MODEL, "stream": stream, "ignore_eos": True}
    return [
        ("/v1/completions", {**common, "prompt": "Once upon a time", "max_tokens": max_tokens, "n": 3,
                             "temperature": 0.8, "logprobs": 2}, 3),
        ("/v1/completions", {**common, "prompt": ["Once upon a time", "Once upon a"], "max_tokens": max_tokens,
                             "stop": [stop], "temperature": 0}, 2),
        ("/v1/completions", {**common, "prompt": "Tom said", "max_tokens": max_tokens, "response_format": SCHEMA}, 1),
        ("/v1/chat/completions", {**common, "messages": user, "max_tokens": max_tokens, "n": 2, "temperature": 1,
                                  "logprobs": True, "top_logprobs": 2}, 2),
        ("/v1/responses", {"model": MODEL, "stream": stream, "input": "Once upon a time", "temperature": 0,
                           "max_output_tokens": max_tokens}, 1),
        ("/v1/messages", {"model": MODEL, "stream": stream, "messages": user, "max_tokens": max_tokens,
                          "temperature": 0}, 1),
    ]


class Client:
    """One raw HTTP/1.1 connection that sends a request and hangs up when told."""

    def __init__(self, url: str, path: str, body: dict):
        self.address = url.removeprefix("http://").split(":")
        data = json.dumps(body).encode()
        self.head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n").encode()
        self.data, self.seen = data, b""

    async def send(self, num_body_bytes: int | None = None) -> None:
        self.reader, self.writer = await asyncio.open_connection(*self.address)
        self.writer.write(self.head + self.data[:num_body_bytes])
        await self.writer.drain()

    async def read_until(self, done) -> None:
        """Read until done(bytes seen) holds (the response must not end before)."""
        while not done(self.seen):
            chunk = await asyncio.wait_for(self.reader.read(65536), 60)
            assert chunk, f"the response ended first: {self.seen[-300:]!r}"
            self.seen += chunk

    def hang_up(self) -> None:
        self.writer.transport.abort()


async def _leave_at(url: str, path: str, body: dict, point: str, n: int = 1) -> None:
    """Send one request of n sequences and hang up at `point`."""
    client = Client(url, path, body)
    await client.send(len(client.data) // 2 if point == "partial body" else None)
    if point == "after headers":
        await client.read_until(lambda seen: b"\r\n\r\n" in seen)
    elif point == "first event":
        await client.read_until(lambda seen: seen.count(b"data:") >= 1)
    elif point == "mid-stream":
        await client.read_until(lambda seen: seen.count(b"data:") >= 4)
    elif point == "before the final event":
        await client.read_until(lambda seen: len(FINISHED.findall(seen)) >= n)
    client.hang_up()


async def _leave_the_queue(urls: list[str]) -> int:
    """Two long streams take both sequence slots; a request of each kind queues behind them and
    hangs up there (streaming or not); then the long streams hang up. Returns the sequences aborted."""
    holders = [Client(urls[i], "/v1/completions", {"model": MODEL, "prompt": "Once", "max_tokens": LONG,
                                                   "ignore_eos": True, "stream": True}) for i in range(2)]
    for holder in holders:
        await holder.send()
        await holder.read_until(lambda seen: b"data:" in seen)
    kinds = _requests(8, stream=False)[::2] + _requests(8, stream=True)[1::2]   # each endpoint, both ways
    queued = [(Client(urls[i % 2], path, body), n) for i, (path, body, n) in enumerate(kinds)]
    for client, _ in queued:
        await client.send()
    num_queued = sum(n for _, n in queued)
    async with httpx.AsyncClient(base_url=urls[0], timeout=10) as http:
        assert await _poll(http, lambda s: s["num_waiting"] == num_queued), "the requests never queued"
        for client, _ in queued:
            client.hang_up()
        left = await _poll(http, lambda s: s["num_waiting"] == 0)
    assert left and left["num_running"] == 2, left         # they left the queue; the long streams still run
    for holder in holders:
        holder.hang_up()
    return num_queued + 2


async def _poll(http: httpx.AsyncClient, predicate, timeout: float = 30.0) -> dict | None:
    """Poll /v1/stats until predicate(stats) holds; the stats then, or None at the deadline."""
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        stats = (await http.get("/v1/stats")).json()
        if predicate(stats):
            return stats
    return None


async def _storm(urls: list[str]) -> tuple[int, int]:
    """Every hang-up point on every endpoint, all at once: (sequences aborted, sequences finished)."""
    jobs, num_aborted, num_finished = [], 0, 0
    points = ["partial body", "after headers", "first event", "mid-stream"]
    for i, (path, body, n) in enumerate(_requests(LONG, stream=True)):
        for j, point in enumerate(points):
            jobs.append(_leave_at(urls[(i + j) % 2], path, body, point))
            num_aborted += n if point != "partial body" else 0
    for i, (path, body, n) in enumerate(_requests(6, stream=True, stop=" was")):     # greedy: ", there was"
        jobs.append(_leave_at(urls[i % 2], path, body, "before the final event", n))
        num_finished += n
    await asyncio.gather(*jobs)
    return num_aborted, num_finished


def _greedy(url: str) -> str:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]


def _success(url: str) -> dict[str, float]:
    """minillm:request_success_total by finished_reason."""
    found = re.findall(r'minillm:request_success_total\{finished_reason="(\w+)"[^}]*\} (\S+)',
                       httpx.get(f"{url}/metrics", timeout=10).text)
    return {reason: float(value) for reason, value in found}


def _histogram_count(url: str, name: str) -> float:
    found = re.search(rf"minillm:{name}_count\{{[^}}]*\}} (\S+)", httpx.get(f"{url}/metrics", timeout=10).text)
    return float(found.group(1))


def _is_idle(stats: dict) -> bool:
    return (stats["num_running"] == stats["num_waiting"] == stats["kv_num_used_blocks"] == 0
            and stats["requests"] == [])


def test_clients_that_hang_up_anywhere_leave_the_engine_idle_and_counted(servers, caplog, capfd):
    urls, engines = servers
    greedy = _greedy(urls[0])
    before = [_success(url) for url in urls]
    latencies = sum(_histogram_count(url, "e2e_request_latency_seconds") for url in urls)
    caplog.set_level(logging.WARNING)

    num_aborted = asyncio.run(_leave_the_queue(urls))
    storm_aborted, num_finished = asyncio.run(_storm(urls))
    num_aborted += storm_aborted

    stats = wait_for(lambda: (s := get_stats(urls[1]))["num_requests_finished"].get("abort", 0)
                     - before[1].get("abort", 0) >= num_aborted and _is_idle(s) and s, timeout=60)
    assert stats, get_stats(urls[1])
    assert stats["kv_num_free_blocks"] + stats["kv_num_cached_blocks"] == stats["kv_num_blocks"]
    assert all(not engine.processor.requests for engine in engines)
    for url, counts in zip(urls, before):       # either server's /metrics counts the whole engine, once
        after = _success(url)
        assert {reason: after[reason] - counts.get(reason, 0) for reason in after} == {
            "abort": num_aborted, "length": num_finished - 2, "stop": 2, "error": 0, "repetition": 0}, after
    # Aborted sequences stay out of the per-request histograms (each server's own), as vLLM's do.
    assert sum(_histogram_count(url, "e2e_request_latency_seconds") for url in urls) - latencies == num_finished
    assert [_greedy(url) for url in urls] == [greedy, greedy]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert not re.search(r"Traceback|ERROR|Exception", "".join(capfd.readouterr()))
