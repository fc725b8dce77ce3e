"""minillm bench throughput as users run it on the CPU: the figures it prints and saves describe the
workload alone."""
from __future__ import annotations

import json
import re

from test_cli import STORIES, needs_stories, run_main


@needs_stories
def test_the_steps_printed_and_saved_are_the_workloads_not_the_warm_ups(capsys, tmp_path):
    # One request of a 4-token prompt and 3 output tokens takes 3 steps (the prompt and the first token
    # in one); the warm-up's 8 steps were counted in too: "11 steps" for 3 output tokens.
    out_file = tmp_path / "figures.json"
    status, out, err = run_main(capsys, "bench", "throughput", "--model", str(STORIES), "--device", "cpu",
                                "--num-seqs", "1", "--max-input-len", "4", "--max-output-len", "3",
                                "--json", str(out_file))
    assert status == 0, err
    figures = json.loads(out_file.read_text())
    assert figures["output_tokens"] == 3
    assert figures["steps"] == 3 and figures["preemptions"] == 0
    [line] = [line for line in out.splitlines() if line.startswith("minillm:")]
    assert re.search(r"\b3 steps, 0 preemptions\b", line), line
