"""What a user who reads only the README and each command's --help runs into: messages that name the
command they typed, options that cannot be combined refused by name, and vLLM's flags that behave as
vLLM's do."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import STORIES, needs_stories, run_main
from test_server_helpers import running_server

from minillm.benchmarks import serving as bench_serving
from minillm.benchmarks.cli_args import BenchError, BenchUsageError

REPO = Path(__file__).resolve().parents[1]


def minillm(*args: str, stdin: str | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter, as the console script runs it."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "minillm", *args], cwd=cwd, env=env, input=stdin,
                          capture_output=True, text=True, timeout=240)


# ---- run-batch ---------------------------------------------------------------------------------------

@needs_stories
def test_run_batch_names_itself_when_served_model_name_took_the_model(capsys, tmp_path):
    # the advice read "give the model first: minillm serve MODEL ...", a command the user had not typed
    batch = tmp_path / "in.jsonl"
    batch.write_text("")
    status, _, err = run_main(capsys, "run-batch", "-i", str(batch), "-o", str(tmp_path / "out.jsonl"),
                              "--device", "cpu", "--served-model-name", "a", str(STORIES))
    assert status == 1, err
    assert err.strip().endswith(f"give the model first: minillm run-batch {STORIES} --served-model-name ..."), err


@needs_stories
def test_run_batch_output_dash_is_stdout_as_input_dash_is_stdin(tmp_path):
    # -o - wrote a file named "-" in the working directory, and the summary said "wrote -"
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "m", "prompt": prompt, "max_tokens": 3, "temperature": 0}}
             for i, prompt in enumerate(["Once", "Tom had"])]
    result = minillm("run-batch", "-i", "-", "-o", "-", str(STORIES), "--device", "cpu", "--served-model-name", "m",
                     stdin="".join(json.dumps(line) + "\n" for line in lines), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(a["custom_id"], a["response"]["status_code"]) for a in answers] == [("c0", 200), ("c1", 200)]
    summary = result.stderr.rstrip().splitlines()[-1]
    assert "2 requests, 2 succeeded, 0 failed" in summary and summary.endswith("; wrote stdout"), summary
    assert list(tmp_path.iterdir()) == []


# ---- bench serving -------------------------------------------------------------------------------------

@pytest.mark.parametrize("option", ["--base-url", "--peer-base-url"])
def test_bench_serving_refuses_a_unix_socket_url_by_name(option):
    # taken by the URL check, then every request failed: "no server answers at unix:PATH (UnsupportedProtocol)"
    with pytest.raises(BenchUsageError) as info:
        bench_serving.parse_args([option, "unix:/tmp/minillm.sock"])
    assert info.value.message.startswith(f"{option} unix:/tmp/minillm.sock: the benchmark's clients connect "
                                         "over TCP"), info.value.message


def test_bench_serving_sends_openai_api_key_as_vllms_does(monkeypatch):
    # vLLM's bench serve sends $OPENAI_API_KEY; it was left out here and a keyed server answered 401
    monkeypatch.setenv("OPENAI_API_KEY", "k2")
    assert bench_serving.parse_args([]).api_key == "k2"
    assert bench_serving.parse_args(["--api-key", "k1"]).api_key == "k1"      # the option wins
    monkeypatch.setenv("OPENAI_API_KEY", "a\nb")
    with pytest.raises(BenchUsageError, match=r"^\$OPENAI_API_KEY holds a control character"):
        bench_serving.parse_args([])
    monkeypatch.setenv("OPENAI_API_KEY", "")
    assert bench_serving.parse_args([]).api_key is None


@needs_stories
def test_bench_serving_against_a_keyed_server(monkeypatch, capsys):
    workload = ["--num-prompts", "2", "--input-len", "4", "--output-len", "2"]
    monkeypatch.setenv("OPENAI_API_KEY", "k2")
    with running_server(STORIES, api_key=("k1", "k2")) as (url, _):
        assert bench_serving.main(["--base-url", url, *workload]) == 0
        assert re.search(r"Successful requests:\s+2\n", capsys.readouterr().out)
        with pytest.raises(BenchError, match=r"refused the request \(401\); the key given \(--api-key, else "
                                             r"\$OPENAI_API_KEY\) is not one of its keys"):
            bench_serving.main(["--base-url", url, "--api-key", "k3", *workload])
        monkeypatch.delenv("OPENAI_API_KEY")
        with pytest.raises(BenchError, match=r"\(401\); give its key with --api-key or \$OPENAI_API_KEY"):
            bench_serving.main(["--base-url", url, *workload])


@pytest.mark.parametrize("given", [["--prompt", "Once upon a time"], ["--prompts-file", "FILE"]])
def test_bench_serving_traffic_line_does_not_give_given_prompts_the_random_length(tmp_path, given):
    # "Traffic: ..., 2 prompts, input 128 / output 4 tokens" where the prompts were 5 tokens
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n")
    args = bench_serving.parse_args([*(str(prompts) if a == "FILE" else a for a in given), "--output-len", "4"])
    assert bench_serving.workload_shape(args) == "given by --prompt / --prompts-file (cycled), output 4 tokens"
    assert bench_serving.workload_shape(bench_serving.parse_args(["--output-len", "4"])) == \
        "input 128 / output 4 tokens"


@pytest.mark.parametrize("args, said", [
    (["--step-trace-interval", "0.2"], "--step-trace-interval sets --step-trace's polls; give --step-trace too"),
    (["--offline-device", "cpu"], "--offline-device is the backend of --offline-model's run; give --offline-model too"),
    (["--offline-arg", "dtype=float32"], "--offline-arg shapes --offline-model's engine; give --offline-model too"),
    (["--prompt", "Once", "--input-len", "5"], "--input-len shapes random prompts, and --prompt / --prompts-file give "
                                               "the prompts; leave one out"),
    (["--prompt", "Once", "--vocab-range", "3", "9"], "--vocab-range shapes random prompts, and --prompt / "
                                                      "--prompts-file give the prompts; leave one out"),
    (["--dataset-name", "sharegpt", "--dataset-path", "d.json", "--vocab-range", "3", "9"],
     "--vocab-range is read by --dataset-name random, not sharegpt"),
])
def test_bench_serving_refuses_an_option_it_would_pass_over(args, said):
    # each was taken and never read: the run measured what the option did not ask for
    with pytest.raises(BenchUsageError) as info:
        bench_serving.parse_args(args)
    assert info.value.message.startswith(said), info.value.message


def test_bench_serving_takes_those_options_with_what_reads_them(tmp_path):
    args = bench_serving.parse_args(["--step-trace", "--result-file", str(tmp_path / "r.json"),
                                     "--step-trace-interval", "0.2", "--offline-model", "m", "--offline-device", "cpu",
                                     "--offline-arg", "max_num_seqs=4", "--input-len", "9", "--vocab-range", "3", "9"])
    assert (args.step_trace_interval, args.input_len, list(args.vocab_range)) == (0.2, 9, [3, 9])
    assert args.offline_engine_args == {"device": "cpu", "max_num_seqs": 4}


@needs_stories
def test_bench_serving_takes_vllms_served_model_name(tmp_path, capsys):
    # `vllm bench serve --model PATH --served-model-name NAME` was refused: unrecognized arguments
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["Once upon a time", "Tom had a ball"]))
    with running_server(STORIES, served_model_name="org/stories") as (url, _):
        workload = ["--base-url", url, "--model", str(STORIES), "--num-prompts", "2", "--custom-output-len", "3",
                    "--dataset-name", "custom", "--dataset-path", str(data), "--skip-chat-template"]
        assert bench_serving.main([*workload, "--served-model-name", "org/stories"]) == 0
        assert re.search(r"Successful requests:\s+2\n", capsys.readouterr().out)
        assert bench_serving.main(workload) == 1          # the path is not the name it is served under
        assert "does not exist" in capsys.readouterr().out


# ---- monitor -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, said", [
    (["--demo", "http://127.0.0.1:8000"], "URL and --demo"),
    (["--demo", "--url", "http://127.0.0.1:8000"], "--url and --demo"),
    (["--demo", "--api-key", "k"], "--api-key and --demo"),
    (["--replay", "REC", "unix:/tmp/minillm.sock"], "URL and --replay"),
    (["--replay", "REC", "--api-key", "k"], "--api-key and --replay"),
])
def test_monitor_refuses_a_server_named_beside_a_recording(capsys, monkeypatch, tmp_path, args, said):
    # the server was passed over unread: the recording played as if the user watched that server
    monkeypatch.setattr("minillm.tui.app.run_monitor", lambda *a, **k: pytest.fail("the monitor ran"))
    recording = tmp_path / "rec.jsonl"
    recording.write_text("")
    status, _, err = run_main(capsys, "monitor", *[str(recording) if a == "REC" else a for a in args])
    assert status == 2, err
    assert err.splitlines() == [f"minillm monitor: error: {said} cannot be combined: a recording is played instead "
                                "of watching a server (give one or the other) (try 'minillm monitor --help')"]


# ---- --speculative-config ------------------------------------------------------------------------------

@pytest.mark.parametrize("config, said", [
    ({"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3-Instruct-8B"}, "model must be 'ngram' (draft models are not "
                                                                       "supported), got 'yuhuili/EAGLE-LLaMA3-Instruct-8B'"),
    ({"method": "suffix"}, "method must be 'ngram', got 'suffix'"),
    ({"method": "ngram"}, "num_speculative_tokens must be given in speculative_config"),
    ({}, "num_speculative_tokens must be given in speculative_config"),
])
def test_a_speculative_method_not_taken_is_named_before_a_missing_count(config, said):
    # vLLM derives an EAGLE model's count from its config: such a config was told to add
    # num_speculative_tokens, and then, with it, that the method is not taken
    from minillm.spec_decode.config import SpeculativeConfig
    with pytest.raises(ValueError) as info:
        SpeculativeConfig.from_dict(config)
    assert str(info.value) == said


@needs_stories
def test_generate_names_the_speculative_method_it_does_not_take(capsys):
    status, _, err = run_main(capsys, "generate", str(STORIES), "--device", "cpu", "-p", "x",
                              "--speculative-config", '{"method": "eagle3", "model": "org/draft"}')
    assert status == 2 and "'--speculative-config': model must be 'ngram'" in err, err


# ---- bench serving_gaps --------------------------------------------------------------------------------

def _stream(start, itls):
    """A --save-detailed request entry, its first token 5 ms after START."""
    return {"client": 0, "start_ms": start, "end_ms": start + 5.0 + sum(itls) + 1, "ttft_ms": 5.0,
            "itl_ms": list(itls), "output_tokens": len(itls) + 1, "error": None}


@pytest.mark.parametrize("first_step_ms, said", [
    (-60_000.0, "engine: 3 steps, interval median 5.0 max 5.0 ms"),  # a step of the idle engine, a minute before
    (None, "engine: 3 steps, interval median 5.0 max 5.0 ms"),       # no step before the run traced
])
def test_serving_gaps_does_not_count_the_idle_time_before_the_run_as_a_step_interval(first_step_ms, said):
    # a snapshot's last steps reach back before the run: the first step's "interval" was the engine's idle
    # minute, printed as "interval ... max 60000.0 ms" in a window a few ms long
    from minillm.benchmarks import serving_gaps
    requests = [_stream(0.0, [5.0] * 8 + [20.0] + [5.0] * 8) for _ in range(2)]
    steps = [{"step": 10 + k, "t_ms": 46.0 + 5.0 * k, "num_prefill_tokens": 0, "num_decode_tokens": 2,
              "device_step_s": None} for k in range(3)]
    if first_step_ms is not None:
        steps.insert(0, {"step": 9, "t_ms": first_step_ms, "num_prefill_tokens": 4, "num_decode_tokens": 0,
                         "device_step_s": None})
    report = serving_gaps.analyze({"requests": requests, "steps": steps})
    text = serving_gaps.format_report(report, steps)
    assert f"{said}, 0 prompt tokens" in text, text


def test_serving_gaps_says_when_no_interval_of_a_window_was_traced(recwarn):
    # a window whose one step follows only a step from before the run printed "interval median nan max nan"
    # under numpy's All-NaN RuntimeWarning
    from minillm.benchmarks import serving_gaps
    requests = [_stream(0.0, [5.0] * 8 + [20.0] + [5.0] * 8) for _ in range(2)]
    steps = [{"step": 9, "t_ms": -5000.0, "num_prefill_tokens": 0, "num_decode_tokens": 2, "device_step_s": None},
             {"step": 10, "t_ms": 60.0, "num_prefill_tokens": 0, "num_decode_tokens": 2, "device_step_s": None}]
    text = serving_gaps.format_report(serving_gaps.analyze({"requests": requests, "steps": steps}), steps)
    assert "engine: 1 steps, no interval traced, 0 prompt tokens" in text, text
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


# ---- chat --url --chat-template ------------------------------------------------------------------------

TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m.content }} {% endfor %}"


@needs_stories
@pytest.mark.parametrize("trusted", [False, True])
def test_chat_help_says_a_template_sent_to_a_server_needs_its_trust(capsys, trusted):
    # --help said only that the template replaces the model's own; through --url a server refuses it
    # unless started with --trust-request-chat-template
    from minillm.server.app import ServerOptions
    status, text, _ = run_main(capsys, "chat", "--help")
    assert status == 0
    assert "With --url it goes with each request, which the server renders only when started with " \
           "--trust-request-chat-template" in " ".join(text.split())
    with running_server(STORIES, options=ServerOptions(trust_request_chat_template=trusted)) as (url, _):
        status, out, err = run_main(capsys, "chat", "--url", url, "--chat-template", TEMPLATE, "-q", "Tom had a ball.",
                                    "--temperature", "0", "--max-tokens", "4")
    if trusted:
        assert status == 0 and out.strip(), err
    else:
        assert status == 1 and "--trust-request-chat-template" in err, err


# ---- bench throughput ----------------------------------------------------------------------------------

@needs_stories
def test_bench_throughput_kernel_profile_without_a_gpu_is_a_usage_error(capsys, monkeypatch):
    # --device auto on a machine without a GPU ran the workload, then torch.profiler's AssertionError
    # ("No activities specified for the profiler") ended it in a traceback
    monkeypatch.setattr("minillm.engine.choose_backend", lambda device: "numpy")
    status, out, err = run_main(capsys, "bench", "throughput", "--model", str(STORIES), "--num-seqs", "2",
                                "--max-input-len", "8", "--max-output-len", "8", "--kernel-profile")
    assert (status, out) == (2, ""), err
    assert err.splitlines() == ["minillm bench throughput: error: --kernel-profile: records CUDA kernels, and there is "
                                "no CUDA GPU here (leave --kernel-profile out) (try 'minillm bench throughput --help')"]


def test_bench_throughput_peer_num_seqs_needs_a_peer():
    # it was passed over unread
    from minillm.benchmarks import throughput
    with pytest.raises(BenchUsageError, match=r"^--peer-num-seqs sizes the workload of --peer; give --peer too"):
        throughput.parse_args(["--model", str(STORIES), "--peer-num-seqs", "1"])


# ---- bench pd_disagg -----------------------------------------------------------------------------------

@pytest.mark.parametrize("args", [["--dtype", "bfloat16"], ["--equality-dtype", "float16"], ["--dtype", "half"]])
def test_pd_disagg_on_the_cpu_refuses_a_dtype_it_would_not_run(args):
    # the CPU's servers ran float32 whatever --dtype or --equality-dtype said, and the report said float32
    from minillm.benchmarks import pd_disagg
    with pytest.raises(BenchUsageError) as info:
        pd_disagg.parse_args(["--device", "cpu", "--small", *args])
    assert info.value.message == f"{args[0]} {args[1]}: the CPU's servers run float32 (leave {args[0]} out, or run " \
                                 "with --device cuda)"


def test_pd_disagg_dtypes_default_per_device_and_take_the_servers_names():
    from minillm.benchmarks import pd_disagg
    cpu = pd_disagg.parse_args(["--device", "cpu", "--small", "--dtype", "float"])
    assert (cpu.equality_dtype, cpu.dtype) == ("float32", "float")
    gpu = pd_disagg.parse_args(["--device", "cuda"])
    assert (gpu.equality_dtype, gpu.dtype) == ("float32", "bfloat16")
    with pytest.raises(BenchUsageError, match="argument --equality-dtype: invalid choice: 'fp32'"):
        pd_disagg.parse_args(["--device", "cuda", "--equality-dtype", "fp32"])  # each server failed to start on it


@pytest.mark.parametrize("model, said", [
    ("DIR", "--model DIR: no config.json there (give a model directory)"),
    ("DIR/none", "--model DIR/none: no such directory"),
    ("STORIES/config.json", "--model STORIES/config.json: a file, not a model directory"),
    ("STORIES", "--max-model-len 1024 is past --model STORIES's max_position_embeddings 512; lower it"),
])
def test_pd_disagg_checks_its_model_before_starting_a_server(monkeypatch, tmp_path, model, said):
    # a directory without config.json ended in "[Errno 2] No such file or directory: '.../config.json'";
    # stories260K under --small's --max-model-len 1024 failed in the first server's log, 'minillm serve: error'
    from minillm.benchmarks import pd_disagg
    if "STORIES" in model and not STORIES.is_dir():
        pytest.skip("stories260K is not here")
    monkeypatch.setattr(pd_disagg, "Process", lambda *a, **k: pytest.fail("a server started"))
    model, said = (x.replace("DIR", str(tmp_path)).replace("STORIES", str(STORIES)) for x in (model, said))
    with pytest.raises(BenchError) as info:
        pd_disagg.main(["--device", "cpu", "--small", "--phases", "equality", "--model", model])
    assert str(info.value) == said


@pytest.mark.parametrize("args, said", [
    (["--phases", "equality", "--users", "3"], "--users only shapes the mixed phase, which --phases equality leaves out"),
    (["--phases", "equality", "--dtype", "float32", "--duration", "5"],
     "--dtype and --duration only shape the mixed phase, which --phases equality leaves out"),
    (["--phases", "mixed", "--num-equality", "3", "--equality-prompt", "9", "--equality-output", "2"],
     "--num-equality, --equality-prompt and --equality-output only shape the equality phase, which --phases mixed "
     "leaves out"),
])
def test_pd_disagg_refuses_the_options_of_a_phase_it_does_not_run(args, said):
    # they were passed over unread
    from minillm.benchmarks import pd_disagg
    with pytest.raises(BenchUsageError) as info:
        pd_disagg.parse_args(["--device", "cpu", "--small", *args])
    assert info.value.message == said


def test_pd_disagg_options_of_both_phases_run_with_both():
    from minillm.benchmarks import pd_disagg
    args = pd_disagg.parse_args(["--device", "cpu", "--small", "--users", "3", "--num-equality", "2",
                                 "--single-budget", "64"])
    assert (args.users, args.num_equality, args.single_budget, args.phases) == (3, 2, 64, ["equality", "mixed"])
    # the decode server's token budget is --single-budget too: it shapes the equality phase as well
    assert pd_disagg.parse_args(["--device", "cpu", "--phases", "equality", "--single-budget", "64"]).single_budget == 64


def test_pd_disagg_help_says_single_budget_is_the_decode_servers_too(capsys):
    # the help named the single server's steps only, while the decode server of both phases runs under it
    status, out, _ = run_main(capsys, "bench", "pd_disagg", "--help")
    assert status == 0
    assert "Token budget of the decode server's steps and the single server's (its chunked prefill)." in \
        " ".join(out.split())


# ---- generate ------------------------------------------------------------------------------------------

@needs_stories
def test_generate_prints_prompt_logprobs_without_json(capsys):
    # --prompt-logprobs without --json computed the whole prompt's logprobs (no cached prefix) and printed none
    status, out, err = run_main(capsys, "generate", str(STORIES), "--device", "cpu", "-p", "Once upon",
                                "--max-tokens", "2", "--temperature", "0", "--prompt-logprobs", "1")
    assert status == 0, err
    lines = out.splitlines()
    assert lines[1] == "  prompt logprobs (the first token has none):", out
    assert [line.strip().partition("'   ")[0] + "'" for line in lines[2:]] == ["' Once'", "' upon'"], out
    assert all("   top: " in line for line in lines[2:]), out


def test_bench_serving_gaps_usage_line_names_its_result_file(capsys):
    # "Usage: minillm bench serving_gaps [OPTIONS]" left out the file it requires
    status, out, _ = run_main(capsys, "bench", "serving_gaps", "--help")
    assert status == 0 and out.splitlines()[0] == "Usage: minillm bench serving_gaps [OPTIONS] result_file"
    status, out, _ = run_main(capsys, "bench", "serving", "--help")
    assert status == 0 and out.splitlines()[0] == "Usage: minillm bench serving [OPTIONS]"


@needs_stories
def test_generate_refuses_two_biases_for_one_token(capsys):
    # the last was kept and the first dropped unsaid: --logit-bias 403=-inf --logit-bias 403=5 favoured the token
    status, out, err = run_main(capsys, "generate", str(STORIES), "--device", "cpu", "-p", "Once", "--logit-bias",
                                "403=-inf", "--logit-bias", "403=5")
    assert (status, out) == (2, ""), err
    assert err.splitlines() == ["minillm generate: error: --logit-bias: token 403 is given two biases (-inf and 5); "
                                "give it one (try 'minillm generate --help')"]
    status, out, err = run_main(capsys, "generate", str(STORIES), "--device", "cpu", "-p", "Once", "--max-tokens", "2",
                                "--logit-bias", "403=5", "--logit-bias", "0403=5.0")     # the same bias twice
    assert status == 0 and out.strip(), err


def test_monitor_demo_takes_an_empty_api_key_as_none(capsys, monkeypatch):
    # --api-key "" (a script's unset variable) is no key to the monitor's client: beside --demo it names no server
    ran = []
    monkeypatch.setattr("minillm.tui.app.run_monitor", lambda *a, **k: ran.append(k) or 0)
    monkeypatch.setattr("minillm.cli.stream_not_a_terminal", lambda: None)
    status, _, err = run_main(capsys, "monitor", "--demo", "--api-key", "")
    assert (status, len(ran)) == (0, 1), err
