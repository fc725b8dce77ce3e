"""minillm bench serving driven with vLLM's `vllm bench serve` options: --percentile-metrics and
--metric-percentiles (printed and saved as vLLM prints and saves them), --host / --port, and the
progress bar on a terminal (--disable-tqdm)."""
from __future__ import annotations

import io
import json
import re
import sys
import urllib.parse

import pytest
from test_server_helpers import running_server

from minillm.benchmarks import serving as bench
from minillm.benchmarks.cli_args import BenchUsageError


@pytest.fixture(scope="module")
def server(stories_path):
    with running_server(stories_path) as (url, engine):
        yield url, engine


def _results(n: int) -> list[bench.RequestResult]:
    """n answered requests of 3 tokens each, their TTFTs 10, 20, ... ms and ITLs 1 ms."""
    return [bench.RequestResult(ok=True, prompt_tokens=4, output_tokens=3, ttft_s=0.01 * (i + 1),
                                latency_s=0.01 * (i + 1) + 0.002, itl_s=[0.001, 0.001], num_chunks=3)
            for i in range(n)]


# ---- --percentile-metrics and --metric-percentiles --------------------------------------------------------

def test_the_defaults_are_vllms():
    args = bench.parse_args([])
    assert args.percentile_metrics == ["ttft", "tpot", "itl"] and args.metric_percentiles == [99.0]


def test_the_selected_metrics_and_percentiles_are_printed_as_vllm_prints_them():
    args = bench.parse_args(["--num-prompts", "5", "--percentile-metrics", "ttft,e2el",
                             "--metric-percentiles", "25,50,99.9"])
    summary = bench.summarize("http://127.0.0.1:9", 5, _results(5), 1.0, percentiles=args.metric_percentiles)
    table = bench.format_results([summary], args)
    for line in ("Mean TTFT (ms):", "Median TTFT (ms):", "P25 TTFT (ms):", "P50 TTFT (ms):", "P99.9 TTFT (ms):",
                 "Mean E2EL (ms):", "P99.9 E2EL (ms):"):
        assert re.search(rf"^{re.escape(line)}\s+\d+\.\d\d$", table, re.M), (line, table)
    assert re.search(r"^-+Time to First Token-+$", table, re.M) and re.search(r"^-+End-to-end Latency-+$", table, re.M)
    assert "TPOT" not in table and "ITL" not in table and "P99 TTFT" not in table
    [p25] = re.findall(r"^P25 TTFT \(ms\):\s+(\S+)$", table, re.M)
    assert p25 == "20.00"           # 10..50 ms: numpy's linear interpolation, as vLLM's np.percentile
    default = bench.format_results([bench.summarize("http://127.0.0.1:9", 5, _results(5), 1.0)], bench.parse_args([]))
    assert "P99 TTFT (ms):" in default and "P99 TPOT (ms):" in default and "P99 ITL (ms):" in default
    assert "E2EL" not in default     # vLLM reports e2el only when asked


def test_the_saved_result_holds_vllms_keys(server, tmp_path, capsys):
    url, _ = server
    out = tmp_path / "r.json"
    status = bench.main(["--base-url", url, "--random-input-len", "4", "--random-output-len", "3",
                         "--num-prompts", "4", "--percentile-metrics", "ttft,itl,e2el",
                         "--metric-percentiles", "25,50,99.5", "--result-file", str(out)])
    assert status == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())["results"][0]
    for metric in ("ttft", "itl", "e2el"):
        for key in ("mean", "median", "std", "p25", "p50", "p99.5"):
            assert isinstance(result[f"{key}_{metric}_ms"], float), (key, metric)
        assert result[f"p50_{metric}_ms"] == pytest.approx(result[f"median_{metric}_ms"])
        assert result[f"p25_{metric}_ms"] <= result[f"p99.5_{metric}_ms"]
        assert result[f"{metric}_ms"]["p99.5"] == result[f"p99.5_{metric}_ms"]
    assert not any(key.endswith("_tpot_ms") for key in result)
    [line] = [line for line in printed.splitlines() if line.startswith("P99.5 E2EL (ms):")]
    assert f"{result['p99.5_e2el_ms']:.2f}" in line


@pytest.mark.parametrize("args, message", [
    (["--percentile-metrics", "ttft,foo"], "argument --percentile-metrics: unknown metric 'foo'"),
    (["--percentile-metrics", "ttft,,itl"], "argument --percentile-metrics: expected metric names"),
    (["--metric-percentiles", "101"], "argument --metric-percentiles: each percentile must be in [0, 100], got 101"),
    (["--metric-percentiles", "-1"], "argument --metric-percentiles: each percentile must be in [0, 100], got -1"),
    (["--metric-percentiles", "nan"], "argument --metric-percentiles: each percentile must be in [0, 100], got nan"),
    (["--metric-percentiles", "50,x"], "argument --metric-percentiles: expected numbers separated by commas"),
    (["--metric-percentiles", "25,,50"], "argument --metric-percentiles: expected numbers separated by commas"),
    (["--metric-percentiles", ""], "argument --metric-percentiles: expected numbers separated by commas"),
])
def test_bad_metric_options_are_usage_errors_naming_the_flag(args, message):
    with pytest.raises(BenchUsageError) as info:
        bench.parse_args(args)
    assert message in info.value.message, info.value.message


def test_a_bad_percentile_option_exits_2_from_the_command_line(capsys):
    from test_cli import run_main
    status, _, err = run_main(capsys, "bench", "serve", "--metric-percentiles", "99,200")
    assert status == 2
    assert err.strip() == ("minillm bench serving: error: argument --metric-percentiles: each percentile must be in "
                           "[0, 100], got 200 (try 'minillm bench serving --help')")


# ---- --host and --port -----------------------------------------------------------------------------------

@pytest.mark.parametrize("args, base_url", [
    ([], "http://127.0.0.1:8000"),
    (["--port", "9001"], "http://127.0.0.1:9001"),
    (["--host", "::1", "--port", "9001"], "http://[::1]:9001"),
    (["--host", "example.org"], "http://example.org:8000"),
    (["--base-url", "http://127.0.0.1:8000", "--port", "8000"], "http://127.0.0.1:8000"),
    (["--base-url", "http://LocalHost:8000", "--host", "localhost"], "http://LocalHost:8000"),
    (["--base-url", "http://example.org", "--port", "80"], "http://example.org"),
])
def test_host_and_port_build_the_base_url_as_vllm_does(args, base_url):
    assert bench.parse_args(args).base_url == base_url


@pytest.mark.parametrize("args, message", [
    (["--base-url", "http://127.0.0.1:8000", "--port", "9000"],
     "--port 9000 and --base-url http://127.0.0.1:8000 name different servers"),
    (["--base-url", "http://localhost:8000", "--host", "127.0.0.1"],
     "--host 127.0.0.1 and --base-url http://localhost:8000 name different servers"),
    (["--port", "0"], "--port must be in [1, 65535], got 0"),
    (["--port", "65536"], "--port must be in [1, 65535], got 65536"),
    (["--host", "a b"], "--host 'a b' is not a host name or an IP address"),
    (["--host", "h/x"], "--host 'h/x' is not a host name or an IP address"),
])
def test_host_and_port_that_cannot_be_are_usage_errors_naming_them(args, message):
    with pytest.raises(BenchUsageError) as info:
        bench.parse_args(args)
    assert message in info.value.message, info.value.message


def test_a_run_given_host_and_port_measures_that_server(server, capsys):
    url, _ = server
    parts = urllib.parse.urlsplit(url)
    status = bench.main(["--host", parts.hostname, "--port", str(parts.port), "--num-prompts", "2",
                         "--random-input-len", "4", "--random-output-len", "2"])
    assert status == 0
    assert re.search(r"Successful requests:\s+2\n", capsys.readouterr().out)


# ---- the progress bar ------------------------------------------------------------------------------------

class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("extra, shown", [([], True), (["--disable-tqdm"], False),
                                          (["--num-client-processes", "2"], True)])
def test_a_progress_bar_is_drawn_on_a_terminal_unless_disabled(server, monkeypatch, capsys, extra, shown):
    url, _ = server
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    status = bench.main(["--base-url", url, "--num-prompts", "3", "--random-input-len", "4",
                         "--random-output-len", "2", *extra])
    assert status == 0
    drawn = terminal.getvalue()
    assert ("3/3" in drawn) is shown, drawn
    assert "3/3" not in capsys.readouterr().out       # never on stdout, which holds the results


def test_no_progress_bar_when_stderr_is_no_terminal(server, capsys):
    url, _ = server
    status = bench.main(["--base-url", url, "--num-prompts", "2", "--random-input-len", "4",
                         "--random-output-len", "2"])
    assert status == 0
    assert capsys.readouterr().err == ""


def test_a_base_url_given_with_v1_is_the_servers_root():
    # OpenAI clients take http://host:port/v1; the benchmark kept it, then asked for /v1/v1/models.
    from minillm.benchmarks import serving
    args = serving.parse_args(["--base-url", "http://127.0.0.1:8000/v1", "--peer-base-url", "127.0.0.1:9/v1/"])
    assert (args.base_url, args.peer_base_url) == ("http://127.0.0.1:8000", "http://127.0.0.1:9")
