"""`minillm` commands as a user runs them: help, generate against LLM.generate, argument errors."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STORIES = Path(os.environ.get("MINILLM_TEST_MODEL", REPO.parent / "shared" / "models" / "stories260K"))
needs_stories = pytest.mark.skipif(not (STORIES / "config.json").is_file(),
                                   reason=f"stories260K not found at {STORIES}; set MINILLM_TEST_MODEL")
COMMANDS = ("chat", "generate", "serve", "monitor", "pull", "list", "bench")
ENGINE_FLAGS = ("--device", "--dtype", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
                "--block-size", "--num-kv-blocks", "--gpu-memory-utilization", "--enable-prefix-caching",
                "--no-enable-prefix-caching", "--enforce-eager", "--tensor-parallel-size", "--download-dir",
                "--kv-offload-gib", "--speculative-config")


def minillm(*args: str, env: dict | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run the CLI in a fresh interpreter, as the console script would."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "minillm.cli", *args], cwd=REPO, env=full_env,
                          input=stdin, capture_output=True, text=True, timeout=120)


def test_help_lists_every_command_and_the_engine_options():
    result = minillm("--help")
    assert result.returncode == 0
    for name in COMMANDS:
        assert f"  {name} " in result.stdout
    from minillm.cli import ENGINE_OPTIONS, app
    import typer.main
    group = typer.main.get_command(app)
    for name in ("chat", "generate", "serve"):
        flags = {f for p in group.commands[name].params for f in (*p.opts, *p.secondary_opts)}
        assert set(ENGINE_FLAGS) <= flags, name
    assert len(ENGINE_OPTIONS) == 14


@pytest.mark.parametrize("args, needle", [
    (["generate", "--prompt", "hi", "--frobnicate"], "--frobnicate"),
    (["generate", "--prompt", "hi"], "model"),
    (["generate", str(STORIES), "--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["generate", str(STORIES), "--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
    (["generate", str(STORIES)], "--prompt"),
    (["chat", str(STORIES), "--top-p", "1.5"], "top_p"),
    (["serve", "--device", "tpu"], "--device"),
])
def test_bad_arguments_fail_in_one_line(args, needle):
    result = minillm(*args)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert needle in lines[0]


def test_missing_model_directory_fails_in_one_line(tmp_path):
    result = minillm("generate", str(tmp_path / "no-such-model"), "--prompt", "hi", "--device", "cpu")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@needs_stories
def test_generate_json_equals_llm_generate(tmp_path):
    from minillm import LLM, SamplingParams
    from minillm.cli import output_record

    prompts = ["Once upon a time", "The little dog"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    result = minillm("generate", str(STORIES), "--device", "cpu", "--prompts-file",
                     str(tmp_path / "prompts.txt"), "--temperature", "0.8", "--top-k", "40", "--seed", "7",
                     "--max-tokens", "24", "--n", "2", "--stop", "Lily", "--json")
    assert result.returncode == 0, result.stderr
    got = [json.loads(line) for line in result.stdout.splitlines()]

    llm = LLM(str(STORIES), device="cpu")
    params = SamplingParams(temperature=0.8, top_k=40, seed=7, max_tokens=24, n=2, stop=["Lily"])
    want = [output_record(out) for out in llm.generate(prompts, params)]
    assert got == want
    assert [r["prompt"] for r in got] == prompts
    assert all(len(r["outputs"]) == 2 for r in got)
    # The load report: backend, dtype, weights, KV pool in blocks and tokens, concurrency.
    report = next(line for line in result.stderr.splitlines() if line.startswith("minillm: backend"))
    for word in ("dtype float32", "weights", "blocks x 16", "tokens", "max concurrency"):
        assert word in report


@needs_stories
def test_generate_plain_text_greedy_matches_reference():
    reference = json.loads((STORIES / "reference.json").read_text())
    result = minillm("generate", str(STORIES), "--device", "cpu", "-p", "Once upon a time",
                     "--temperature", "0", "--max-tokens", "40", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    from minillm.tokenizer import Tokenizer
    expected = Tokenizer.from_pretrained(STORIES).decode(reference["greedy_from_bos_200_ids"][1:5 + 40])
    assert result.stdout.strip() == expected.strip()


def test_chat_without_a_fetchable_default_model_says_how_to_use_a_local_dir(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MINILLM_MODEL"}
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-m", "minillm.cli", "chat", "--download-dir", str(tmp_path)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120, input="")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert "Qwen/Qwen3-0.6B" in line and "minillm chat path/to/model" in line


@needs_stories
def test_list_shows_local_models_with_sizes(tmp_path):
    store = tmp_path / "weights"
    shutil.copytree(STORIES, store / "karpathy--stories260K")
    result = minillm("list", "--download-dir", str(store))
    assert result.returncode == 0, result.stderr
    [line] = result.stdout.strip().splitlines()
    assert line.split()[:3] == ["karpathy/stories260K", "1.0", "MiB"]
