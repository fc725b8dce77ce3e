"""The long-prompt mix benchmark runs on the CPU with stories260K at tiny sizes (so it cannot rot)."""
import json

from minillm.benchmarks import long_prompt_mix as bench


def test_long_prompt_mix_runs_both_budgets_and_reports_them(stories_path, tmp_path, capsys):
    out = tmp_path / "mix.json"
    rc = bench.main(["--model", str(stories_path), "--device", "cpu", "--users", "3", "--user-prompt-len", "8",
                     "--user-output-len", "40", "--long-prompt-len", "200", "--num-long", "2", "--long-every-s", "0",
                     "--max-num-batched-tokens", "32", "--decode-steps", "8", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| a: token budget | - |" in printed and "| b: step budget |" in printed
    assert "ITL p99 <= 2.5x ITL p50" in printed
    figures = json.loads(out.read_text())
    a, b = figures["a: token budget"], figures["b: step budget"]
    assert a["max_step_ms"] is None
    assert b["max_step_ms"] == 2.0 * a["plain_decode_step_ms"]       # twice run (a)'s plain decode step
    for run in (a, b):
        assert len(run["long_ttft_ms"]) == 2 and run["ttft_alone_ms"] > 0 and run["plain_decode_step_ms"] > 0
        assert run["user_requests_before_measure"] >= 2 * 3        # the users' steady state: each one ended one
        assert run["steps_while_long_prefills"] >= 200 // 32         # the prompts took chunks at least
        assert 0 < run["step_ms_p50"] <= run["step_ms_p99"] <= run["step_ms_worst"]
        assert 0 < run["itl_ms_p50"] <= run["itl_ms_p99"]
    assert list(b["step_cost"]["coefficients_s"]) == ["base", "mixed", "tokens", "attention", "kv_read"]
    assert a["step_cost"] == {}


def test_long_prompt_mix_needs_a_model_without_a_gpu(capsys):
    rc = bench.run_main(bench.main, "long_prompt_mix", ["--device", "cpu"])
    assert rc == 1 and "give a small model" in capsys.readouterr().err
