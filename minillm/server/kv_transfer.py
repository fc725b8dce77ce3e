"""`kv_transfer_params` on the OpenAI routes (prefill/decode disaggregation, vLLM's protocol).

    {"do_remote_decode": true}    a prefill server runs the request for one token; its response
                                  carries the kv_transfer_params of the prompt's leased blocks (a
                                  lease no response carried, its client gone first, is given back)
    {"do_remote_prefill": true, "remote_host": ..., "remote_port": ..., "remote_lease_id": ...,
     "remote_block_ids": [...], "remote_num_tokens": N, "remote_prompt_hash": ..., ...}
                                  a decode server claims that lease from the prefill engine's
                                  transfer endpoint before the request reaches its engine, which
                                  then copies the blocks instead of computing the prompt

Every way a decode request's params can be wrong (malformed, another prompt's, a lease that does
not exist or has expired) is a 400 naming kv_transfer_params; a prefill engine that does not
answer is a 503. Nothing reaches the engine before the claim holds.
"""
from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import json
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

from minillm.kv_connector.endpoint import ClaimClient, KVGrant, KVRefusal
from minillm.kv_connector.lease import prompt_hash
from minillm.kv_connector.pd_connector import RemotePrefill
from minillm.kv_connector.transport import KVRegion
from minillm.sampling_params import SamplingParams, short_repr
from minillm.server.errors import APIError
from minillm.server.streaming import HangUpWatch

logger = logging.getLogger("minillm.server")

PARAM = "kv_transfer_params"
CLAIM_TIMEOUT_S = 5.0
HEADER = "x-minillm-kv-transfer"      # a decode response's: what the transfer took (JSON)
MAX_CLAIM_MARGIN_S = 2.0               # a claim is used only while this much of its lease is left
MAX_FIELD_CHARS = 256                  # lease ids and hashes are 32 hex digits; a host name is at most 253


@dataclass(eq=False)
class Claim:
    """A lease this decode server claimed for one request."""

    remote: RemotePrefill
    claim_s: float                     # the claim's round trip
    lease_ends: float = math.inf       # time.monotonic() when the claimed lease runs out
    handed: "HandedClaims | None" = None   # where it goes once handed over
    # The engine holds (or may hold) its request: from then on the engine's KV connector releases the
    # lease when the request ends, after any copy planned from it. A release from here could reach the
    # prefill server first, which may reuse the blocks before the copy reads them.
    is_handed_over: bool = False

    def hand_over(self) -> None:
        """Mark the request as the engine's (release_claim leaves its lease to the connector, unless
        the engine fails: then HandedClaims gives it back)."""
        if not self.is_handed_over and self.handed is not None:
            self.handed.add(self)
        self.is_handed_over = True

    on_output = None                   # answer()'s hook: a decode request watches none of its outputs

    def answered(self, raw, response, stats: dict | None) -> None:
        """The response is built: it carries HEADER."""
        response.headers[HEADER] = self.header(stats)

    def header(self, stats: dict | None) -> str:
        """The HEADER value: claim and copy times, tokens, blocks and bytes loaded."""
        stats = stats or {}
        return json.dumps({"claim_ms": round(self.claim_s * 1e3, 3),
                           "copy_ms": round(stats.get("copy_s", 0.0) * 1e3, 3),
                           "tokens": stats.get("num_tokens", 0), "blocks": stats.get("num_blocks", 0),
                           "bytes": stats.get("num_bytes", 0), "remote_engine_id": self.remote.engine_id},
                          separators=(",", ":"))


class HandedClaims:
    """The claims an engine holds (or may hold) the requests of, until their leases run out; all
    given back when the engine fails. A request's API server may be done with it before the engine
    is (its caller left and its abort is queued), and an engine that dies then releases nothing.
    A lease that the engine had released already is ignored by its producer on a second release."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self._claims: list[tuple[float, int, Claim]] = []    # a heap by the time the lease runs out
        self._order = itertools.count()
        self._watcher: threading.Thread | None = None

    def add(self, claim: Claim) -> None:
        """Keep a claim handed to the engine (on the event loop), dropping those whose leases ran out."""
        now = time.monotonic()
        while self._claims and self._claims[0][0] <= now:
            heapq.heappop(self._claims)
        heapq.heappush(self._claims, (claim.lease_ends, next(self._order), claim))
        if self._watcher is None:
            loop = asyncio.get_running_loop()
            self._watcher = threading.Thread(target=self._watch, args=(loop,), name="minillm-kv-claims",
                                             daemon=True)
            self._watcher.start()

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        engine = self.ctx.engine
        engine.ended.wait()
        if engine.has_failed:
            try:
                loop.call_soon_threadsafe(self.release_all)
            except RuntimeError:
                pass                           # the loop is closed: the server is gone

    def release_all(self) -> None:
        """Give back every lease not run out yet (on the event loop; the engine has failed)."""
        now = time.monotonic()
        claims, self._claims = self._claims, []
        for lease_ends, _, claim in claims:
            if lease_ends > now:
                remote = claim.remote
                _send_release(self.ctx, remote.host, remote.port, remote.lease_id)


class ProducedLease:
    """A prefill request's lease (do_remote_decode) on this server's own engine. Only the response
    names it, and a decode server claims it by that name: a response that reaches its client is the
    protocol (the lease lasts until claimed and released, or it runs out). One that never left,
    because its client hung up before it was written, named it to nobody: the lease is given back
    at once, as a give-back from a party that never claimed it (KVRelease if_unclaimed)."""

    hand_over = None                   # answer()'s hook: a prefill request claimed nothing

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.kv: dict | None = None    # the finished output's kv_transfer_params, once it came
        self.is_unsent = False         # its client left before the response was written

    def on_output(self, output, seen: float | None = None) -> None:
        """The request's outputs as they arrive (a stream's observer, on the event loop): the lease
        is known from its final output, which may arrive after the handler gave up on it."""
        if output.finished and isinstance(output.kv_transfer_params, dict):
            self.kv = output.kv_transfer_params
            self._give_back_if_unsent()

    def abandon(self) -> None:
        """The response will not be written (the client left, or the request failed)."""
        self.is_unsent = True
        self._give_back_if_unsent()

    def answered(self, raw, response, stats: dict | None) -> None:
        """The response is built; a client that has hung up meanwhile will never read it."""
        if HangUpWatch.of(raw.scope, raw.receive).hung_up:
            self.abandon()

    def _give_back_if_unsent(self) -> None:
        if not self.is_unsent or self.kv is None:
            return
        kv, self.kv = self.kv, None
        host, port, lease_id = kv.get("remote_host"), kv.get("remote_port"), kv.get("remote_lease_id")
        if isinstance(host, str) and type(port) is int and isinstance(lease_id, str):
            _send_give_back(self.ctx, host, port, lease_id)


def _bad(message: str, status: int = 400, code: str | None = None) -> APIError:
    return APIError(status, f"{PARAM}: {message}", param=PARAM, code=code)


def _field(kv: dict, name: str, kind: type, required: bool = True) -> Any:
    value = kv.get(name)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, kind):
        raise _bad(f"{name} must be {'an integer' if kind is int else 'a string'}, got {short_repr(value)}")
    if kind is str and not value:       # an empty host is an address ZeroMQ takes and never reaches
        raise _bad(f"{name} must be a non-empty string, got ''")
    if kind is str and len(value) > MAX_FIELD_CHARS:
        raise _bad(f"{name} has {len(value)} characters, more than {MAX_FIELD_CHARS}")
    return value


async def apply_kv_transfer(ctx, kv: dict | None, prompt_ids: list[list[int]], params: list[SamplingParams],
                            n: int, stream: bool) -> tuple[list[SamplingParams], Claim | ProducedLease | None]:
    """The requests' params with the engine's kv_transfer_params set, and the lease: claimed for a
    decode request (the caller marks it handed over once the engine has the request, and releases
    it if the request never reaches the engine), or made by a prefill request (the caller passes
    the request's outputs to it, and gives it back if the response is not written)."""
    if kv is None:
        return params, None
    config = ctx.engine.config.kv_transfer_config
    if config is None:
        raise _bad("this server takes no part in KV transfers (start it with --kv-role producer or consumer)")
    # A prefill server hands over one sequence's KV: the request (and so a request through
    # `minillm router`) must make exactly one.
    if n != 1:
        raise APIError(400, f"n: a request with {PARAM} takes n = 1 only, got {n}",
                       param="n")
    if len(prompt_ids) != 1:
        raise APIError(400, f"prompt: a request with {PARAM} takes one prompt, got "
                            f"{len(prompt_ids)}", param="prompt")
    if kv.get("do_remote_decode") is True:
        if not config.is_kv_producer:
            raise _bad(f"do_remote_decode needs a prefill server (--kv-role producer); this one is {config.kv_role}")
        if stream:
            raise _bad("do_remote_decode needs stream false: the params for the decode server come in the response")
        engine_params = {"do_remote_decode": True}
        return [dataclasses.replace(params[0], max_tokens=1, min_tokens=0,
                                    extra_args={**(params[0].extra_args or {}), PARAM: engine_params})], \
            ProducedLease(ctx)
    if kv.get("do_remote_prefill") is not True:
        raise _bad("must set do_remote_decode or do_remote_prefill to true")
    if not config.is_kv_consumer:
        raise _bad(f"do_remote_prefill needs a decode server (--kv-role consumer); this one is {config.kv_role}")
    claim = await _claim(ctx, kv, prompt_ids[0])
    return [dataclasses.replace(params[0], extra_args={**(params[0].extra_args or {}),
                                                       PARAM: claim.remote.to_params()})], claim


async def _claim(ctx, kv: dict, ids: list[int]) -> Claim:
    """Check the params against the prompt, claim the lease, and check the grant against the params."""
    host = _field(kv, "remote_host", str)
    port = _field(kv, "remote_port", int)
    lease_id = _field(kv, "remote_lease_id", str)
    num_tokens = _field(kv, "remote_num_tokens", int)
    digest = _field(kv, "remote_prompt_hash", str)
    block_size = _field(kv, "remote_block_size", int, required=False)
    block_ids = kv.get("remote_block_ids")
    if not 1 <= port <= 65535:
        raise _bad(f"remote_port must be in [1, 65535], got {port}")
    if block_ids is not None and (not isinstance(block_ids, list) or
                                  any(isinstance(b, bool) or not isinstance(b, int) for b in block_ids)):
        raise _bad("remote_block_ids must be a list of integers")
    own_block_size = ctx.engine.config.block_size
    if block_size is not None and block_size != own_block_size:
        raise _bad(f"the prefill engine's blocks hold {block_size} tokens, this engine's {own_block_size}")
    if (num_tokens, digest) != (len(ids), prompt_hash(ids)):
        raise _bad(f"belong to another prompt ({num_tokens} tokens, hash {digest[:12]}), not this "
                   f"request's ({len(ids)} tokens)")
    started = time.monotonic()
    try:
        reply = await _claim_client(ctx).claim(host, port, lease_id, digest, num_tokens)
    except asyncio.TimeoutError:
        raise _bad(f"the prefill engine's transfer endpoint at {host}:{port} did not answer within "
                   f"{CLAIM_TIMEOUT_S:g} s", status=503, code="kv_transfer_unavailable") from None
    except ValueError as exc:
        raise _bad(str(exc)) from None
    claim_s = time.monotonic() - started
    if isinstance(reply, KVRefusal):
        raise _bad(reply.reason)
    region = _granted_region(ctx, reply, host, port, lease_id)
    remote = RemotePrefill(lease_id, host, port, reply.engine_id, list(reply.block_ids), num_tokens, digest,
                           region, started + reply.lease_s - min(0.25 * reply.lease_s, MAX_CLAIM_MARGIN_S))
    if ctx.kv_handed is None:
        ctx.kv_handed = HandedClaims(ctx)
    claim = Claim(remote, claim_s, started + reply.lease_s, ctx.kv_handed)
    if block_ids is not None and block_ids != remote.block_ids:
        release_claim(ctx, claim)
        raise _bad(f"remote_block_ids do not match lease {lease_id}'s blocks")
    return claim


def _granted_region(ctx, reply, host: str, port: int, lease_id: str) -> KVRegion:
    """The region of a well-formed grant; a 502 for any other answer (the address is the client's,
    and what listens there need not be a minillm engine), whose lease is given back."""
    try:
        if not isinstance(reply, KVGrant):
            raise ValueError(f"it answered with a {type(reply).__name__} message")
        if not math.isfinite(reply.lease_s) or reply.lease_s <= 0:
            raise ValueError(f"its lease of {reply.lease_s!r} s is not a positive number")
        return KVRegion.from_dict(reply.region)
    except ValueError as exc:
        if isinstance(reply, KVGrant):
            _send_release(ctx, host, port, lease_id)
        raise _bad(f"the transfer endpoint at {host}:{port} gave no usable grant: {exc}", status=502,
                   code="kv_transfer_bad_reply") from None


def _claim_client(ctx) -> ClaimClient:
    """The server's sockets to transfer endpoints, made on first use."""
    if ctx.kv_claims is None:
        ctx.kv_claims = ClaimClient(CLAIM_TIMEOUT_S)
    return ctx.kv_claims


def _send_release(ctx, host: str, port: int, lease_id: str) -> None:
    _in_background(ctx, _claim_client(ctx).release(host, port, lease_id))


def _send_give_back(ctx, host: str, port: int, lease_id: str) -> None:
    """Release a lease this server never claimed (freed only while nobody has claimed it)."""
    _in_background(ctx, _claim_client(ctx).release(host, port, lease_id, if_unclaimed=True))


def _in_background(ctx, release) -> None:
    task = asyncio.ensure_future(release)
    ctx.background.add(task)
    task.add_done_callback(ctx.background.discard)


def release_claim(ctx, claim: Claim | ProducedLease | None) -> None:
    """Give a claimed lease back without waiting, unless its request was handed over to an engine
    that still runs (its KV connector releases it then). An engine that has died copies nothing
    more, and would never release it: the lease is given back here, not left to run out. A prefill
    request's lease, whose response will not be written, is given back once it is made."""
    if isinstance(claim, ProducedLease):
        claim.abandon()
        return
    if claim is None or (claim.is_handed_over and not ctx.engine.has_failed) or ctx.kv_claims is None:
        return
    remote = claim.remote
    _send_release(ctx, remote.host, remote.port, remote.lease_id)
