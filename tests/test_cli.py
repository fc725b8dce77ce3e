"""`minillm` commands as a user runs them: help, generate against LLM.generate, argument errors."""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STORIES = Path(os.environ.get("MINILLM_TEST_MODEL", REPO.parent / "shared" / "models" / "stories260K"))
needs_stories = pytest.mark.skipif(not (STORIES / "config.json").is_file(),
                                   reason=f"stories260K not found at {STORIES}; set MINILLM_TEST_MODEL")
COMMANDS = ("chat", "generate", "serve", "monitor", "pull", "list", "bench", "router")
ENGINE_FLAGS = ("--device", "--dtype", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
                "--block-size", "--num-kv-blocks", "--gpu-memory-utilization", "--enable-prefix-caching",
                "--no-enable-prefix-caching", "--enforce-eager", "--tensor-parallel-size", "--load-format",
                "--download-dir", "--kv-offload-gib", "--speculative-config", "--max-step-ms", "--max-step-factor",
                "--kv-cache-dtype", "--generation-config", "--revision", "--async-scheduling",
                "--no-async-scheduling", "--max-logprobs", "--calculate-kv-scales", "--override-generation-config",
                "--grammar-process", "--no-grammar-process", "--kv-cache-memory-bytes", "--threads",
                "--scheduling-policy", "--tokenizer", "--tokenizer-revision", "--tokenizer-mode")


def minillm(*args: str, env: dict | None = None, stdin: str | None = None,
            cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run the CLI in a fresh interpreter, as the console script would (empty env values unset)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v != ""}
    return subprocess.run([sys.executable, "-m", "minillm.cli", *args], cwd=cwd, env=full_env,
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
    assert len(ENGINE_OPTIONS) == 32


def test_the_cli_imports_no_numpy_before_a_command_needs_it():
    """--help, list, pull, router and argument errors start in a quarter of a second, not half."""
    result = subprocess.run([sys.executable, "-c", "import sys, minillm.cli; print('numpy' in sys.modules)"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False"]


@pytest.mark.parametrize("args, needle", [
    (["generate", "--prompt", "hi", "--frobnicate"], "--frobnicate"),
    (["generate", "--prompt", "hi"], "model"),
    (["generate", str(STORIES), "--prompt", "hi", "--temperature", "-1"], "--temperature"),
    (["generate", str(STORIES), "--prompt", "hi", "--max-tokens", "0"], "--max-tokens"),
    (["generate", str(STORIES)], "--prompt"),
    (["chat", str(STORIES), "--top-p", "1.5"], "--top-p"),
    (["serve", "--device", "tpu"], "--device"),
    (["serve", str(STORIES), "--allowed-origins", "*"], "--allowed-origins"),
    (["serve", str(STORIES), "--allowed-headers", '["x", 1]'], "--allowed-headers"),
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


# ---- the model store ------------------------------------------------------------------------------

TINY = REPO / "tests" / "fixtures" / "tiny" / "llama-mha"


def test_the_store_is_the_hugging_face_cache_from_any_directory(tmp_path):
    """Models other tools put in the Hugging Face cache are listed and run, whatever the working directory."""
    from conftest import put_in_hf_cache
    hf_home = tmp_path / "hf-home"
    snapshot = put_in_hf_cache(hf_home / "hub", "someorg/tiny-llama", TINY)
    elsewhere = tmp_path / "some" / "other" / "dir"
    elsewhere.mkdir(parents=True)
    env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": ""}
    listings = []
    for cwd in (REPO, elsewhere):
        result = minillm("list", env=env, cwd=cwd)
        assert result.returncode == 0, result.stderr
        listings.append(result.stdout)
    assert listings[0] == listings[1]
    header, row = listings[0].strip().splitlines()
    assert header.split() == ["NAME", "SIZE", "PATH"]
    assert row.split()[0] == "someorg/tiny-llama" and row.split()[-1] == str(snapshot)
    result = minillm("generate", "someorg/tiny-llama", "-p", "Hi", "--device", "cpu", "--max-tokens", "4",
                     "--temperature", "0", "--json", env=env, cwd=elsewhere)
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["outputs"][0]["token_ids"]) == 4
    # HF_HUB_CACHE wins over HF_HOME, as in huggingface_hub; an empty store says where it looked.
    result = minillm("list", env={**env, "HF_HUB_CACHE": str(tmp_path / "empty")}, cwd=elsewhere)
    assert result.stdout.strip() == f"no models in {tmp_path / 'empty'} (minillm pull MODEL fetches one)"


@needs_stories
def test_pull_of_a_local_directory_is_an_error_that_says_what_to_do(tmp_path):
    result = minillm("pull", str(STORIES))
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert f"{STORIES} is a local directory: there is nothing to pull" in line
    assert f"minillm chat {STORIES}" in line
    result = minillm("pull", "./no/such/model")
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert "no such directory: ./no/such/model" in line and "Hugging Face repo id" in line
    result = minillm("pull", "someorg/not-there", "--download-dir", str(tmp_path), env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 1 and "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("minillm: error: someorg/not-there could not be fetched into"), line   # pull takes ids only


@needs_stories
def test_a_mistyped_local_path_is_no_such_directory_with_a_suggestion():
    env = {"HF_HUB_OFFLINE": "1"}
    for typo in ("shared/stories260K", "./shared/stories260K", "../shared/stories260K"):
        result = minillm("generate", typo, "-p", "hi", "--device", "cpu", env=env)
        assert result.returncode == 1 and "Traceback" not in result.stderr
        [line] = result.stderr.strip().splitlines()
        assert line.startswith(f"minillm: error: no such directory: {typo}"), line
        if STORIES == REPO.parent / "shared" / "models" / "stories260K":
            assert "did you mean ../shared/models/stories260K?" in line


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """minillm's console entry point in this process: (exit status, stdout, stderr)."""
    from minillm.cli import main
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_no_error_suggests_an_option_that_does_not_exist(tmp_path, monkeypatch, capsys):
    """Every --flag that an error message mentions is an option of the command that printed it.

    In-process through the console entry point: a fresh interpreter per case costs seconds each.
    """
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("MINILLM_MODEL", raising=False)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    failures = [
        ("generate", str(tmp_path / "nope"), "-p", "hi"),
        ("generate", "shared/stories260K", "-p", "hi"),
        ("generate", "someorg/not-there", "-p", "hi", "--download-dir", str(tmp_path)),
        ("generate", str(STORIES)),
        ("generate", str(STORIES), "-p", "hi", "--prompts-file", str(tmp_path / "f")),
        ("chat", "--download-dir", str(tmp_path)),
        ("chat", str(STORIES), "--chat-template", str(tmp_path / "none.jinja")),
        ("serve", "--download-dir", str(tmp_path)),
        ("pull", "./x"),
        ("monitor", "--replay", str(tmp_path / "none.jsonl")),
        ("bench", "throughput", "--device", "cpu"),
        ("bench", "throughput", "--model", str(STORIES), "--max-input-len", "400", "--max-output-len", "400"),
        ("bench", "serving", "--base-url", "http://127.0.0.1:9"),
        ("bench", "serving", "--num-prompts", "0"),
    ]
    helps: dict[tuple[str, ...], set[str]] = {}
    for args in failures:
        status, _, err = run_main(capsys, *args)
        assert status != 0, args
        assert "Traceback" not in err, args
        [line] = err.strip().splitlines()
        flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", line))
        command = tuple(a for a in args[:2] if not a.startswith(("-", "/", ".")) and "/" not in a)
        if command not in helps:
            helps[command] = set(re.findall(r"--[a-z][a-z-]*", run_main(capsys, *command, "--help")[1]))
        assert flags <= helps[command], f"{args}: {line} names {flags - helps[command]}"


@pytest.mark.parametrize("args, message", [
    (["generate", "-p", "hi", "--temperature", "-1"],
     "Invalid value for '--temperature': must be non-negative, got -1.0"),
    (["generate", "-p", "hi", "--top-p", "2"], "Invalid value for '--top-p': must be in (0, 1], got 2.0"),
    (["generate", "-p", "hi", "--max-tokens", "0"], "Invalid value for '--max-tokens': must be an integer >= 1, got 0"),
    (["generate", "-p", "hi", "--top-k", "-5"],
     "Invalid value for '--top-k': must be -1 (off), 0 (off) or a positive integer, got -5"),
    (["generate", "-p", "hi", "--stop-token-id", "-2"],
     "Invalid value for '--stop-token-id': must be non-negative integers, got [-2]"),
    (["generate", "-p", "hi", "--min-tokens", "9", "--max-tokens", "4"],
     "Invalid value for '--min-tokens': must not exceed max_tokens (4), got 9"),
    (["serve", "--kv-role", "producer", "--kv-offload-gib", "1"],
     "--kv-role and --kv-offload-gib cannot be combined: an engine has one KV connector"),
    (["generate", "-p", "hi", "--max-num-seqs", "0"],
     "Invalid value for '--max-num-seqs': must be in [1, 65536], got 0"),
    (["generate", "-p", "hi", "-tp", "0"],
     "Invalid value for '--tensor-parallel-size': must be an integer >= 1, got 0"),
    (["chat", "--temperature", "-1"], "Invalid value for '--temperature': must be non-negative, got -1.0"),
    (["chat", "--top-p", "2"], "Invalid value for '--top-p': must be in (0, 1], got 2.0"),
    (["chat", "--max-tokens", "0"], "Invalid value for '--max-tokens': must be an integer >= 1, got 0"),
    (["chat", "--block-size", "3"], "Invalid value for '--block-size': must be a power of two in [1, 1024], got 3"),
    (["serve", "--gpu-memory-utilization", "2"],
     "Invalid value for '--gpu-memory-utilization': must be in (0, 1], got 2.0"),
    (["serve", "--max-model-len", "0"], "Invalid value for '--max-model-len': must be >= 1, got 0"),
])
def test_a_bad_sampling_or_engine_value_is_a_usage_error_naming_the_option(tmp_path, capsys, monkeypatch, args,
                                                                           message):
    # These exited 1 naming SamplingParams' or EngineConfig's field ("top_p must be in (0, 1]"), where
    # click exits 2 for an option's bad value; checked before the model (missing here) is looked for.
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    command, *flags = args
    status, out, err = run_main(capsys, command, str(tmp_path / "no-model"), *flags)
    assert (status, out) == (2, "")
    assert err.splitlines() == [f"minillm {command}: error: {message} (try 'minillm {command} --help')"]


def test_a_bad_value_is_status_2_in_one_line_from_a_fresh_interpreter(tmp_path):
    result = minillm("serve", "someorg/not-fetched", "--download-dir", str(tmp_path), "--max-num-seqs", "0",
                     env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == ["minillm serve: error: Invalid value for '--max-num-seqs': must be in "
                                          "[1, 65536], got 0 (try 'minillm serve --help')"]
    assert not any(tmp_path.iterdir())                  # refused before anything was fetched


@pytest.mark.parametrize("args", [["generate", "-p", "hi", "--seed", "-1"], ["chat", "--seed", "-3"]])
def test_a_negative_sampling_seed_is_taken_as_vllm_takes_it(tmp_path, capsys, monkeypatch, args):
    # SamplingParams' seed is any 64-bit integer (-1: none), as vLLM's; serve's engine --seed is >= 0.
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    status, _, err = run_main(capsys, args[0], str(tmp_path / "no-model"), *args[1:])
    assert status == 1 and "no-model" in err


# ---- vLLM's names ---------------------------------------------------------------------------------

def test_version():
    from minillm import __version__
    result = minillm("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"minillm {__version__}"
    import importlib.metadata
    try:
        assert importlib.metadata.version("minillm") == __version__
    except importlib.metadata.PackageNotFoundError:
        pass


@needs_stories
def test_generate_flags_for_penalties_and_logprobs_match_llm_generate():
    from minillm import LLM, SamplingParams
    from minillm.cli import output_record

    result = minillm("generate", str(STORIES), "--device", "cpu", "-p", "Once upon a time", "--temperature", "0.9",
                     "--seed", "3", "--max-tokens", "12", "--repetition-penalty", "1.3", "--presence-penalty", "0.5",
                     "--frequency-penalty", "0.4", "--logprobs", "3", "--min-tokens", "12", "--json")
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    llm = LLM(str(STORIES), device="cpu")
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=12, repetition_penalty=1.3, presence_penalty=0.5,
                            frequency_penalty=0.4, logprobs=3, min_tokens=12)
    want = output_record(llm.generate(["Once upon a time"], params)[0], llm.get_tokenizer(), 3)
    assert got == want
    out = got["outputs"][0]
    assert len(out["logprobs"]) == len(out["token_ids"]) == 12
    for token_id, entry in zip(out["token_ids"], out["logprobs"]):
        assert entry["token_id"] == token_id and entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and entry["logprob"] <= tops[0]
    assert abs(out["cumulative_logprob"] - sum(e["logprob"] for e in out["logprobs"])) < 1e-4
    # The penalties change the greedy text, so the flags reach the sampler.
    plain = minillm("generate", str(STORIES), "--device", "cpu", "-p", "Once upon a time", "--temperature", "0",
                    "--max-tokens", "40")
    penalised = minillm("generate", str(STORIES), "--device", "cpu", "-p", "Once upon a time", "--temperature", "0",
                        "--max-tokens", "40", "--repetition-penalty", "1.5", "--logprobs", "0")
    assert plain.returncode == penalised.returncode == 0
    assert penalised.stdout.splitlines()[0] != plain.stdout.splitlines()[0]
    assert "logprobs (cumulative" in penalised.stdout


@needs_stories
def test_generate_logit_bias_flag_reaches_the_sampler_and_bad_pairs_name_the_option():
    result = minillm("generate", str(STORIES), "--device", "cpu", "-p", "Once upon a time", "--temperature", "0",
                     "--max-tokens", "4", "--logit-bias", "300=100", "--logit-bias", "2=-5", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["outputs"][0]["token_ids"] == [300] * 4
    for pair, message in (("x=1", "--logit-bias: expected ID=BIAS"), ("300", "--logit-bias: expected ID=BIAS"),
                          ("5=nan", "Invalid value for '--logit-bias': values must be numbers (not NaN)"),
                          ("600=1", "Invalid value for '--logit-bias': keys must be token ids in [0, 512)")):
        bad = minillm("generate", str(STORIES), "--device", "cpu", "-p", "Once", "--logit-bias", pair)
        assert bad.returncode != 0 and message in bad.stderr, (pair, bad.stderr)


@needs_stories
def test_generate_allowed_token_id_and_bad_word_flags_reach_the_sampler():
    def run(*flags: str) -> subprocess.CompletedProcess:
        return minillm("generate", str(STORIES), "--device", "cpu", "-p", "Once upon a time", "--temperature", "0",
                       "--max-tokens", "12", "--json", *flags)

    allowed = run("--allowed-token-id", "265", "--allowed-token-id", "376")
    assert allowed.returncode == 0, allowed.stderr
    assert set(json.loads(allowed.stdout)["outputs"][0]["token_ids"]) <= {265, 376}
    plain, banned = run(), run("--bad-word", "Lily", "--bad-word", "girl")
    assert plain.returncode == banned.returncode == 0, banned.stderr
    assert "Lily" in json.loads(plain.stdout)["outputs"][0]["text"]
    assert not {"Lily", "girl"} & set(json.loads(banned.stdout)["outputs"][0]["text"].replace(".", " ").split())
    bad = run("--allowed-token-id", "600")
    assert bad.returncode == 2, bad.stderr              # a usage error, though only the model can judge it
    assert "Invalid value for '--allowed-token-id': must be token ids in [0, 512)" in bad.stderr, bad.stderr


@needs_stories
def test_generate_prompt_logprobs_flag_scores_each_prompt_token_in_the_json_record():
    from minillm import LLM, SamplingParams

    result = minillm("generate", str(STORIES), "--device", "cpu", "-p", "Once upon a time", "--temperature", "0",
                     "--max-tokens", "2", "--prompt-logprobs", "2", "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    entries, ids = record["prompt_logprobs"], record["prompt_token_ids"]
    assert len(entries) == len(ids) and entries[0] is None
    want = LLM(str(STORIES), device="cpu").generate(
        ["Once upon a time"], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))[0].prompt_logprobs
    for i, entry in enumerate(entries[1:], start=1):
        assert entry["token_id"] == ids[i] and len(entry["top_logprobs"]) == 2
        assert entry["logprob"] == want[i][ids[i]]


# ---- minillm bench ---------------------------------------------------------------------------------

def test_bench_throughput_without_a_gpu_says_so_at_once():
    started = time.monotonic()
    result = minillm("bench", "throughput")
    assert time.monotonic() - started < 20          # it used to build 0.6B random weights first
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("minillm bench throughput: error: no CUDA GPU here")
    assert "--model" in line


@needs_stories
def test_bench_throughput_defaults_work_on_the_cpu():
    result = minillm("bench", "throughput", "--model", str(STORIES))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("workload: 16 requests") and lines[0].endswith("on cpu")
    assert re.match(r"minillm: +\d+ output tok/s", lines[1])
    assert any(line.startswith("ceiling:") for line in lines)


def test_bench_help_shows_every_default_like_the_rest_of_the_cli(capsys):
    helps = {}
    for name in ("throughput", "serving", "kernels", "serving_gaps"):
        status, text, _ = run_main(capsys, "bench", name, "--help")
        assert status == 0
        assert text.startswith(f"Usage: minillm bench {name} [OPTIONS]") and "\nOptions:\n" in text
        assert "  -h, --help  " in text and "Show this message and exit." in text
        helps[name] = " ".join(text.split())
    assert "<int>" in helps["throughput"] and "<path>" not in helps["throughput"]
    for shown in ("[default: auto]", "[default: 256]", "[default: 16384]", "default: 256 on a GPU, 16 on the CPU"):
        assert shown in helps["throughput"], shown
    for shown in ("[default: http://127.0.0.1:8000]", "[default: 100]", "[default: 128]", "[default: inf]"):
        assert shown in helps["serving"], shown
    result = minillm("bench", "serving", "--num-prompts", "x")
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line == ("minillm bench serving: error: argument --num-prompts: invalid int value: 'x' "
                    "(try 'minillm bench serving --help')")


def test_bench_serving_without_a_server_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]          # free now, so nothing answers there
    result = minillm("bench", "serving", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "2")
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line == (f"minillm bench serving: error: no server answers at http://127.0.0.1:{port} (ConnectError); "
                    f"start one with minillm serve MODEL, or point --base-url at it")


def test_wheel_installs_tui_and_benchmarks_inside_minillm(tmp_path):
    # A copy of the tracked tree: building writes build/ and *.egg-info next to the sources.
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    src = tmp_path / "src"
    for name in files.splitlines():
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / name, src / name)
    # Build with the setuptools at hand when it can make wheels (70.1+, or the wheel package), else
    # let pip fetch a build environment.
    import importlib.util
    import setuptools
    in_place = importlib.util.find_spec("wheel") is not None or tuple(
        int(part) for part in setuptools.__version__.split(".")[:2]) >= (70, 1)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-q",
                            "-w", str(tmp_path / "dist"), *(["--no-build-isolation"] if in_place else [])],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    import zipfile
    [wheel] = (tmp_path / "dist").glob("minillm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    dist_info = "-".join(wheel.name.split("-")[:2]) + ".dist-info"
    assert {n.split("/")[0] for n in names} == {"minillm", dist_info}   # no top-level tui or benchmarks
    for needed in ("minillm/tui/app.py", "minillm/tui/monitor.tcss", "minillm/tui/demo.jsonl.gz",
                   "minillm/benchmarks/throughput.py", "minillm/cuda_src/common.cuh"):
        assert needed in names


def test_the_test_extra_needs_no_torch_and_ci_still_runs_the_live_comparison():
    tomllib = pytest.importorskip("tomllib")   # Python 3.11+
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {extra: {re.split(r"[<>=!~\[; ]", req)[0].lower() for req in reqs} for extra, reqs in extras.items()}
    assert "torch" not in names["test"] and not any(n.startswith("nvidia") for n in names["test"])
    assert {"torch", "transformers"} <= names["parity"]
    ci = (REPO / ".ci" / "run").read_text()
    assert ci.index('"torch==2.13.0"') < ci.index('-e ".[test,parity]"')
    readme = (REPO / "README.md").read_text()
    assert 'pip install -e ".[test]" && python3 -m pytest -q' in readme


@needs_stories
def test_max_step_ms_calibrates_at_start_up_and_keeps_greedy_text():
    common = ("generate", str(STORIES), "--device", "cpu", "-p", "Once upon a time", "--temperature", "0",
              "--max-tokens", "16", "--max-num-seqs", "4")
    plain, budgeted = minillm(*common), minillm(*common, "--max-step-ms", "20")
    assert plain.returncode == 0 and budgeted.returncode == 0, budgeted.stderr
    assert budgeted.stdout == plain.stdout
    assert "step cost model fitted on" in budgeted.stderr and "step budget 20 ms" in budgeted.stderr
    assert "step cost model" not in plain.stderr
    bad = minillm(*common, "--max-step-ms", "0")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    [line] = bad.stderr.strip().splitlines()
    assert "Invalid value for '--max-step-ms': must be a finite number > 0" in line and bad.returncode == 2
    relative = minillm(*common, "--max-step-factor", "1.5")
    assert relative.returncode == 0, relative.stderr
    assert relative.stdout == plain.stdout and "step budget 1.5x the batch's decode step" in relative.stderr


@needs_stories
def test_revision_picks_the_hub_snapshot_the_model_loads_from(tmp_path):
    from conftest import put_in_hf_cache
    store = tmp_path / "hub"
    main = put_in_hf_cache(store, "someorg/stories", STORIES, revision="0123abcd")
    broken = main.parent / "fedc9876"
    shutil.copytree(main, broken, symlinks=True)
    (broken / "config.json").unlink()
    (broken / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    (main.parents[1] / "refs" / "v2").write_text("fedc9876")
    common = ("generate", "someorg/stories", "--download-dir", str(store), "--device", "cpu", "-p", "Once",
              "--temperature", "0", "--max-tokens", "8")
    env = {"HF_HUB_OFFLINE": "1"}
    plain, at_main = minillm(*common, env=env), minillm(*common, "--revision", "0123abcd", env=env)
    assert plain.returncode == 0 and at_main.returncode == 0, plain.stderr + at_main.stderr
    assert at_main.stdout == plain.stdout and plain.stdout.startswith("Once")
    tagged = minillm(*common, "--revision", "v2", env=env)
    assert tagged.returncode != 0 and "Traceback" not in tagged.stderr
    assert "unsupported architecture GPT2LMHeadModel" in tagged.stderr
    local = minillm("generate", str(STORIES), "--revision", "main", "--device", "cpu", "-p", "Once")
    assert local.returncode != 0 and "Traceback" not in local.stderr
    assert "revision 'main' names a version of a hub model" in local.stderr


@needs_stories
def test_async_scheduling_and_max_logprobs_flags_reach_the_engine():
    common = ("generate", str(STORIES), "--device", "cpu", "-p", "Once upon a time", "--temperature", "0",
              "--max-tokens", "12")
    plain = minillm(*common)
    overlapped = minillm(*common, "--async-scheduling")
    assert plain.returncode == 0 and overlapped.returncode == 0, overlapped.stderr
    assert overlapped.stdout == plain.stdout                # same greedy text, steps overlapped
    capped = minillm(*common, "--max-logprobs", "2", "--logprobs", "3")
    assert capped.returncode == 2 and "Traceback" not in capped.stderr
    assert "Invalid value for '--logprobs': must be at most --max-logprobs (2), got 3" in capped.stderr
    allowed = minillm(*common, "--max-logprobs", "2", "--logprobs", "2", "--json")
    assert allowed.returncode == 0, allowed.stderr
    [record] = [json.loads(line) for line in allowed.stdout.splitlines()]
    steps = record["outputs"][0]["logprobs"]
    assert len(steps) == 12 and all(len(step["top_logprobs"]) == 2 for step in steps)
    bad = minillm(*common, "--max-logprobs", "-1")
    assert bad.returncode == 2 and "Invalid value for '--max-logprobs': must be an integer in [0, 20]" in bad.stderr


# ---- prefill/decode disaggregation -----------------------------------------------------------------

@needs_stories
@pytest.mark.parametrize("args, message", [
    (("--kv-lease-s", "3"), "--kv-lease-s needs --kv-role or --kv-transfer-config"),
    (("--kv-transfer-config", "{"), "Invalid value for '--kv-transfer-config': is not valid JSON"),
    (("--kv-role", "producer", "--kv-transfer-config", '{"kv_role": "kv_consumer"}'), "disagree"),
    (("--kv-transfer-config", '{"kv_colour": 1}'), "Invalid value for '--kv-transfer-config': has unknown keys "
                                                    "kv_colour"),
    (("--kv-role", "consumer", "--kv-lease-s", "-1"),
     "Invalid value for '--kv-lease-s': must be a finite number > 0, got -1.0"),
])
def test_serve_kv_transfer_options_are_checked_before_loading(args, message):
    result = minillm("serve", str(STORIES), "--device", "cpu", "--port", "9", *args)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (("--prefill", "http://127.0.0.1:9"), "Missing option '--decode'"),
    (("--prefill", "ftp://x", "--decode", "http://127.0.0.1:9"), "Invalid value for '--prefill': not a server URL"),
])
def test_router_options_are_checked(args, message):
    result = minillm("router", *args)
    assert result.returncode != 0 and message in result.stderr, result.stderr


@needs_stories
def test_serve_refuses_a_port_it_cannot_listen_on_before_loading_the_model():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [(("--port", str(port)), f"cannot listen on 127.0.0.1:{port}"),
                 (("--host", "999.1.1.1", "--port", "0"), "cannot listen on 999.1.1.1:0"),
                 (("--port", "70000"), "--port"), (("--port", "-1"), "--port"),
                 (("--api-key", "", "--port", "0"), "Invalid value for '--api-key': must not be empty")]
        for args, needle in cases:
            result = minillm("serve", str(STORIES), "--device", "cpu", *args)
            assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and needle in lines[0], result.stderr   # one line: no model was loaded


@needs_stories
def test_prompts_that_are_not_text_fail_in_one_line(tmp_path):
    binary = tmp_path / "prompts.txt"
    binary.write_bytes(b"\xff\xfe not text\n")
    result = minillm("generate", str(STORIES), "--device", "cpu", "--prompts-file", str(binary))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [f"minillm: error: --prompts-file {binary} is not UTF-8 text: "
                                                  "invalid start byte at byte 0"]
    # A --prompt with bytes that are not UTF-8 arrives as lone surrogates: named, before the model loads.
    result = subprocess.run([sys.executable, "-m", "minillm.cli", "generate", str(STORIES), "--device", "cpu",
                             "--max-tokens", "2", "--prompt", b"a\xffb"], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == ["minillm: error: --prompt is not UTF-8 text: character 2 (byte 0xff)"]


def _strict_json(line: str):
    """json.loads that refuses NaN and Infinity, which JSON does not have (Python writes them)."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(line, parse_constant=refuse)


@needs_stories
def test_generate_says_why_a_request_failed_and_exits_1(tmp_path):
    # A constraint the engine cannot compile used to print the bare prompt and exit 0. This one (every
    # token id past stories260K's 512) only the model's tokenizer can judge, so it fails in the engine.
    grammar = tmp_path / "no_token.lark"
    grammar.write_text("start: <[^0-511]>\n")
    result = minillm("generate", str(STORIES), "--device", "cpu", "-p", "Once upon", "--grammar", str(grammar))
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "minillm generate: error: structured_outputs.grammar: no output satisfies" in result.stderr
    assert "Traceback" not in result.stderr


@needs_stories
def test_generate_json_is_strict_json_with_stop_reason():
    """A grammar rules tokens out, so their logprobs are -inf: --json writes -9999.0 as the server
    does; each completion carries its index and stop_reason (the stop string or token id)."""
    result = minillm("generate", str(STORIES), "--device", "cpu", "-p", "Tom said", "--regex", "yes|no",
                     "--logprobs", "3", "--prompt-logprobs", "2", "--temperature", "0", "--json")
    assert result.returncode == 0, result.stderr
    [out] = _strict_json(result.stdout)["outputs"]
    assert out["text"] in ("yes", "no") and out["stop_reason"] is None and out["index"] == 0
    tops = [t["logprob"] for e in out["logprobs"] for t in e["top_logprobs"]]
    assert -9999.0 in tops and all(lp >= -9999.0 for lp in tops)
    stopped = minillm("generate", str(STORIES), "--device", "cpu", "-p", "Once upon a time", "-p", "Lily",
                      "--temperature", "0", "--max-tokens", "30", "--stop", "girl", "--stop-token-id", "298",
                      "--n", "2", "--json")
    assert stopped.returncode == 0, stopped.stderr
    records = [_strict_json(line) for line in stopped.stdout.splitlines()]
    assert [[c["index"] for c in r["outputs"]] for r in records] == [[0, 1], [0, 1]]
    first = records[0]["outputs"][0]
    assert first["finish_reason"] == "stop" and first["stop_reason"] == 298 and first["token_ids"][-1] == 298


def test_serve_monitor_without_a_terminal_is_refused_before_anything_starts(stories_path):
    """Its frames would go into the log that stdout is: one line instead, exit 1."""
    result = minillm("serve", str(stories_path), "--device", "cpu", "--monitor", "--port", "0")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "minillm: error: --monitor draws the dashboard in this terminal, but stdout is not a terminal (a log would "
        "get its frames); leave it out, and run `minillm monitor URL` in a terminal"]


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "3601"])
def test_serve_refuses_a_graceful_shutdown_it_cannot_keep(value):
    result = minillm("serve", "./no/such/model", "--device", "cpu", "--timeout-graceful-shutdown", value)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("minillm serve: error: Invalid value for '--timeout-graceful-shutdown': must be in "
                           "(0, 3600] seconds"), line


def test_generate_values_only_the_model_can_judge_are_usage_errors_naming_the_option(tmp_path):
    # Checked once the model is loaded (its vocabulary, its context), they exited 1 naming the Python
    # field; a usage error like the values checked before the model loads.
    cases = ((("--max-model-len", "100000"), "Invalid value for '--max-model-len': 100000 exceeds the model's"),
             (("-p", "hello " * 700), "Invalid value for '--prompt': has 2102 tokens, which leaves no room"))
    for args, message in cases:
        prompt = () if "-p" in args else ("-p", "Once")
        bad = minillm("generate", str(STORIES), "--device", "cpu", "--max-tokens", "2", *prompt, *args)
        assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr, (args, bad.stderr)
    # A prompt from --prompts-file is not --prompt's: the engine's own message, status 1.
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello " * 700 + "\n")
    long_file = minillm("generate", str(STORIES), "--device", "cpu", "--prompts-file", str(prompts))
    assert long_file.returncode == 1 and "--prompt'" not in long_file.stderr, long_file.stderr
    assert "prompt has 2102 tokens, which leaves no room under max_model_len 512" in long_file.stderr
