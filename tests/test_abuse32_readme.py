"""README.md against what minillm does: its shown error for an unreachable Hub and the vLLM LLM arguments it
says are taken at one value only."""
import os
import re
import shlex
import socket
import subprocess
import sys

import pytest
from conftest import REPO

README = (REPO / "README.md").read_text()


def free_port() -> int:
    """A local port nothing listens on (bound, then closed): a connection to it is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def hub_reason_masked(line: str) -> str:
    """LINE with the Hub's address and the connection error's own words masked (they vary by network)."""
    return re.sub(r"the Hugging Face Hub at \S+ cannot be reached \(.*?\);",
                  "the Hugging Face Hub at HUB cannot be reached (ERROR);", line)


def test_the_mistyped_model_path_error_is_the_one_an_unreachable_hub_gives(tmp_path):
    """The README shows the line a user without network sees; it named an exception the store no
    longer raises (LocalEntryNotFoundError), where the store says the Hub cannot be reached."""
    if not (REPO / "../shared/models/stories260K/config.json").is_file():
        pytest.skip("the README's model path ../shared/models/stories260K is not there")
    [command, shown] = re.search(r"^\$ (minillm generate shared/stories260K .*)\n(.*)$", README,
                                 flags=re.MULTILINE).groups()
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    env.pop("HF_HUB_OFFLINE", None)
    result = subprocess.run([sys.executable, "-m", "minillm", *shlex.split(command)[1:]], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    expected = shown.replace("/root/.cache/huggingface/hub", str(tmp_path))
    assert hub_reason_masked(result.stderr.strip()) == hub_reason_masked(expected)


def other_value(value):
    """A value of the same kind as VALUE and unlike it."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if value is None:
        return "something"
    if isinstance(value, dict):
        return {"key": 1}
    return value + "-other"


def test_the_vllm_llm_arguments_named_at_one_value_refuse_another():
    """The README lists vLLM LLM() arguments "where the value is what minillm does anyway" as
    name=value, and says another value is a ValueError; swap_space takes any size (as vLLM's V1
    engine, which swaps nothing either), so it cannot be listed at 0."""
    from minillm.llm import VLLM_FIXED_ARGS
    [listed] = re.findall(r"what minillm does anyway\n(.*?)another value is a `ValueError`", README, flags=re.DOTALL)
    pairs = re.findall(r"`(\w+)=([^`]+)`", listed)
    assert len(pairs) >= 8
    for name, text in pairs:
        value = eval(text, {})                                          # the README's literal
        is_taken, _why = VLLM_FIXED_ARGS[name]
        assert is_taken(value), name
        assert not is_taken(other_value(value)), f"{name}={other_value(value)!r} is taken too"
