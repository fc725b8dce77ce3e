"""A decode engine on a thread of the API server (AsyncLLMEngine): a request whose caller leaves while
its add is still queued gives its claimed lease back at once (its API server left the release to
the engine, which may have taken the request), never leaving it to the lease's expiry."""
from __future__ import annotations

import asyncio
import threading

import pytest

from minillm import SamplingParams
from minillm.kv_connector.endpoint import LeaseReleaser
from minillm.server.async_engine import AsyncLLMEngine

from test_kv_transfer import PROMPTS, claim, engines, prefill, wait_until_free


@pytest.fixture
def released(monkeypatch):
    """Lease ids the decode engine sent releases for."""
    seen: list[str] = []
    real = LeaseReleaser.release

    def release(self, host, port, lease_id):
        seen.append(lease_id)
        return real(self, host, port, lease_id)

    monkeypatch.setattr(LeaseReleaser, "release", release)
    return seen


class Held:
    """A utility of the engine that holds its thread until let go (commands queue up meanwhile)."""

    def __init__(self, engine) -> None:
        self.entered, self.gate = threading.Event(), threading.Event()
        engine.hold_thread = self

    def __call__(self) -> bool:
        self.entered.set()
        self.gate.wait(30)
        return True


async def cancel_queued_add(async_engine: AsyncLLMEngine, request_id: str, ids: list[int],
                            params: SamplingParams, abort_first: bool) -> None:
    """Queue an add behind a held engine thread and cancel its caller before the thread takes it
    (abort_first: behind an abort of the running request of the same id, so the add is deferred
    until that one is retired)."""
    held = Held(async_engine.engine)
    holding = asyncio.ensure_future(async_engine.call_utility("hold_thread"))
    await asyncio.get_running_loop().run_in_executor(None, held.entered.wait, 30)
    if abort_first:
        async_engine.abort(request_id)
    adding = asyncio.ensure_future(async_engine.add_request(request_id, ids, params))
    await asyncio.sleep(0)                       # the add runs up to its wait: the command is queued
    assert async_engine._commands.qsize() == 1 + abort_first
    adding.cancel()
    with pytest.raises(asyncio.CancelledError):
        await adding
    held.gate.set()
    assert await holding is True
    await async_engine.get_stats()               # every command queued before it has been handled


@pytest.mark.parametrize("in_use", [False, True], ids=["fresh-id", "id-of-a-request-retiring"])
def test_an_add_cancelled_in_flight_releases_its_lease_at_once(stories_path, released, in_use):
    producer, consumer, plain = engines(stories_path, lease_s=60)
    async_engine = AsyncLLMEngine(consumer)
    try:
        ids = plain.tokenizer.encode(PROMPTS[1], add_special_tokens=True)
        kv = prefill(producer, "p", ids)
        params = SamplingParams(temperature=0, max_tokens=8, extra_args={"kv_transfer_params": claim(kv, ids)})

        async def main():
            if in_use:   # the id names a running request, aborted just before the add: the add waits a step
                await async_engine.add_request("d", ids[:4], SamplingParams(max_tokens=200, ignore_eos=True))
            await cancel_queued_add(async_engine, "d", ids, params, abort_first=in_use)
            while async_engine.engine.has_unfinished_requests():
                await async_engine.get_stats()

        asyncio.run(main())
        assert released == [kv["remote_lease_id"]]
        wait_until_free(producer)
        stats = producer.stats(cells=1)
        assert (stats.kv_transfer_leases_released, stats.kv_transfer_leases_expired) == (1, 0)
        assert consumer.stats(cells=1).kv_num_used_blocks == 0
    finally:
        async_engine.shutdown()
        for engine in (producer, consumer, plain):
            engine.shutdown()


def model_copy(stories_path, out, change_weights: bool):
    """stories260K in another directory: the same weights (linked), or one of its tensors changed."""
    from minillm.loader import checkpoint_tensors
    out.mkdir()
    for f in stories_path.iterdir():
        if f.name != "model.safetensors" or not change_weights:
            (out / f.name).symlink_to(f)
    if change_weights:
        data = bytearray((stories_path / "model.safetensors").read_bytes())
        entry = min(checkpoint_tensors(stories_path).values(), key=lambda e: e.start)
        data[entry.start] ^= 0x01            # one bit of one weight: another fine-tune, as far as KV goes
        (out / "model.safetensors").write_bytes(bytes(data))
    return out


@pytest.mark.parametrize("change_weights", [False, True], ids=["same-weights-elsewhere", "other-weights"])
def test_a_decode_engine_refuses_kv_of_other_weights_of_the_same_shape(stories_path, tmp_path, change_weights):
    from minillm.config import EngineConfig
    from minillm.engine import LLMEngine
    producer_path = model_copy(stories_path, tmp_path / "producer", change_weights)
    producer = LLMEngine(EngineConfig(str(producer_path), device="cpu", block_size=8,
                                      kv_transfer_config={"kv_role": "kv_producer", "kv_lease_s": 60}))
    consumer = LLMEngine(EngineConfig(str(stories_path), device="cpu", block_size=8,
                                      kv_transfer_config={"kv_role": "kv_consumer"}))
    try:
        ids = consumer.tokenizer.encode(PROMPTS[0], add_special_tokens=True)
        params = SamplingParams(temperature=0, max_tokens=4,
                                extra_args={"kv_transfer_params": claim(prefill(producer, "p", ids), ids)})
        if change_weights:
            with pytest.raises(ValueError, match=r"^kv_transfer_params: the prefill engine serves other weights "
                                                 r"\(fingerprint \w{12}\) than this engine \(\w{12}\): both must "
                                                 r"serve the same model"):
                consumer.add_request("d", ids, params)
            assert not consumer.has_unfinished_requests()
        else:
            consumer.add_request("d", ids, params)
            while consumer.has_unfinished_requests():
                consumer.step()
            wait_until_free(producer)
            assert consumer.stats(cells=1).kv_transfer_tokens == len(ids) - 1
    finally:
        producer.shutdown()
        consumer.shutdown()
