"""Abuse of prefill/decode disaggregation's KV transfer path: what a client puts in kv_transfer_params
and what a peer sends to a transfer endpoint (or answers from one) gets a clear error or is dropped,
never an exception in the engine loop, a 500, or another request's claim answered."""
from __future__ import annotations

import asyncio
import dataclasses
import queue
import socket
import threading
import time

import httpx
import msgspec
import pytest
import zmq
from test_kv_transfer import PROMPTS, claim, engines, prefill, run, wait_until_free
from test_server_helpers import HealthyStreams, openai_error, running_server, wait_for

from minillm.kv_connector.endpoint import (ClaimClient, KVClaim, KVGrant, KVRefusal, KVRelease, Message,
                                           TransferEndpoint)
from minillm.kv_connector.lease import LeaseTable, prompt_hash
from minillm.sampling_params import SamplingParams

MODEL = "stories"

REGION = {"kind": "shm", "handle": "/dev/shm/x", "shape": [1, 2, 3, 4, 5, 6], "dtype": "float32", "device": ""}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recv_reply(sock, request_id: int, timeout: float = 30.0):
    """The endpoint's reply to request_id (others are skipped)."""
    decoder = msgspec.msgpack.Decoder(Message)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sock.poll(100):
            reply = decoder.decode(sock.recv())
            if reply.request_id == request_id:
                return reply
    raise AssertionError(f"no reply to claim {request_id}")


def test_an_oversized_frame_never_reaches_the_endpoint_and_it_keeps_answering():
    # A 200 MiB frame was read whole into the producer's memory (a few such frames: out of memory).
    table = LeaseTable(30)
    endpoint = TransferEndpoint("127.0.0.1", 0, "engine-p", table, REGION)
    lease = table.create([7, 8], "hash", 20)
    sizes = []
    handle = endpoint._handle
    endpoint._handle = lambda identity, data: (sizes.append(len(data)), handle(identity, data))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{endpoint.port}")
        encoder = msgspec.msgpack.Encoder()
        sock.send(b"\x00" * (64 << 20))
        sock.send(encoder.encode(KVClaim(9, lease.lease_id, "hash", 20)))
        reply = recv_reply(sock, 9)
        assert isinstance(reply, KVGrant) and reply.block_ids == [7, 8]
        assert sizes and max(sizes) < 1 << 20       # the claim alone was handled
    finally:
        sock.close()
        endpoint.close()


class RouterPeer:
    """A ROUTER on a thread, at a random local port: each message it receives goes to handle()."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.encoder = msgspec.msgpack.Encoder()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        decoder = msgspec.msgpack.Decoder(Message)
        while not self._stop.is_set():
            self.before_poll()
            if self.sock.poll(20):
                identity, data = self.sock.recv_multipart()
                self.handle(identity, decoder.decode(data))

    def before_poll(self) -> None:
        """Work of the peer's thread between polls (nothing by default)."""

    def handle(self, identity: bytes, message) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sock.close()


class ScriptedPeer(RouterPeer):
    """Keeps the claims it receives and sends what the test hands it."""

    def __init__(self) -> None:
        self.claims: list[tuple[bytes, KVClaim]] = []
        self.outbox: queue.Queue = queue.Queue()
        super().__init__()

    def before_poll(self) -> None:
        while not self.outbox.empty():
            identity, reply = self.outbox.get()
            self.sock.send_multipart([identity, self.encoder.encode(reply)])

    def handle(self, identity: bytes, message) -> None:
        if isinstance(message, KVClaim):
            self.claims.append((identity, message))


def test_a_peer_cannot_answer_a_claim_made_to_another_producer():
    # Replies were matched by request id alone, from any socket: a peer at an address one client
    # chose could answer another client's claim on a real producer with a grant of its own making.
    producer, hostile = ScriptedPeer(), ScriptedPeer()

    async def claims():
        client = ClaimClient(timeout_s=30)
        try:
            victim = asyncio.ensure_future(client.claim("127.0.0.1", producer.port, "lease-v", "hash", 20))
            assert await asyncio.to_thread(wait_for, lambda: producer.claims, 30)
            own = asyncio.ensure_future(client.claim("127.0.0.1", hostile.port, "lease-h", "hash", 20))
            assert await asyncio.to_thread(wait_for, lambda: hostile.claims, 30)
            identity, mine = hostile.claims[0]
            victim_id = producer.claims[0][1].request_id
            hostile.outbox.put((identity, KVGrant(victim_id, "lease-v", [666], REGION, "hostile", 30.0)))
            hostile.outbox.put((identity, KVRefusal(mine.request_id, "no")))
            assert isinstance(await own, KVRefusal)     # sent after the forged grant: that one was read first
            identity, theirs = producer.claims[0]
            producer.outbox.put((identity, KVGrant(theirs.request_id, "lease-v", [3, 4], REGION, "producer", 30.0)))
            return await victim
        finally:
            client.close()

    try:
        grant = asyncio.run(claims())
    finally:
        producer.close()
        hostile.close()
    assert isinstance(grant, KVGrant) and (grant.engine_id, grant.block_ids) == ("producer", [3, 4])


# ---------------------------------------------------------------------------------------------
# A decode server whose client points remote_host / remote_port at something that is no producer
# ---------------------------------------------------------------------------------------------

class HostilePeer(RouterPeer):
    """Answers each claim by its lease id's mode ("bad-region", "claim-type", "nan-lease") and keeps
    the lease ids released to it."""

    def __init__(self) -> None:
        self.released: list[str] = []
        super().__init__()

    def handle(self, identity: bytes, message) -> None:
        if isinstance(message, KVRelease):
            self.released.append(message.lease_id)
            return
        mode, rid = message.lease_id, message.request_id
        reply = {"bad-region": KVGrant(rid, mode, [0, 1], {"kind": "weird"}, "e", 30.0),
                 "claim-type": KVClaim(rid, mode, "hash", 3),
                 "nan-lease": KVGrant(rid, mode, [0, 1], REGION, "e", float("nan"))}[mode]
        self.sock.send_multipart([identity, self.encoder.encode(reply)])


@pytest.fixture(scope="module")
def consumer(stories_path):
    with running_server(stories_path, served_model_name=MODEL, engine_core="thread",
                        kv_transfer_config={"kv_role": "kv_consumer"}) as (url, _):
        yield url


IDS = [1, 403, 411, 263, 358, 282, 281, 431, 266, 275, 268, 369, 301, 291, 358, 392, 300, 31]   # stories260K ids


def decode_params(port: int, lease_id: str) -> dict:
    return {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port, "remote_lease_id": lease_id,
            "remote_num_tokens": len(IDS), "remote_prompt_hash": prompt_hash(IDS)}


def test_a_peer_that_answers_a_claim_with_no_usable_grant_is_a_502_and_its_lease_is_given_back(consumer):
    # A grant with a malformed region, or a message of another kind, was a 500 (ValueError, AttributeError).
    healthy = HealthyStreams(consumer, {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 60})
    peer = HostilePeer()
    try:
        with healthy.in_flight():
            for mode, why in [("bad-region", "the KV region's kind"), ("claim-type", "a KVClaim message"),
                              ("nan-lease", "lease of nan s")]:
                r = httpx.post(f"{consumer}/v1/completions", timeout=60, json={
                    "model": MODEL, "prompt": IDS, "max_tokens": 4, "kv_transfer_params": decode_params(peer.port, mode)})
                error = openai_error(r, 502, "kv_transfer_params", "kv_transfer_bad_reply")
                assert error["message"].startswith("kv_transfer_params: the transfer endpoint at 127.0.0.1:")
                assert why in error["message"], error["message"]
        assert wait_for(lambda: sorted(peer.released) == ["bad-region", "nan-lease"], timeout=30), peer.released
    finally:
        peer.close()
    healthy.check()


@pytest.mark.parametrize("field", ["remote_lease_id", "remote_prompt_hash", "remote_host"])
def test_an_oversized_string_field_is_a_400_naming_it(consumer, field):
    # A 100 000-character lease id went to the producer as a claim too large for its endpoint: a 503
    # after the claim's 5 s timeout instead of the client's error.
    kv = {**decode_params(free_port(), "0" * 32), field: "a" * 100_000}
    r = httpx.post(f"{consumer}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": IDS, "max_tokens": 4, "kv_transfer_params": kv})
    error = openai_error(r, 400, "kv_transfer_params")
    assert f"{field} has 100000 characters" in error["message"]


# ---------------------------------------------------------------------------------------------
# The Python API: kv_transfer_params straight into a consumer engine
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("override, match", [
    ({"remote_port": -1}, "remote_port must be in"),
    ({"remote_port": 70000}, "remote_port must be in"),
    ({"remote_host": "no such host!"}, "is not an address"),
    ({"remote_host": ""}, "must be non-empty strings"),
    ({"remote_lease_id": 5}, "must be non-empty strings"),
    ({"load_by": float("nan")}, "load_by"),
])
def test_a_consumer_engine_refuses_a_release_address_it_cannot_use_where_the_request_enters(
        stories_path, override, match):
    # A port or host ZeroMQ refuses was taken, and raised ZMQError from the engine's step when the
    # lease was released after the copy; a lease id that is no string was released in vain.
    producer, consumer, plain = engines(stories_path)
    try:
        ids = plain.tokenizer.encode(PROMPTS[0], add_special_tokens=True)
        greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        expected = run(plain, "plain", ids, greedy).outputs[0].token_ids
        good = claim(prefill(producer, "p", ids), ids)
        with pytest.raises(ValueError, match=match) as info:
            consumer.add_request("bad", ids, dataclasses.replace(
                greedy, extra_args={"kv_transfer_params": {**good, **override}}))
        assert str(info.value).startswith("kv_transfer_params") and not consumer.has_unfinished_requests()
        out = run(consumer, "good", ids, dataclasses.replace(greedy, extra_args={"kv_transfer_params": good}))
        assert out.outputs[0].token_ids == expected and out.kv_transfer_stats["num_tokens"] == len(ids) - 1
        wait_until_free(producer)
    finally:
        for engine in (producer, consumer, plain):
            engine.shutdown()


def test_a_mapped_pool_named_again_with_a_larger_shape_is_refused_where_the_request_enters(stories_path):
    # The pool was mapped once per handle and the shape of later requests went unchecked: block ids
    # checked against a larger made-up shape raised IndexError from the step's copy.
    producer, consumer, plain = engines(stories_path)
    try:
        ids = plain.tokenizer.encode(PROMPTS[0], add_special_tokens=True)
        greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        with_kv = lambda kv: dataclasses.replace(greedy, extra_args={"kv_transfer_params": kv})  # noqa: E731
        expected = run(plain, "plain", ids, greedy).outputs[0].token_ids
        assert run(consumer, "first", ids, with_kv(claim(prefill(producer, "p1", ids), ids))).outputs[0].token_ids \
            == expected                                   # the producer's pool is mapped now
        good = claim(prefill(producer, "p2", ids), ids)
        shape = list(good["remote_region"]["shape"])
        shape[2] *= 100
        forged = {**good, "remote_region": {**good["remote_region"], "shape": shape},
                  "remote_block_ids": [shape[2] - 1] * len(good["remote_block_ids"])}
        with pytest.raises(ValueError, match="is mapped with shape") as info:
            consumer.add_request("forged", ids, with_kv(forged))
        assert str(info.value).startswith("kv_transfer_params") and not consumer.has_unfinished_requests()
        assert run(consumer, "second", ids, with_kv(good)).outputs[0].token_ids == expected
        wait_until_free(producer)
    finally:
        for engine in (producer, consumer, plain):
            engine.shutdown()
