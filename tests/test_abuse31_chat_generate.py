"""`minillm generate` read from a terminal as llama-cli's users run it: prompts typed at stdin."""
from __future__ import annotations

import os
import sys

import pytest
from test_chat import REPO, STORIES, needs_stories


@needs_stories
def test_prompts_file_dash_from_a_terminal_says_it_reads_stdin_and_how_to_end():
    # --prompt - said "reading the prompt from stdin (Ctrl-D ends it)"; --prompts-file - waited
    # without a word, the terminal still, as if the command hung.
    pexpect = pytest.importorskip("pexpect")
    env = {**os.environ, "TERM": "dumb", "PYTHONPATH": str(REPO)}
    child = pexpect.spawn(sys.executable, ["-m", "minillm.cli", "generate", str(STORIES), "--device", "cpu",
                                           "--prompts-file", "-", "--max-tokens", "1", "--temperature", "0"],
                          cwd=str(REPO), env=env, encoding="utf-8", timeout=120)
    child.sendline("Once")
    child.sendline("Lily")
    child.sendeof()
    index = child.expect_exact(["minillm generate: reading the prompts from stdin, one a line (Ctrl-D ends them)",
                                pexpect.EOF])
    seen = child.before
    child.expect(pexpect.EOF)
    child.close()
    assert index == 0, seen
    assert child.exitstatus == 0
