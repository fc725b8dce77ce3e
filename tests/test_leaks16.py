"""A long-running server keeps no per-request state once a request has ended, however it ended.

Each test drives requests through a real server and then counts what is left in the maps that
follow a request (the API server's output processor, the engine core's routes, the engine's
queues and blocks), waiting on that state to drain, with a generous limit as a safety net.
"""
from __future__ import annotations

import sys
import threading

import httpx
import pytest
from core_hooks import install
from test_server_helpers import call_utility, wait_for

from minillm.config import EngineConfig
from minillm.engine_core.client import CoreProcess
from minillm.server.app import ServerOptions, ServerThread, create_app
from minillm.server.async_llm import AsyncLLM

MODEL = "stories"
DRAIN_S = 30.0     # a safety net only: every wait below polls state and returns as soon as it holds


def install_with_counts(engine) -> None:
    """core_hooks.install, plus a utility that counts the per-request state the core holds."""
    install(engine)

    def per_request_counts():
        """Entries in the engine's and the core loop's per-request maps, and the KV blocks in use."""
        counts = {"requests": len(engine.requests), "changed": len(engine._changed),
                  "waiting": engine.scheduler.num_waiting, "running": engine.scheduler.num_running,
                  "used_blocks": engine.block_manager.num_used_blocks}
        frame = sys._getframe(1)
        while frame is not None:   # the core loop and its EngineCore call this utility: they are on the stack
            owner = frame.f_locals.get("self")
            frame = frame.f_back
            if hasattr(owner, "client_of"):
                counts["client_of"] = len(owner.client_of)
            if hasattr(owner, "_prompt_logprobs_sent"):
                counts["prompt_logprobs_sent"] = len(owner._prompt_logprobs_sent)
        return counts

    engine.per_request_counts = per_request_counts


def _drained(counts: dict) -> bool:
    return all(value == 0 for value in counts.values())


@pytest.fixture(scope="module")
def two_servers(stories_path):
    """One engine core for two API servers in this process: ([urls], [AsyncLLM])."""
    config = EngineConfig(model=str(stories_path), device="cpu", max_model_len=256)
    core = CoreProcess(config, 2, install_with_counts)
    engines = [AsyncLLM(config, link=link) for link in core.links]
    servers = [ServerThread(create_app(engine, ServerOptions(served_model_name=MODEL))).start() for engine in engines]
    try:
        yield [server.url for server in servers], engines
    finally:
        for server in servers:
            server.stop()
        for engine in engines:
            engine.shutdown()
        core.stop()
        core.close()


def test_a_failed_step_on_the_second_api_server_leaves_nothing_behind(two_servers):
    """A step that fails for a request of the second API server: the core's last output for it
    (the next step's) must reach that server, whose output processor follows the request until
    then; sent to the first server instead, the second kept the request for ever."""
    urls, engines = two_servers
    core = engines[0]
    prompts = ["Lily and Ben", "One day, a cat", "The little dog"]
    results: dict[str, int] = {}

    def post(prompt: str) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 200, "ignore_eos": True}
        results[prompt] = httpx.post(f"{urls[1]}/v1/completions", json=body, timeout=60).status_code

    for prompt in prompts:
        ids = engines[1].tokenizer.encode(prompt, add_special_tokens=True)
        call_utility(core, "pace_steps", 0.05)     # the request is still running when the failure is armed
        try:
            thread = threading.Thread(target=post, args=(prompt,))
            thread.start()
            assert wait_for(lambda: ids in call_utility(core, "unfinished_prompts"), timeout=DRAIN_S)
            call_utility(core, "fail_next_step_for", [ids])
            thread.join(DRAIN_S)
        finally:
            call_utility(core, "pace_steps", 0)
        assert not thread.is_alive() and results[prompt] == 500

    counts = call_utility(core, "per_request_counts")
    assert {"client_of", "prompt_logprobs_sent"} <= counts.keys(), counts
    assert wait_for(lambda: _drained(call_utility(core, "per_request_counts")), timeout=DRAIN_S), \
        call_utility(core, "per_request_counts")
    assert wait_for(lambda: not engines[1].processor.requests, timeout=DRAIN_S), \
        f"{len(engines[1].processor.requests)} failed requests still followed by the second API server"
    assert not engines[0].processor.requests
