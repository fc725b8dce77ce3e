"""Prefill/decode disaggregation end to end: a prefill server, a decode server and the router as
three processes on loopback (stories260K, the CPU backend).

- 32 concurrent greedy requests through the router give exactly the prefill server's own text
  (a single server); the decode server computed one prompt token per request and loaded the rest;
  both pools are all free afterwards.
- Bad kv_transfer_params are 400s naming the field while a healthy stream goes on.
- Killing the decode server mid-stream ends its streams with an error event, and the prefill
  server frees the leased blocks within the lease; killing the prefill server gives new requests a
  503 from the router, never a hang.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_server_helpers import CHAT_TEMPLATE, HealthyStreams, choice_texts, get_stats, sse_events, started_url, wait_for

from minillm.kv_connector.transport import SEGMENT_PREFIX, SHM_DIR, SHM_DIR_ENV, sweep_stale_segments

REPO = Path(__file__).resolve().parents[1]
MODEL = "stories"
NAMES = ["Lily", "Tom", "Ben", "Sue", "Max", "Anna", "Tim", "Mia", "Sam", "Zoe", "Jack", "Lucy", "Bob", "Kim",
         "Leo", "Amy"]
PLACES = ["park", "garden"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A `minillm serve` or `minillm router` process on a port the kernel picks, its output in a log file."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None) -> None:
        self.log = log
        self._url: str | None = None
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "minillm.cli", *args, "--port", "0"],
                                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, stdout=out,
                                         stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        """The base URL the process names in its log once its port (the kernel's pick) is bound."""
        if self._url is None:
            self._url = started_url(self.proc, self.log)
        return self._url

    def wait_up(self, timeout: float = 180) -> "Process":
        def up():
            assert self.proc.poll() is None, self.log.read_text()
            try:
                return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False
        assert wait_for(up, timeout=timeout, interval=0.1), f"{self.url} did not come up:\n{self.log.read_text()}"
        return self

    @property
    def core_pid(self) -> int:
        """The engine core's process (a serve process says which at start-up)."""
        return int(re.search(r"engine core in process (\d+)", self.log.read_text()).group(1))

    def crash(self) -> None:
        """SIGKILL the server and its engine core, as a machine failure would."""
        core = self.core_pid
        # Frozen first: else the core may see its API server die and exit cleanly (freeing what a
        # crash leaves behind) before its own SIGKILL comes.
        try:
            os.kill(core, signal.SIGSTOP)
        except ProcessLookupError:
            pass
        self.proc.kill()
        self.proc.wait(30)
        try:
            os.kill(core, signal.SIGKILL)
        except ProcessLookupError:
            pass
        assert wait_for(lambda: not Path(f"/proc/{core}").exists(), timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def serve(stories_path: Path, role: str, lease_s: float, log: Path, env: dict | None = None) -> Process:
    return Process(["serve", str(stories_path), "--device", "cpu", "--served-model-name", MODEL, "--chat-template",
                    CHAT_TEMPLATE, "--kv-role", role, "--kv-lease-s", str(lease_s)], log, env)


def start_trio(stories_path: Path, tmp: Path, lease_s: float, extra_prefill: list[str] = (),
               shm_dir: Path | None = None):
    """A prefill server, a decode server and the router between them, started together (their KV
    segments in shm_dir when given)."""
    env = {SHM_DIR_ENV: str(shm_dir)} if shm_dir is not None else None
    prefill = serve(stories_path, "producer", lease_s, tmp / "prefill.log", env)
    decode = serve(stories_path, "consumer", lease_s, tmp / "decode.log", env)
    router = Process(["router", "--prefill", prefill.url, *[a for u in extra_prefill for a in ("--prefill", u)],
                      "--decode", decode.url, "--connect-timeout", "2"], tmp / "router.log")
    return prefill.wait_up(), decode.wait_up(), router.wait_up()


def segments_of(pid: int, directory: Path = SHM_DIR) -> list[Path]:
    return list(directory.glob(f"{SEGMENT_PREFIX}{pid}-*"))


def pools_free(*servers: Process) -> bool:
    for server in servers:
        stats = get_stats(server.url)
        if stats["kv_num_used_blocks"] or stats["kv_transfer_num_leases"]:
            return False
    return True


@pytest.fixture(scope="module")
def trio(stories_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    dead = f"http://127.0.0.1:{free_port()}"     # a prefill URL nobody serves: the router skips it
    servers = start_trio(stories_path, tmp, lease_s=30, extra_prefill=[dead])
    prefill_core = servers[0].core_pid
    assert len(segments_of(prefill_core)) == 1   # the prefill engine's KV pool, shared
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()
    assert wait_for(lambda: not segments_of(prefill_core), timeout=30)   # unlinked by its engine at exit


def prompt(i: int) -> str:
    return (f"{NAMES[i % 16]} and the {['red', 'blue'][i // 16]} {PLACES[i % 2]}: one day {NAMES[(i + 3) % 16]} "
            f"saw a little bird")


async def complete_all(url: str, bodies: list[dict]) -> list[tuple[str, int, str]]:
    """Send every body at once; (text, prompt tokens, finish reason) of each, streamed or not."""
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(body: dict):
            if not body.get("stream"):
                r = await client.post(f"{url}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                data = r.json()
                return data["choices"][0]["text"], data["usage"]["prompt_tokens"], data["choices"][0]["finish_reason"]
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                assert r.status_code == 200, await r.aread()
                lines = [line async for line in r.aiter_lines()]
            assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]", lines[-3:]
            events = sse_events(lines)
            finish = [c["finish_reason"] for e in events for c in e.get("choices", []) if c["finish_reason"]]
            return choice_texts(events)[0], events[-1]["usage"]["prompt_tokens"], finish[-1]
        return await asyncio.gather(*map(one, bodies))


def test_32_concurrent_greedy_requests_through_the_router_give_the_single_servers_text(trio):
    prefill, decode, router = trio
    bodies = [{"model": MODEL, "prompt": prompt(i), "max_tokens": 24, "temperature": 0, "stream": i % 2 == 1,
               **({"stream_options": {"include_usage": True}} if i % 2 else {})} for i in range(32)]
    before = get_stats(decode.url)
    routed = asyncio.run(complete_all(router.url, bodies))
    after = get_stats(decode.url)
    # The single server's text: the prefill server answering the same requests itself.
    alone = asyncio.run(complete_all(prefill.url, [{**{k: v for k, v in b.items() if k != "stream_options"},
                                                    "stream": False} for b in bodies]))
    assert [r[0] for r in routed] == [a[0] for a in alone]
    assert [r[2] for r in routed] == [a[2] for a in alone]
    prompt_tokens = [r[1] for r in routed]
    # The decode server computed one token of each prompt (the last, for its logits) and loaded the rest.
    assert after["kv_transfer_num_requests"] - before["kv_transfer_num_requests"] == 32
    assert after["kv_transfer_tokens"] - before["kv_transfer_tokens"] == sum(n - 1 for n in prompt_tokens)
    assert after["prefill_tokens_total"] - before["prefill_tokens_total"] == 32
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == sum(prompt_tokens)
    loaded = {k: after["prompt_tokens_by_source"][k] - before["prompt_tokens_by_source"].get(k, 0)
              for k in after["prompt_tokens_by_source"]}
    assert loaded["external_kv_transfer"] == sum(n - 1 for n in prompt_tokens) and loaded["local_compute"] == 32
    assert after["kv_transfer_bytes"] > before["kv_transfer_bytes"] and after["kv_transfer_seconds"] > 0
    assert wait_for(lambda: pools_free(prefill, decode), timeout=30), (get_stats(prefill.url), get_stats(decode.url))
    p = get_stats(prefill.url)
    assert p["kv_transfer_leases_released"] >= 32 and p["kv_transfer_leases_expired"] == 0
    # The router says where the time went, per request and in its stats; /metrics has the transfer.
    stats = httpx.get(f"{router.url}/v1/stats", timeout=10).json()
    assert stats["num_requests"] >= 32 and stats["num_failed"] == 0 and stats["prefill_ms"]["p50"] > 0
    assert stats["kv_transfer_tokens"] >= sum(n - 1 for n in prompt_tokens)
    lines = [line for line in router.log.read_text().splitlines() if "/v1/completions: prefill" in line]
    assert len(lines) >= 32 and all("kv transfer" in line and "decode" in line for line in lines)
    metrics = httpx.get(f"{decode.url}/metrics", timeout=10).text
    assert re.search(r'minillm:kv_transfer_tokens_total\{model_name="stories"\} [1-9]', metrics)


def test_chat_through_the_router_and_the_routers_health(trio):
    prefill, decode, router = trio
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about a cat and a dog"}],
            "max_tokens": 20, "temperature": 0}
    alone = httpx.post(f"{prefill.url}/v1/chat/completions", json=body, timeout=60).json()
    routed = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)
    assert routed.status_code == 200, routed.text
    assert routed.json()["choices"][0]["message"] == alone["choices"][0]["message"]
    with httpx.stream("POST", f"{router.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        events = sse_events(r.iter_lines())
    text = "".join(c["delta"].get("content", "") for e in events for c in e["choices"])
    assert text == alone["choices"][0]["message"]["content"]
    health = httpx.get(f"{router.url}/health", timeout=10)
    assert health.status_code == 200
    data = health.json()
    assert [r["ok"] for r in data["prefill"]] == [True, False] and [r["ok"] for r in data["decode"]] == [True]
    assert httpx.get(f"{router.url}/v1/models", timeout=10).json()["data"][0]["id"] == MODEL
    bad = httpx.post(f"{router.url}/v1/completions", content=b"[1, 2", timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert wait_for(lambda: pools_free(prefill, decode), timeout=30)


def test_several_prompts_and_n_above_one_through_the_router_are_served_by_the_decode_server(trio):
    prefill, decode, router = trio
    batch = {"model": MODEL, "prompt": ["Once upon a time", "The little dog"], "max_tokens": 12, "temperature": 0}
    several = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.8, "seed": 7, "n": 2}
    for body in (batch, several):
        alone = httpx.post(f"{prefill.url}/v1/completions", json=body, timeout=60)
        routed = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
        assert routed.status_code == 200, routed.text
        assert [c["text"] for c in routed.json()["choices"]] == [c["text"] for c in alone.json()["choices"]]
        assert len(routed.json()["choices"]) == 2
    lines = router.log.read_text().splitlines()
    assert any("decode only (2 prompts)" in line for line in lines)
    assert any("decode only (n = 2)" in line for line in lines)
    assert wait_for(lambda: pools_free(prefill, decode), timeout=30)


def lease_for(prefill: Process, text: str) -> dict:
    """The kv_transfer_params a prefill server returns for a prompt (its blocks leased)."""
    r = httpx.post(f"{prefill.url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": text, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["text"]) > 0 and r.json()["usage"]["completion_tokens"] == 1
    return r.json()["kv_transfer_params"]


def decode_with(decode: Process, text: str, kv: dict | None, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": text, "max_tokens": 8, "temperature": 0, **extra}
    if kv is not None:
        body["kv_transfer_params"] = kv
    return httpx.post(f"{decode.url}/v1/completions", json=body, timeout=60)


def assert_bad(response: httpx.Response, match: str, status: int = 400) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == "kv_transfer_params" and error["message"].startswith("kv_transfer_params")
    assert re.search(match, error["message"]), error["message"]


def test_bad_kv_transfer_params_are_400s_and_the_decode_server_keeps_serving(trio):
    prefill, decode, _ = trio
    healthy = HealthyStreams(decode.url, {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 120})
    x, y = "The dog ran to the big tree and sat down", "A girl found a shiny stone by the river"
    expected = httpx.post(f"{prefill.url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": x, "max_tokens": 8, "temperature": 0}).json()["choices"][0]["text"]
    kv = lease_for(prefill, x)
    kv_y = lease_for(prefill, y)
    with healthy.in_flight():
        assert_bad(decode_with(decode, x, {**kv, "remote_lease_id": "0" * 32}), "does not exist")
        assert_bad(decode_with(decode, y, kv), "belong to another prompt")
        forged = {**kv, "remote_num_tokens": kv_y["remote_num_tokens"],
                  "remote_prompt_hash": kv_y["remote_prompt_hash"]}
        assert_bad(decode_with(decode, y, forged), "holds the KV of another prompt")
        assert_bad(decode_with(decode, x, {**kv, "remote_port": "eighty"}), "remote_port must be an integer")
        assert_bad(decode_with(decode, x, {**kv, "remote_host": "no such host!"}), "is not an address")
        assert_bad(decode_with(decode, x, {k: v for k, v in kv.items() if k != "remote_lease_id"}),
                   "remote_lease_id must be a string")
        assert_bad(decode_with(decode, x, {**kv, "do_remote_prefill": False}), "must set do_remote_decode")
        assert_bad(decode_with(decode, x, {**kv, "remote_block_size": 32}), "blocks hold 32 tokens")
        # n and a list of prompts are named as the fields they are (a router's client sends no kv_transfer_params)
        response = decode_with(decode, x, kv, n=2)
        assert response.status_code == 400 and response.json()["error"]["param"] == "n", response.text
        assert "takes n = 1 only" in response.json()["error"]["message"]
        response = decode_with(decode, [x, y], kv)
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
        assert_bad(decode_with(decode, x, {"do_remote_decode": True}), "needs a prefill server")
        assert_bad(decode_with(prefill, x, kv), "needs a decode server")
        assert_bad(decode_with(prefill, x, {"do_remote_decode": True}, stream=True), "stream false")
    with healthy.in_flight():
        nobody = {**kv, "remote_port": free_port()}
        assert_bad(decode_with(decode, x, nobody), "did not answer", status=503)
    # A refused claim leaves the lease good: the right request still loads it, then it is used up.
    ok = decode_with(decode, x, kv)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == expected
    transfer = json.loads(ok.headers["x-minillm-kv-transfer"])
    assert transfer["tokens"] == kv["remote_num_tokens"] - 1 and transfer["claim_ms"] > 0
    assert_bad(decode_with(decode, x, kv), "already released")
    assert decode_with(decode, y, kv_y).status_code == 200
    # Block ids that are not the lease's: the claim is given back, the request refused.
    kv_z = lease_for(prefill, x)
    with healthy.in_flight():
        assert_bad(decode_with(decode, x, {**kv_z, "remote_block_ids": [1, 2]}), "do not match")
    assert_bad(decode_with(decode, x, kv_z), "already released")
    healthy.check()
    assert wait_for(lambda: pools_free(prefill, decode), timeout=30)


def stream_until_killed(url: str, body: dict, started: threading.Event, result: dict) -> None:
    lines = result["lines"] = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            result["status"] = r.status_code
            for line in r.iter_lines():
                lines.append(line)
                if len([x for x in lines if x.startswith("data:")]) >= 2:
                    started.set()
    except httpx.HTTPError as exc:
        result["error"] = repr(exc)
    started.set()


def test_killing_the_decode_then_the_prefill_server(stories_path, tmp_path):
    lease_s = 3.0
    # Segments of their own: a producer started by another test meanwhile sweeps those of dead processes.
    shm = Path(tempfile.mkdtemp(prefix="minillm-test-", dir=SHM_DIR))
    prefill, decode, router = start_trio(stories_path, tmp_path, lease_s=lease_s, shm_dir=shm)
    try:
        # A lease nobody claims runs out (the decode server then says so).
        kv = lease_for(prefill, "The cat sat on the mat all day")
        assert wait_for(lambda: get_stats(prefill.url)["kv_transfer_leases_expired"] == 1, timeout=lease_s + 30)
        assert_bad(decode_with(decode, "The cat sat on the mat all day", kv), "has expired")
        # Streams in flight through the router, and leases prefilled but never claimed, when the
        # decode server dies.
        runs = []
        for i in range(4):
            started, result = threading.Event(), {}
            body = {"model": MODEL, "prompt": prompt(i), "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            thread = threading.Thread(target=stream_until_killed, args=(router.url, body, started, result), daemon=True)
            thread.start()
            runs.append((thread, started, result))
        for _, started, result in runs:
            assert started.wait(60) and result.get("status") == 200, result
        orphans = [lease_for(prefill, prompt(i)) for i in (10, 11)]
        assert get_stats(prefill.url)["kv_transfer_num_leases"] == len(orphans)
        decode.crash()
        killed = time.monotonic()
        for thread, _, result in runs:
            thread.join(60)
            assert not thread.is_alive()
            events = sse_events(result["lines"])
            assert "error" in events[-1] and events[-1]["error"]["code"] == "decode_server_failed", events[-1]
            assert result["lines"][-2:] == ["data: [DONE]", ""] or result["lines"][-1] == "data: [DONE]"
        assert wait_for(lambda: pools_free(prefill), timeout=lease_s + 30)
        assert time.monotonic() - killed < lease_s + 5, "the leases outlived their lease"
        assert get_stats(prefill.url)["kv_transfer_leases_expired"] == 1 + len(orphans)
        # A request now: its prefill succeeds, no decode server is there: 503 at once, not a hang.
        t0 = time.monotonic()
        r = httpx.post(f"{router.url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "Hello there", "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "decode_unavailable", r.text
        assert time.monotonic() - t0 < 30
        prefill_core = prefill.core_pid
        prefill.crash()
        t0 = time.monotonic()
        r = httpx.post(f"{router.url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "Hello there", "max_tokens": 4})
        assert r.status_code in (502, 503) and r.json()["error"]["type"] == "server_error", r.text
        assert time.monotonic() - t0 < 30
        assert httpx.get(f"{router.url}/health", timeout=30).status_code == 503
        # The crashed prefill engine left its shared pool behind; the next producer sweeps it.
        assert len(segments_of(prefill_core, shm)) == 1
        sweep_stale_segments(shm)
        assert not segments_of(prefill_core, shm)
    finally:
        for server in (router, decode, prefill):
            server.stop()
        shutil.rmtree(shm, ignore_errors=True)
