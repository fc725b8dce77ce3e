"""The API server's engine clients, driven without an engine: AsyncLLM's handlers called in the order a
race would make (an add that reuses the id of a request whose add the core refuses), and costs that must
grow with what a request holds, not with its square (a DELTA stream nobody reads; bad words' look at the
output, each step, plain and verifying drafts), counted in ids and characters copied, never timed."""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from minillm.bad_words import bad_word_entries, banned_next_tokens
from minillm.engine_core import messages as m
from minillm.engine_core.output_processor import OutputProcessor
from minillm.outputs import CompletionOutput, RequestOutput
from minillm.sampling_params import SamplingParams
from minillm.server.async_engine import OutputQueue, RequestStream
from minillm.server.async_llm import AsyncLLM
from minillm.sequence import Sequence
from minillm.spec_decode import draft_row_views

RID = "r"


class FakeCore:
    """What AsyncLLM sends to its core, kept in order."""

    def __init__(self) -> None:
        self.sent = []

    def send(self, message) -> None:
        self.sent.append(message)

    def adds(self) -> list[m.AddRequest]:
        return [one for one in self.sent if isinstance(one, m.AddRequest)]


def frontend(tok) -> AsyncLLM:
    """An AsyncLLM with no core process and no reader thread: the test calls its handlers."""
    llm = AsyncLLM.__new__(AsyncLLM)
    llm.config = SimpleNamespace(scheduling_policy="fcfs")
    llm.tokenizer, llm.core, llm.client_index = tok, FakeCore(), 0
    llm.max_model_len, llm.vocab_size, llm.prefix_block_size = 256, tok.vocab_size, 0
    llm.processor = OutputProcessor(tok)
    llm._lock = threading.Lock()
    llm._adds, llm._retiring, llm._calls = {}, {}, {}
    llm._dead, llm._failed, llm._stopping = None, False, False
    return llm


async def until(condition, what: str) -> None:
    """Let the event loop run until condition() holds (a bounded number of turns, no clock)."""
    for _ in range(100):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never came: {what}")


async def second_add_after_a_cancelled_first(llm, prompt):
    """Add RID, cancel its caller while the add is in flight, add RID again: the second add (a task) waits for the id."""
    first = asyncio.ensure_future(llm.add_request(RID, prompt, SamplingParams(max_tokens=4)))
    await until(lambda: len(llm.core.adds()) == 1, "the first add")
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    second = asyncio.ensure_future(llm.add_request(RID, prompt, SamplingParams(max_tokens=4)))
    await until(lambda: RID in llm._retiring, "the second add waiting for the id")
    return second


def test_an_add_waiting_for_a_refused_requests_id_goes_once_the_core_refuses_it(tok):
    # The first caller left while its add was in flight; a second add of the same id waited for the core's
    # last word on the first request. The core refused that add, so no step ever retired it: the second
    # add waited for ever.
    llm = frontend(tok)
    prompt = tok.encode("Once upon a time")

    async def scenario():
        second = await second_add_after_a_cancelled_first(llm, prompt)
        assert RID in llm.processor.requests and not llm.processor.requests[RID].is_followed
        llm._on_adds(m.AddResults([(RID, "prompt is too long")]))     # the first add, refused
        await until(lambda: len(llm.core.adds()) == 2, "the second add sent")
        assert llm._retiring == {}
        llm._on_adds(m.AddResults([(RID, None)]))
        stream = await second
        assert stream.request_id == RID and llm.processor.requests[RID].handle is stream
        return stream

    asyncio.run(scenario())
    assert llm.processor.finished == {}      # the refused request never ran: nothing counted


def test_an_add_waiting_for_an_accepted_requests_id_goes_once_the_core_retires_it(tok):
    # The same race with the first add taken: the id is free only at the core's last output for it.
    llm = frontend(tok)
    prompt = tok.encode("Once upon a time")

    async def scenario():
        second = await second_add_after_a_cancelled_first(llm, prompt)
        llm._on_adds(m.AddResults([(RID, None)]))
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(llm.core.adds()) == 1 and RID in llm._retiring     # still the first request's id
        out = m.RequestStepOutput(RID, [m.SeqOutput(0, [], None, "abort", None)], True, 0, None, None, None)
        llm._on_step(m.StepOutputs(1, 0.0, [out]))
        await until(lambda: len(llm.core.adds()) == 2, "the second add sent")
        llm._on_adds(m.AddResults([(RID, None)]))
        return await second

    stream = asyncio.run(scenario())
    assert stream.request_id == RID
    assert llm.processor.finished == {"abort": 1}


NUM_OUTPUTS = 1500


class CountingIds(list):
    """A list that counts the items copied out of it by slices, iteration and concatenation; what
    concatenation makes counts into the same tally."""

    def __init__(self, items=(), tally=None) -> None:
        super().__init__(items)
        self.tally = tally if tally is not None else [0]

    def __getitem__(self, index):
        item = super().__getitem__(index)
        if isinstance(index, slice):
            self.tally[0] += len(item)
        return item

    def __iter__(self):
        self.tally[0] += len(self)
        return super().__iter__()

    def __add__(self, other):
        self.tally[0] += len(self) + len(other)
        return CountingIds(list.__add__(self, list(other)), self.tally)

    def __radd__(self, other):
        self.tally[0] += len(self) + len(other)
        return CountingIds(list(other) + list.__iter__(self), self.tally)


class CountingText(str):
    """A str that counts the characters copied by concatenating it; what that makes counts too."""

    tally = [0]

    def __add__(self, other):
        CountingText.tally[0] += len(self) + len(other)
        return CountingText(str.__add__(self, other))

    def __radd__(self, other):
        CountingText.tally[0] += len(self) + len(other)
        return CountingText(str.__add__(other, self))


def delta(index: int, step: int, tally: list[int], finish_reason: str | None = None) -> CompletionOutput:
    """Completion index's delta of one step: one token, its text and its log-probability."""
    return CompletionOutput(index, CountingText(f"w{step} "), CountingIds([step], tally), -float(step),
                            CountingIds([{step: -1.0}], tally), finish_reason, None)


def test_a_delta_stream_nobody_reads_copies_each_output_once(tok):
    # The backlog of a caller that did not read was rebuilt at each step (held text + new text, held ids +
    # new ids): 1500 steps copied 1.1 million ids, as many log-probabilities and 7 million characters.
    tally, CountingText.tally[0] = [0], 0

    async def scenario():
        loop, queue = asyncio.get_running_loop(), OutputQueue()
        stream = RequestStream(RID, loop, queue, is_delta=True)
        for step in range(NUM_OUTPUTS):
            done = step == NUM_OUTPUTS - 1
            stream.deliver(RequestOutput(RID, None, [1], [None, {1: -0.5}] if step == 0 else None,
                                         [delta(0, step, tally, "length" if done else None)], done), float(step))
        assert len(queue) == 1
        return await queue.get_all()

    [(_, out, seen)] = asyncio.run(scenario())
    [completion] = out.outputs
    assert completion.token_ids == list(range(NUM_OUTPUTS))
    assert completion.logprobs == [{step: -1.0} for step in range(NUM_OUTPUTS)]
    assert completion.text == "".join(f"w{step} " for step in range(NUM_OUTPUTS))
    assert (completion.finish_reason, completion.cumulative_logprob) == ("length", -float(NUM_OUTPUTS - 1))
    assert out.finished and out.prompt_logprobs == [None, {1: -0.5}] and seen == NUM_OUTPUTS - 1
    # ids and log-probabilities once each, whatever the backlog
    assert tally[0] <= 4 * NUM_OUTPUTS and CountingText.tally[0] <= 8 * NUM_OUTPUTS


def test_a_delta_backlog_of_several_completions_adds_each_up_apart():
    tally = [0]

    async def scenario():
        loop, queue = asyncio.get_running_loop(), OutputQueue()
        stream = RequestStream(RID, loop, queue, is_delta=True)
        outputs = [[delta(0, 0, tally), delta(1, 0, tally)],
                   [delta(0, 1, tally, "stop")],                      # 0 ends; 1 has nothing new
                   [CompletionOutput(1, "", [], 0.0, None, None, None)],   # 1: a step without log-probabilities
                   [delta(1, 3, tally, "length"), delta(2, 3, tally)]]
        for step, completions in enumerate(outputs):
            stream.deliver(RequestOutput(RID, None, [1], None, completions, False), float(step))
        [(_, out, _)] = await queue.get_all()
        stream.deliver(RequestOutput(RID, None, [1], None, [delta(2, 4, tally, "abort")], True), 4.0)
        [(_, last, _)] = await queue.get_all()
        return out, last

    out, last = asyncio.run(scenario())
    got = [(c.index, c.text, c.token_ids, c.finish_reason, c.cumulative_logprob, c.logprobs) for c in out.outputs]
    assert got == [(0, "w0 w1 ", [0, 1], "stop", -1.0, [{0: -1.0}, {1: -1.0}]),
                   (1, "w0 w3 ", [0, 3], "length", -3.0, None),
                   (2, "w3 ", [3], None, -3.0, [{3: -1.0}])]
    assert not out.finished
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in last.outputs] == [(2, "w4 ", [4], "abort")]
    assert last.finished


def story_ids(tok, count: int) -> list[int]:
    """count ids of ordinary text (repeated as needed)."""
    ids = tok.encode("Once upon a time, there was a little girl named Lily. She liked to play outside. ",
                     add_special_tokens=False)
    return [ids[i % len(ids)] for i in range(count)]


def bad_words_seq(tok) -> Sequence:
    """A sequence whose bad words are words of the story, several tokens each, its ids counted."""
    params = SamplingParams(temperature=1.0, bad_words=["little girl", "play outside", "Lily"])
    params.update_from_tokenizer(tok, tok.vocab_size)
    assert params._bad_word_ids.max_prefix_len >= 2
    seq = Sequence(RID, 0, tok.encode("Once upon a time"), params, 0.0, np.random.default_rng(0), 10**6)
    seq.token_ids = CountingIds(seq.token_ids)
    return seq


def test_bad_words_read_only_the_last_outputs_each_step(tok):
    # Each step copied every output id of each row with bad words (output_token_ids): 1500 steps, 1.1
    # million ids; a ban looks at max_prefix_len of them.
    seq = bad_words_seq(tok)
    ids, outputs, num_banned = seq.params._bad_word_ids, [], 0
    for token in story_ids(tok, NUM_OUTPUTS):
        seq.token_ids.append(token)
        outputs.append(token)
        rows, banned = bad_word_entries([seq], [0])
        assert banned == banned_next_tokens(ids, outputs) and rows == [0] * len(banned)
        num_banned += len(banned) > 1           # a word's last token, after its first ones
    assert num_banned > 0
    assert seq.token_ids.tally[0] <= (ids.max_prefix_len + 1) * NUM_OUTPUTS


def test_bad_words_of_rows_verifying_drafts_read_only_the_last_outputs(tok):
    seq = bad_words_seq(tok)
    ids, outputs, num_banned = seq.params._bad_word_ids, [], 0
    story = story_ids(tok, NUM_OUTPUTS + 2)
    for step in range(NUM_OUTPUTS):
        drafts = story[step:step + 3]
        seq.num_output_placeholders = len(drafts) + 1
        views = draft_row_views([seq], [drafts])
        for j, view in enumerate(views):
            banned = bad_word_entries([view], [0])[1]
            assert banned == banned_next_tokens(ids, outputs + drafts[:j])
            num_banned += len(banned) > 1
        seq.num_output_placeholders = 0
        seq.token_ids.append(story[step])
        outputs.append(story[step])
    assert num_banned > 0
    assert seq.token_ids.tally[0] <= (ids.max_prefix_len + 1) * NUM_OUTPUTS
