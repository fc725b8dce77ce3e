"""Seams the server tests open inside the LLMEngine, in whichever process runs it.

`install` is a core_hook (running_server(core_hook=install)): it is called with the LLMEngine
before it serves, in the engine core's process or on the server's engine thread, and wraps the
engine's step, abort_request and stats with recorders and failure switches. The tests drive them
through utility calls (test_server_helpers.call_utility), which run between two steps.
"""
from __future__ import annotations

import time

from minillm.engine import StepError


def install(engine) -> None:
    """Give the engine the utilities below."""
    real_step, real_abort, real_stats = engine.step, engine.abort_request, engine.stats
    state = {"log": None, "fail_for": None, "fatal": None, "stats_calls": 0, "aborts": [], "pace": 0.0}

    def step():
        if state["fatal"] is not None:
            raise RuntimeError(state["fatal"])
        if state["fail_for"] is not None:
            # As LLMEngine does for a contained failure: abort the requests hit, then raise StepError.
            prompts, state["fail_for"] = state["fail_for"], None
            hit = [rid for rid, req in engine.requests.items() if req.prompt_token_ids in prompts]
            for rid in hit:
                real_abort(rid)
            raise StepError(request_ids=hit, cause=RuntimeError("injected kernel fault"))
        if state["log"] is not None:
            state["log"].append("step")
        started = time.perf_counter()
        outputs = real_step()
        # A step as long as a large batch's on a GPU: counts of steps between two processes' events
        # then measure the engine, not the time a message spends between processes on a busy machine.
        time.sleep(max(0.0, state["pace"] - (time.perf_counter() - started)))
        return outputs

    def abort_request(request_id):
        if state["log"] is not None:
            state["log"].append("abort")
        req = engine.requests.get(request_id)
        if req is not None and not req.is_finished:
            state["aborts"].append((request_id, time.time(), engine.metrics.num_steps,
                                    sum(seq.num_output_tokens for seq in req.seqs)))
        return real_abort(request_id)

    def stats(cells=64, **kwargs):
        state["stats_calls"] += 1
        return real_stats(cells, **kwargs)

    def fail_next_step_for(prompts):
        """The next step fails for the requests with these prompt ids only (a contained failure)."""
        state["fail_for"] = [list(p) for p in prompts]

    def fail_every_step(message):
        """Every step from now on raises RuntimeError(message): a failure that cannot be contained."""
        state["fatal"] = message

    def pace_steps(seconds):
        """From now on each step lasts at least `seconds` (0: as long as it takes)."""
        state["pace"] = float(seconds)

    def start_log():
        """Record "step" and "abort" in the order they happen, from now on."""
        state["log"] = []

    def take_log():
        """The record so far; recording stops."""
        log, state["log"] = state["log"], None
        return log

    def stats_calls():
        """How many snapshots the engine has built."""
        return state["stats_calls"]

    def aborted_requests():
        """(request_id, time.time(), engine step count, output tokens) for each live request aborted so far."""
        return state["aborts"]

    def unfinished_prompts():
        """The prompt token ids of every request the engine holds."""
        return [req.prompt_token_ids for req in engine.requests.values() if not req.is_finished]

    engine.step, engine.abort_request, engine.stats = step, abort_request, stats
    for utility in (fail_next_step_for, fail_every_step, pace_steps, start_log, take_log, stats_calls, aborted_requests,
                    unfinished_prompts):
        setattr(engine, utility.__name__, utility)
