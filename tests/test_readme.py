"""README.md's examples print what the README shows: its commands and snippets run as written on
stories260K (greedy, or sampled with a seed), and their output is compared with the text block after them."""
import re
import shlex
import subprocess
import sys

import pytest
from conftest import REPO, STORIES
from test_server_helpers import running_server

README_MODEL = "../shared/models/stories260K"
# The chat's /stats line carries timings; the rest of it (tokens, finish reason) is compared.
TIMINGS = re.compile(r"\d+\.\d+ s, \d+\.\d+ tok/s, time to first token \d+\.\d+ ms")


def readme_blocks() -> list[tuple[str, str]]:
    """The README's fenced blocks in order, as (language, text)."""
    text = (REPO / "README.md").read_text()
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def block_after(start: str) -> tuple[str, str]:
    """The block that begins with START and the text block that follows it (what it prints)."""
    blocks = readme_blocks()
    [i] = [i for i, (_, text) in enumerate(blocks) if text.startswith(start)]
    assert blocks[i + 1][0] == "text", f"no text block after the block that begins {start!r}"
    return blocks[i][1], blocks[i + 1][1]


def with_test_model(text: str) -> str:
    """TEXT with the README's model path replaced by the one the tests use (MINILLM_TEST_MODEL)."""
    return text.replace(README_MODEL, str(STORIES))


def run_minillm(args: list[str], stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minillm", *args], cwd=REPO, input=stdin, capture_output=True,
                          text=True, timeout=300)


def test_quick_start_continues_the_story_the_readme_shows(stories_path):
    [bash, shown] = block_after("pip install -e . && minillm generate ")[:2]
    command = bash.splitlines()[0].split(" && ", 1)[1]
    result = run_minillm(shlex.split(with_test_model(command))[1:])
    assert result.returncode == 0, result.stderr
    logs = [line for line in shown.splitlines() if line.startswith(("minillm:", "generate:"))]
    story = "".join(line + "\n" for line in shown.splitlines() if line not in logs)
    assert result.stdout == story
    assert logs[0] in result.stderr.splitlines()


def test_chat_transcript_replies_as_the_readme_shows(stories_path):
    [transcript] = [text for _, text in readme_blocks() if text.startswith("$ minillm chat ")]
    [command, options, backend, *lines] = transcript.splitlines()
    args = shlex.split(with_test_model(command.removeprefix("$ minillm ").removesuffix("\\") + options))
    inputs = [line[len(">>> "):] for line in lines if line.startswith(">>> ")]
    result = run_minillm(args, stdin="".join(line + "\n" for line in inputs))
    assert result.returncode == 0, result.stderr
    assert backend in result.stderr.splitlines()
    # Piped, the typed lines are not echoed: each reply follows its prompt on the same line.
    expected = re.sub(r"^>>> .*\n", ">>> ", "\n".join(lines) + "\n", flags=re.MULTILINE)
    assert TIMINGS.sub("<timings>", with_test_model(expected)) in TIMINGS.sub("<timings>", result.stdout)


def test_python_api_example_prints_what_the_readme_shows(stories_path, capsys, monkeypatch):
    code, shown = block_after("from minillm import LLM, SamplingParams\n")
    monkeypatch.chdir(REPO)
    namespace = {}
    exec(with_test_model(code), namespace)
    namespace["llm"].shutdown()
    assert capsys.readouterr().out == shown


def test_asyncio_example_prints_what_the_readme_shows(stories_path, tmp_path):
    code, shown = block_after("import asyncio\n")
    script = tmp_path / "story.py"
    script.write_text(with_test_model(code))
    result = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == shown


def test_openai_client_example_prints_what_the_readme_shows(stories_path, capsys):
    pytest.importorskip("openai")
    code, shown = block_after("from openai import OpenAI\n")
    with running_server(stories_path, served_model_name="stories", engine_core="thread") as (url, _engine):
        exec(code.replace("http://127.0.0.1:8000", url), {})
    assert capsys.readouterr().out == shown
