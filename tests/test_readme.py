"""README.md's examples print what the README shows: its commands and snippets run as written on
stories260K (greedy, or sampled with a seed), and their output is compared with the text block after them."""
import os
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


def transcript(start: str) -> list[tuple[str, list[str]]]:
    """The text block that begins with START as (command, the lines it printed) pairs: a command is a
    line after "$ ", without its "# comment"."""
    [block] = [text for _, text in readme_blocks() if text.startswith(start)]
    pairs: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            pairs.append((line[2:].split("  #")[0].strip(), []))
        else:
            pairs[-1][1].append(line)
    return pairs


def store_transcript() -> dict[str, list[str]]:
    return dict(transcript("$ minillm pull "))


def test_version_and_an_empty_store_print_what_the_readme_shows(tmp_path):
    shown = store_transcript()
    result = run_minillm(["--version"])
    assert result.stdout.splitlines() == shown["minillm --version"]
    [line] = shown["minillm list"]
    result = subprocess.run([sys.executable, "-m", "minillm", "list"], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "HF_HUB_CACHE": str(tmp_path)}, timeout=300)
    assert result.stdout == line.replace("/root/.cache/huggingface/hub", str(tmp_path)) + "\n"


def test_a_mistyped_model_path_is_answered_as_the_readme_shows(tmp_path):
    if not (REPO / README_MODEL / "config.json").is_file():
        pytest.skip(f"the README's model path {README_MODEL} is not there from {REPO}")
    [command] = [c for c in store_transcript() if c.startswith("minillm generate ")]
    [shown] = store_transcript()[command]
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "minillm", *shlex.split(command)[1:]], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    # Up to the hub's own words, which say why the fetch failed (offline here, no network there).
    assert result.stderr.split("; ")[0] == shown.split("; ")[0].replace("/root/.cache/huggingface/hub", str(tmp_path))


def masked(line: str) -> str:
    """LINE with its figures masked: timings, process ids and ports change from run to run (and with
    them the padding of a right-aligned figure: a busy machine's 926 tok/s is one digit short of 1926)."""
    return re.sub(r" +N", " N", re.sub(r"\d+(\.\d+)?", "N", line))


def test_bench_throughput_prints_the_lines_the_readme_shows(stories_path):
    [(command, shown)] = [(c, lines) for c, lines in store_transcript().items() if c.startswith("minillm bench ")]
    result = run_minillm(shlex.split(with_test_model(command))[1:])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [lines[0], lines[-1]] == [shown[0], shown[-1]]         # the workload, the ceiling
    assert masked(lines[1]) == masked(shown[1])
    # The phases are listed slowest first, an order that changes with the machine.
    phases = [re.sub(r"^(.*: )|( N)$", "", part) for part in masked(lines[2]).split(", ")]
    assert sorted(phases) == sorted(re.sub(r"^(.*: )|( N)$", "", part) for part in masked(shown[2]).split(", "))


def test_serve_starts_with_the_lines_the_readme_shows(stories_path):
    [(command, shown)] = transcript("$ minillm serve ../shared/models/stories260K --device cpu --served-model-name")
    args = shlex.split(with_test_model(command))[1:] + ["--port", "0"]
    server = subprocess.Popen([sys.executable, "-m", "minillm", *args], cwd=REPO, stderr=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, text=True)
    lines = []
    try:
        for line in server.stderr:
            lines.append(line.rstrip("\n"))
            if "Uvicorn running on" in line:
                break
    finally:
        server.terminate()
        server.wait(timeout=60)
        server.stderr.close()
    assert [masked(line) for line in lines] == [masked(with_test_model(line)) for line in shown]


def option_names() -> set[str]:
    """Every option of every minillm command, bench's (argparse) included."""
    import typer

    from minillm.cli import app
    names, commands = set(), [typer.main.get_command(app)]
    while commands:
        command = commands.pop()
        commands += getattr(command, "commands", {}).values()
        names.update(o for p in command.params for o in (*p.opts, *p.secondary_opts))
    for bench in ("throughput", "latency", "serving"):
        names.update(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", run_minillm(["bench", bench, "--help"]).stdout))
    return names | {"--help"}


def test_every_flag_the_readme_names_is_taken_or_refused_with_a_reason():
    from minillm.cli import VLLM_FLAGS_NOT_TAKEN
    text = (REPO / "README.md").read_text()
    flags = {f.replace("_", "-") for f in re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*|-[a-z]{2,})\b", text)}
    flags -= {"-m", "-n", "-e", "--unix-socket"}         # pip's, pytest's and curl's
    unknown = flags - option_names() - set(VLLM_FLAGS_NOT_TAKEN)
    assert unknown == set()


def test_structured_outputs_example_prints_a_complete_object_of_the_schema(stories_path, capsys, monkeypatch):
    """The README's structured-outputs snippet, run after the Python API example it continues, prints
    a whole object of its schema (its max_tokens leaves room for the grammar to complete)."""
    import json
    api, _ = block_after("from minillm import LLM, SamplingParams\n")
    [structured] = [text for lang, text in readme_blocks() if lang == "python"
                    and text.startswith("from minillm import StructuredOutputsParams")]
    monkeypatch.chdir(REPO)
    namespace = {}
    exec(with_test_model(api), namespace)
    capsys.readouterr()
    try:
        exec(structured, namespace)
    finally:
        namespace["llm"].shutdown()
    value = json.loads(capsys.readouterr().out)
    assert set(value) == {"age"} and isinstance(value["age"], int) and 0 <= value["age"] <= 120
