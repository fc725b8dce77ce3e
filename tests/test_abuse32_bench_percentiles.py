"""--percentile-metrics and --metric-percentiles choose the latency columns of the concurrency sweep's
table and of the mixed workload's (--mixed-users), and the figures the mixed workload saves, as
vLLM's benchmark prints and saves them: mean, median and each percentile of each selected metric.
The sweep printed ITL and TTFT p50 / p99 whatever was asked, and the mixed workload ignored both."""
from __future__ import annotations

import json
import re

import pytest
from test_server_helpers import running_server

from minillm.benchmarks import serving as bench
from minillm.benchmarks import serving_mixed


@pytest.fixture(scope="module")
def server(stories_path):
    with running_server(stories_path) as (url, engine):
        yield url, engine


def _results(n: int) -> list[bench.RequestResult]:
    """n answered requests of 3 tokens each, their TTFTs 10, 20, ... ms, their ITLs 1 ms."""
    return [bench.RequestResult(ok=True, prompt_tokens=4, output_tokens=3, ttft_s=0.01 * (i + 1),
                                latency_s=0.01 * (i + 1) + 0.002, itl_s=[0.001, 0.001], num_chunks=3)
            for i in range(n)]


def _header(table: str) -> list[str]:
    """The column names of the table's header row."""
    [line] = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line
              and not line[2].isdigit() and "|" in line[2:]][:1]
    return [cell.strip() for cell in line.strip("|").split("|")]


def _row(table: str, first: str) -> dict[str, str]:
    """The cells of the row whose first cell is FIRST, by column name."""
    header = _header(table)
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] == first:
            return dict(zip(header, cells))
    raise AssertionError(f"no row {first!r} in\n{table}")


def test_the_sweep_table_shows_the_selected_metrics_and_percentiles():
    args = bench.parse_args(["--num-prompts", "5", "--concurrency-sweep", "1,2", "--percentile-metrics", "ttft,e2el",
                             "--metric-percentiles", "25,90"])
    summary = bench.summarize("http://127.0.0.1:9", 5, _results(5), 1.0, percentiles=args.metric_percentiles)
    table = bench.format_sweep([(1, summary, None)], args)
    header = _header(table)
    assert "TTFT mean / median / P25 / P90 (ms)" in header and "E2EL mean / median / P25 / P90 (ms)" in header
    assert not any("ITL" in name or "TPOT" in name or "p99" in name.lower() for name in header), header
    ttft = summary.ttft_ms
    assert _row(table, "1")["TTFT mean / median / P25 / P90 (ms)"] == \
        f"{ttft['mean']:.1f} / {ttft['median']:.1f} / {ttft['p25']:.1f} / {ttft['p90']:.1f}"


def test_the_sweep_table_defaults_to_vllms_metrics():
    args = bench.parse_args(["--num-prompts", "5", "--concurrency-sweep", "1"])
    summary = bench.summarize("http://127.0.0.1:9", 5, _results(5), 1.0, percentiles=args.metric_percentiles)
    header = _header(bench.format_sweep([(1, summary, None)], args))
    latency = [name for name in header if name.endswith("(ms)")]
    assert latency == ["TTFT mean / median / P99 (ms)", "TPOT mean / median / P99 (ms)", "ITL mean / median / P99 (ms)"]


def _mixed(args) -> serving_mixed.MixedResult:
    figures = serving_mixed._figures(_results(5), 1.0, args.metric_percentiles)
    return serving_mixed.MixedResult(12.0, figures, figures, figures)


def test_the_mixed_table_shows_the_selected_metrics_and_percentiles():
    args = bench.parse_args(["--mixed-users", "2", "--percentile-metrics", "itl,e2el", "--metric-percentiles", "50,99.9"])
    result = _mixed(args)
    table = serving_mixed.format_mixed(result, args)
    header = _header(table)
    assert [name for name in header if name.endswith("(ms)")] == \
        ["ITL mean / median / P50 / P99.9 (ms)", "E2EL mean / median / P50 / P99.9 (ms)"]
    e2el = result.users_alone.e2el_ms
    assert f"{e2el['mean']:.1f} / {e2el['median']:.1f} / {e2el['p50']:.1f} / {e2el['p99.9']:.1f}" in table
    assert "users' ITL p99 / p50 while long prompts arrive" in table      # the ceilings' verdicts stay


def test_the_mixed_workload_saves_vllms_figures_of_the_selected_metrics(server, tmp_path, capsys):
    url, _ = server
    out = tmp_path / "mixed.json"
    status = bench.main(["--base-url", url, "--mixed-users", "2", "--input-len", "4", "--output-len", "3",
                         "--long-input-len", "20", "--long-every-s", "0.2", "--duration", "0.3",
                         "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90", "--result-file", str(out)])
    assert status == 0
    printed = capsys.readouterr().out
    assert "TTFT mean / median / P50 / P90 (ms)" in printed and "E2EL mean / median / P50 / P90 (ms)" in printed
    assert "ITL mean" not in printed
    mixed = json.loads(out.read_text())["mixed"]
    for phase in ("users_alone", "users_mixed", "long_mixed"):
        figures = mixed[phase]
        for metric in ("ttft", "e2el"):
            for stat in ("mean", "median", "std", "p50", "p90"):
                assert isinstance(figures[f"{stat}_{metric}_ms"], float), (phase, stat, metric)
            assert figures[f"p50_{metric}_ms"] == pytest.approx(figures[f"median_{metric}_ms"])
        assert not any(re.fullmatch(r"\w+_(itl|tpot)_ms", key) for key in figures), figures
