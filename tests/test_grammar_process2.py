"""Structured outputs with the grammar process, what went wrong when it died: requests waiting for
their grammar there, a new process started while a step still reads the old one's masks, requests
added after it died idle, compiles queued at its stop, the message of a request it cut short."""
from minillm import SamplingParams, StructuredOutputsParams
from test_grammar_process import alone, kill, long_constrained, new_engine, run, step_until_done, tokens_until
from test_structured_engine import PROMPT, assert_valid, constrained


def test_requests_waiting_for_their_grammar_when_the_process_died_get_a_new_one(stories_path):
    # The second grammar's compile was never sent (the process was found gone) and never answered:
    # its second request waited for it forever. And every request still waiting for its grammar
    # ended with the process's error, though nothing of it was lost with the process.
    engine = new_engine(stories_path, True)
    try:
        for kind in ("date", "choice"):
            for seed in (0, 1):
                engine.add_request(f"{kind}-{seed}", PROMPT, constrained(kind, seed))
        first = engine.structured_outputs._process
        kill(first)
        done = step_until_done(engine)
        assert sorted(done) == ["choice-0", "choice-1", "date-0", "date-1"]
        for request_id, out in done.items():
            assert_valid(request_id.split("-")[0], out, request_id)
        assert engine.structured_outputs._process is not first
    finally:
        engine.shutdown()


def test_a_grammar_whose_process_dies_twice_ends_with_the_error(stories_path):
    # A request moves to a new process once: a grammar that takes processes down does not start them forever.
    engine = new_engine(stories_path, True)
    try:
        engine.add_request("c", PROMPT, constrained("date", 0))
        done = {}
        for _ in range(2):
            process = engine.structured_outputs._process
            kill(process)
            for _ in range(1000):
                if engine.structured_outputs._process is not process:
                    break
                done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
            assert engine.structured_outputs._process is not process, "no new process was started"
        out = {**done, **step_until_done(engine)}["c"]
        assert out.finish_reason == "error" and "the grammar process failed" in out.stop_reason
    finally:
        engine.shutdown()


def test_a_new_process_started_while_a_step_reads_the_old_ones_masks(stories_path):
    # The restart unmapped the old process's mask buffers under the step in flight (a segfault),
    # and then sent the old process's matcher handles to the new one (a KeyError there: the step
    # failed, and the unconstrained request beside it was aborted).
    plain = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    expected = alone(stories_path, plain).token_ids
    engine = new_engine(stories_path, True)
    try:
        engine.add_request("a", PROMPT, long_constrained())
        counts = {}
        tokens_until(engine, counts, "a", 5)
        engine.add_request("u", PROMPT, plain)
        tokens_until(engine, counts, "u", 3)
        first = engine.structured_outputs._process
        kill(first)
        first.poll()                      # found gone (as a compile check finds it)
        engine.add_request("b", PROMPT, constrained("date", 3))     # starts the next process
        done = step_until_done(engine)
        assert done["u"].token_ids == expected and done["u"].finish_reason == "length"
        assert done["a"].finish_reason == "error" and len(done["a"].token_ids) < 200
        assert_valid("date", done["b"])
        assert engine.structured_outputs._process is not first
    finally:
        engine.shutdown()


def test_a_process_stopped_with_compiles_queued_prints_no_traceback(stories_path, capfd):
    # Stopping cancels the compiles still queued there, and the callback that answers a compile
    # raised CancelledError from each of them: a traceback on the engine's stderr for every one.
    engine = new_engine(stories_path, True)
    try:
        manager = engine._structured_output_manager()
        grammars = [manager.grammar_init(StructuredOutputsParams(regex=f"x{i}[a-z]{{1,{i + 1}}}")).result()
                    for i in range(24)]
        process = manager._process
        for grammar in grammars:
            process.compile(grammar)
        process.shutdown()
        assert process._proc.returncode is not None
    finally:
        engine.shutdown()
    assert "Traceback" not in capfd.readouterr().err


def test_requests_added_after_the_process_died_idle_get_a_new_one(stories_path):
    # Nothing had found the process gone, so the new requests' grammars were sent to it: they
    # ended with "the grammar process did not take the grammar", and only the next ones got a new process.
    engine = new_engine(stories_path, True)
    try:
        assert_valid("date", run(engine, {"a": constrained("date", 0)})["a"])
        first = engine.structured_outputs._process
        kill(first)
        done = run(engine, {"b": constrained("date", 1), "c": constrained("json", 1)})
        assert_valid("date", done["b"])
        assert_valid("json", done["c"])
        assert engine.structured_outputs._process is not first
    finally:
        engine.shutdown()


def test_a_request_cut_short_by_the_process_says_so_not_that_its_token_broke_the_grammar(stories_path):
    # It read "token 413 is not allowed by the grammar (the grammar process failed: ...)".
    engine = new_engine(stories_path, True)
    try:
        engine.add_request("a", PROMPT, long_constrained())
        tokens_until(engine, {}, "a", 5)
        process = engine.structured_outputs._process
        kill(process)
        out = step_until_done(engine)["a"]
        assert out.finish_reason == "error"
        assert out.stop_reason.startswith("structured_outputs: the grammar process failed: the grammar process is gone")
        assert "not allowed by the grammar" not in out.stop_reason
    finally:
        engine.shutdown()
