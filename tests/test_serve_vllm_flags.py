"""vLLM's `vllm serve` flags that `minillm serve` takes, each with its effect: the command line they
are parsed from (in this process, the server's start stubbed), and a real server on loopback that
serves with them."""
from __future__ import annotations

import httpx
import pytest
from test_cli import STORIES, needs_stories, run_main
from test_server_helpers import CHAT_TEMPLATE, chat_model_dir, running_server, sse_events

from minillm.cli import spread_option_values
from minillm.server.app import ServerOptions

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


# ---- a server with the flags ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    """A chat-capable stories260K server with --served-model-name stories alias and an API key."""
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    options = ServerOptions(chat_template=CHAT_TEMPLATE)
    with running_server(model, api_key=KEY, served_model_name=NAMES, options=options) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[0], timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


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
