"""Prefill/decode disaggregation's KV connector (`--kv-transfer-config`, `--kv-role`), with vLLM's
`kv_transfer_params` protocol.

Producer (the prefill server). A request whose kv_transfer_params say {"do_remote_decode": true}
runs as any other (its API server caps it at one token). When it ends, request_finished() takes
one more reference on its prompt's blocks and puts them under a lease (lease.py); the request's
output carries the kv_transfer_params a decode server needs: this engine's id, its transfer
endpoint's address, the block ids, the prompt's length and hash, the lease id. The endpoint
(endpoint.py, a thread) answers claims from the lease table; the blocks go back to the pool
(process_pending(), on the engine thread) when the consumer releases the lease or it runs out.

Consumer (the decode server). Its API server claimed the lease before adding the request, and the
grant rides in the request's extra_args. At admission get_num_new_matched_tokens() offers every
prompt token but the last (recomputed here, so this engine samples the first token from its own
logits) beyond what the local prefix cache holds; once the blocks are allocated the step's loads
are planned, and the runner side copies them from the producer's exported pool (shm or CUDA IPC,
transport.py) on the compute stream before the step's forward pass. When that step has finished
(update_connector_output) the lease is released. A claim that may have run out by the time the
request is admitted is not used: the prompt is computed here instead, never read from blocks the
producer may have reused.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from minillm.block_manager import BlockManager
from minillm.kv_connector.base import (KVConnectorMetadata, KVConnectorScheduler, KVConnectorWorker,
                                       KVTransferStats)
from minillm.kv_connector.endpoint import LeaseReleaser, TransferEndpoint, tcp_address
from minillm.kv_connector.lease import LeaseTable, prompt_hash
from minillm.kv_connector.transfer_config import KVTransferConfig
from minillm.kv_connector.transport import KVRegion, is_region_gone
from minillm.sequence import Sequence, SequenceStatus
from minillm.step import SchedulerOutput

logger = logging.getLogger("minillm.kv_transfer")

RELEASE_POLL_S = 0.05     # an idle producer holding leases looks for releases this often
RATE_WINDOW_S = 5.0
PARAM = "kv_transfer_params"


def transfer_params(params) -> dict | None:
    """A request's kv_transfer_params (SamplingParams.extra_args["kv_transfer_params"]), or None."""
    extra = params.extra_args
    return extra.get(PARAM) if isinstance(extra, dict) else None


@dataclass(frozen=True)
class RemotePrefill:
    """A consumer request's granted claim, as its API server passes it to the engine."""

    lease_id: str
    host: str
    port: int
    engine_id: str
    block_ids: list[int]
    num_tokens: int
    prompt_hash: str
    region: KVRegion
    load_by: float                   # time.monotonic() after which the lease may have run out

    def to_params(self) -> dict:
        """The kv_transfer_params the engine reads (plain data, msgpack-able)."""
        return {"do_remote_prefill": True, "remote_lease_id": self.lease_id, "remote_host": self.host,
                "remote_port": self.port, "remote_engine_id": self.engine_id, "remote_block_ids": self.block_ids,
                "remote_num_tokens": self.num_tokens, "remote_prompt_hash": self.prompt_hash,
                "remote_region": self.region.to_dict(), "load_by": self.load_by}

    @classmethod
    def from_params(cls, params: dict) -> "RemotePrefill":
        """From to_params()'s form; ValueError naming kv_transfer_params when it is not one."""
        try:
            out = cls(params["remote_lease_id"], params["remote_host"], params["remote_port"],
                      params["remote_engine_id"], list(params["remote_block_ids"]), params["remote_num_tokens"],
                      params["remote_prompt_hash"], KVRegion.from_dict(params["remote_region"]),
                      float(params["load_by"]))
        except KeyError as exc:
            raise ValueError(f"{PARAM} has no {exc.args[0]} (a claim the API server granted)") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{PARAM}: {exc}") from None
        ints = [out.port, out.num_tokens, *out.block_ids]
        if any(isinstance(v, bool) or not isinstance(v, int) for v in ints):
            raise ValueError(f"{PARAM}: remote_port, remote_num_tokens and remote_block_ids must be integers")
        if not all(isinstance(v, str) and v for v in (out.lease_id, out.host, out.engine_id, out.prompt_hash)):
            raise ValueError(f"{PARAM}: remote_lease_id, remote_host, remote_engine_id and remote_prompt_hash "
                             f"must be non-empty strings")
        if not 1 <= out.port <= 65535:
            raise ValueError(f"{PARAM}: remote_port must be in [1, 65535], got {out.port}")
        if math.isnan(out.load_by):
            raise ValueError(f"{PARAM}: load_by must be a time, got nan")
        return out


@dataclass(frozen=True)
class BlockLoad:
    """Copy the source pool's src_ids blocks into this engine's dst_ids blocks."""

    source: str | bytes              # the KVRegion's handle (the worker's key of the imported pool)
    src_ids: np.ndarray              # [n] int64
    dst_ids: np.ndarray              # [n] int64


@dataclass(frozen=True)
class PDMetadata(KVConnectorMetadata):
    """One step's loads; steps with loads are numbered from 0."""

    step: int
    loads: list[BlockLoad]


@dataclass(eq=False)
class ClaimState:
    """A consumer sequence's claim until it is released."""

    seq: Sequence
    remote: RemotePrefill
    is_released: bool = False


@dataclass
class LoadRecord:
    """A load in flight: whose, how much."""

    state: ClaimState
    num_tokens: int
    num_blocks: int


class PDConnectorScheduler(KVConnectorScheduler):
    """Leases (producer) and claimed loads (consumer) on the engine thread."""

    def __init__(self, config: KVTransferConfig, block_manager: BlockManager, worker: "PDConnectorWorker",
                 region: KVRegion | None):
        self.config, self.block_manager, self.worker = config, block_manager, worker
        self.block_size = block_manager.block_size
        self.leases: LeaseTable | None = None
        self.endpoint: TransferEndpoint | None = None
        if config.is_kv_producer:
            self.leases = LeaseTable(config.kv_lease_s)
            self.endpoint = TransferEndpoint(config.kv_ip, config.kv_port, config.engine_id, self.leases,
                                             region.to_dict())
        self.releaser = LeaseReleaser() if config.is_kv_consumer else None
        self._claims: dict[int, ClaimState] = {}           # seq_id -> its claim, until the sequence ends
        self._matched: dict[int, int] = {}                 # seq_id -> first block to load, this round
        self._loads: list[tuple[ClaimState, list[int], list[int], int]] = []   # (claim, src, dst, tokens)
        self._loading: dict[int, list[LoadRecord]] = {}    # step -> its loads, until it finishes
        self.num_steps = 0
        self.num_requests = self.num_blocks = self.num_tokens = self.num_bytes = self.num_stale = 0
        self.seconds = 0.0
        self._window: deque[tuple[float, int]] = deque()   # (time, bytes) of recent loads
        self._started = time.time()

    # ---- requests ------------------------------------------------------------------------------
    def check_request(self, token_ids: list[int], params) -> None:
        """Validate a request's kv_transfer_params where it enters the engine (ValueError naming
        kv_transfer_params); a consumer's producer pool is mapped here, so a bad one fails the request."""
        kv = transfer_params(params)
        if kv is None:
            return
        if not isinstance(kv, dict):
            raise ValueError(f"{PARAM} must be an object")
        if params.n != 1:
            raise ValueError(f"{PARAM} work with n = 1 only, got n = {params.n}")
        if kv.get("do_remote_decode") is True:
            if not self.config.is_kv_producer:
                raise ValueError(f"{PARAM}: do_remote_decode needs a KV producer (this engine is "
                                 f"{self.config.kv_role})")
            return
        if kv.get("do_remote_prefill") is not True:
            raise ValueError(f"{PARAM} must set do_remote_decode or do_remote_prefill")
        if not self.config.is_kv_consumer:
            raise ValueError(f"{PARAM}: do_remote_prefill needs a KV consumer (this engine is "
                             f"{self.config.kv_role})")
        remote = RemotePrefill.from_params(kv)
        if (remote.num_tokens, remote.prompt_hash) != (len(token_ids), prompt_hash(token_ids)):
            raise ValueError(f"{PARAM} belong to another prompt ({remote.num_tokens} tokens, hash "
                             f"{remote.prompt_hash[:12]}), not this request's ({len(token_ids)} tokens)")
        if len(remote.block_ids) < self.block_manager.blocks_needed(len(token_ids) - 1):
            raise ValueError(f"{PARAM}: {len(remote.block_ids)} remote_block_ids cannot hold {len(token_ids)} "
                             f"tokens in blocks of {self.block_size}")
        if any(not 0 <= b < remote.region.num_blocks for b in remote.block_ids):
            raise ValueError(f"{PARAM}: remote_block_ids outside the prefill engine's pool of "
                             f"{remote.region.num_blocks} blocks")
        try:
            self.releaser.connect(remote.host, remote.port)    # the lease goes back there: a bad address fails here
            self.worker.attach(remote.region)
        except ValueError as exc:
            raise ValueError(f"{PARAM}: {exc}") from None

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        """Every prompt token but the last beyond the num_computed_tokens the device prefix cache
        holds, for a consumer sequence with a claim still good; 0 otherwise."""
        state = self._claim(seq)
        if state is None or state.is_released:
            return 0
        if time.monotonic() > state.remote.load_by or not self.worker.is_attached(state.remote.region):
            logger.warning("kv transfer: request %s waited past its claim on lease %s (or its prefill engine has "
                           "gone); its prompt is computed here instead", seq.request_id, state.remote.lease_id)
            self.num_stale += 1
            self._release(state)
            return 0
        end = seq.num_prompt_tokens - 1      # the last prompt token runs here: its logits give token one
        if num_computed_tokens >= end:
            self._release(state)             # the local prefix cache holds it all
            return 0
        self._matched[seq.seq_id] = num_computed_tokens // self.block_size
        return end - num_computed_tokens

    def update_state_after_alloc(self, seq: Sequence, num_external_tokens: int) -> None:
        """Plan the copy of the claimed blocks into seq's newly allocated ones."""
        first = self._matched.pop(seq.seq_id)
        state = self._claims[seq.seq_id]
        last = -(-(first * self.block_size + num_external_tokens) // self.block_size)
        self._loads.append((state, state.remote.block_ids[first:last], seq.block_table[first:last],
                            num_external_tokens))

    def build_connector_meta(self, out: SchedulerOutput) -> PDMetadata | None:
        """This step's loads (None when it has none)."""
        self._matched.clear()
        if out.is_empty or not self._loads:
            return None
        step, self.num_steps = self.num_steps, self.num_steps + 1
        self._loading[step] = [LoadRecord(state, tokens, len(src)) for state, src, _, tokens in self._loads]
        loads = [BlockLoad(state.remote.region.handle, np.asarray(src, np.int64), np.asarray(dst, np.int64))
                 for state, src, dst, _ in self._loads]
        self._loads = []
        return PDMetadata(step, loads)

    def update_connector_output(self, out: SchedulerOutput) -> None:
        """out's loads are done: count them, tell each request what its load took, release the leases."""
        meta = out.kv_connector_metadata
        if not isinstance(meta, PDMetadata):
            return
        records = self._loading.pop(meta.step, [])
        seconds = self.worker.load_seconds(meta.step)
        num_blocks = sum(r.num_blocks for r in records) or 1
        now = time.time()
        for r in records:
            num_bytes = r.num_blocks * self.worker.bytes_per_block
            self.num_requests += 1
            self.num_blocks += r.num_blocks
            self.num_tokens += r.num_tokens
            self.num_bytes += num_bytes
            self._window.append((now, num_bytes))
            r.state.seq.kv_transfer_stats = {"num_tokens": r.num_tokens, "num_blocks": r.num_blocks,
                                             "num_bytes": num_bytes, "copy_s": seconds * r.num_blocks / num_blocks,
                                             "remote_engine_id": r.state.remote.engine_id}
            self._release(r.state)
        self.seconds += seconds

    def step_failed(self, out: SchedulerOutput) -> None:
        """A failed step's loads never finish: forget them and release their leases (their requests
        were aborted, which defers a release while a load is in flight); kept, each held its
        requests' sequences for ever."""
        meta = out.kv_connector_metadata
        if isinstance(meta, PDMetadata):
            for record in self._loading.pop(meta.step, []):
                self._release(record.state)
            self.worker.forget_step(meta.step)

    def request_finished(self, seq: Sequence) -> None:
        """Producer: a do_remote_decode request that ran to its end leaves its prompt's blocks under a
        lease. Consumer: a claim not released yet is released (the request ended before its copy),
        unless a launched step still copies its blocks: the producer must not reuse them before the
        copy has run, so that release waits for the step (update_connector_output, step_failed)."""
        kv = transfer_params(seq.params)
        if not isinstance(kv, dict):
            return
        if kv.get("do_remote_decode") is True and self.leases is not None:
            if seq.status in (SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_STOPPED):
                self._lease(seq)
        elif kv.get("do_remote_prefill") is True and self.releaser is not None:
            state = self._claim(seq)
            self._claims.pop(seq.seq_id, None)
            if state is not None and not state.is_released and not self._is_loading(state):
                self._release(state)

    def request_refused(self, kv_transfer_params) -> None:
        """Consumer: release the lease a refused request claimed. Its API server may have left the
        release to this engine (its caller left while the add was in flight); a second release of
        a lease, from that server, is ignored by the producer."""
        kv = kv_transfer_params
        if self.releaser is None or not isinstance(kv, dict) or kv.get("do_remote_prefill") is not True:
            return
        try:
            remote = RemotePrefill.from_params(kv)
        except (ValueError, TypeError):
            return                              # no lease a claim could have granted
        self.releaser.release(remote.host, remote.port, remote.lease_id)

    def _is_loading(self, state: ClaimState) -> bool:
        """Whether a launched step's load reads the claim's blocks."""
        return any(record.state is state for records in self._loading.values() for record in records)

    def _lease(self, seq: Sequence) -> None:
        num_tokens = seq.num_prompt_tokens
        num_blocks = self.block_manager.blocks_needed(num_tokens)
        if seq.num_computed_tokens < num_tokens or len(seq.block_table) < num_blocks:
            return                          # its prompt was not all computed: nothing to hand over
        blocks = seq.block_table[:num_blocks]
        self.block_manager.hold(blocks)
        lease = self.leases.create(blocks, prompt_hash(seq.prompt_token_ids), num_tokens)
        endpoint = self.endpoint
        seq.kv_transfer_params = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.config.engine_id,
            "remote_host": endpoint.host, "remote_port": endpoint.port, "remote_block_ids": blocks,
            "remote_lease_id": lease.lease_id, "remote_num_tokens": num_tokens,
            "remote_prompt_hash": lease.prompt_hash, "remote_block_size": self.block_size, "tp_size": 1}

    def _claim(self, seq: Sequence) -> ClaimState | None:
        """seq's claim (made on first sight from its params, which check_request validated; a
        do_remote_decode request, as check_request takes it, has none)."""
        state = self._claims.get(seq.seq_id)
        if state is None:
            kv = transfer_params(seq.params)
            if (not isinstance(kv, dict) or kv.get("do_remote_decode") is True
                    or kv.get("do_remote_prefill") is not True or self.releaser is None):
                return None
            state = self._claims[seq.seq_id] = ClaimState(seq, RemotePrefill.from_params(kv))
        return state

    def _release(self, state: ClaimState) -> None:
        if not state.is_released:
            state.is_released = True
            remote = state.remote
            self.releaser.release(remote.host, remote.port, remote.lease_id)

    # ---- leases --------------------------------------------------------------------------------
    def describe(self) -> str:
        """The start-up line: role, engine id, and a producer's endpoint and lease."""
        line = f"KV transfer {self.config.kv_role}, engine {self.config.engine_id}"
        if self.endpoint is not None:
            line += (f", transfer endpoint {tcp_address(self.endpoint.host, self.endpoint.port)}, leases of "
                     f"{self.config.kv_lease_s:g} s")
        return line

    def holds_blocks(self) -> bool:
        """True while leases hold blocks (they end by a release or within lease_s)."""
        return self.leases is not None and self.leases.has_leases()

    def process_pending(self) -> float | None:
        """Free the blocks of leases released or run out; seconds until the idle loop looks again."""
        if self.leases is None:
            return None
        for lease in self.leases.take_ended():
            self.block_manager.release_blocks(lease.block_ids)
        wait = self.leases.seconds_to_deadline()
        return None if wait is None else min(wait, RELEASE_POLL_S)

    # ---- stats and lifetime --------------------------------------------------------------------
    def snapshot(self) -> KVTransferStats:
        """Leases held and loads done so far."""
        leases = self.leases.snapshot() if self.leases is not None else None
        now = time.time()
        while self._window and self._window[0][0] < now - RATE_WINDOW_S:
            self._window.popleft()
        span = max(min(RATE_WINDOW_S, now - self._started), 1e-3)
        return KVTransferStats(
            self.config.kv_role, self.config.engine_id, leases.num_leases if leases else 0,
            leases.num_blocks if leases else 0, leases.block_ids if leases else [],
            leases.num_created if leases else 0, leases.num_released if leases else 0,
            leases.num_expired if leases else 0, self.num_requests, self.num_blocks, self.num_tokens,
            self.num_bytes, self.seconds, sum(b for _, b in self._window) / span, self.num_stale)

    def shutdown(self) -> None:
        """Close the transfer endpoint and the release sockets."""
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
        if self.releaser is not None:
            self.releaser.close()
            self.releaser = None


class PDConnectorWorker(KVConnectorWorker):
    """The runner side: the producers' pools this engine has mapped, and the copies out of them."""

    def __init__(self, dtype: str, model: str = ""):
        self.dtype, self.model = dtype, model      # model: the fingerprint of the weights served
        self.device = self.kv_pool = None
        self.bytes_per_block = 0
        self._sources: dict[str | bytes, object] = {}      # region handle -> the imported pool
        self._regions: dict[str | bytes, KVRegion] = {}    # region handle -> the region checked when mapped
        self._timings: dict[int, tuple] = {}               # step -> (event before, event after) its loads

    def register_kv_cache(self, kv_pool, device) -> None:
        """The pool loads land in: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]."""
        self.kv_pool, self.device = kv_pool, device
        self.bytes_per_block = int(kv_pool.nbytes) // kv_pool.shape[2]

    def export(self) -> KVRegion:
        """How another process maps this engine's pool (allocated shared)."""
        return dataclasses.replace(self.device.export_kv_pool(self.kv_pool, self.dtype), model=self.model)

    def attach(self, region: KVRegion) -> None:
        """Map a producer's pool once; ValueError when its blocks do not fit ours or it cannot be mapped."""
        mapped = self._regions.get(region.handle)
        if mapped is not None:
            # The block ids were checked against this region's shape: it must be the one mapped.
            if (mapped.kind, mapped.shape, mapped.dtype, mapped.device, mapped.model) != (
                    region.kind, region.shape, region.dtype, region.device, region.model):
                raise ValueError(f"the KV region {region.handle!r} is mapped with shape {list(mapped.shape)} "
                                 f"{mapped.dtype}, not {list(region.shape)} {region.dtype}")
            return
        region.check_compatible(tuple(self.kv_pool.shape), self.dtype, self.model)
        self._forget_gone_regions()
        self._sources[region.handle] = self.device.import_kv_pool(region)
        self._regions[region.handle] = region

    def is_attached(self, region: KVRegion) -> bool:
        """Whether region's pool is mapped here (a gone producer's is dropped when another is mapped)."""
        return region.handle in self._sources

    def _forget_gone_regions(self) -> None:
        """Unmap the pools of producers that have gone: kept, a restarted prefill server's old pool
        stayed held (its segment's memory) for as long as this engine ran. Loads are planned and
        run within one step, never across a new mapping, so none reads a pool dropped here."""
        for handle, region in list(self._regions.items()):
            if is_region_gone(region):
                del self._regions[handle], self._sources[handle]

    def start_load_kv(self, meta: PDMetadata | None) -> None:
        """Queue the step's copies on the compute stream: after the step in flight (which may still
        write a block that was freed after its launch and is a destination now), before this one."""
        if meta is None:
            return
        dev = self.device
        before = dev.record_event()
        for load in meta.loads:
            dev.copy_blocks(self.kv_pool, load.dst_ids, self._sources[load.source], load.src_ids)
        self._timings[meta.step] = (before, dev.record_event())

    def shutdown(self) -> None:
        """Drop this engine's pool and the producers' pools it mapped."""
        self.kv_pool = None
        self._sources.clear()
        self._regions.clear()

    def load_seconds(self, step: int) -> float:
        """Seconds the step's copies took (the step has finished, so its events are done)."""
        timing = self._timings.pop(step, None)
        return self.device.elapsed_seconds(*timing) if timing is not None else 0.0

    def forget_step(self, step: int) -> None:
        """Drop a failed step's timing events unread (they may never be done)."""
        self._timings.pop(step, None)


def make_pd_connector(config: KVTransferConfig, runner, block_manager: BlockManager,
                      model: str = "") -> PDConnectorScheduler:
    """The connector of kv_transfer_config: its runner side registered with runner (whose pool a
    producer allocated shared), its scheduler side returned. model: the fingerprint of the weights
    served (fingerprint.py), which a consumer checks against each producer's."""
    worker = PDConnectorWorker(runner.dtype, model)
    runner.register_kv_connector(worker)
    region = worker.export() if config.is_kv_producer else None
    return PDConnectorScheduler(config, block_manager, worker, region)
