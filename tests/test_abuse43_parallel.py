"""Tensor parallelism and prefill/decode disaggregation abused as vLLM users abuse them: ranks
killed while the engine idles, on the engine core's thread as in its own process."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal

import httpx
import pytest
from test_server_helpers import running_server, wait_for

from minillm import LLM


def test_a_worker_killed_while_a_thread_engine_idles_ends_it_before_any_request(stories_path):
    # --engine-core thread: the engine thread slept on its command queue, so /health said 200 until a
    # request found the worker gone (the engine core process watches its workers' sentinels).
    with running_server(stories_path, engine_core="thread", tensor_parallel_size=2) as (url, engine):
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        [worker] = engine.engine.runner.workers.pids
        os.kill(worker, signal.SIGKILL)
        assert wait_for(lambda: httpx.get(f"{url}/health", timeout=30).status_code == 503, timeout=60)
        error = httpx.get(f"{url}/health", timeout=30).json()["error"]
        assert error["code"] == "engine_dead" and "rank 1" in error["message"], error
        assert engine.has_failed


def test_a_kv_budget_that_holds_no_block_is_the_value_error_of_one_process(stories_path):
    # Each rank sizes its own pool (vLLM's kv_cache_memory_bytes is per device): rank 0's refusal was
    # wrapped as "rank 0 failed in a tensor-parallel call" (a RuntimeError), and the command line
    # answered it with a plain error, exit status 1, where one process names the flag.
    earlier = set(mp.active_children())
    with pytest.raises(ValueError, match=r"^kv_cache_memory_bytes 10 holds no KV block: a block of 16 tokens "
                                         r"takes 10240 bytes"):
        LLM(str(stories_path), device="cpu", tensor_parallel_size=2, kv_cache_memory_bytes=10)
    assert set(mp.active_children()) <= earlier                  # the group was stopped
