"""vLLM's `vllm serve` flags that `minillm serve` takes, each with its effect: the command line they
are parsed from (in this process, the server's start stubbed), and a real server on loopback that
serves with them."""
from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys

import httpx
import pytest
from test_cli import REPO, STORIES, needs_stories, run_main
from test_server_helpers import CHAT_TEMPLATE, chat_model_dir, listening_url, running_server, sse_events

from minillm.cli import spread_option_values
from minillm.server.app import ServerOptions, api_server_log_level

KEY = "sk-test"
NAMES = ("stories", "alias")


# ---- the command line -----------------------------------------------------------------------------

@pytest.fixture
def started(monkeypatch):
    """serve's run_server stubbed: what it was started with ({"config", "options"}) once main() returns."""
    seen: dict = {}

    def fake_run_server(config, host="127.0.0.1", port=8000, options=None, monitor=False, core_hook=None):
        seen.update(config=config, options=options, monitor=monitor)
        return 0

    monkeypatch.setattr("minillm.server.app.run_server", fake_run_server)
    return seen


def serve(capsys, *flags: str) -> tuple[int, str]:
    """`minillm serve stories260K --device cpu FLAGS` in this process: (exit status, stderr)."""
    status, _, err = run_main(capsys, "serve", str(STORIES), "--device", "cpu", *flags)
    return status, err


def test_an_option_of_several_values_is_spread_one_flag_a_value():
    flag = "--served-model-name"
    assert spread_option_values([flag, "a", "b", "--port", "1"], (flag,)) == [flag, "a", flag, "b", "--port", "1"]
    assert spread_option_values(["m", flag, "a"], (flag,)) == ["m", flag, "a"]
    assert spread_option_values([flag, "a", "b"], (flag,)) == [flag, "a", flag, "b"]
    assert spread_option_values([f"{flag}=a", "b"], (flag,)) == [f"{flag}=a", "b"]      # one value, then MODEL
    assert spread_option_values([flag, "--port", "1"], (flag,)) == [flag, "--port", "1"]  # click says it lacks one
    assert spread_option_values(["--", flag, "a", "b"], (flag,)) == ["--", flag, "a", "b"]


@needs_stories
def test_served_model_name_takes_several_names_after_one_flag(capsys, started):
    assert serve(capsys, "--served-model-name", "a", "b", "--port", "0") == (0, "")
    assert started["options"].served_model_name == ("a", "b")
    assert started["config"].served_model_name == "a"          # the engine's stats name the first
    assert serve(capsys, "--served-model-name", "a", "--served-model-name", "b")[0] == 0
    assert started["options"].served_model_name == ("a", "b")
    assert serve(capsys)[0] == 0
    assert started["options"].served_model_name == (str(STORIES),)    # MODEL as given, as vLLM names it


@needs_stories
def test_a_model_written_after_served_model_name_is_not_taken_for_a_name(capsys, started):
    status, _, err = run_main(capsys, "serve", "--device", "cpu", "--served-model-name", "a", str(STORIES))
    assert status == 1 and not started
    assert err.strip() == (f"minillm: error: --served-model-name took {STORIES} as a name (its values run up to the "
                           f"next option, as in vLLM); give the model first: minillm serve {STORIES} "
                           "--served-model-name ...")


FLAG_EFFECTS = [
    (("--enable-log-requests",), "log_requests", True),
    (("--enable-log-requests", "--no-enable-log-requests"), "log_requests", False),
    (("--disable-log-requests",), "log_requests", False),
    (("--disable-log-stats",), "log_interval", None),
    (("--uvicorn-log-level", "warning"), "uvicorn_log_level", "warning"),
    (("--disable-uvicorn-access-log",), "uvicorn_access_log", False),
    (("--root-path", "/llm/"), "root_path", "/llm"),
    (("--response-role", "narrator"), "response_role", "narrator"),
    (("--disable-fastapi-docs",), "enable_docs", False),
    (("--enable-request-id-headers",), "request_id_headers", True),
    (("-asc", "2"), "api_server_count", 2),
    (("--chat-template-content-format", "openai"), "chat_template_content_format", "openai"),
    (("--chat-template-content-format", "string"), "chat_template_content_format", "string"),
    (("--return-tokens-as-token-ids",), "return_tokens_as_token_ids", True),
    (("--enable-prompt-tokens-details",), "enable_prompt_tokens_details", True),
    (("--enable-server-load-tracking",), "enable_server_load_tracking", True),
]


@needs_stories
@pytest.mark.parametrize("flags, field, value", FLAG_EFFECTS, ids=[" ".join(f[0]) for f in FLAG_EFFECTS])
def test_each_flag_reaches_the_server_options(capsys, started, flags, field, value):
    assert serve(capsys, *flags) == (0, "")
    assert getattr(started["options"], field) == value


@needs_stories
def test_without_the_flags_serve_keeps_its_defaults(capsys, started):
    assert serve(capsys) == (0, "")
    options = started["options"]
    assert (options.log_requests, options.log_interval, options.uvicorn_log_level, options.uvicorn_access_log) == (
        False, 5.0, "info", True)
    assert (options.root_path, options.response_role, options.enable_docs, options.request_id_headers) == (
        "", "assistant", True, False)


@needs_stories
def test_engine_flags_of_vllm_reach_the_engine_config(capsys, started):
    assert serve(capsys, "--dtype", "half", "--max-logprobs", "5", "--enable-chunked-prefill") == (0, "")
    assert started["config"].dtype == "float16" and started["config"].max_logprobs == 5
    assert serve(capsys, "--dtype", "float")[0] == 0
    assert started["config"].dtype == "float32"


@needs_stories
def test_trust_remote_code_is_taken_and_says_it_changes_nothing(capsys, started):
    status, err = serve(capsys, "--trust-remote-code")
    assert status == 0 and started
    assert err.strip() == ("minillm: --trust-remote-code changes nothing: minillm runs its own decoder for every "
                           "model it loads, never code from a checkpoint")


@needs_stories
@pytest.mark.parametrize("flags, message", [
    (("--enable-log-requests", "--disable-log-requests"), "--enable-log-requests and --disable-log-requests disagree"),
    (("--no-enable-chunked-prefill", "--max-num-batched-tokens", "64", "--max-model-len", "128"),
     "'--max-num-batched-tokens': 64 is smaller than --max-model-len 128: with --no-enable-chunked-prefill"),
    (("--monitor", "--enable-log-requests"), "where --enable-log-requests would log over it"),
    (("--monitor", "--uvicorn-log-level", "debug"), "where --uvicorn-log-level would log over it"),
    (("--uvicorn-log-level", "loud"), "'loud' is not one of"),
    (("--root-path", "llm"), "Invalid value for '--root-path': must be a path starting with /"),
    (("--response-role", " "), "Invalid value for '--response-role': must not be empty"),
    (("--max-log-len", "100"), "No such option: --max-log-len"),     # no prompt text is logged to cut
])
def test_flags_that_cannot_work_fail_in_one_line_before_loading(capsys, started, monkeypatch, flags, message):
    monkeypatch.setattr("minillm.chat_terminal.is_terminal", lambda stream: True)
    status, err = serve(capsys, *flags)
    assert status != 0 and not started
    [line] = err.strip().splitlines()
    assert message in line, line


def test_the_other_api_servers_log_at_most_warnings():
    assert [api_server_log_level("info", i) for i in (0, 1)] == ["info", "warning"]
    assert [api_server_log_level("error", i) for i in (0, 1)] == ["error", "error"]
    assert [api_server_log_level("debug", i) for i in (0, 1)] == ["debug", "warning"]


# ---- a server with the flags ----------------------------------------------------------------------

class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    """A chat-capable stories260K server with --served-model-name stories alias, --enable-log-requests,
    --response-role narrator, --root-path /llm, --disable-fastapi-docs, --enable-request-id-headers and
    an API key."""
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    options = ServerOptions(chat_template=CHAT_TEMPLATE, log_requests=True, response_role="narrator",
                            root_path="/llm", enable_docs=False, request_id_headers=True)
    with running_server(model, api_key=KEY, served_model_name=NAMES, options=options) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[0], timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


@pytest.fixture
def logged():
    """The minillm.server log lines written during the test."""
    logger = logging.getLogger("minillm.server")
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.messages
    logger.removeHandler(handler)
    logger.setLevel(level)


def _complete(http, model: str, **fields) -> httpx.Response:
    return http.post("/v1/completions", json={"model": model, "prompt": "Once upon a time", "max_tokens": 4,
                                              "temperature": 0, **fields})


def test_the_server_answers_to_every_served_name_and_names_itself_by_the_first(http):
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == list(NAMES)
    assert http.get("/v1/models/alias").json()["id"] == "alias"
    first, second = _complete(http, "stories"), _complete(http, "alias")
    assert first.status_code == second.status_code == 200, second.text
    assert second.json()["model"] == "stories"
    assert second.json()["choices"] == first.json()["choices"]
    with http.stream("POST", "/v1/completions", json={"model": "alias", "prompt": "Once", "max_tokens": 3,
                                                      "stream": True}) as response:
        events = sse_events(response.iter_lines())
    assert events and {e["model"] for e in events} == {"stories"}
    chat = http.post("/v1/chat/completions", json={"model": "alias", "messages": [{"role": "user", "content": "Hi"}],
                                                   "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["model"] == "stories"
    assert http.post("/tokenize", json={"model": "alias", "prompt": "Once"}).status_code == 200


def test_a_name_not_served_is_still_vllms_404(http):
    for response in (_complete(http, "other"), http.get("/v1/models/other")):
        assert response.status_code == 404
        error = response.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert error["message"] == "The model 'other' does not exist."


def test_each_request_received_is_logged_with_its_id_and_params_never_its_text(http, logged):
    response = http.post("/v1/completions", headers={"X-Request-Id": "mine"},
                         json={"model": "alias", "prompt": ["Once upon a time", "The dog"], "max_tokens": 3,
                               "stop": ["zebra"]})
    assert response.status_code == 200 and response.json()["id"] == "cmpl-mine"
    lines = [m for m in logged if m.startswith("Received request")]
    assert len(lines) == 2, logged   # logged before the engine took them, so before the response came
    # The engine's ids, as vLLM's: the response's id, the prompt's index and 8 random hex digits.
    ids = [re.match(r"Received request cmpl-mine-([01])-[0-9a-f]{8}: params: SamplingParams\(n=1, ", line)
           for line in lines]
    assert all(ids) and {m.group(1) for m in ids} == {"0", "1"}, lines
    assert all("max_tokens=3" in line and "stop=['zebra']" in line for line in lines)
    counts = [int(re.search(r"num_prompt_tokens: (\d+)\.$", line).group(1)) for line in lines]
    assert sum(counts) == response.json()["usage"]["prompt_tokens"] and min(counts) > 0
    assert not any("upon" in line or "dog" in line or "_stop_list" in line for line in lines)


def test_a_huge_request_is_logged_in_a_short_line(http, logged):
    response = _complete(http, "stories", allowed_token_ids=list(range(500)), logit_bias={str(i): 1 for i in range(50)})
    assert response.status_code == 200, response.text
    [line] = [m for m in logged if m.startswith("Received request")]
    assert "allowed_token_ids=[0, 1, 2, 3, 4, ...] (500 items)" in line and "logit_bias={...} (50 items)" in line
    assert len(line) < 2000


def test_a_reply_opening_a_new_turn_takes_the_response_role(http):
    body = {"model": "stories", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    assert http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["role"] == "narrator"
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        events = sse_events(response.iter_lines())
    assert events[0]["choices"][0]["delta"]["role"] == "narrator"
    # Without a new turn the reply continues the last message's, as vLLM names it; echo repeats that message.
    unopened = http.post("/v1/chat/completions", json={**body, "add_generation_prompt": False, "echo": True})
    message = unopened.json()["choices"][0]["message"]
    assert message["role"] == "user" and message["content"].startswith("Hi")


def test_paths_are_served_under_the_root_path_and_the_key_still_guards_them(http, server):
    assert http.get("/llm/v1/models").json()["data"][0]["id"] == "stories"
    assert http.get("/v1/models").status_code == 200             # a proxy that strips the prefix
    assert _complete(http, "stories").status_code == 200
    assert http.post("/llm/v1/completions", json={"model": "stories", "prompt": "Once", "max_tokens": 2}
                     ).status_code == 200
    for path in ("/llm/v1/models", "/v1/models"):
        assert httpx.get(f"{server[0]}{path}", timeout=10).status_code == 401, path
    assert httpx.get(f"{server[0]}/llm/health", timeout=10).status_code == 200


def test_no_api_docs_are_served(http):
    for path in ("/docs", "/redoc", "/openapi.json", "/llm/docs", "/llm/openapi.json"):
        assert http.get(path).status_code == 404, path


def test_every_response_carries_a_request_id_header(http, server):
    assert re.fullmatch(r"[0-9a-f]{32}", _complete(http, "stories").headers["x-request-id"])
    assert http.get("/health", headers={"X-Request-Id": "probe-1"}).headers["x-request-id"] == "probe-1"
    refused = _complete(http, "other")
    assert refused.status_code == 404 and re.fullmatch(r"[0-9a-f]{32}", refused.headers["x-request-id"])
    unauthorised = httpx.get(f"{server[0]}/v1/models", headers={"X-Request-Id": "r2"}, timeout=10)
    assert unauthorised.status_code == 401 and unauthorised.headers["x-request-id"] == "r2"


# ---- the logs of `minillm serve` ------------------------------------------------------------------

@needs_stories
def test_serve_logs_requests_and_leaves_out_uvicorns_info_and_access_lines(tmp_path):
    """Through the console entry point: the uvicorn flags reach the server uvicorn runs."""
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "minillm.cli", "serve", str(STORIES), "--device", "cpu", "--port", "0",
               "--enable-log-requests", "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        url = listening_url(proc, log, timeout=120)     # the log names no URL at this log level
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200, log.read_text()
        response = httpx.post(f"{url}/v1/completions", timeout=60,
                              json={"prompt": "Once upon a time", "max_tokens": 3})
        assert response.status_code == 200, response.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert re.search(r"INFO \S+ \S+ Received request cmpl-[0-9a-f]{32}-0-[0-9a-f]{8}: params: SamplingParams\(",
                     text), text
    assert "Uvicorn running" not in text and "Application startup complete" not in text, text
    assert "POST /v1/completions" not in text and "GET /health" not in text, text
