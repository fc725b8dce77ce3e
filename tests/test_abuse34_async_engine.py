"""The API server's engine clients, driven without an engine: AsyncLLM's handlers called in the order a
race would make (an add that reuses the id of a request whose add the core refuses)."""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from minillm.engine_core import messages as m
from minillm.engine_core.output_processor import OutputProcessor
from minillm.sampling_params import SamplingParams
from minillm.server.async_llm import AsyncLLM

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


def test_an_add_waiting_for_a_refused_requests_id_goes_once_the_core_refuses_it(tok):
    # The first caller left while its add was in flight; a second add of the same id waited for the core's
    # last word on the first request. The core refused that add, so no step ever retired it: the second
    # add waited for ever.
    llm = frontend(tok)
    prompt = tok.encode("Once upon a time")

    async def scenario():
        first = asyncio.ensure_future(llm.add_request(RID, prompt, SamplingParams(max_tokens=4)))
        await until(lambda: len(llm.core.adds()) == 1, "the first add")
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert RID in llm.processor.requests and not llm.processor.requests[RID].is_followed
        second = asyncio.ensure_future(llm.add_request(RID, prompt, SamplingParams(max_tokens=4)))
        await until(lambda: RID in llm._retiring, "the second add waiting for the id")
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
        first = asyncio.ensure_future(llm.add_request(RID, prompt, SamplingParams(max_tokens=4)))
        await until(lambda: len(llm.core.adds()) == 1, "the first add")
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        second = asyncio.ensure_future(llm.add_request(RID, prompt, SamplingParams(max_tokens=4)))
        await until(lambda: RID in llm._retiring, "the second add waiting for the id")
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

