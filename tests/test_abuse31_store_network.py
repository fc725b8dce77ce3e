"""minillm pull when the Hugging Face Hub cannot be reached: one line that says so, within seconds,
never a wait without end (huggingface_hub's client sets no timeout on its metadata calls)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest


def pull(tmp_path, endpoint: str, *args: str) -> subprocess.CompletedProcess:
    """`minillm pull` in its own interpreter (huggingface_hub reads HF_ENDPOINT when imported)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf"), HF_HUB_ETAG_TIMEOUT="1")
    return subprocess.run([sys.executable, "-m", "minillm", "pull", *args], env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.fixture
def silent_hub():
    """The URL of a server that takes connections and never answers (a firewall, a stuck proxy)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)        # the kernel completes the handshakes; nobody reads or writes
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


@pytest.fixture
def closed_hub():
    """The URL of a port nobody listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_a_hub_that_never_answers_is_named_after_the_metadata_timeout(tmp_path, silent_hub):
    done = pull(tmp_path, silent_hub, "Qwen/Qwen3-0.6B")
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert f"the Hugging Face Hub at {silent_hub} did not answer within 1 s" in line, line
    assert "HF_HUB_OFFLINE=1" in line


def test_a_hub_that_cannot_be_reached_is_named_as_such(tmp_path, closed_hub):
    done = pull(tmp_path, closed_hub, "Qwen/Qwen3-0.6B", "--revision", "v1")
    assert done.returncode == 1, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("minillm: error: Qwen/Qwen3-0.6B could not be fetched at revision 'v1' into "), line
    assert f"the Hugging Face Hub at {closed_hub} cannot be reached" in line, line
    assert "HF_HUB_OFFLINE=1" in line
