"""minillm bench serving driven with vLLM's `vllm bench serve` command lines: --dataset-name random,
--random-input-len / --random-output-len, --backend, and --save-result with --result-dir /
--result-filename (the directory made when missing, the file named as vLLM names it)."""
from __future__ import annotations

import json
import re

import pytest
from test_server_helpers import running_server

from minillm.benchmarks import serving as bench
from minillm.benchmarks.cli_args import BenchUsageError


@pytest.fixture(scope="module")
def server(stories_path):
    with running_server(stories_path, served_model_name="org/stories") as (url, engine):
        yield url, engine


def test_a_vllm_bench_serve_command_line_runs_and_saves_into_a_new_result_dir(server, tmp_path, capsys):
    url, _ = server
    result_dir = tmp_path / "results" / "run 1"          # neither exists yet: vLLM makes it
    status = bench.main(["--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
                         "--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "4",
                         "--num-prompts", "3", "--max-concurrency", "2", "--request-rate", "inf",
                         "--save-result", "--result-dir", str(result_dir), "--result-filename", "r.json"])
    assert status == 0
    printed = capsys.readouterr().out
    result = json.loads((result_dir / "r.json").read_text())["results"][0]
    assert result["completed"] == 3 and result["total_input_tokens"] == 3 * 8 and result["total_output_tokens"] == 3 * 4
    assert re.search(r"Total generated tokens:\s+12\n", printed), printed


def test_save_result_names_the_file_as_vllm_does(server, tmp_path, monkeypatch):
    url, _ = server
    monkeypatch.chdir(tmp_path)                           # no --result-dir: the current directory
    status = bench.main(["--base-url", url, "--random-input-len", "4", "--random-output-len", "2",
                         "--num-prompts", "2", "--max-concurrency", "1", "--save-result"])
    assert status == 0
    [saved] = list(tmp_path.iterdir())
    # {backend}-{request_rate}qps-concurrency{N}-{the model id's last part}-{YYYYMMDD-HHMMSS}.json
    assert re.fullmatch(r"openai-infqps-concurrency1-stories-\d{8}-\d{6}\.json", saved.name), saved.name
    assert json.loads(saved.read_text())["results"][0]["completed"] == 2


@pytest.mark.parametrize("args, message", [
    (["--result-dir", "x"], "--result-dir needs --save-result"),
    (["--result-filename", "x.json"], "--result-filename needs --save-result"),
    (["--save-result", "--result-file", "a.json"], "--save-result and --result-file"),
    (["--dataset-name", "sonnet"], "argument --dataset-name: invalid choice: 'sonnet'"),
    (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "--backend openai-chat sends to /v1/chat/completions"),
])
def test_vllm_result_options_that_cannot_work_together_are_usage_errors(args, message):
    with pytest.raises(BenchUsageError, match=re.escape(message)):
        bench.parse_args(args)


def test_backend_openai_chat_sends_to_the_chat_endpoint():
    assert bench.parse_args(["--backend", "openai-chat"]).endpoint == "/v1/chat/completions"
    assert bench.parse_args(["--random-input-len", "7"]).input_len == 7


def test_a_result_dir_that_cannot_be_made_is_named_before_the_run(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(bench.BenchError, match=r"--result-dir .*file/sub"):
        bench.main(["--save-result", "--result-dir", str(blocker / "sub"), "--model", "m",
                    "--base-url", "http://127.0.0.1:9"])


def test_the_saved_requests_give_back_the_printed_latencies(server, tmp_path):
    # --save-detailed kept each request's TTFT and ITLs but not its E2EL: the printed E2EL and TPOT
    # could not be computed again from the saved requests (end_ms - start_ms is not the same span).
    url, _ = server
    out = tmp_path / "r.json"
    status = bench.main(["--base-url", url, "--random-input-len", "4", "--random-output-len", "5",
                         "--num-prompts", "4", "--max-concurrency", "2", "--result-file", str(out), "--save-detailed"])
    assert status == 0
    result = json.loads(out.read_text())["results"][0]
    requests = result["requests"]
    e2el = [r["e2el_ms"] for r in requests]
    assert sum(e2el) / len(e2el) == pytest.approx(result["e2el_ms"]["mean"])
    tpot = [(r["e2el_ms"] - r["ttft_ms"]) / (r["output_tokens"] - 1) for r in requests]
    assert sum(tpot) / len(tpot) == pytest.approx(result["tpot_ms"]["mean"])
    ttft = [r["ttft_ms"] for r in requests]
    assert sum(ttft) / len(ttft) == pytest.approx(result["ttft_ms"]["mean"])


def test_a_run_where_every_request_failed_prints_no_cpu_per_token():
    # With no output token the client's CPU was divided by 1 token: "1362.0 us" per token that never came.
    failed = [bench.RequestResult(ok=False, error="HTTP 500: boom") for _ in range(3)]
    summary = bench.summarize("http://127.0.0.1:9", 3, failed, 0.01, client_cpu_s=0.0014)
    table = bench.format_results([summary], bench.parse_args(["--num-prompts", "3"]))
    [row] = [line for line in table.splitlines() if line.startswith("Client CPU per output token")]
    assert row.split()[-1] == "-", row
    assert "Failed requests:" in table and "error (http://127.0.0.1:9): HTTP 500: boom" in table


def test_a_server_that_takes_the_connection_and_never_answers_is_named_soon(monkeypatch):
    # The model list was asked with the requests' --timeout (600 s by default): a stuck server held the
    # benchmark ten minutes without a word before its first request.
    import socket
    import threading
    monkeypatch.setattr(bench, "MODEL_LIST_TIMEOUT_S", 0.5, raising=False)
    outcome = {}

    def run(url):
        try:
            bench.main(["--base-url", url, "--num-prompts", "1"])
        except bench.BenchError as exc:
            outcome["error"] = str(exc)

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)                   # connections complete in the kernel; nobody answers
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        client = threading.Thread(target=run, args=(url,), daemon=True)
        client.start()
        client.join(30)
    assert not client.is_alive(), "still waiting for the model list"
    assert outcome["error"].startswith(f"no answer from {url}/v1/models within 0.5 s"), outcome


def test_bench_serve_is_vllms_name_for_bench_serving(capsys):
    # `vllm bench serve ...` retyped as `minillm bench serve ...` was "No such command 'serve'".
    from test_cli import run_main
    status, out, err = run_main(capsys, "bench", "serve", "--num-prompts", "0")
    assert status == 2
    assert err.strip() == ("minillm bench serving: error: --num-prompts, --input-len and --output-len must be >= 1 "
                           "(try 'minillm bench serving --help')")
