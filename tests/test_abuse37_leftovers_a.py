"""Leftovers: bench latency and throughput with a hub id at --revision or --tokenizer-revision; serve with several
API servers of a model without tokenizer.json; /v1/responses with conversation, custom tools and an assistant's
refusal part sent back."""
from __future__ import annotations

import json
import shutil

import pytest
from conftest import put_in_hf_cache
from test_abuse28_cli import started  # noqa: F401 - serve's run_server stubbed, as a fixture
from test_abuse29_cli import one_line
from test_cli import STORIES, needs_stories, run_main
from test_server_helpers import CHAT_TEMPLATE, openai_error, running_server

from minillm.server.app import ServerOptions

pytestmark = needs_stories

# ---- bench latency and throughput: a hub id from the store at a revision ---------------------------------------

BENCH_SIZES = {"latency": ("--input-len", "4", "--output-len", "2", "--batch-size", "2", "--num-iters-warmup", "0",
                           "--num-iters", "1"),
               "throughput": ("--input-len", "4", "--output-len", "2", "--num-prompts", "2")}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A Hugging Face cache holding someorg/st: main is stories260K, v2 a tokenizer with one token past its
    vocabulary (so a run that reads it fails naming it)."""
    root = tmp_path_factory.mktemp("hub")
    put_in_hf_cache(root, "someorg/st", STORIES, revision="c" * 40)
    big = root / "models--someorg--st" / "snapshots" / ("d" * 40)
    big.mkdir()
    shutil.copyfile(STORIES / "tokenizer_config.json", big / "tokenizer_config.json")
    data = json.loads((STORIES / "tokenizer.json").read_text())
    data["added_tokens"].append({"id": 512, "content": "<extra>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    (big / "tokenizer.json").write_text(json.dumps(data))
    (root / "models--someorg--st" / "refs" / "v2").write_text("d" * 40)
    return root


@pytest.mark.parametrize("bench", ["latency", "throughput"])
def test_bench_takes_a_hub_id_at_revision_and_tokenizer_revision(store, capsys, monkeypatch, bench):
    # The model was made a local directory first and its revision then passed on to LLM, which refuses a
    # revision of a directory: "--revision 'main' names a version of a hub model; .../snapshots/ccc... is a
    # local directory".
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base = ("bench", bench, "--model", "someorg/st", "--download-dir", str(store), "--device", "cpu",
            *BENCH_SIZES[bench])
    status, _, err = run_main(capsys, *base, "--revision", "main", "--tokenizer-revision", "main")
    assert status == 0, err
    status, _, err = run_main(capsys, *base, "--tokenizer-revision", "v2")      # v2's tokenizer is the one read
    assert status != 0 and "has token ids up to 512" in err and "Traceback" not in err, err


# ---- serve: the model's tokenizer read once before several API servers start ------------------------------------

def test_serve_with_api_servers_of_a_model_without_tokenizer_json_is_one_line_before_starting(
        tmp_path, capsys, started):  # noqa: F811
    # Three processes started and each said so, then several error lines; --tokenizer already got one line.
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (model / name).symlink_to(STORIES / name)
    status, _, err = run_main(capsys, "serve", str(model), "--device", "cpu", "--api-server-count", "2")
    line = one_line(err)
    assert status == 1 and f"{model} has no tokenizer.json" in line and not started, line


# ---- /v1/responses ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(stories_path):
    options = ServerOptions(chat_template=CHAT_TEMPLATE)
    with running_server(stories_path, max_model_len=256, options=options) as running:
        yield running


def respond(http, **fields):
    return http.post("/v1/responses", json={"model": "stories", "max_output_tokens": 2, "temperature": 0, **fields})


@pytest.mark.parametrize("conversation", ["conv_1", {"id": "conv_1"}])
def test_a_conversation_is_a_400_naming_it(http, conversation):
    # It was served as if absent: no conversation is stored, so none can be read or added to.
    error = openai_error(respond(http, input="Hi", conversation=conversation), 400, "conversation")
    assert "conversation" in error["message"] and "store" in error["message"]


def test_a_custom_tool_is_not_called_a_built_in_tool(http):
    grammar = {"type": "grammar", "syntax": "lark", "definition": 'start: "a"'}
    tool = {"type": "custom", "name": "g", "format": grammar}
    error = openai_error(respond(http, input="Hi", tools=[tool]), 400, "tools[0].type")
    assert "custom tools" in error["message"] and "built-in" not in error["message"], error
    error = openai_error(respond(http, input="Hi", tools=[{"type": "function", "name": "f"}],
                                 tool_choice={"type": "custom", "name": "g"}), 400, "tool_choice.type")
    assert "custom tools" in error["message"] and "built-in" not in error["message"], error


def test_an_assistant_refusal_part_sent_back_is_read_as_its_words(http):
    # It was a 400 ("type must be input_text or output_text"); OpenAI takes an earlier output sent back.
    def turn(part: dict) -> list[dict]:
        return [{"role": "user", "content": "Tell me a story."},
                {"type": "message", "role": "assistant", "content": [part]},
                {"role": "user", "content": "Please?"}]
    refused = respond(http, input=turn({"type": "refusal", "refusal": "I will not."}))
    said = respond(http, input=turn({"type": "output_text", "text": "I will not.", "annotations": []}))
    assert refused.status_code == said.status_code == 200, refused.text
    assert refused.json()["usage"]["input_tokens"] == said.json()["usage"]["input_tokens"]
    assert refused.json()["output"][0]["content"][0]["text"] == said.json()["output"][0]["content"][0]["text"]
    unread = respond(http, input=turn({"type": "refusal", "text": "I will not."}))
    openai_error(unread, 400, "input[1].content[0].refusal")
