"""minillm run-batch: an OpenAI batch file answered line by line as minillm serve answers, in input order."""
import http.server
import json
import subprocess
import sys
import threading

import httpx
import pytest

from minillm.run_batch import read_input, upload
from minillm.server.app import ServerOptions
from test_abuse34_parsers import TEMPLATE, TOOLS, install_script
from test_server_helpers import CHAT_TEMPLATE, running_server

CHAT = {"model": "stories", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}
COMPLETION = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "n": 2}
BAD_TEMPERATURE = {"model": "stories", "prompt": "x", "max_tokens": 4, "temperature": -1}


def line(custom_id, url, body, method="POST") -> str:
    """One batch input line."""
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body}, ensure_ascii=False)


LINES = [
    line("chat-1", "/v1/chat/completions", CHAT),
    line("cmpl-n2", "/v1/completions", COMPLETION),
    "{not json",
    "",                                                    # blank lines are skipped, as vLLM skips them
    line("bad-temperature", "/v1/completions", BAD_TEMPERATURE),
    line("embed", "/v1/embeddings", {"model": "stories", "input": "x"}),
    line("streamed", "/v1/completions", {**COMPLETION, "n": 1, "stream": True}),
    line("get", "/v1/completions", COMPLETION, method="GET"),
    json.dumps({"method": "POST", "url": "/v1/completions", "body": COMPLETION}),
    line("ünïcødé ✓", "/v1/chat/completions", CHAT),
]


def minillm(*args: str) -> subprocess.CompletedProcess:
    """minillm ARGS in a subprocess."""
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def batch(stories_path, tmp_path_factory):
    """(output lines, the run) of one run-batch over LINES."""
    folder = tmp_path_factory.mktemp("run_batch")
    (folder / "in.jsonl").write_text("\n".join(LINES) + "\n", encoding="utf-8")
    run = minillm("run-batch", "-i", str(folder / "in.jsonl"), "-o", str(folder / "out.jsonl"),
                  "--model", str(stories_path), "--served-model-name", "stories", "--chat-template", CHAT_TEMPLATE,
                  "--max-model-len", "256", "--device", "cpu")
    assert run.returncode == 0, run.stderr
    text = (folder / "out.jsonl").read_text(encoding="utf-8")
    # Split at newlines only, as the file is written: a JSON string may hold U+2028 as it is.
    return [json.loads(out) for out in text.removesuffix("\n").split("\n")], run, text


@pytest.fixture(scope="module")
def served(stories_path):
    """An HTTP client of minillm serve with the batch's settings."""
    options = ServerOptions(chat_template=CHAT_TEMPLATE)
    with running_server(stories_path, served_model_name="stories", max_model_len=256, options=options) as (url, _):
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client


def without_ids(body: dict) -> dict:
    """A response body without what differs between two runs of one request."""
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def test_one_output_line_per_request_in_input_order(batch):
    outputs, run, text = batch
    assert [o["custom_id"] for o in outputs] == ["chat-1", "cmpl-n2", None, "bad-temperature", "embed", "streamed",
                                                 "get", None, "ünïcødé ✓"]
    assert "ünïcødé ✓" in text
    for out in outputs:
        assert set(out) == {"id", "custom_id", "response", "error"}
        assert out["id"].startswith("vllm-") and out["response"]["request_id"].startswith("vllm-batch-")
    assert "9 requests, 3 succeeded, 6 failed" in run.stderr.splitlines()[-1]
    assert "9/9 requests done" in run.stderr


@pytest.mark.parametrize("index, url, body", [(0, "/v1/chat/completions", CHAT), (1, "/v1/completions", COMPLETION),
                                              (8, "/v1/chat/completions", CHAT)])
def test_a_greedy_answer_is_what_serve_answers(batch, served, index, url, body):
    out = batch[0][index]
    assert out["error"] is None and out["response"]["status_code"] == 200
    answer = served.post(url, json=body)
    assert answer.status_code == 200
    assert without_ids(out["response"]["body"]) == without_ids(answer.json())
    assert len(out["response"]["body"]["choices"]) == body.get("n", 1)


def test_a_400_body_carries_serve_error_as_the_lines_error(batch, served):
    out = batch[0][3]
    answer = served.post("/v1/completions", json=BAD_TEMPERATURE)
    assert answer.status_code == 400
    assert out["response"] == {"status_code": 400, "request_id": out["response"]["request_id"], "body": None}
    assert out["error"] == answer.json() and out["error"]["error"]["param"] == "temperature"


@pytest.mark.parametrize("index, error", [
    (2, "Invalid JSON"), (4, "URL /v1/embeddings was used. Supported endpoints: /v1/chat/completions, "
                             "/v1/completions."),
    (5, "Request must not be sent in stream mode"), (6, "method GET is not supported"),
    (7, "custom_id: field required")])
def test_a_line_that_cannot_run_gets_its_own_error(batch, index, error):
    out = batch[0][index]
    assert out["response"]["status_code"] == 400 and out["response"]["body"] is None
    assert isinstance(out["error"], str) and out["error"].startswith(error)


@pytest.mark.parametrize("args, flag", [(["-i", "missing.jsonl", "-o", "out.jsonl"], "--input-file"),
                                        (["-i", "in.jsonl", "-o", "no/such/dir/out.jsonl"], "--output-file")])
def test_a_bad_path_is_a_usage_error_before_the_model_loads(stories_path, tmp_path, args, flag):
    (tmp_path / "in.jsonl").write_text(LINES[0] + "\n")
    run = subprocess.run([sys.executable, "-m", "minillm", "run-batch", *args, str(stories_path)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert f"'{flag}'" in run.stderr and "backend" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


class FileServer(http.server.SimpleHTTPRequestHandler):
    """GET serves the folder's files; PUT keeps the body in `put`."""

    folder = "."
    put: dict = {}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, directory=self.folder, **kwargs)

    def do_PUT(self) -> None:
        FileServer.put[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_the_input_may_be_an_http_url_and_the_output_is_put_to_one(tmp_path):
    (tmp_path / "in.jsonl").write_text("\n".join(LINES) + "\n", encoding="utf-8")
    FileServer.folder = str(tmp_path)
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), FileServer) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            lines = read_input(f"{base}/in.jsonl")
            upload(f"{base}/out.jsonl", str(tmp_path / "in.jsonl"))
        finally:
            server.shutdown()
    assert lines == [x for x in LINES if x]
    assert FileServer.put["/out.jsonl"] == (tmp_path / "in.jsonl").read_bytes()


# ---- serve's options that shape an answer: the same flags give the same bodies ----------------------

REPLY = '<think>It may rain.</think><tool_call>{"name": "f", "arguments": {"city": "Paris"}}</tool_call>'
PARSER_FLAGS = ("--served-model-name", "stories", "--chat-template", TEMPLATE, "--tool-call-parser", "hermes",
                "--enable-auto-tool-choice", "--reasoning-parser", "deepseek_r1", "--max-model-len", "256",
                "--device", "cpu", "--engine-core", "thread")
TOOL_CHAT = {**CHAT, "max_tokens": 200, "tools": TOOLS, "tool_choice": "auto"}
PLAIN_CHAT = {**CHAT, "max_tokens": 200}


def scripted(engine) -> None:
    """A core hook: every reply is REPLY (stories260K writes no tags of its own)."""
    install_script(engine)
    engine.script("choice", [REPLY])


def main_status(*args: str) -> int:
    """minillm ARGS through the console entry point in this process: its exit status."""
    from minillm.cli import main
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    return exit_info.value.code


@pytest.fixture(scope="module")
def parsed(stories_path, tmp_path_factory):
    """(run-batch's output lines, serve's answers) for TOOL_CHAT and PLAIN_CHAT under PARSER_FLAGS."""
    from minillm.server import async_engine
    folder, seen = tmp_path_factory.mktemp("run_batch_parsers"), {}
    (folder / "in.jsonl").write_text(line("tool", "/v1/chat/completions", TOOL_CHAT) + "\n"
                                     + line("plain", "/v1/chat/completions", PLAIN_CHAT) + "\n")
    start = async_engine.start_async_engine
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("minillm.server.app.run_server", lambda config, options, **kw: seen.update(options=options))
        patch.setattr(async_engine, "start_async_engine", lambda config, core: start(config, core, scripted))
        assert main_status("serve", str(stories_path), *PARSER_FLAGS) == 0
        assert main_status("run-batch", "-i", str(folder / "in.jsonl"), "-o", str(folder / "out.jsonl"),
                           str(stories_path), *PARSER_FLAGS) == 0
    text = (folder / "out.jsonl").read_text(encoding="utf-8")
    outputs = [json.loads(out) for out in text.removesuffix("\n").split("\n")]
    with running_server(stories_path, max_model_len=256, options=seen["options"], core_hook=scripted) as (url, _):
        answers = [httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60) for body in (TOOL_CHAT, PLAIN_CHAT)]
    return outputs, answers


@pytest.mark.parametrize("index", [0, 1])
def test_parser_flags_answer_a_line_as_serve_with_them_answers(parsed, index):
    outputs, answers = parsed
    assert answers[index].status_code == 200, answers[index].text
    assert outputs[index]["error"] is None
    assert without_call_ids(outputs[index]["response"]["body"]) == without_call_ids(answers[index].json())


def without_call_ids(body: dict) -> dict:
    """A chat body without what differs between two runs of one request, its tool calls' ids included."""
    body = json.loads(json.dumps(without_ids(body)))
    for call in body["choices"][0]["message"].get("tool_calls") or ():
        call.pop("id")
    return body


def test_tool_calls_and_reasoning_are_parsed_out_of_the_batch_reply(parsed):
    tool, plain = (out["response"]["body"]["choices"][0] for out in parsed[0])
    assert tool["finish_reason"] == "tool_calls" and tool["message"]["reasoning"] == "It may rain."
    call = tool["message"]["tool_calls"][0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == ("f", {"city": "Paris"})
    assert plain["message"]["reasoning"] == "It may rain." and plain["message"]["content"].startswith("<tool_call>")


@pytest.mark.parametrize("flags", [("--host", "0.0.0.0"), ("--api-key", "k"), ("-asc", "2"), ("--ssl-keyfile=k.pem",)])
def test_a_server_only_flag_is_a_one_line_usage_error_naming_it(capsys, tmp_path, flags):
    (tmp_path / "in.jsonl").write_text(LINES[0] + "\n")
    status = main_status("run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), *flags)
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1
    assert f"No such option: {flags[0].partition('=')[0]}: run-batch" in err
