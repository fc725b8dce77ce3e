"""What the README says of bench serving's datasets, run-batch's URLs, the structured-outputs config and
bench latency's prefix caching holds: a dataset is counted with the served model's own tokenizer when
the server lists its path, a batch whose input or output URL fails ends in one line, and the
refusals and help name what is taken."""
from __future__ import annotations

import http.server
import json
import threading

import pytest
from test_server_helpers import running_server

from minillm import LLM
from minillm import run_batch
from minillm.benchmarks import datasets
from minillm.benchmarks import latency
from minillm.benchmarks import serving as bench
from minillm.benchmarks.cli_args import BenchUsageError


# ---- bench serving: the tokenizer a dataset is counted with -------------------------------------------

def test_a_dataset_is_counted_with_the_served_models_tokenizer_without_tokenizer(stories_path, tmp_path,
                                                                                  capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Once upon a time", "Tom had a ball")))
    with running_server(stories_path, served_model_name="stories") as (url, _engine):
        argv = ["--base-url", url, "--dataset-name", "custom", "--dataset-path", str(data), "--num-prompts", "2",
                "--custom-output-len", "2", "--skip-chat-template", "--disable-tqdm"]
        assert bench.main(argv) == 0, capsys.readouterr().err
    assert f"2 prompts, dataset custom {data}" in capsys.readouterr().out


@pytest.mark.parametrize("root, expected", [
    (None, ["name"]), ("name", ["name"]),
    ("HERE", ["HERE", "name"]),                      # the server's model directory, on this machine: first
    ("org/hub-model", ["name", "org/hub-model"]),    # elsewhere: the name first, then the root as a hub id
])
def test_a_served_models_tokenizer_is_sought_at_its_root_first_when_that_is_here(root, expected, tmp_path):
    here = str(tmp_path)
    sources = bench._tokenizer_sources("name", here if root == "HERE" else root)
    assert sources == [here if s == "HERE" else s for s in expected]


def test_no_tokenizer_for_the_served_model_names_it_and_asks_for_tokenizer(tmp_path):
    with pytest.raises(BenchUsageError) as info:
        datasets.first_tokenizer([str(tmp_path / "a"), str(tmp_path / "b")], "the server's model x (give --tokenizer)")
    assert info.value.message.startswith("the server's model x (give --tokenizer): no tokenizer to count")
    assert str(tmp_path / "a") in info.value.message and "\n" not in info.value.message


# ---- run-batch: an input or output URL that fails ----------------------------------------------------

class _Files(http.server.BaseHTTPRequestHandler):
    def do_GET(self):           # noqa: N802 (http.server's name)
        self.send_error(404, "File not found")

    def do_PUT(self):           # noqa: N802
        self.send_error(403, "Forbidden")

    def log_message(self, *args):
        pass


@pytest.fixture
def files_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _closed_port_url() -> str:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Files)
    port = server.server_address[1]
    server.server_close()
    return f"http://127.0.0.1:{port}/out.jsonl"


def test_an_input_url_that_answers_an_error_is_one_line_naming_the_status(files_url):
    with pytest.raises(ValueError) as info:
        run_batch.read_input(f"{files_url}/in.jsonl")
    assert str(info.value) == f"--input-file {files_url}/in.jsonl: the download got HTTP 404 File not found"


def test_an_output_url_that_cannot_be_reached_is_an_oserror_of_one_line(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text("{}\n")
    url = _closed_port_url()
    with pytest.raises(OSError) as info:
        run_batch.upload(url, str(path))
    assert str(info.value).startswith(f"--output-file {url}: the upload failed: ConnectError: ")
    assert "\n" not in str(info.value)


def test_an_output_url_that_refuses_the_upload_names_the_status(files_url, tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text("{}\n")
    with pytest.raises(OSError, match="the upload got HTTP 403"):
        run_batch.upload(f"{files_url}/out.jsonl", str(path))


def test_a_failed_upload_keeps_the_batchs_answers_and_names_their_file(stories_path, tmp_path):
    from minillm.config import EngineConfig
    from minillm.server.app import ServerOptions
    from minillm.server.async_engine import start_async_engine
    body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}
    lines = [json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body})]
    url = _closed_port_url()
    engine = start_async_engine(EngineConfig(model=str(stories_path), device="cpu", max_model_len=64), "thread")
    try:
        with pytest.raises(OSError) as info:
            run_batch.write_outputs(engine, ServerOptions(served_model_name=("stories",)), lines,
                                    run_batch.BatchFiles(str(tmp_path / "in.jsonl"), url, str(tmp_path)))
    finally:
        engine.shutdown()
    [kept] = list(tmp_path.glob("tmp_batch_output_*.jsonl"))
    assert str(info.value).endswith(f"; the answers are kept in {kept}")
    [answer] = [json.loads(text) for text in kept.read_text(encoding="utf-8").removesuffix("\n").split("\n")]
    assert answer["custom_id"] == "a" and answer["response"]["body"]["choices"][0]["text"] == ", there was"


# ---- help and refusals that name what is taken -------------------------------------------------------

def test_llm_takes_a_structured_outputs_config_and_names_a_key_it_does_not_take(stories_path):
    with LLM(str(stories_path), device="cpu", max_model_len=32,
             structured_outputs_config={"backend": "guidance"}) as llm:
        assert llm.llm_engine.config.structured_outputs_config.backend == "guidance"
    with pytest.raises(ValueError, match="structured_outputs_config.backend 'outlines' is not supported"):
        LLM(str(stories_path), device="cpu", structured_outputs_config={"backend": "outlines"})


def test_serve_help_names_the_structured_outputs_configs_keys_it_takes():
    from typer.testing import CliRunner

    from minillm.cli import app
    result = CliRunner().invoke(app, ["serve", "--help"], terminal_width=200)
    text = " ".join(result.output.split())
    start = text.index("--structured-outputs-config JSON")
    entry = text[start:text.index("--enable-server-load-tracking", start)]
    for key in ("backend auto", "guidance", "disable_additional_properties", "disable_fallback",
                "disable_any_whitespace true", "reasoning_parser"):
        assert key in entry, entry


def test_bench_latency_help_says_prefix_caching_is_off_unless_given(capsys):
    with pytest.raises(SystemExit):
        latency.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    entry = text[text.index("--enable-prefix-caching, --no-enable-prefix-caching"):]
    assert entry[:entry.index("--enforce-eager")].count("Off here unless given") == 1
    assert latency.parse_args([]).enable_prefix_caching is False
