"""vLLM's `vllm chat` options in `minillm chat`: -q/--quick MESSAGE (one message, the reply alone on
stdout), --system-prompt (--system) and --model-name (MODEL). `minillm chat -q hi` was refused with
"No such option: -q: minillm runs unquantized weights only", vLLM serve's -q."""
from __future__ import annotations

import pytest
from test_chat import STORIES, needs_stories
from test_cli import minillm

GREEDY = ("--device", "cpu", "--temperature", "0", "--max-tokens", "12")


@needs_stories
def test_quick_prints_the_reply_alone_and_exits():
    piped = minillm("chat", str(STORIES), *GREEDY, stdin="Once upon\n")
    assert piped.returncode == 0, piped.stderr
    reply = piped.stdout.split(">>> ")[1].split(" [max_tokens 12 reached")[0]
    quick = minillm("chat", str(STORIES), *GREEDY, "-q", "Once upon")
    assert quick.returncode == 0, quick.stderr
    assert quick.stdout == reply + "\n"         # no banner, no prompt, no mark
    assert quick.stderr.splitlines()[-1] == "[max_tokens 12 reached: --max-tokens N for longer replies]"
    # vLLM's names of --system and MODEL
    for system in ("--system", "--system-prompt"):
        result = minillm("chat", "--model-name", str(STORIES), *GREEDY, system, "Tom had a dog.", "--quick", "Once")
        assert result.returncode == 0, result.stderr
        if system == "--system":
            expected = result.stdout
    assert result.stdout == expected and result.stdout != quick.stdout


@needs_stories
def test_a_quick_message_that_fails_exits_1_with_the_error_on_stderr():
    result = minillm("chat", str(STORIES), "--device", "cpu", "-q", "hello " * 1000)
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.splitlines()[-1].startswith("error: message too long: the prompt is")


@pytest.mark.parametrize("args, message", [
    (["-q", ""], "Invalid value for '--quick': is empty; give the message to send"),
    (["a", "--model-name", "b", "-q", "hi"], "MODEL a and --model-name b disagree; give the model once"),
])
def test_bad_quick_and_model_name_values_are_usage_errors(args, message):
    result = minillm("chat", *args)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines() == [f"minillm chat: error: {message} (try 'minillm chat --help')"]


def test_reply_once_sends_text_any_tokenizer_takes():
    # Bytes that were not UTF-8 (lone surrogates from the command line) go as U+FFFD, as a typed line does.
    import io

    from test_abuse30_chat import _EchoBackend

    from minillm.chat import ChatSession
    backend, out = _EchoBackend(), io.StringIO()
    assert ChatSession(backend, out=out).reply_once("caf\udce9") == 0
    assert backend.sent == ["caf\ufffd"] and out.getvalue() == "ok\n"
