"""bench serving's step trace (the engine's steps polled from /v1/stats) and bench serving_gaps, which
places a run's long inter-token gaps: who else saw them, when, and what the engine's steps did then."""
from __future__ import annotations

import json

import pytest
from test_server_helpers import running_server

from minillm.benchmarks import serving as bench
from minillm.benchmarks import serving_gaps as gaps
from minillm.benchmarks.cli_args import BenchError, BenchUsageError


def stream(start, ttft, itls, client):
    """A --save-detailed request entry."""
    return {"client": client, "start_ms": start, "end_ms": start + ttft + sum(itls) + 1, "ttft_ms": ttft,
            "itl_ms": list(itls), "output_tokens": len(itls) + 1, "error": None}


def test_gaps_are_told_apart_by_who_else_saw_them_and_grouped_in_windows_with_the_engines_steps():
    # Four streams over two clients, a token every 5 ms. At 100 ms every stream waits 15 ms (upstream);
    # at 300 ms one stream alone waits 12 ms.
    def itls(stall_at=None, stall=15.0):
        out = [5.0] * 80
        if stall_at is not None:
            out[stall_at] = stall
        return out
    requests = [stream(0.0, 5.0, itls(19), 0), stream(0.0, 5.0, itls(19), 0),
                stream(0.0, 5.0, itls(19), 1), stream(0.0, 5.0, itls(19), 1)]
    requests[2]["itl_ms"][57] = 12.0       # mid 5 + 5 * 57 + 6 = 296 ms, after the upstream stall's 10 ms
    steps = [{"step": k, "t_ms": 5.0 * k + (10.0 if k >= 20 else 0.0), "num_prefill_tokens": 16 if k == 20 else 0,
              "num_decode_tokens": 4, "device_step_s": None} for k in range(1, 90)]
    report = gaps.analyze({"requests": requests, "steps": steps}, level=4)
    assert report.num_itls == 4 * 80 and report.itl_p50_ms == 5.0 and report.threshold_ms == 7.5
    kinds = sorted(g.kind for g in report.gaps)
    assert kinds == ["alone"] + ["upstream"] * 4
    assert [len(w.gaps) for w in report.windows] == [4, 1]
    upstream = report.windows[0]
    assert all(g.token_index == 20 for g in upstream.gaps) and upstream.steps
    text = gaps.format_report(report, steps)
    assert "upstream 4, alone 1" in text and "token index: 1-4: 0, 5-31: 4, 32+: 1" in text
    # The engine's step 20 came 15 ms after step 19: the window's line says so.
    assert "interval median 5.0 max 15.0 ms, 16 prompt tokens" in text


def test_a_result_without_requests_or_a_bad_file_is_one_line(tmp_path, capsys):
    with pytest.raises(BenchError, match="--save-detailed"):
        gaps.analyze({"requests": None})
    with pytest.raises(BenchError, match="no request streamed more than one chunk"):
        gaps.analyze({"requests": [stream(0.0, 5.0, [], 0)]})
    with pytest.raises(BenchError, match="median inter-token latency is 0"):
        gaps.analyze({"requests": [stream(0.0, 5.0, [0.0, 0.0, 3.0], 0)]})
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(BenchError, match="cannot read"):
        gaps.main([str(bad)])
    other = tmp_path / "other.json"
    other.write_text("{}")
    with pytest.raises(BenchError, match="not a bench serving result"):
        gaps.main([str(other)])
    for doc in ({"results": 5}, [], {"sweep": [{"result": {}}]},
                {"results": [{"requests": [{"start_ms": 0, "ttft_ms": 1, "itl_ms": ["a", "b"], "end_ms": 3}]}]}):
        edited = tmp_path / "edited.json"
        edited.write_text(json.dumps(doc))
        with pytest.raises(BenchError, match="not a bench serving result"):
            gaps.main([str(edited)])
    with pytest.raises(BenchUsageError, match="--step-trace needs --result-file"):
        bench.parse_args(["--step-trace"])
    with pytest.raises(BenchUsageError, match="--step-trace-interval"):
        bench.parse_args(["--step-trace", "--result-file", str(tmp_path / "x.json"), "--step-trace-interval", "0"])


def test_a_traced_run_keeps_every_engine_step_once_and_the_gaps_report_reads_it(stories_path, tmp_path, capsys):
    result_file = tmp_path / "traced.json"
    with running_server(stories_path) as (url, _):
        rc = bench.main(["--base-url", url, "--num-prompts", "12", "--input-len", "8", "--output-len", "24",
                         "--max-concurrency", "4", "--num-client-processes", "2", "--result-file", str(result_file),
                         "--save-detailed", "--step-trace", "--step-trace-interval", "0.02"])
    assert rc == 0
    result = json.loads(result_file.read_text())["results"][0]
    steps = result["steps"]
    numbers = [s["step"] for s in steps]
    assert numbers == sorted(set(numbers)) and len(numbers) >= 24      # each step once, in order
    # 12 requests x 24 tokens at 4 in flight: at least 3 x 24 decode steps ran; the polls missed none of
    # them unless more than 32 passed between two polls, and said how many they missed.
    assert numbers[-1] - numbers[0] + 1 == len(numbers) + result["steps_missed"]
    assert sum(s["num_decode_tokens"] + s["num_prefill_tokens"] for s in steps) > 0
    times = [s["t_ms"] for s in steps]
    assert times == sorted(times)
    requests = result["requests"]
    first_token = min(r["start_ms"] + r["ttft_ms"] for r in requests)
    last_token = max(r["end_ms"] for r in requests)
    # The engine's steps, on the client's clock, end within the run (the first poll may see steps of
    # the warm-up before it; the last step ends before the last client hears of it).
    assert any(first_token - 1000 <= t <= last_token for t in times) and times[-1] <= last_token + 1000
    capsys.readouterr()
    assert gaps.main([str(result_file)]) == 0
    first_line = capsys.readouterr().out.splitlines()[0]
    assert f"12 requests, {sum(len(r['itl_ms']) for r in requests)} ITLs" in first_line


def test_a_server_without_v1_stats_leaves_the_trace_empty_and_says_why():
    import http.server
    import socketserver
    import threading

    from minillm.benchmarks.step_trace import StepTracer

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = socketserver.TCPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        tracer = StepTracer(f"http://127.0.0.1:{server.server_address[1]}", 10.0).start()
        tracer.stop()                    # the first poll, then the last one
    finally:
        server.shutdown()
        server.server_close()
    assert tracer.polls == 0 and len(tracer.errors) == 2 and "404" in tracer.errors[-1]
    assert tracer.steps(0.0) == [] and tracer.missed() == 0
