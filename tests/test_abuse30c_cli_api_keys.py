"""`minillm serve --api-key KEY...` as `vllm serve` takes it: several keys after one flag (nargs="+"), a
request carrying any of them is served, each compared in constant time; $VLLM_API_KEY stays one key.
minillm took one key and refused several."""
from __future__ import annotations

import httpx
import pytest
from test_abuse29b_cli import one_line
import test_abuse30_cli
from test_cli import STORIES, needs_stories, run_main
from test_server_helpers import running_server

from minillm.server.app import ServerOptions

serve, started = test_abuse30_cli.serve, test_abuse30_cli.started      # started: a fixture


@needs_stories
@pytest.mark.parametrize("flags, keys", [
    (("--api-key", "a", "b"), ("a", "b")),
    (("--api-key", "a", "--api-key", "b"), ("a", "b")),
    (("--api-key", "a", "b", "c", "--port", "0"), ("a", "b", "c")),
    (("--api-key=a",), ("a",)),
])
def test_serve_takes_several_keys_after_one_flag(capsys, started, flags, keys):
    status, err = serve(capsys, *flags)
    assert status == 0, err
    assert started["options"].api_keys == keys


@needs_stories
def test_model_written_after_the_keys_is_the_model(capsys, started):
    # The keys run up to the next option; a model directory after them is MODEL, as it was after one key.
    status, _, err = run_main(capsys, "serve", "--device", "cpu", "--api-key", "a", "b", str(STORIES))
    assert status == 0, err
    assert started["options"].api_keys == ("a", "b") and started["config"].model == str(STORIES)


@needs_stories
def test_vllm_api_key_is_one_key_and_an_empty_one_of_several_is_named(capsys, started, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "k1 k2")
    assert serve(capsys)[0] == 0 and started["options"].api_keys == ("k1 k2",)
    status, err = serve(capsys, "--api-key", "a", "")
    assert status == 2 and "Invalid value for '--api-key': must not be empty" in one_line(err), err


def test_server_options_hold_one_key_or_several():
    assert ServerOptions(api_key="a").api_keys == ("a",) and ServerOptions().api_keys == ()
    assert ServerOptions(api_key=["a", "b"]).api_keys == ("a", "b")
    for bad in ([], ["a", " "]):
        with pytest.raises(ValueError, match="api_key must not be empty"):
            ServerOptions(api_key=bad)


def test_the_startup_line_and_the_help_say_any_key_is_taken(capsys):
    from minillm.server.app import api_key_note
    assert api_key_note(ServerOptions()) is None
    assert "an API key" in api_key_note(ServerOptions(api_key="a"))
    assert "any of 2 API keys" in api_key_note(ServerOptions(api_key=("a", "b")))
    status, out, _ = run_main(capsys, "serve", "--help")
    assert status == 0 and "--api-key" in out
    assert "any of several keys" in " ".join(out.replace("│", " ").split())


@needs_stories
def test_each_key_is_served_and_any_other_is_a_401(stories_path):
    keys = ("sk-one", "sk-two", "sk-three-longer")
    with running_server(stories_path, api_key=keys, max_model_len=64) as (url, _):
        for key in keys:
            assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
            assert httpx.get(f"{url}/v1/models", headers={"x-api-key": key}).status_code == 200
        for wrong in ("sk-on", "sk-one sk-two", "sk-twoo", "SK-ONE"):
            answer = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {wrong}"})
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200
