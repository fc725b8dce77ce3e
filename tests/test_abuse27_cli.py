"""The command line and the LLM API as vLLM, Ollama and transformers users drive them: an empty --host or
--revision, chat templates from pipes, empty files and inline escapes, a Hugging Face cache variable that
names a file, a blank $MINILLM_MODEL, an empty model or benchmark option, and the tokenizer's
transformers names with ids and text no tokenizer takes."""
from __future__ import annotations

import io
import os
import threading

import pytest

from minillm import LLM, SamplingParams
from test_cli import STORIES, needs_stories, run_main

TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m.content }} {% endfor %}"
HELLO = [{"role": "user", "content": "Tom had a red ball."}]


def one_line(err: str) -> str:
    """The single line a failed command printed (asserting there is one, and no traceback)."""
    assert "Traceback" not in err, err
    [line] = err.strip().splitlines()
    return line


@pytest.fixture(scope="module")
def llm(stories_path):
    """One stories260K LLM on the CPU for the module."""
    with LLM(str(stories_path), device="cpu", max_model_len=128) as model:
        yield model


@pytest.fixture
def no_store_variables(monkeypatch):
    """The Hugging Face cache variables and $MINILLM_MODEL unset, the hub offline."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "MINILLM_MODEL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return monkeypatch


# ---- serve's start-up flags --------------------------------------------------------------------------

@pytest.mark.parametrize("command", [
    ("serve", "./no/such/model", "--device", "cpu"),
    ("router", "--prefill", "ftp://x", "--decode", "http://127.0.0.1:9"),
])
def test_an_empty_host_is_named_not_read_as_every_interface(capsys, command):
    # --host "" (an unset variable in `--host "$HOST"`) served on 0.0.0.0, open to the network. (The
    # model and the prefill URL are bad too, so that a --host taken as it was fails after binding.)
    status, out, err = run_main(capsys, *command, "--host", "")
    assert status == 2 and out == ""
    line = one_line(err)
    assert "'--host'" in line and "0.0.0.0" in line, line


# ---- --chat-template ---------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["chat", "serve"])
def test_an_empty_chat_template_is_named(capsys, monkeypatch, tmp_path, command):
    # chat took --chat-template "" for no template at all (the model's own, or plain text); serve read
    # it as the current directory ("--chat-template  is a directory"); an empty file gave chat plain text.
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    empty = tmp_path / "empty.jinja"
    empty.write_text("")
    status, out, err = run_main(capsys, command, str(tmp_path / "no-model"), "--chat-template", "")
    assert status == 2 and one_line(err) == (f"minillm {command}: error: Invalid value for '--chat-template': is "
                                             f"empty; give the template's file, or the template itself (try "
                                             f"'minillm {command} --help')")
    status, out, err = run_main(capsys, command, str(tmp_path / "no-model"), "--chat-template", str(empty))
    assert status == 1 and one_line(err) == f"minillm: error: --chat-template: {empty} is empty"


def chat_replies(capsys, monkeypatch, template: str, messages: str) -> str:
    """What `minillm chat STORIES --chat-template TEMPLATE` prints for MESSAGES piped in, greedy."""
    monkeypatch.setattr("sys.stdin", io.StringIO(messages))
    status, out, err = run_main(capsys, "chat", str(STORIES), "--device", "cpu", "--temperature", "0",
                                "--max-tokens", "8", "--chat-template", template)
    assert status == 0, err
    return out


@needs_stories
def test_a_chat_template_from_a_pipe_is_read_as_from_a_file(capsys, monkeypatch, tmp_path):
    # `--chat-template <(curl ...)` (bash's process substitution, a pipe) was "chat template file not
    # found: /dev/fd/63" in chat and "not a regular file" in serve; vLLM reads it.
    file = tmp_path / "template.jinja"
    file.write_text(TEMPLATE)
    expected = chat_replies(capsys, monkeypatch, str(file), "Tom had a red ball.\n/stats\n")
    fifo = tmp_path / "template.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=fifo.write_text, args=(TEMPLATE,))
    writer.start()
    try:
        got = chat_replies(capsys, monkeypatch, str(fifo), "Tom had a red ball.\n/stats\n")
    finally:
        if writer.is_alive():        # the chat never opened the pipe: let the writer finish
            with open(fifo):
                pass
        writer.join()
    assert _replies(got) == _replies(expected)


def _replies(out: str) -> list[str]:
    """The chat's output without the banner line (it names the template's path) and timings."""
    return [line for line in out.splitlines()[1:] if "tok/s" not in line]


@needs_stories
def test_chat_reads_an_inline_template_as_serve_and_vllm_do(capsys, monkeypatch, tmp_path):
    # chat and serve read an inline --chat-template alike: as given, no escape read (current vLLM's
    # load_chat_template); the same text in a file gives the same prompt.
    file = tmp_path / "template.jinja"
    file.write_text("{{ bos_token }}{% for m in messages %}{{ m.content }}\\n{% endfor %}")
    inline = "{{ bos_token }}{% for m in messages %}{{ m.content }}\\n{% endfor %}"
    script = "Tom had a red ball.\n/stats\n"
    assert _replies(chat_replies(capsys, monkeypatch, inline, script)) == \
        _replies(chat_replies(capsys, monkeypatch, str(file), script))


# ---- the model store's environment -------------------------------------------------------------------

@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HF_HOME"])
@pytest.mark.parametrize("command", [("list",), ("pull", "someorg/somemodel"),
                                     ("generate", "someorg/somemodel", "-p", "hi")])
def test_a_cache_variable_naming_a_file_is_named(capsys, tmp_path, no_store_variables, variable, command):
    # HF_HUB_CACHE=<a file>: list blamed --download-dir, which was never given; HF_HOME=<a file>: list said
    # "no models in <file>/hub"; pull and generate tried to fetch into the file.
    a_file = tmp_path / "cache"
    a_file.write_text("x")
    no_store_variables.setenv(variable, str(a_file))
    status, out, err = run_main(capsys, *command)
    assert status == 1 and out == ""
    line = one_line(err)
    assert f"${variable} {a_file}" in line and "not a directory" in line and "--download-dir" not in line, line


@needs_stories
def test_a_cache_variable_naming_a_file_leaves_local_models_alone(capsys, no_store_variables, tmp_path):
    a_file = tmp_path / "cache"
    a_file.write_text("x")
    no_store_variables.setenv("HF_HUB_CACHE", str(a_file))
    status, out, err = run_main(capsys, "generate", str(STORIES), "--device", "cpu", "-p", "Once", "--max-tokens", "2")
    assert status == 0 and out.startswith("Once"), err


@pytest.mark.parametrize("command", ["chat", "serve"])
def test_a_blank_minillm_model_variable_is_named(capsys, monkeypatch, no_store_variables, command):
    # It read "could not fetch the default model   (CliError: MODEL is empty: ...)".
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    no_store_variables.setenv("MINILLM_MODEL", "  ")
    status, out, err = run_main(capsys, command, "--device", "cpu")
    line = one_line(err)
    assert status == 1 and line.startswith("minillm: error: $MINILLM_MODEL is blank"), line
    assert "CliError" not in line


def test_an_empty_model_is_named_not_read_as_the_current_directory(capsys, stories_path, tmp_path, monkeypatch):
    # LLM("") and `bench throughput --model ""` said "model directory . has no config.json".
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as info:
        LLM("", device="cpu")
    assert str(info.value).startswith("model is empty"), info.value
    status, out, err = run_main(capsys, "bench", "throughput", "--model", " ", "--device", "cpu")
    line = one_line(err)
    assert status == 2 and "--model" in line and "directory ." not in line, line


def test_a_benchmark_output_file_that_is_empty_is_named(capsys, stories_path):
    # `--json ""` (an unset variable) ran the whole benchmark and wrote nothing.
    status, out, err = run_main(capsys, "bench", "throughput", "--model", str(stories_path), "--device", "cpu",
                                "--json", "")
    assert status == 2 and "workload" not in out
    assert one_line(err) == ("minillm bench throughput: error: --json is empty (try 'minillm bench throughput "
                             "--help')")


# ---- the tokenizer's transformers names --------------------------------------------------------------

def test_decode_refuses_ids_past_any_vocabulary_by_name(llm):
    # OverflowError ("number too small to fit in target type") from the tokenizers library.
    tok = llm.get_tokenizer()
    for ids in ([-1], [5, 2**64], -3):
        with pytest.raises(ValueError, match=r"^decode: token ids must be integers in \[0, 2\*\*32\)"):
            tok.decode(ids)
    with pytest.raises(ValueError, match=r"^batch_decode: token ids must be"):
        tok.batch_decode([[1], [-1]])
    assert tok.decode([10**6]) == ""        # an unknown id in range still decodes to nothing, as before


@pytest.mark.parametrize("call, name", [
    (lambda tok: tok.encode("a\ud800"), "text"), (lambda tok: tok.tokenize("a\ud800"), "text"),
    (lambda tok: tok("a\ud800"), "text"), (lambda tok: tok(["ok", "a\ud800"]), "text[1]"),
    (lambda tok: tok.encode_batch(["a\ud800"]), "text[0]"),
])
def test_text_with_a_lone_surrogate_is_a_value_error_naming_it(llm, call, name):
    # TypeError "TextInputSequence must be str", of a str.
    with pytest.raises(ValueError) as info:
        call(llm.get_tokenizer())
    assert str(info.value) == f"{name} is not valid Unicode: a lone surrogate at index 1"


def test_apply_chat_template_takes_transformers_conversation_argument_and_batches(llm):
    # conversation= (transformers' name of the first argument) was a TypeError; a batch of
    # conversations was "messages[0] must be a dict with a 'role'".
    tok = llm.get_tokenizer()
    one = tok.apply_chat_template(HELLO, chat_template=TEMPLATE)
    assert tok.apply_chat_template(conversation=HELLO, chat_template=TEMPLATE) == one
    other = [{"role": "user", "content": "Lily"}]
    assert tok.apply_chat_template([HELLO, other], chat_template=TEMPLATE) == \
        [one, tok.apply_chat_template(other, chat_template=TEMPLATE)]
    assert tok.apply_chat_template([HELLO, other], chat_template=TEMPLATE, tokenize=False) == \
        ["<s>Tom had a red ball. ", "<s>Lily "]
    with pytest.raises(TypeError, match="conversation"):
        tok.apply_chat_template(HELLO, conversation=HELLO, chat_template=TEMPLATE)


def test_llm_chat_names_a_template_with_a_lone_surrogate(llm):
    # "messages is not valid Unicode", of messages that were plain ASCII.
    with pytest.raises(ValueError, match="^chat_template is not valid Unicode"):
        llm.chat(HELLO, SamplingParams(max_tokens=2), chat_template="{{ bos_token }}\ud800{{ messages[0].content }}")


# ---- --revision ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [("generate", "someorg/somemodel", "-p", "hi"), ("pull", "someorg/somemodel")])
def test_an_empty_revision_is_named_not_asked_of_the_hub(capsys, no_store_variables, command):
    # --revision "" (an unset variable) went to the hub: "could not be fetched at revision '' ...".
    status, out, err = run_main(capsys, *command, "--revision", "")
    assert status == 2 and one_line(err).startswith(
        f"minillm {command[0]}: error: Invalid value for '--revision': is empty"), err
    with pytest.raises(ValueError, match="^revision is empty"):
        LLM("someorg/somemodel", device="cpu", revision=" ")
