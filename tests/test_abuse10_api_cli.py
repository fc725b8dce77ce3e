"""The Python API and the CLI as careless users run them: closed stdin, broken model directories,
odd engine settings and unreadable option files."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from test_cli import REPO, STORIES, minillm, needs_stories


def minillm_stdin_closed(*args: str) -> subprocess.CompletedProcess:
    """Run the CLI with file descriptor 0 closed, as `minillm ... <&-` in a shell does."""
    return subprocess.run([sys.executable, "-m", "minillm.cli", *args], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=None, capture_output=True,
                          text=True, timeout=120, preexec_fn=lambda: os.close(0))


def test_a_closed_stdin_is_one_line_for_prompts_file_dash_and_for_chat():
    result = minillm_stdin_closed("generate", str(STORIES), "--device", "cpu", "--prompts-file", "-")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "minillm: error: --prompts-file -: stdin is closed; give a file, or pipe the prompts in"]
    result = minillm_stdin_closed("chat", str(STORIES), "--device", "cpu")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == ["minillm: error: chat reads your messages from stdin, which is closed"]
