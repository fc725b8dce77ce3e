"""The control messages of a KV transfer, over ZeroMQ between the engines' transfer endpoints.

    decode API server  --KVClaim-->    prefill engine's endpoint (ROUTER, a thread of its core)
                       <--KVGrant--    block ids and the KVRegion to copy them from (or KVRefusal)
    decode engine core --KVRelease-->  the copy is done: the producer frees the blocks

The claim comes from the decode server's API server before the request reaches its engine, so a
lease that does not exist, has expired or holds another prompt is a 400 there; the release comes
from the decode engine once the step that copied the blocks has finished on its device (or the
request ended before its copy). Messages are msgspec structs framed as msgpack.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from typing import Any, Union

import msgspec
import zmq

from minillm.kv_connector.lease import LeaseError, LeaseTable

logger = logging.getLogger("minillm.kv_transfer")

POLL_MS = 100          # how often the endpoint's thread looks at its stop flag
MAX_ENDPOINTS = 64     # producers a decode API server keeps a socket to (the least recently used goes)
# Frames past these sizes drop their peer's connection before they are held in memory. The
# endpoint takes claims and releases (two short ids and two integers); a grant lists a prompt's
# block ids (64 Ki blocks fit in about 320 KiB).
MAX_REQUEST_BYTES = 64 << 10
MAX_REPLY_BYTES = 16 << 20


class KVClaim(msgspec.Struct, tag=True, array_like=True):
    """A consumer will copy this lease's blocks into the prompt of this hash and length."""

    request_id: int
    lease_id: str
    prompt_hash: str
    num_tokens: int


class KVRelease(msgspec.Struct, tag=True, array_like=True):
    """The consumer is done with the lease (copied, or gave up). if_unclaimed: a give-back from a
    party that never claimed it (the router), which leaves a claimed lease to its claimer: that
    one may still copy the blocks."""

    lease_id: str
    if_unclaimed: bool = False


class KVGrant(msgspec.Struct, tag=True, array_like=True):
    """The claim holds: copy these blocks from this region within lease_s seconds."""

    request_id: int
    lease_id: str
    block_ids: list[int]
    region: dict[str, Any]        # KVRegion.to_dict()
    engine_id: str
    lease_s: float


class KVRefusal(msgspec.Struct, tag=True, array_like=True):
    """The claim does not hold; reason says why."""

    request_id: int
    reason: str


Message = Union[KVClaim, KVRelease, KVGrant, KVRefusal]


def tcp_address(host: str, port: int | None = None) -> str:
    """ZeroMQ's tcp:// address of host (an IPv6 literal in brackets) and port."""
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{host}" if port is None else f"tcp://{host}:{port}"


class TransferEndpoint:
    """The producer's endpoint: a ROUTER socket on a thread of its own answering claims from the
    lease table (thread-safe) and taking releases; the engine thread frees the ended leases' blocks."""

    def __init__(self, host: str, port: int, engine_id: str, leases: LeaseTable, region: dict[str, Any]):
        self.engine_id, self.leases, self.region = engine_id, leases, region
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self.sock.setsockopt(zmq.IPV6, 1)
        try:
            if port:
                self.sock.bind(tcp_address(host, port))
            else:
                port = self.sock.bind_to_random_port(tcp_address(host))
        except zmq.ZMQError as exc:
            self.sock.close()
            self.ctx.term()
            raise ValueError(f"kv_transfer_config: the transfer endpoint cannot listen on {host}:{port}: "
                             f"{exc}") from None
        self.host, self.port = host, port
        self.encoder, self.decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Message)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="minillm-kv-endpoint", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(POLL_MS):
                continue
            while True:
                try:
                    identity, data = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except ValueError:     # not two frames: not one of ours
                    continue
                try:
                    self._handle(identity, data)
                except Exception:  # noqa: BLE001 - a bad message must not end the endpoint
                    logger.exception("kv transfer endpoint: a message could not be handled")

    def _handle(self, identity: bytes, data: bytes) -> None:
        try:
            message = self.decoder.decode(data)
        except msgspec.DecodeError:
            return
        if isinstance(message, KVClaim):
            try:
                lease = self.leases.claim(message.lease_id, message.prompt_hash, message.num_tokens)
                reply = KVGrant(message.request_id, lease.lease_id, lease.block_ids, self.region, self.engine_id,
                                self.leases.lease_s)
            except LeaseError as exc:
                reply = KVRefusal(message.request_id, f"{exc} on engine {self.engine_id}")
            self.sock.send_multipart([identity, self.encoder.encode(reply)])
        elif isinstance(message, KVRelease):
            if message.if_unclaimed:
                self.leases.give_back(message.lease_id)
            else:
                self.leases.release(message.lease_id)

    def close(self) -> None:
        """Stop the thread and close the socket."""
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        self.ctx.term()


class LeaseReleaser:
    """The decode engine's side: releases leases on their producers' endpoints (fire and forget:
    a release that is lost only leaves the blocks to the lease's expiry)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.encoder = msgspec.msgpack.Encoder()
        self._socks: dict[tuple[str, int], zmq.Socket] = {}

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        """The producers it keeps a socket to, least recently used first."""
        return list(self._socks)

    def connect(self, host: str, port: int):
        """The socket to a producer's endpoint; ValueError for an address ZeroMQ cannot connect to.

        The addresses are those of leases the API server claimed, which a client named: at most
        MAX_ENDPOINTS sockets are kept, the least recently used closed first (a release still queued
        on it is lost, which leaves its blocks to the lease's expiry)."""
        sock = self._socks.pop((host, port), None)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IPV6, 1)
            try:
                sock.connect(tcp_address(host, port))
            except zmq.ZMQError as exc:
                sock.close()
                raise ValueError(f"remote_host {host!r} with remote_port {port} is not an address: {exc}") from None
            while len(self._socks) >= MAX_ENDPOINTS:
                self._socks.pop(next(iter(self._socks))).close()
        self._socks[(host, port)] = sock               # most recently used last
        return sock

    def release(self, host: str, port: int, lease_id: str) -> None:
        """Send a release without waiting."""
        try:
            self.connect(host, port).send(self.encoder.encode(KVRelease(lease_id)), zmq.NOBLOCK)
        except (zmq.ZMQError, ValueError):
            logger.warning("kv transfer: the release of lease %s to %s:%d could not be sent", lease_id, host, port)

    def close(self) -> None:
        """Close every socket."""
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()
        self.ctx.term()


class ClaimClient:
    """The decode API server's side: claims leases from producers' endpoints on its event loop.

    One DEALER per producer (IMMEDIATE: a message waits for a live connection, never for a peer
    that is not there), a reader task per socket handing replies to the waiting claims. The socket
    to an address that let a claim or release time out is closed, not kept reconnecting."""

    def __init__(self, timeout_s: float) -> None:
        import zmq.asyncio
        self.timeout_s = timeout_s
        self.ctx = zmq.asyncio.Context()
        self.encoder, self.decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Message)
        self._socks: dict[tuple[str, int], tuple[Any, asyncio.Task]] = {}
        self._waiting: dict[int, tuple[Any, asyncio.Future]] = {}   # request id -> (the claim's socket, its reply)
        self._ids = itertools.count()

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        """The producers it keeps a socket to, least recently used first."""
        return list(self._socks)

    def _sock(self, host: str, port: int):
        """The socket to a producer's endpoint (ValueError for an address ZeroMQ cannot connect to)."""
        entry = self._socks.pop((host, port), None)
        if entry is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
            try:
                sock.connect(tcp_address(host, port))
            except zmq.ZMQError as exc:
                sock.close()
                raise ValueError(f"remote_host {host!r} with remote_port {port} is not an address: {exc}") from None
            entry = (sock, asyncio.get_running_loop().create_task(self._read(sock)))
            while len(self._socks) >= MAX_ENDPOINTS:    # addresses come from clients: keep a bounded few
                old_sock, old_task = self._socks.pop(next(iter(self._socks)))
                old_task.cancel()
                old_sock.close()
        self._socks[(host, port)] = entry            # most recently used last
        return entry[0]

    async def _read(self, sock) -> None:
        while True:
            data = await sock.recv()
            try:
                reply = self.decoder.decode(data)
            except msgspec.DecodeError:
                continue
            request_id = getattr(reply, "request_id", -1)
            # Only the socket a claim went out on answers it: another peer (whose address a client
            # chose) must not answer the claims made to other producers.
            sock_of, waiter = self._waiting.get(request_id, (None, None))
            if sock_of is sock and not waiter.done():
                del self._waiting[request_id]
                waiter.set_result(reply)

    async def claim(self, host: str, port: int, lease_id: str, prompt_hash: str, num_tokens: int
                    ) -> KVGrant | KVRefusal:
        """The producer's answer; asyncio.TimeoutError when it does not answer within timeout_s,
        ValueError when host and port are not an address."""
        sock = self._sock(host, port)
        request_id = next(self._ids)
        waiter = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = (sock, waiter)

        async def exchange() -> KVGrant | KVRefusal:
            await sock.send(self.encoder.encode(KVClaim(request_id, lease_id, prompt_hash, num_tokens)))
            return await waiter

        try:
            return await asyncio.wait_for(exchange(), self.timeout_s)
        except asyncio.TimeoutError:
            self._waiting.pop(request_id, None)
            self._forget(host, port, sock)
            raise
        finally:
            self._waiting.pop(request_id, None)

    async def release(self, host: str, port: int, lease_id: str, if_unclaimed: bool = False) -> None:
        """Give a lease back (a claim whose request never reached the engine; if_unclaimed: a lease
        this side never claimed, freed only while nobody has); waits at most timeout_s."""
        try:
            sock = self._sock(host, port)
        except ValueError:
            sock = None
        try:
            if sock is not None:
                await asyncio.wait_for(sock.send(self.encoder.encode(KVRelease(lease_id, if_unclaimed))),
                                       self.timeout_s)
                return
        except asyncio.TimeoutError:
            self._forget(host, port, sock)
        except zmq.ZMQError:
            pass
        logger.warning("kv transfer: the release of lease %s to %s:%d could not be sent", lease_id, host, port)

    def _forget(self, host: str, port: int, sock) -> None:
        """Close the socket to a producer that did not answer in time, unless a claim still waits on
        it: ZeroMQ would go on reconnecting to that address (one a client chose) every 100 ms."""
        entry = self._socks.get((host, port))
        if entry is None or entry[0] is not sock or any(s is sock for s, _ in self._waiting.values()):
            return
        del self._socks[(host, port)]
        entry[1].cancel()
        sock.close()

    def close(self) -> None:
        """Stop the readers and close the sockets."""
        for sock, task in self._socks.values():
            task.cancel()
            sock.close()
        self._socks.clear()
        self.ctx.term()
