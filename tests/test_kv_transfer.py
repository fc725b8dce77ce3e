"""Prefill/decode disaggregation's parts: the lease table, the config, the shared-memory transport,
the transfer endpoint's messages, and the connector inside two engines in one process.

End to end through `minillm serve` and `minillm router` processes: test_pd_disagg.py.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time

import numpy as np
import pytest

from minillm.config import EngineConfig
from minillm.device import CpuDevice
from minillm.engine import LLMEngine
from minillm.kv_connector.endpoint import ClaimClient, KVGrant, KVRefusal, LeaseReleaser, TransferEndpoint
from minillm.kv_connector.lease import LeaseError, LeaseTable, prompt_hash
from minillm.kv_connector.pd_connector import RemotePrefill
from minillm.kv_connector.transfer_config import KVTransferConfig, role_config
from minillm.kv_connector.transport import (SEGMENT_PREFIX, SHM_DIR, KVRegion, SharedSegment, attach_segment,
                                            sweep_stale_segments)
from minillm.router import Backends, prefill_body
from minillm.sampling_params import SamplingParams


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------------------------------
# The lease table
# ---------------------------------------------------------------------------------------------

def test_a_lease_is_claimed_once_by_its_own_prompt_and_freed_when_released():
    clock = FakeClock()
    table = LeaseTable(30, clock)
    lease = table.create([4, 5, 6], "abc", 40)
    assert table.snapshot().num_blocks == 3 and table.seconds_to_deadline() == 30
    with pytest.raises(LeaseError, match="another prompt"):
        table.claim(lease.lease_id, "abd", 40)
    with pytest.raises(LeaseError, match="another prompt"):
        table.claim(lease.lease_id, "abc", 41)
    clock.now += 20
    claimed = table.claim(lease.lease_id, "abc", 40)
    assert claimed.block_ids == [4, 5, 6] and claimed.deadline == clock.now + 30   # a fresh window to copy
    with pytest.raises(LeaseError, match="already claimed"):
        table.claim(lease.lease_id, "abc", 40)
    assert table.take_ended() == []
    assert table.release(lease.lease_id) and not table.release(lease.lease_id)
    assert table.seconds_to_deadline() == 0.0                  # ended, blocks not taken yet
    assert table.snapshot().num_blocks == 3
    ended = table.take_ended()
    assert [e.block_ids for e in ended] == [[4, 5, 6]] and table.take_ended() == []
    snap = table.snapshot()
    assert (snap.num_leases, snap.num_blocks, snap.num_created, snap.num_released, snap.num_expired) == (0, 0, 1, 1, 0)
    assert table.seconds_to_deadline() is None
    with pytest.raises(LeaseError, match="already released"):
        table.claim(lease.lease_id, "abc", 40)
    with pytest.raises(LeaseError, match="does not exist"):
        table.claim("no-such-lease", "abc", 40)


def test_a_lease_nobody_releases_expires_claimed_or_not():
    clock = FakeClock()
    table = LeaseTable(5, clock)
    idle = table.create([1], "h1", 3)
    copying = table.create([2, 3], "h2", 20)
    clock.now += 4
    table.claim(copying.lease_id, "h2", 20)                    # its deadline moves to now + 5
    clock.now += 1.5
    assert [e.lease_id for e in table.take_ended()] == [idle.lease_id]
    with pytest.raises(LeaseError, match="expired"):
        table.claim(idle.lease_id, "h1", 3)
    assert table.seconds_to_deadline() == pytest.approx(3.5)
    clock.now += 3.5
    assert [e.block_ids for e in table.take_ended()] == [[2, 3]]
    assert table.snapshot().num_expired == 2 and not table.release(copying.lease_id)


def test_concurrent_claims_of_one_lease_grant_it_once():
    table = LeaseTable(30)
    lease = table.create([0], "h", 1)
    results, barrier = [], threading.Barrier(8)

    def claim():
        barrier.wait()
        try:
            results.append(table.claim(lease.lease_id, "h", 1))
        except LeaseError:
            results.append(None)

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r is not None for r in results) == 1


def test_prompt_hash_is_stable_and_tells_prompts_apart():
    assert prompt_hash([1, 2, 3]) == prompt_hash(np.array([1, 2, 3], dtype=np.int32))
    assert prompt_hash([1, 2, 3]) != prompt_hash([1, 2, 4]) != prompt_hash([1, 2])


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------

def test_kv_transfer_config_takes_vllms_json_and_names_what_is_wrong(stories_path):
    config = KVTransferConfig.from_any('{"kv_connector": "PDConnector", "kv_role": "kv_consumer"}')
    assert config.is_kv_consumer and not config.is_kv_producer and config.kv_lease_s == 30
    assert KVTransferConfig.from_any(role_config("producer", 3)).kv_lease_s == 3
    assert KVTransferConfig.from_any({"kv_role": "kv_both"}).is_kv_producer
    for bad, match in (("{", "not valid JSON"), ('{"kv_role": "prefill"}', "kv_role"),
                       ('{"kv_colour": 1}', "unknown keys kv_colour"), ('{"kv_lease_s": 0}', "kv_lease_s"),
                       ('{"kv_port": 70000}', "kv_port"), ('{"kv_connector": "NixlConnector"}', "kv_connector"),
                       ('[1]', "JSON object")):
        with pytest.raises(ValueError, match=match):
            KVTransferConfig.from_any(bad)
    with pytest.raises(ValueError, match="cuda needs the GPU"):
        KVTransferConfig(kv_role="kv_both", kv_buffer_device="cuda").check_backend("numpy")
    with pytest.raises(ValueError, match="host staging"):
        KVTransferConfig(kv_role="kv_both", kv_buffer_device="cpu").check_backend("cuda")
    with pytest.raises(ValueError, match="cannot be combined"):
        EngineConfig(str(stories_path), kv_transfer_config={"kv_role": "kv_producer"}, kv_offload_gib=0.01)
    with pytest.raises(ValueError, match="cuda needs the GPU"):
        LLMEngine(EngineConfig(str(stories_path), device="cpu", kv_transfer_config={"kv_role": "kv_both",
                                                                               "kv_buffer_device": "cuda"}))


# ---------------------------------------------------------------------------------------------
# The shared-memory transport
# ---------------------------------------------------------------------------------------------

def test_a_shared_pool_is_read_by_another_mapping_block_for_block():
    device = CpuDevice()
    shape = (2, 2, 6, 4, 1, 3)          # [layers, K/V, blocks, block_size, kv_heads, head_dim]
    pool = device.kv_pool_zeros(shape, "float32", shared=True)
    region = device.export_kv_pool(pool, "float32")
    assert region.kind == "shm" and region.num_blocks == 6 and os.path.exists(region.handle)
    pool[:, :, 3] = 7.0
    pool[:, :, 5] = np.arange(2 * 2 * 4 * 3, dtype=np.float32).reshape(2, 2, 4, 1, 3)
    remote = device.import_kv_pool(KVRegion.from_dict(region.to_dict()))
    assert not remote.flags.writeable
    local = CpuDevice().kv_pool_zeros(shape, "float32")
    CpuDevice().copy_blocks(local, np.array([0, 1]), remote, np.array([5, 3]))
    np.testing.assert_array_equal(local[:, :, 0], pool[:, :, 5])
    np.testing.assert_array_equal(local[:, :, 1], pool[:, :, 3])
    assert not local[:, :, 2:].any()
    pool[:, :, 3] = 9.0                 # one memory: later writes are seen through the mapping
    assert (remote[:, :, 3] == 9.0).all()
    with pytest.raises(ValueError, match="do not fit"):
        region.check_compatible((2, 2, 6, 8, 1, 3), "float32")
    with pytest.raises(ValueError, match="do not fit"):
        region.check_compatible((2, 2, 99, 4, 1, 3), "bfloat16")
    region.check_compatible((2, 2, 99, 4, 1, 3), "float32")     # another pool size is fine
    device.release()
    assert not os.path.exists(region.handle)
    with pytest.raises(ValueError, match="is gone"):
        device.import_kv_pool(region)
    with pytest.raises(ValueError, match="only a KV pool allocated with shared=True"):
        device.export_kv_pool(local, "float32")


def test_a_kv_region_is_checked_before_it_is_mapped(tmp_path):
    segment = SharedSegment(4 * 2 * 2 * 3 * 4)
    try:
        good = KVRegion("shm", str(segment.path), (2, 2, 3, 2, 1, 2), "float32")
        assert attach_segment(good).shape == (2, 2, 3, 2, 1, 2)
        with pytest.raises(ValueError, match="holds .* bytes"):
            attach_segment(KVRegion("shm", str(segment.path), (2, 2, 4, 2, 1, 2), "float32"))
        with pytest.raises(ValueError, match="not a minillm KV segment"):
            attach_segment(KVRegion("shm", "/etc/passwd", (2, 2, 3, 2, 1, 2), "float32"))
        with pytest.raises(ValueError, match="CPU backend reads KV from host shared memory"):
            CpuDevice().import_kv_pool(KVRegion("cuda_ipc", b"x" * 64, (2, 2, 3, 2, 1, 2), "float32"))
    finally:
        segment.unlink()
    for bad, match in (({"kind": "nfs"}, "kind"), ({"kind": "shm", "handle": ""}, "no handle"),
                       ({"kind": "shm", "handle": "x", "shape": [1, 2]}, "shape"),
                       ({"kind": "shm", "handle": "x", "shape": [1, 2, 3, 4, 5, True], "dtype": "f"}, "shape"),
                       ("region", "must be an object")):
        with pytest.raises(ValueError, match=match):
            KVRegion.from_dict(bad)


def test_segments_of_dead_producers_are_swept_and_live_ones_kept(tmp_path):
    # A directory of its own: producers that other tests start meanwhile sweep the shared one.
    dead_pid = 2**22 + 12345            # above pid_max's default: no such process
    stale = tmp_path / f"{SEGMENT_PREFIX}{dead_pid}-feedbeef"
    live = SharedSegment(16, directory=tmp_path)
    try:
        stale.write_bytes(b"\0" * 16)
        removed = sweep_stale_segments(tmp_path)
        assert removed == [stale] and live.path.exists()
        stale.write_bytes(b"\0" * 16)
        SharedSegment(16, directory=tmp_path).unlink()      # a new producer's segment sweeps first
        assert not stale.exists() and live.path.exists()
    finally:
        live.unlink()


# ---------------------------------------------------------------------------------------------
# The endpoint's messages
# ---------------------------------------------------------------------------------------------

def test_claims_are_granted_or_refused_and_a_release_ends_the_lease():
    table = LeaseTable(30)
    region = {"kind": "shm", "handle": "/dev/shm/x", "shape": [1, 2, 3, 4, 5, 6], "dtype": "float32", "device": ""}
    endpoint = TransferEndpoint("127.0.0.1", 0, "engine-p", table, region)
    lease = table.create([7, 8], "hash", 20)

    async def talk():
        client = ClaimClient(timeout_s=5)
        try:
            other = await client.claim("127.0.0.1", endpoint.port, lease.lease_id, "other", 20)
            grant = await client.claim("127.0.0.1", endpoint.port, lease.lease_id, "hash", 20)
            again = await client.claim("127.0.0.1", endpoint.port, lease.lease_id, "hash", 20)
            missing = await client.claim("127.0.0.1", endpoint.port, "nope", "hash", 20)
            return other, grant, again, missing
        finally:
            client.close()

    try:
        endpoint.sock.getsockopt  # the endpoint is up
        import zmq
        garbage = zmq.Context.instance().socket(zmq.DEALER)
        garbage.connect(f"tcp://127.0.0.1:{endpoint.port}")
        garbage.send(b"\x93not a message")               # ignored: the endpoint goes on
        other, grant, again, missing = asyncio.run(talk())
        garbage.close(0)
        assert isinstance(other, KVRefusal) and "another prompt" in other.reason and "engine-p" in other.reason
        assert isinstance(grant, KVGrant) and grant.block_ids == [7, 8] and grant.region == region
        assert grant.engine_id == "engine-p" and grant.lease_s == 30
        assert isinstance(again, KVRefusal) and "already claimed" in again.reason
        assert isinstance(missing, KVRefusal) and "does not exist" in missing.reason
        releaser = LeaseReleaser()
        releaser.release("127.0.0.1", endpoint.port, lease.lease_id)
        deadline = time.monotonic() + 30
        ended = []
        while not ended and time.monotonic() < deadline:
            ended = table.take_ended()
            time.sleep(0.01)
        releaser.close()
        assert [e.lease_id for e in ended] == [lease.lease_id] and table.snapshot().num_released == 1
    finally:
        endpoint.close()


def test_a_claim_to_an_endpoint_nobody_runs_times_out():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def claim():
        client = ClaimClient(timeout_s=0.3)
        try:
            return await client.claim("127.0.0.1", port, "lease", "hash", 3)
        finally:
            client.close()

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(claim())


def test_a_decode_server_keeps_sockets_to_a_bounded_few_producers(monkeypatch):
    """Producer addresses come from clients: the least recently used socket is closed past the cap."""
    from minillm.kv_connector import endpoint
    monkeypatch.setattr(endpoint, "MAX_ENDPOINTS", 2)

    producers = [TransferEndpoint("127.0.0.1", 0, f"engine-{i}", LeaseTable(30), {}) for i in range(3)]
    ports = [p.port for p in producers]

    async def connect():
        client = ClaimClient(timeout_s=30)
        try:
            for port in (ports[0], ports[1], ports[0], ports[2]):     # each answers: no such lease
                assert isinstance(await client.claim("127.0.0.1", port, "lease", "hash", 3), KVRefusal)
            with pytest.raises(ValueError, match="is not an address"):
                await client.claim("no such host!", 7004, "lease", "hash", 3)
            return client.endpoints
        finally:
            client.close()

    try:
        assert asyncio.run(connect()) == [("127.0.0.1", ports[0]), ("127.0.0.1", ports[2])]
    finally:
        for producer in producers:
            producer.close()


def test_a_decode_engine_keeps_release_sockets_to_a_bounded_few_producers(monkeypatch):
    """The decode engine releases leases at addresses that clients named: past the cap, the least
    recently used socket is closed."""
    from minillm.kv_connector import endpoint
    monkeypatch.setattr(endpoint, "MAX_ENDPOINTS", 2)
    releaser = LeaseReleaser()
    try:
        for port in (7001, 7002, 7001, 7003):      # nobody listens: a release is queued, never waited for
            releaser.release("127.0.0.1", port, "lease")
        releaser.release("no such host!", 7004, "lease")   # logged, not raised, and no socket kept
        assert releaser.endpoints == [("127.0.0.1", 7001), ("127.0.0.1", 7003)]
    finally:
        releaser.close()


def test_the_router_asks_the_prefill_server_for_one_token_and_takes_turns():
    body = {"prompt": "x", "max_tokens": 50, "min_tokens": 10, "stream": True,
            "stream_options": {"include_usage": True},
            "max_completion_tokens": 50, "temperature": 0}
    assert prefill_body(body) == {"prompt": "x", "max_tokens": 1, "max_completion_tokens": 1, "stream": False,
                                  "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}}
    assert body["max_tokens"] == 50      # the original goes to the decode server unchanged
    backends = Backends("decode", ("http://a/", "http://b", "http://c"))
    assert [backends.order()[0] for _ in range(4)] == ["http://a", "http://b", "http://c", "http://a"]
    assert sorted(backends.order()) == ["http://a", "http://b", "http://c"]


# ---------------------------------------------------------------------------------------------
# The connector in two engines (one process, the CPU backend)
# ---------------------------------------------------------------------------------------------

PROMPTS = ["Once upon a time there was a little girl named Lily who loved to play in the park with her friends",
           "Tom had a big red ball. He liked to kick it high into the sky and run after it all day long",
           "The sun was shining and the birds were singing when Ben went out to find his lost dog"]


def engines(stories_path, lease_s: float = 30, **kw):
    """A producer, a consumer and a plain engine over stories260K."""
    make = lambda transfer: LLMEngine(EngineConfig(str(stories_path), device="cpu", block_size=8,   # noqa: E731
                                                   kv_transfer_config=transfer, **kw))
    return (make({"kv_role": "kv_producer", "kv_lease_s": lease_s}), make({"kv_role": "kv_consumer"}), make(None))


def run(engine: LLMEngine, request_id: str, ids: list[int], params: SamplingParams):
    """Add one request and step until it is done; its last output."""
    engine.add_request(request_id, ids, params)
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out
    return last


def prefill(producer: LLMEngine, request_id: str, ids: list[int]) -> dict:
    """Run a do_remote_decode request on the producer; the kv_transfer_params it returns."""
    out = run(producer, request_id, ids, SamplingParams(temperature=0, max_tokens=1,
                                                        extra_args={"kv_transfer_params": {"do_remote_decode": True}}))
    return out.kv_transfer_params


def claim(kv: dict, ids: list[int], load_within: float = 60.0) -> dict:
    """Claim the lease as a decode API server does; the kv_transfer_params its engine reads."""
    async def ask():
        client = ClaimClient(timeout_s=10)
        try:
            return await client.claim(kv["remote_host"], kv["remote_port"], kv["remote_lease_id"], prompt_hash(ids),
                                      len(ids))
        finally:
            client.close()

    grant = asyncio.run(ask())
    assert isinstance(grant, KVGrant), grant
    return RemotePrefill(grant.lease_id, kv["remote_host"], kv["remote_port"], grant.engine_id, grant.block_ids,
                         len(ids), prompt_hash(ids), KVRegion.from_dict(grant.region),
                         time.monotonic() + load_within).to_params()


def wait_until_free(engine: LLMEngine, timeout: float = 30) -> None:
    """Let an idle producer act on releases until it holds no lease and no block."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        engine.service_kv_transfers()
        stats = engine.stats(cells=1)
        if stats.kv_transfer_num_leases == 0 and stats.kv_num_used_blocks == 0:
            return
        time.sleep(0.01)
    raise AssertionError("the producer still holds leased blocks")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decoding_from_loaded_kv_gives_the_single_engines_text(stories_path, async_scheduling):
    producer, consumer, plain = engines(stories_path, async_scheduling=async_scheduling)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        for i, text in enumerate(PROMPTS):
            ids = plain.tokenizer.encode(text, add_special_tokens=True)
            reference = run(plain, f"ref-{i}", ids, greedy)
            kv = prefill(producer, f"p-{i}", ids)
            assert kv["remote_num_tokens"] == len(ids) and kv["do_remote_prefill"] is True
            assert len(kv["remote_block_ids"]) == -(-len(ids) // 8)
            assert producer.stats(cells=1).kv_transfer_num_leased_blocks == len(kv["remote_block_ids"])
            before = consumer.stats(cells=1)
            params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                    extra_args={"kv_transfer_params": claim(kv, ids)})
            out = run(consumer, f"d-{i}", ids, params)
            assert out.outputs[0].text == reference.outputs[0].text
            assert out.outputs[0].token_ids == reference.outputs[0].token_ids
            after = consumer.stats(cells=1)
            assert after.kv_transfer_tokens - before.kv_transfer_tokens == len(ids) - 1
            assert after.prefill_tokens_total - before.prefill_tokens_total == 1     # the last prompt token only
            assert after.prompt_tokens_total - before.prompt_tokens_total == len(ids)
            assert after.prompt_tokens_by_source["external_kv_transfer"] \
                - before.prompt_tokens_by_source["external_kv_transfer"] == len(ids) - 1
            assert out.kv_transfer_stats["num_tokens"] == len(ids) - 1
            wait_until_free(producer)
        assert consumer.stats(cells=1).kv_num_used_blocks == 0
        assert producer.stats(cells=1).kv_transfer_leases_released == len(PROMPTS)
    finally:
        for engine in (producer, consumer, plain):
            engine.shutdown()


def test_a_local_prefix_hit_loads_only_the_rest_and_a_stale_claim_computes(stories_path):
    producer, consumer, plain = engines(stories_path)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        ids = plain.tokenizer.encode(PROMPTS[0], add_special_tokens=True)
        reference = run(plain, "ref", ids, greedy).outputs[0].text
        run(consumer, "warm", ids[:17], SamplingParams(temperature=0, max_tokens=1))   # caches 2 blocks of 8
        kv = prefill(producer, "p0", ids)
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                extra_args={"kv_transfer_params": claim(kv, ids)})
        out = run(consumer, "d0", ids, params)
        assert out.outputs[0].text == reference and out.kv_transfer_stats["num_tokens"] == len(ids) - 1 - 16
        # A claim whose window has passed is not used: the prompt is computed here, the lease released.
        kv = prefill(producer, "p1", ids)
        before = consumer.stats(cells=1)
        stale = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                               extra_args={"kv_transfer_params": claim(kv, ids, load_within=-1)})
        out = run(consumer, "d1", ids, stale)
        after = consumer.stats(cells=1)
        assert out.outputs[0].text == reference and out.kv_transfer_stats is None
        assert after.kv_transfer_tokens == before.kv_transfer_tokens
        assert after.kv_transfer_stale_claims == before.kv_transfer_stale_claims + 1
        wait_until_free(producer)
        assert producer.stats(cells=1).kv_transfer_leases_expired == 0
    finally:
        for engine in (producer, consumer, plain):
            engine.shutdown()


def test_a_request_aborted_before_its_load_releases_the_lease(stories_path):
    producer, consumer, plain = engines(stories_path)
    try:
        ids = plain.tokenizer.encode(PROMPTS[1], add_special_tokens=True)
        kv = prefill(producer, "p", ids)
        consumer.add_request("d", ids, SamplingParams(temperature=0, max_tokens=8,
                                                       extra_args={"kv_transfer_params": claim(kv, ids)}))
        consumer.abort_request("d")
        consumer.step()
        wait_until_free(producer)
        assert producer.stats(cells=1).kv_transfer_leases_released == 1
    finally:
        for engine in (producer, consumer, plain):
            engine.shutdown()


def test_an_unreleased_lease_expires_and_its_blocks_go_back(stories_path):
    producer, consumer, plain = engines(stories_path, lease_s=0.3)
    try:
        ids = plain.tokenizer.encode(PROMPTS[2], add_special_tokens=True)
        prefill(producer, "p", ids)
        assert producer.stats(cells=1).kv_num_used_blocks > 0
        wait = producer.service_kv_transfers()
        assert wait is not None and 0 <= wait <= 0.3
        wait_until_free(producer)
        stats = producer.stats(cells=1)
        assert stats.kv_transfer_leases_expired == 1 and stats.kv_num_cached_blocks > 0   # freed into the prefix cache
        assert producer.service_kv_transfers() is None
    finally:
        for engine in (producer, consumer, plain):
            engine.shutdown()


def test_kv_transfer_params_are_checked_where_they_enter_the_engine(stories_path):
    producer, consumer, plain = engines(stories_path)
    try:
        ids = plain.tokenizer.encode(PROMPTS[0], add_special_tokens=True)
        kv = prefill(producer, "p", ids)
        good = claim(kv, ids)

        def add(engine, extra, n=1, prompt=ids):
            engine.add_request(f"r{time.monotonic_ns()}", prompt, SamplingParams(
                n=n, max_tokens=4, extra_args={"kv_transfer_params": extra}))

        cases = [
            (plain, good, 1, ids, "takes no part in KV transfers"),
            (consumer, {"do_remote_decode": True}, 1, ids, "needs a KV producer"),
            (producer, good, 1, ids, "needs a KV consumer"),
            (consumer, {"do_nothing": True}, 1, ids, "must set do_remote_decode or do_remote_prefill"),
            (consumer, good, 2, ids, "n = 1"),
            (consumer, good, 1, ids[:-1], "another prompt"),
            (consumer, {**good, "remote_block_ids": good["remote_block_ids"][:1]}, 1, ids, "cannot hold"),
            (consumer, {**good, "remote_block_ids": [10**6] * 8}, 1, ids, "outside the prefill engine's pool"),
            (consumer, {k: v for k, v in good.items() if k != "remote_region"}, 1, ids, "no remote_region"),
            (consumer, {**good, "remote_port": "80"}, 1, ids, "must be integers"),
            (consumer, {**good, "remote_region": {**good["remote_region"], "handle": "/dev/shm/minillm-kv-1-x"}}, 1,
             ids, "is gone"),
            (consumer, {**good, "remote_region": {**good["remote_region"], "shape": [1, 2, 99999, 4, 5, 6]}}, 1, ids,
             "do not fit"),
            (consumer, "yes", 1, ids, "must be an object"),
        ]
        for engine, extra, n, prompt, match in cases:
            with pytest.raises(ValueError, match=match) as info:
                add(engine, extra, n, prompt)
            assert str(info.value).startswith("kv_transfer_params")
        assert not consumer.has_unfinished_requests()
    finally:
        for engine in (producer, consumer, plain):
            engine.shutdown()


def test_a_request_that_fits_only_once_a_lease_ends_waits_for_it(stories_path):
    """Leases may hold the whole pool: a waiting request is admitted when one ends, never refused."""
    plain = LLMEngine(EngineConfig(str(stories_path), device="cpu"))
    ids, other = (plain.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS[:2])
    plain.shutdown()
    num_blocks = -(-len(ids) // 8) + 1          # the lease leaves one block free; the other request needs two
    producer = LLMEngine(EngineConfig(str(stories_path), device="cpu", block_size=8, num_kv_blocks=num_blocks,
                                      max_model_len=num_blocks * 8, kv_transfer_config={"kv_role": "kv_producer",
                                                                                        "kv_lease_s": 0.5}))
    try:
        prefill(producer, "held", ids)
        assert producer.stats(cells=1).kv_transfer_num_leased_blocks == num_blocks - 1
        out = run(producer, "waits", other[:12], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert out.finished and len(out.outputs[0].token_ids) == 4
        assert producer.stats(cells=1).kv_transfer_leases_expired == 1
    finally:
        producer.shutdown()


def test_servers_with_the_engine_on_a_thread_hand_kv_over_and_the_idle_producer_frees_it(stories_path):
    """--engine-core thread: the producer's idle engine thread wakes for the release."""
    import httpx
    from test_server_helpers import get_stats, running_server, wait_for
    producer_config = {"kv_role": "kv_producer", "kv_lease_s": 30}
    consumer_config = {"kv_role": "kv_consumer"}
    with running_server(stories_path, engine_core="thread", kv_transfer_config=producer_config) as (p_url, _), \
            running_server(stories_path, engine_core="thread", kv_transfer_config=consumer_config) as (d_url, _):
        body = {"model": "stories", "prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0}
        alone = httpx.post(f"{p_url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        first = httpx.post(f"{p_url}/v1/completions", timeout=60,
                           json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()
        assert get_stats(p_url)["kv_transfer_num_leases"] == 1
        routed = httpx.post(f"{d_url}/v1/completions", timeout=60,
                            json={**body, "kv_transfer_params": first["kv_transfer_params"]})
        assert routed.status_code == 200 and routed.json()["choices"][0]["text"] == alone
        assert wait_for(lambda: get_stats(p_url)["kv_transfer_num_leases"] == 0, timeout=30)
        assert get_stats(p_url)["kv_num_used_blocks"] == 0 and get_stats(d_url)["kv_num_used_blocks"] == 0


def test_cuda_copy_blocks_device_to_device_and_past_the_largest_pitch():
    """CudaDevice.copy_blocks between two device pools (a pool opened by CUDA IPC and ours), with
    the CUDA copies played by memmove over host memory: one 2D copy per run of blocks, or, where the
    pools' rows lie further apart than a 2D copy's largest pitch, one copy per (layer, K|V) row."""
    import ctypes
    import types

    from minillm.device import CudaDevice
    calls = []

    def memcpy2d(dst, dpitch, src, spitch, width, height, kind, stream):
        calls.append(("2d", width, height, kind, stream))
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)

    def memcpy(dst, src, size, kind, stream):
        calls.append(("1d", size, 1, kind, stream))
        ctypes.memmove(dst, src, size)

    class OnDevice:                      # what copy_blocks reads of a CuPy array
        def __init__(self, a):
            self.a, self.shape, self.dtype = a, a.shape, a.dtype
            self.data = types.SimpleNamespace(ptr=a.ctypes.data)

    rng = np.random.default_rng(1)
    for max_pitch, kind in ((2**31 - 1, "2d"), (100, "1d")):
        rt = types.SimpleNamespace(memcpy2DAsync=memcpy2d, memcpyAsync=memcpy, memcpyHostToDevice=1,
                                   memcpyDeviceToHost=2, memcpyDeviceToDevice=3, getDevice=lambda: 0,
                                   deviceGetAttribute=lambda attribute, device, p=max_pitch: p)
        device = CudaDevice.__new__(CudaDevice)
        device.cp = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt))
        device.stream = types.SimpleNamespace(ptr=77)                  # the compute stream: the default
        remote = OnDevice(rng.standard_normal((3, 2, 9, 4, 2, 5)).astype(np.float32))  # [L, 2, blocks, bs, H, D]
        local = OnDevice(np.zeros((3, 2, 6, 4, 2, 5), np.float32))
        calls.clear()
        device.copy_blocks(local, np.array([2, 3, 0]), remote, np.array([7, 8, 1]))
        assert np.array_equal(local.a[:, :, [2, 3, 0]], remote.a[:, :, [7, 8, 1]])
        assert not local.a[:, :, [1, 4, 5]].any()
        assert {c[0] for c in calls} == {kind} and {c[3] for c in calls} == {3} and {c[4] for c in calls} == {77}
        assert len(calls) == (2 if kind == "2d" else 2 * 6)    # two runs; 6 rows each when row by row


def test_a_segment_loses_its_name_when_its_process_exits_without_unlinking():
    """A producer whose engine is never shut down (an engine thread left running) leaves nothing in /dev/shm."""
    import subprocess
    import sys
    from pathlib import Path
    code = ("from minillm.kv_connector.transport import SharedSegment\n"
            "segment = SharedSegment(4096)\n"
            "print(segment.path, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1],
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert out.returncode == 0, out.stderr
    path = out.stdout.strip()
    assert path.startswith(str(SHM_DIR)) and not os.path.exists(path)
