"""The engine-side ITL benchmark runs on the CPU with stories260K at tiny sizes (so it cannot rot)."""
import json

import pytest

from minillm.benchmarks import engine_itl as bench


def test_engine_itl_times_every_token_of_a_closed_loop_and_reruns_under_the_step_budget(stories_path, tmp_path,
                                                                                         capsys):
    out = tmp_path / "itl.json"
    rc = bench.main(["--model", str(stories_path), "--device", "cpu", "--users", "4", "--num-requests", "10",
                     "--prompt-len", "24", "--output-len", "8", "--step-budget-factor", "2", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "token budget only:" in printed and "max_step_ms" in printed
    plain, budgeted = json.loads(out.read_text())
    assert plain["max_step_ms"] is None
    assert budgeted["max_step_ms"] == pytest.approx(2 * plain["itl_ms_p50"], abs=1e-3)
    for run in (plain, budgeted):
        assert 0 < run["itl_ms_p50"] <= run["itl_ms_p90"] <= run["itl_ms_p99"]
        # every step is in one group; the steps that read back prompts are the loop's ten requests' chunks
        assert sum(g["steps"] for g in run["groups"]) == run["steps"]
        assert run["groups"][0]["name"] == "decode only" and run["groups"][0]["mean_prompt_tokens"] == 0
        assert 0 < run["share_of_steps_with_prompt_tokens"] < 1 and run["decode_tokens_per_s"] > 0


def test_engine_itl_reruns_under_the_relative_budget(stories_path, tmp_path):
    out = tmp_path / "itl.json"
    assert bench.main(["--model", str(stories_path), "--device", "cpu", "--users", "4", "--num-requests", "8",
                       "--prompt-len", "24", "--output-len", "6", "--max-step-factor", "1.5", "--json", str(out)]) == 0
    plain, budgeted = json.loads(out.read_text())
    assert plain["max_step_factor"] is None and budgeted["max_step_factor"] == 1.5
    assert budgeted["max_step_ms"] is None and budgeted["decode_tokens_per_s"] > 0
    assert list(budgeted["step_cost_ms"]) == ["base", "mixed", "tokens", "attention", "kv_read"]
    assert plain["step_cost_ms"] == {}


@pytest.mark.parametrize("argv, message", [
    (["--device", "cpu"], "give a small model"),
    (["--users", "0"], "--users must be at least 1"),
    (["--step-budget-factor", "2", "--max-step-ms", "3"], "not both"),
    (["--max-step-factor", "1.5", "--max-step-ms", "3"], "not both"),
    (["--max-step-factor", "0.5"], "--max-step-factor must be at least 1"),
])
def test_engine_itl_refuses_what_it_cannot_run(argv, message, capsys):
    rc = bench.run_main(bench.main, "engine_itl", argv)
    assert rc == 1 and message in capsys.readouterr().err
