"""Many streaming clients on a KV pool small enough to force preemption; clients that hang up."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from core_hooks import install
from test_server_helpers import (call_utility, get_stats, hang_up_stream, running_server, sse_events,
                                 wait_for)

from minillm.benchmarks import serving as bench
from minillm.benchmarks.cli_args import BenchUsageError
from minillm.server.async_engine import MAX_COMMANDS_PER_STEP

MODEL = "stories"
NUM_KV_BLOCKS = 24          # 16-token blocks: about six of these requests fit at once
PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben", "One day, a cat", "The sun was",
           "Tom had a big", "In the park", "She saw a bird"]


@pytest.fixture(scope="module")
def server(stories_path):
    with running_server(stories_path, served_model_name=MODEL, num_kv_blocks=NUM_KV_BLOCKS,
                        core_hook=install) as (url, engine):
        yield url, engine


def _body(prompt: str, max_tokens: int, stream: bool = True) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


async def _stream_text(client: httpx.AsyncClient, url: str, body: dict) -> tuple[str, str | None]:
    text, finish = "", None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line async for line in response.aiter_lines()]
    for event in sse_events(lines):
        text += event["choices"][0]["text"]
        finish = event["choices"][0]["finish_reason"] or finish
    return text, finish


def test_64_concurrent_streams_under_preemption_match_alone(server):
    url, _ = server
    max_tokens = 40
    alone = {}
    for prompt in PROMPTS:
        r = httpx.post(f"{url}/v1/completions", json=_body(prompt, max_tokens, stream=False), timeout=30)
        alone[prompt] = r.json()["choices"][0]["text"]
    before = get_stats(url)["num_preemptions"]

    async def run_all():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            jobs = [_stream_text(client, url, _body(PROMPTS[i % len(PROMPTS)], max_tokens)) for i in range(64)]
            return await asyncio.gather(*jobs)

    results = asyncio.run(run_all())
    assert [finish for _, finish in results] == ["length"] * 64
    assert [text for text, _ in results] == [alone[PROMPTS[i % len(PROMPTS)]] for i in range(64)]
    stats = wait_for(lambda: (s := get_stats(url))["num_running"] == 0 and s)
    assert stats["num_preemptions"] > before
    assert stats["kv_num_used_blocks"] == 0
    assert stats["kv_num_free_blocks"] + stats["kv_num_cached_blocks"] == stats["kv_num_blocks"] == NUM_KV_BLOCKS
    assert stats["num_waiting"] == 0 and stats["requests"] == []


def test_disconnected_stream_is_aborted_and_frees_blocks(server):
    url, engine = server
    before = get_stats(url)
    gone = hang_up_stream(url, engine, engine, _body("Once upon a time", 300))
    # From the API server sending the abort to the core applying it, at most two steps end (commands
    # are taken before every step); from the hang-up, a few more while the server notices it.
    assert gone.steps_after_sent <= 2 and gone.steps_after_hang_up <= 4
    assert gone.num_output_tokens < 300
    # The abort's count reaches the core's snapshots once the API server has seen the step that ended
    # the request, which may be a snapshot after the one with the freed blocks: wait for it.
    aborts = before["num_requests_finished"].get("abort", 0) + 1
    stats = wait_for(lambda: (s := get_stats(url))["num_requests_finished"].get("abort", 0) >= aborts and s,
                     timeout=60)
    assert stats["num_requests_finished"].get("abort", 0) == aborts
    assert stats["generation_tokens_total"] - before["generation_tokens_total"] < 300


def test_disconnected_non_streaming_request_is_aborted(server):
    url, _ = server
    before = get_stats(url)

    async def leave_early():
        async with httpx.AsyncClient(timeout=30) as client:
            task = asyncio.create_task(client.post(f"{url}/v1/completions", json=_body("The sun was", 370, False)))
            deadline = time.monotonic() + 60       # leave once the engine runs it (state, not a fixed delay)
            while (await client.get(f"{url}/v1/stats")).json()["num_running"] == 0:
                assert time.monotonic() < deadline and not task.done(), "the request never ran"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(leave_early())
    # The abort's count reaches the core's snapshots after the API server has seen the step that
    # ended the request, which may be a snapshot later than the freed blocks: wait for both.
    aborts = before["num_requests_finished"].get("abort", 0) + 1
    stats = wait_for(lambda: ((s := get_stats(url))["num_running"] == 0 and s["kv_num_used_blocks"] == 0
                              and s["num_requests_finished"].get("abort", 0) >= aborts and s), timeout=60)
    assert stats
    assert stats["num_requests_finished"].get("abort", 0) == aborts
    assert stats["generation_tokens_total"] - before["generation_tokens_total"] < 370


def test_serving_benchmark_reports_latencies(server, stories_path, tmp_path, capsys):
    url, _ = server
    result_file = tmp_path / "serving.json"
    rc = bench.main(["--base-url", url, "--num-prompts", "12", "--input-len", "8", "--output-len", "10",
                     "--request-rate", "50", "--vocab-range", "3", "500", "--result-file", str(result_file),
                     "--offline-model", str(stories_path), "--offline-device", "cpu"])
    assert rc == 0
    printed = capsys.readouterr().out
    for label in ("Request throughput (req/s)", "Output token throughput (tok/s)", "Mean TTFT (ms)",
                  "P99 TPOT (ms)", "Median ITL (ms)"):
        assert label in printed
    assert "Offline engine ceiling (tok/s)" in printed
    saved = json.loads(result_file.read_text())
    assert saved["offline_ceiling_tok_s"] > 0
    result = saved["results"][0]
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["total_input_tokens"] == 12 * 8 and result["total_output_tokens"] == 12 * 10
    assert 0 < result["ttft_ms"]["median"] <= result["e2el_ms"]["median"]
    assert result["tpot_ms"]["mean"] > 0 and result["itl_ms"]["p99"] >= result["itl_ms"]["median"]


def test_serving_benchmark_with_max_concurrency_and_given_prompts(server, tmp_path):
    url, _ = server
    result_file = tmp_path / "serving.json"
    rc = bench.main(["--base-url", url, "--num-prompts", "6", "--output-len", "6", "--max-concurrency", "2",
                     "--prompt", "Once upon a time", "--prompt", "The cat", "--result-file", str(result_file),
                     "--save-detailed"])
    assert rc == 0
    result = json.loads(result_file.read_text())["results"][0]
    assert result["completed"] == 6 and result["total_output_tokens"] == 36
    # Each request's own timings: its tokens' gaps add up to its time after the first, and no
    # more than two were ever in flight.
    requests = result["requests"]
    assert len(requests) == 6 and all(r["error"] is None and r["output_tokens"] == 6 for r in requests)
    for r in requests:
        # One gap per streamed event after the first: fewer than 5 when a busy server sent several
        # tokens in one event (all 6 in one leaves none).
        assert 0 <= r["start_ms"] and 0 < r["ttft_ms"] and len(r["itl_ms"]) <= 5
        assert r["ttft_ms"] + sum(r["itl_ms"]) <= r["end_ms"] - r["start_ms"]
    for r in requests:
        assert sum(1 for o in requests if o["start_ms"] <= r["start_ms"] < o["end_ms"]) <= 2
    with pytest.raises(BenchUsageError, match="--save-detailed needs --result-file"):
        bench.parse_args(["--save-detailed"])


def test_serving_benchmark_from_several_client_processes(server, tmp_path, capsys):
    url, _ = server
    result_file = tmp_path / "serving.json"
    rc = bench.main(["--base-url", url, "--num-prompts", "7", "--input-len", "8", "--output-len", "5",
                     "--max-concurrency", "4", "--num-client-processes", "2", "--vocab-range", "3", "500",
                     "--result-file", str(result_file), "--save-detailed"])
    assert rc == 0
    assert "Client CPU per output token (us)" in capsys.readouterr().out
    result = json.loads(result_file.read_text())["results"][0]
    assert result["completed"] == 7 and result["failed"] == 0
    assert result["total_input_tokens"] == 7 * 8 and result["total_output_tokens"] == 7 * 5
    assert 7 <= result["total_chunks"] <= 7 * 5      # every request streamed at least one event with text
    assert result["client_cpu_s"] > 0
    # --save-detailed names the client process of each request: requests 0, 2, 4, 6 went from the first
    assert sorted(r["client"] for r in result["requests"]) == [0, 0, 0, 0, 1, 1, 1]
    shares = bench.client_shares(bench.parse_args(["--num-prompts", "7", "--max-concurrency", "4",
                                                   "--num-client-processes", "3"]))
    assert sorted(i for share in shares for i in share.indices) == list(range(7))
    assert [share.max_concurrency for share in shares] == [2, 1, 1]


def test_serving_benchmark_client_splits_events_across_reads():
    buffer = bytearray()
    assert bench.sse_data(buffer, b'data: {"a":1}\n\nda') == [b'{"a":1}']
    assert bench.sse_data(buffer, b"ta: [DO") == []
    assert bench.sse_data(buffer, b"NE]\r\n\r\n: comment\n") == [b"[DONE]"]
    assert buffer == bytearray()


def test_serving_benchmark_concurrency_sweep_beside_the_offline_ceiling(server, stories_path, tmp_path, capsys):
    url, _ = server
    result_file = tmp_path / "sweep.json"
    rc = bench.main(["--base-url", url, "--num-prompts", "8", "--input-len", "8", "--output-len", "6",
                     "--concurrency-sweep", "1,4", "--result-file", str(result_file), "--offline-model",
                     str(stories_path), "--offline-arg", "device=cpu", "--offline-arg", "num_kv_blocks=64"])
    assert rc == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "4"]
    saved = json.loads(result_file.read_text())
    assert [level["max_concurrency"] for level in saved["sweep"]] == [1, 4]
    for level in saved["sweep"]:
        assert level["result"]["completed"] == 8 and level["result"]["total_output_tokens"] == 8 * 6
        assert level["offline_ceiling_tok_s"] > 0
        ratio = level["result"]["output_throughput"] / level["offline_ceiling_tok_s"]
        assert f"{ratio:.2f}" in rows[[1, 4].index(level["max_concurrency"])]
    assert saved["args"]["offline_engine_args"] == {"device": "cpu", "num_kv_blocks": 64}
    with pytest.raises(BenchUsageError, match="not_a_field=1"):
        bench.parse_args(["--offline-model", "m", "--offline-arg", "not_a_field=1"])


def test_serving_benchmark_mixed_workload_reports_each_class(server, stories_path, tmp_path, capsys):
    """Users streaming, then users while long prompts arrive: each class's figures, the long
    prompt's TTFT alone and the users' offline ceiling."""
    url, _ = server
    result_file = tmp_path / "mixed.json"
    rc = bench.main(["--base-url", url, "--mixed-users", "3", "--input-len", "8", "--output-len", "6",
                     "--long-input-len", "150", "--long-every-s", "0.3", "--duration", "1",
                     "--result-file", str(result_file), "--offline-model", str(stories_path),
                     "--offline-arg", "device=cpu", "--offline-arg", "num_kv_blocks=64"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "users' ITL p99 / p50 while long prompts arrive" in printed
    assert "long prompts' TTFT p50" in printed and "against the offline engine's" in printed
    mixed = json.loads(result_file.read_text())["mixed"]
    assert mixed["long_alone_ttft_ms"] > 0 and mixed["offline_ceiling_tok_s"] > 0
    for phase in ("users_alone", "users_mixed"):
        assert mixed[phase]["requests"] >= 3 and mixed[phase]["failed"] == 0
        assert mixed[phase]["output_tokens"] == 6 * mixed[phase]["requests"]
        assert mixed[phase]["itl_ms"]["p99"] >= mixed[phase]["itl_ms"]["median"] > 0
    assert mixed["long_mixed"]["requests"] >= 1 and mixed["long_mixed"]["failed"] == 0
    assert mixed["long_mixed"]["ttft_ms"]["median"] > 0
    with pytest.raises(BenchUsageError, match="--mixed-users"):
        bench.parse_args(["--mixed-users", "0"])
    with pytest.raises(BenchUsageError, match="without --concurrency-sweep"):
        bench.parse_args(["--mixed-users", "2", "--concurrency-sweep", "1,2"])


def test_command_work_between_two_steps_is_bounded(server):
    url, engine = server
    num_commands = 2000
    call_utility(engine, "start_log")
    result = {}
    worker = threading.Thread(target=lambda: result.update(
        r=httpx.post(f"{url}/v1/completions", json=_body("Once upon a time", 300, stream=False), timeout=60)))
    worker.start()
    assert wait_for(lambda: get_stats(url)["num_running"] == 1, timeout=30)
    for i in range(num_commands):     # a flood of (cheap) commands while the request runs
        engine.abort(f"nobody-{i}")
    worker.join(60)
    log = call_utility(engine, "take_log")
    assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 300
    runs, run = [], 0            # aborts handled between two steps
    for event in log:
        if event == "abort":
            run += 1
        elif run:
            runs.append(run)
            run = 0
    assert sum(runs) + run == num_commands and run == 0, "the flood outlasted the request"
    assert max(runs) <= MAX_COMMANDS_PER_STEP
    assert len(runs) >= num_commands // MAX_COMMANDS_PER_STEP   # the request kept stepping through the flood


def test_concurrent_stats_requests_share_snapshots(server):
    _, engine = server
    cells = [1 + (i * 37) % 300 for i in range(200)]

    async def many():
        return await asyncio.gather(*(engine.get_stats(c) for c in cells))

    calls = call_utility(engine, "stats_calls")
    snapshots = asyncio.run(many())
    calls = call_utility(engine, "stats_calls") - calls
    assert calls <= len(cells) // MAX_COMMANDS_PER_STEP + 2
    num_blocks = snapshots[0].kv_num_blocks
    for wanted, snap in zip(cells, snapshots):
        assert len(snap.block_map) <= wanted
        assert len(snap.block_map) * snap.block_map_blocks_per_cell >= num_blocks
        # the same view the engine would build itself (it is idle)
        assert snap.block_map == call_utility(engine, "stats", wanted)["block_map"]
