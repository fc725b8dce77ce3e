"""A decode request whose caller leaves while its add is in flight, and whose add the engine then
refuses (its id is in use, its prefill engine serves other weights): the refused add's claimed
lease is given back at once, with the engine on a thread (AsyncLLMEngine) or in its own process
(AsyncLLM), never left to the lease's expiry; and the refused add aborts nothing of the request
that holds its id."""
from __future__ import annotations

import asyncio
import os

import pytest

from minillm import SamplingParams
from minillm.config import EngineConfig
from minillm.server.async_engine import AsyncLLMEngine
from minillm.server.async_llm import AsyncLLM

from test_abuse30_pd_engine import cancel_queued_add
from test_kv_transfer import PROMPTS, claim, engines, prefill, wait_until_free


def lease_counts(producer) -> tuple[int, int, int]:
    """The producer's (leases held, released, expired)."""
    stats = producer.stats(cells=1)
    return stats.kv_transfer_num_leases, stats.kv_transfer_leases_released, stats.kv_transfer_leases_expired


def other_weights(kv: dict) -> dict:
    """kv_transfer_params whose region names weights other than the decode engine's."""
    return {**kv, "remote_region": {**kv["remote_region"], "model": "f" * 64}}


@pytest.mark.parametrize("refusal", ["id-in-use", "other-weights"])
def test_a_refused_add_whose_caller_left_releases_its_lease_thread_core(stories_path, refusal):
    producer, consumer, plain = engines(stories_path, lease_s=60)
    async_engine = AsyncLLMEngine(consumer)
    try:
        ids = plain.tokenizer.encode(PROMPTS[1], add_special_tokens=True)
        kv = claim(prefill(producer, "p", ids), ids)
        params = SamplingParams(temperature=0, max_tokens=8, extra_args={
            "kv_transfer_params": kv if refusal == "id-in-use" else other_weights(kv)})

        async def main():
            holder = None
            if refusal == "id-in-use":     # a running request holds the id: the add is refused
                holder = await async_engine.add_request("d", ids[:4], SamplingParams(max_tokens=12, ignore_eos=True))
            await cancel_queued_add(async_engine, "d", ids, params, abort_first=False)
            outputs = [output async for output, _ in holder] if holder is not None else []
            while async_engine.engine.has_unfinished_requests():
                await async_engine.get_stats()
            return outputs

        outputs = asyncio.run(main())
        if refusal == "id-in-use":        # the caller that left aborted nothing of the request holding the id
            assert outputs[-1].outputs[0].finish_reason == "length"
            assert len(outputs[-1].outputs[0].token_ids) == 12
        wait_until_free(producer, timeout=10)
        assert lease_counts(producer) == (0, 1, 0)
        assert consumer.stats(cells=1).kv_num_used_blocks == 0
    finally:
        async_engine.shutdown()
        for engine in (producer, consumer, plain):
            engine.shutdown()


def hold_on_fifo(engine) -> None:
    """A core_hook: the utility hold(path) keeps the core's loop until the FIFO at path is closed by
    its writer (commands queue up meanwhile)."""
    def hold(path):
        with open(path) as fifo:
            fifo.read()
        return True

    engine.hold = hold


def test_a_refused_add_whose_caller_left_releases_its_lease_process_core(stories_path, tmp_path):
    producer, _, plain = engines(stories_path, lease_s=60)
    config = EngineConfig(str(stories_path), device="cpu", block_size=8, kv_transfer_config={"kv_role": "kv_consumer"})
    fifo = str(tmp_path / "hold")
    os.mkfifo(fifo)
    async_llm = AsyncLLM(config, hold_on_fifo)
    try:
        ids = plain.tokenizer.encode(PROMPTS[1], add_special_tokens=True)
        kv = claim(prefill(producer, "p", ids), ids)
        params = SamplingParams(temperature=0, max_tokens=8, extra_args={"kv_transfer_params": other_weights(kv)})

        async def main():
            holding = asyncio.ensure_future(async_llm.call_utility("hold", fifo))
            writer = await asyncio.get_running_loop().run_in_executor(None, open, fifo, "w")   # the core holds
            adding = asyncio.ensure_future(async_llm.add_request("d", ids, params))
            await asyncio.sleep(0)                   # the add is sent: the core refuses it once let go
            assert "d" in async_llm._adds
            adding.cancel()
            with pytest.raises(asyncio.CancelledError):
                await adding
            writer.close()
            assert await holding is True
            await async_llm.get_stats()              # the core has handled the add

        asyncio.run(main())
        wait_until_free(producer, timeout=10)
        assert lease_counts(producer) == (0, 1, 0)
    finally:
        async_llm.shutdown()
        for engine in (producer, plain):
            engine.shutdown()
