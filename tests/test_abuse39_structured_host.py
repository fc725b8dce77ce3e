"""The engine thread's work for constrained rows whose matchers live in a grammar process (stories260K,
CPU, async scheduling): a decode step writes the process one message (its advance, and the fill of the
next step's masks), the pipe is polled without building a selector, and a failed command of such a
message leaves the commands after it answered."""
import pytest

from minillm import SamplingParams
from minillm import grammar_process as gp
from test_grammar_process import long_constrained, new_engine, tokens_until
from test_structured_engine import PROMPT


@pytest.fixture
def steady(stories_path):
    """An engine with three long constrained requests and a plain one, all decoding; (engine, its grammar process)."""
    engine = new_engine(stories_path, True)
    try:
        for i in range(3):
            engine.add_request(f"c{i}", PROMPT, long_constrained(i))
        counts: dict[str, int] = {}
        for request_id in ("c0", "c1", "c2"):
            tokens_until(engine, counts, request_id, 3)
        engine.add_request("plain", PROMPT, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        tokens_until(engine, counts, "plain", 3)       # added once the grammar is there: it would run ahead
        yield engine, engine.structured_outputs._process
    finally:
        engine.shutdown()


def test_a_decode_step_writes_the_grammar_process_one_message(steady, monkeypatch):
    engine, process = steady
    messages, post = [], process._post
    monkeypatch.setattr(process, "_post", lambda message: (messages.append(message), post(message)))

    def no_selector(*args):
        raise AssertionError("the pipe was polled through Connection.poll")
    monkeypatch.setattr(type(process._conn), "poll", no_selector)
    for _ in range(6):
        messages.clear()
        engine.step()
        assert [m[0] for m in messages] == [gp.BATCH], messages
        assert [command[0] for command in messages[0][1]] == [gp.ADVANCE, gp.FILL]
        assert len(messages[0][1][0][1]) == 3               # the three constrained rows' handles
    assert {r.request_id for r in engine.stats(cells=1).requests} == {"c0", "c1", "c2", "plain"}


def test_a_failed_command_in_a_batch_leaves_the_commands_after_it_answered(steady):
    """An advance the process cannot take (a matcher it does not hold) answers an error; the fill
    that went in the same message is still answered, and the process goes on."""
    engine, process = steady
    engine.step()
    stranger = gp.RemoteMatcher(process, 10_000, None)
    advanced = process.advance([stranger], [[5]])
    assert not advanced.done() and process._outbox       # held for the next command
    filled = process.fill(0, [], [])
    with pytest.raises(gp.GrammarProcessError, match="KeyError"):
        advanced.result()
    assert isinstance(filled.result(), float) and not process.failed
    assert stranger.is_error() and stranger.is_stopped()
    for _ in range(3):
        engine.step()
    assert not process.failed
