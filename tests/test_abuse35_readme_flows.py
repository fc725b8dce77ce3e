"""The README's commands as a new user runs them, on stories260K and the CPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def minillm(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run the CLI in a fresh interpreter, as the console script would."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "minillm.cli", *args], cwd=REPO, env=env, input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_generate_json_logprob_tokens_spell_the_text_as_the_server_names_them(stories_path):
    result = minillm("generate", str(stories_path), "--device", "cpu", "-p", "Once upon a time", "--temperature",
                     "0", "--max-tokens", "12", "--logprobs", "2", "--prompt-logprobs", "1", "--json")
    assert result.returncode == 0, result.stderr
    [record] = [json.loads(line) for line in result.stdout.splitlines()]
    out = record["outputs"][0]
    assert "".join(e["token"] for e in out["logprobs"]) == out["text"]
    for entry in out["logprobs"]:
        chosen = [t["token"] for t in entry["top_logprobs"] if t["token_id"] == entry["token_id"]]
        assert chosen in ([], [entry["token"]])
    prompt_tokens = [e["token"] for e in record["prompt_logprobs"][1:]]
    assert "".join(prompt_tokens) == " " + record["prompt"]    # the SentencePiece prefix space, as in vLLM
