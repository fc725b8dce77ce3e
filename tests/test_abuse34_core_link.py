"""An API server joining an engine core whose socket directory is gone (its starter was killed
during the load and the core left): a plain startup error, not zmq's ipc-path message."""
from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minillm.engine_core.client import CoreLink, CoreStartupError, EngineCoreClient

REPO = Path(__file__).resolve().parents[1]


def test_joining_a_core_whose_socket_directory_is_gone_says_so(tmp_path):
    gone = tmp_path / "minillm-core-gone"
    reader, writer = mp.get_context("spawn").Pipe(duplex=False)
    link = CoreLink(0, f"ipc://{gone}/input-0", f"ipc://{gone}/output-0", reader)
    try:
        with pytest.raises(CoreStartupError) as info:
            EngineCoreClient(link=link)
    finally:
        reader.close()
        writer.close()
    message = str(info.value)
    assert "ended before this API server could join it" in message
    assert "ipc path" not in message


CORE_WITH_ITS_STARTER_GONE = """
import multiprocessing as mp, os, sys, time
from minillm.config import EngineConfig
from minillm.engine_core import core
from minillm.engine_core.core import CoreSpec, run_engine_core

start = core.LoadWatch.start
def start_and_take_the_news(watch):
    start(watch)
    for _ in range(6000):        # the watch's StarterGone lands here, as it can land inside start() itself
        time.sleep(0.01)
    print("the watch never fired", flush=True)
core.LoadWatch.start = start_and_take_the_news
directory = sys.argv[2]
os.mkdir(directory)
reader, writer = mp.Pipe(duplex=False)
writer.close()                   # the starter is gone before the core has begun to watch for it
config = EngineConfig(model=sys.argv[1], device="cpu")
run_engine_core(CoreSpec(config, [f"ipc://{directory}/input-0"], [f"ipc://{directory}/output-0"], reader))
print("core returned", flush=True)
"""


def test_a_core_whose_starter_is_gone_before_it_watches_leaves_quietly(stories_path, tmp_path):
    # The core's load watch raised StarterGone into the main thread while the watch itself was being
    # started, outside the code that handles it: a server killed outright right after spawning its
    # core left a traceback on the terminal (the core exited 1). The script holds the core inside the
    # watch's start until the news comes, so it lands there every time.
    directory = tmp_path / "minillm-core-test"
    script = tmp_path / "core.py"
    script.write_text(CORE_WITH_ITS_STARTER_GONE)
    done = subprocess.run([sys.executable, str(script), str(stories_path), str(directory)], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "StarterGone" not in done.stderr, done.stderr
    assert done.stdout.strip() == "core returned"
    assert not directory.exists()          # its socket directory is removed
