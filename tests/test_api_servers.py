"""Several API servers on one engine core (--api-server-count): routing, whole-engine figures, failures."""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from core_hooks import install
from test_server_failure import REPO, _serve, _Stream
from test_server_helpers import api_servers_on_one_core, get_stats, hang_up_stream, sse_events, wait_for

from minillm.config import EngineConfig

MODEL = "stories"
PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben", "One day, a cat"]


def _body(prompt: str, max_tokens: int, stream: bool = True) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


@pytest.fixture(scope="module")
def two_servers(stories_path):
    """One engine core for two API servers, both in this process (each with its own port and loop)."""
    with api_servers_on_one_core(EngineConfig(model=str(stories_path), device="cpu"), 2, install, MODEL) as both:
        yield both


async def _stream_text(client: httpx.AsyncClient, url: str, body: dict) -> str:
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line async for line in response.aiter_lines()]
    return "".join(event["choices"][0]["text"] for event in sse_events(lines))


def test_each_server_gets_its_own_requests_outputs(two_servers):
    urls, engines = two_servers
    alone = {p: httpx.post(f"{urls[0]}/v1/completions", json=_body(p, 24, stream=False), timeout=60)
             .json()["choices"][0]["text"] for p in PROMPTS}
    before = get_stats(urls[0])

    async def run_all():
        async with httpx.AsyncClient(timeout=120) as client:
            jobs = [_stream_text(client, urls[i % 2], _body(PROMPTS[i % len(PROMPTS)], 24)) for i in range(16)]
            return await asyncio.gather(*jobs)

    texts = asyncio.run(run_all())
    assert texts == [alone[PROMPTS[i % len(PROMPTS)]] for i in range(16)]
    # Whole-engine figures through either server: both servers' finished requests, counted once.
    for url in urls:
        stats = wait_for(lambda: (s := get_stats(url))["num_requests_finished"].get("length", 0)
                         - before["num_requests_finished"].get("length", 0) == 16 and s)
        assert stats, get_stats(url)["num_requests_finished"]
        assert stats["generation_tokens_total"] - before["generation_tokens_total"] == 16 * 24
    assert all(not engine.processor.requests for engine in engines)


def test_a_disconnect_on_the_second_server_aborts_in_the_core_within_two_steps(two_servers):
    urls, engines = two_servers
    gone = hang_up_stream(urls[1], engines[1], engines[0], _body("Once upon a time", 300))
    assert gone.steps_after_sent <= 2 and gone.steps_after_hang_up <= 4
    assert gone.num_output_tokens < 300


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_serve_with_two_api_servers_spreads_requests_and_adds_up_metrics(stories_path, tmp_path):
    command = [sys.executable, "-m", "minillm.cli", "serve", str(stories_path), "--api-server-count", "2"]
    with _serve(tmp_path, command) as (proc, url, log):
        server_pids = [int(pid) for pid in re.findall(r"API server \d+ in process (\d+)", log.read_text())]
        assert len(server_pids) == 2 and proc.pid not in server_pids
        before = {pid: _cpu_ticks(pid) for pid in server_pids}

        async def run_all():
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as client:
                return await asyncio.gather(*(_stream_text(client, url, _body(PROMPTS[i % 4], 40))
                                              for i in range(48)))

        texts = asyncio.run(run_all())
        assert all(texts)
        # Both processes did work: the kernel handed connections to each (a busy machine decides how
        # many; an idle API server spends no CPU tick in the second or two this takes).
        ticks = {pid: _cpu_ticks(pid) - before[pid] for pid in server_pids}
        assert all(t >= 1 for t in ticks.values()) and sum(ticks.values()) >= 5, ticks
        for _ in range(4):     # whichever server answers, the figures are the whole engine's
            assert get_stats(url)["num_requests_finished"].get("length") == 48
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
            assert re.search(r'minillm:e2e_request_latency_seconds_count\{model_name="stories"\} 48\.0', metrics)
            assert re.search(r'minillm:request_success_total\{finished_reason="length",model_name="stories"\} 48\.0',
                             metrics)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
        assert wait_for(lambda: all(not Path(f"/proc/{pid}").exists() or _is_zombie(pid) for pid in server_pids),
                        timeout=30)


def _is_zombie(pid: int) -> bool:
    with contextlib.suppress(FileNotFoundError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    return True


def test_a_killed_core_is_seen_by_every_api_server(stories_path, tmp_path):
    command = [sys.executable, "-m", "minillm.cli", "serve", str(stories_path), "--api-server-count", "2"]
    with _serve(tmp_path, command) as (proc, url, log):
        text = log.read_text()
        core_pid = int(re.search(r"engine core in process (\d+)", text).group(1))
        server_pids = [int(pid) for pid in re.findall(r"API server \d+ in process (\d+)", text)]
        streams = [_Stream(url) for _ in range(6)]
        assert all(stream.first.wait(30) for stream in streams)
        os.kill(core_pid, signal.SIGKILL)
        for stream in streams:
            stream.join(30)
            assert not stream.is_alive(), "a stream hung after the core died"
            assert "engine core process ended" in sse_events(stream.lines)[-1]["error"]["message"]
        # Every API server's reader sees the core's end on its own: the streams above may all have
        # been on one of them, and the kernel may hand this request to the other, whose reader
        # thread a busy machine runs a little later. So wait until whichever answers is unhealthy
        # (503, during the drain) or gone (the servers exit at once), and check what it says.
        answers = []

        def unhealthy() -> bool:
            try:
                health = httpx.get(f"{url}/health", timeout=5)
            except httpx.ConnectError:
                answers.append(None)
                return True
            answers.append(health)
            return health.status_code != 200
        assert wait_for(unhealthy, timeout=30), [a.status_code for a in answers if a is not None]
        last = answers[-1]
        assert last is None or (last.status_code == 503 and "engine core" in last.json()["error"]["message"])
        assert proc.wait(timeout=60) == 1, log.read_text()
        assert wait_for(lambda: all(not Path(f"/proc/{pid}").exists() or _is_zombie(pid) for pid in server_pids),
                        timeout=30)
        # The first server to see it exits; the serve process may then stop the other before it logs.
        assert log.read_text().count("the server exits in") >= 1


def test_an_api_server_count_past_the_machines_means_is_refused_before_anything_starts(stories_path):
    import subprocess
    too_many = 4 * (os.cpu_count() or 1) + 1
    done = subprocess.run([sys.executable, "-m", "minillm.cli", "serve", str(stories_path), "--device", "cpu",
                           "--api-server-count", str(too_many), "--port", "0"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2, done.stderr            # a usage error naming the flag
    assert f"Invalid value for '--api-server-count': must be at most {too_many - 1}" in done.stderr
    assert "engine core in process" not in done.stderr and "Traceback" not in done.stderr


def test_serve_cors_options_reach_every_api_server(stories_path, tmp_path):
    command = [sys.executable, "-m", "minillm.cli", "serve", str(stories_path), "--api-server-count", "2",
               "--allowed-origins", '["https://app.example"]', "--allowed-methods", '["POST"]']
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    with _serve(tmp_path, command) as (proc, url, log):
        for _ in range(6):          # new connections: the kernel hands them to either server
            with httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as client:
                ok = client.options(f"{url}/v1/chat/completions", headers={**preflight, "Origin": "https://app.example"})
                assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
                other = client.options(f"{url}/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
                assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
                put = client.options(f"{url}/v1/chat/completions", headers={
                    **preflight, "Origin": "https://app.example", "Access-Control-Request-Method": "PUT"})
                assert put.status_code == 400
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=60) == 0, log.read_text()
        except subprocess.TimeoutExpired:
            raise AssertionError(log.read_text()) from None


def test_sigterm_while_the_api_servers_start_is_a_clean_stop(stories_path, tmp_path):
    """A SIGTERM that reaches the API servers while they import and join the core (spawned with it
    blocked, then taken as a stop) ends the run with status 0; it used to kill a server outright."""
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "minillm.cli", "serve", str(stories_path), "--device", "cpu",
                                 "--port", "0", "--api-server-count", "2"], cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out, stderr=subprocess.STDOUT)
    try:
        assert wait_for(lambda: "API server 1 in process" in log.read_text(), timeout=120), log.read_text()
        proc.send_signal(signal.SIGTERM)          # both servers are spawned; neither serves yet
        assert proc.wait(timeout=90) == 0, log.read_text()
        assert "killed" not in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
