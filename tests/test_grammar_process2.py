"""Structured outputs with the grammar process, what went wrong when it died: requests sharing a
grammar whose process was gone before they were sent there, and a new process started while a
step still reads the old one's masks."""
from minillm import SamplingParams, StructuredOutputsParams
from test_grammar_process import new_engine, run
from test_structured_engine import PROMPT, assert_valid, constrained


def step_until_done(engine, max_steps: int = 2000) -> dict:
    """Step until no request is left (at most max_steps); request id -> its CompletionOutput."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    raise AssertionError(f"requests still unfinished after {max_steps} steps: {sorted(engine.requests)}")


def test_requests_sharing_a_grammar_end_when_the_process_died_before_it_was_sent(stories_path):
    # The second grammar's compile was never sent (the process was found gone) and never answered:
    # its second request waited for it forever.
    engine = new_engine(stories_path, True)
    try:
        for kind in ("date", "choice"):
            for seed in (0, 1):
                engine.add_request(f"{kind}-{seed}", PROMPT, constrained(kind, seed))
        first = engine.structured_outputs._process
        first._proc.kill()
        first._proc.wait()
        done = step_until_done(engine)
        assert sorted(done) == ["choice-0", "choice-1", "date-0", "date-1"]
        assert all(out.finish_reason == "error" for out in done.values())
        assert_valid("date", run(engine, {"again": constrained("date", 3)})["again"])
    finally:
        engine.shutdown()
