"""A report that raises while a step makes its outputs (Ctrl-C, a detokenizer's error) loses only
its own news: the other requests with news are reported by the next step, and every one of them
finishes and leaves the engine."""
from __future__ import annotations

import pytest

from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.sampling_params import SamplingParams


def test_requests_after_a_report_that_raised_are_reported_by_the_next_step(stories_path):
    engine = LLMEngine(EngineConfig(model=str(stories_path), device="cpu"))
    try:
        for i, prompt in enumerate(["Once", "The dog", "Lily liked to"]):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=6, temperature=0))
        processor = engine.output_processor
        real, calls = processor.request_output, []

        def interrupted_once(req, finished):
            if finished:                    # the step where all three finish: their last news
                calls.append(req.request_id)
                if len(calls) == 1:
                    raise KeyboardInterrupt
            return real(req, finished)

        processor.request_output = interrupted_once
        with pytest.raises(KeyboardInterrupt):
            while engine.has_unfinished_requests():
                engine.step()
        processor.request_output = real
        finished, steps = set(), 0
        while engine.has_unfinished_requests():
            steps += 1
            assert steps < 50, f"requests never finish: {sorted(engine.requests)}"
            finished |= {out.request_id for out in engine.step() if out.finished}
        # The interrupted one's last report is lost (it has left the engine); the two after it are
        # reported by the next step, and none is left behind.
        assert finished == {"r0", "r1", "r2"} - {calls[0]} and not engine.requests
    finally:
        engine.shutdown()
