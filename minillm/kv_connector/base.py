"""The KV connector interface: moves full KV blocks between the device pool and somewhere else.

Shaped after vLLM's KVConnectorBase_V1, only as big as minillm's two uses need: a host-memory tier
of the prefix cache (host_tier.py), and prefill/decode disaggregation, where a decode engine loads
the blocks of a prompt that a prefill engine computed. One connector has two sides, one per owner:

    KVConnectorScheduler (pure Python; the scheduler calls it)
        get_num_new_matched_tokens(seq, n)   prompt tokens it can supply beyond the n the device
                                             prefix cache holds
        update_state_after_alloc(seq, n)     blocks for those tokens are allocated: plan the loads
        build_connector_meta(out)            this step's transfers, carried in SchedulerOutput
        update_connector_output(out)         step `out` has finished on the device
        request_finished(seq)                seq ends; its blocks are freed right after
        process_pending()                    work that came from outside (releases, expiries)
        reset_cache()                        forget the prefix blocks it keeps (reset_prefix_cache)
        (device blocks freed or evicted reach it as BlockManager notices: freed, evicted)
    KVConnectorWorker (the model runner calls it; the runner alone touches device memory)
        register_kv_cache(kv_pool, device)   the pool it loads into and saves from
        start_load_kv(meta)                  queue the step's transfers before any of the step's
                                             work; the forward pass runs after them

Loaded tokens count as computed: the scheduler hands the step only the tokens after them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from minillm.sequence import Sequence
from minillm.step import SchedulerOutput


class KVConnectorMetadata:
    """What the scheduler side tells the runner side about one step (subclassed per connector)."""


@dataclass(frozen=True)
class KVConnectorStats:
    """A connector's figures as the stats see them (copies; nothing aliases its state)."""

    num_blocks: int                  # blocks the connector's store holds at most
    num_used_blocks: int
    hit_tokens: int                  # prompt tokens it supplied (a second kind of prefix hit)
    bytes_to_host: int               # totals moved each way
    bytes_to_device: int
    to_host_bytes_per_s: float       # over the last few seconds
    to_device_bytes_per_s: float
    used_block_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class KVTransferStats:
    """Prefill/decode disaggregation's figures (copies): the leases a producer holds, what a
    consumer loaded instead of computing."""

    role: str                        # "kv_producer" | "kv_consumer" | "kv_both"
    engine_id: str
    num_leases: int                  # producer: leases held now
    num_leased_blocks: int
    leased_block_ids: list[int]
    num_leases_created: int
    num_leases_released: int         # released by the consumer that copied them
    num_leases_expired: int          # ran out before a consumer released them
    num_requests: int                # consumer: requests whose prompt KV was loaded
    num_blocks: int                  # blocks loaded
    num_tokens: int                  # prompt tokens loaded (not computed)
    num_bytes: int
    seconds: float                   # copy time on the device
    bytes_per_s: float               # over the last few seconds
    num_stale_claims: int            # claims that ran out before the load (computed instead)


def refuse_kv_transfer_params(params) -> None:
    """ValueError for a request with kv_transfer_params on an engine that takes no part in KV transfers."""
    if isinstance(params.extra_args, dict) and params.extra_args.get("kv_transfer_params") is not None:
        raise ValueError("kv_transfer_params: this engine takes no part in KV transfers (start it with "
                         "kv_transfer_config, or minillm serve --kv-role)")


class KVConnectorScheduler:
    """Scheduler side: answers lookups, plans transfers; no device arrays."""

    def check_request(self, token_ids: list[int], params) -> None:
        """Validate what a request asks of the connector where it enters the engine (ValueError)."""
        refuse_kv_transfer_params(params)

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        """Prompt tokens after num_computed_tokens (the device's prefix hits, a multiple of the
        block size) the connector can load, in whole blocks, leaving at least one to compute."""
        raise NotImplementedError

    def update_state_after_alloc(self, seq: Sequence, num_external_tokens: int) -> None:
        """seq's block table now holds blocks for the num_external_tokens matched tokens."""
        raise NotImplementedError

    def build_connector_meta(self, out: SchedulerOutput) -> KVConnectorMetadata | None:
        """The transfers of the step being scheduled (None for a step that will not run)."""
        raise NotImplementedError

    def update_connector_output(self, out: SchedulerOutput) -> None:
        """Step `out` has finished on the device (its loads are done)."""

    def step_failed(self, out: SchedulerOutput) -> None:
        """Step `out` failed: it never finishes, so what waits for its end is dropped here."""

    def request_finished(self, seq: Sequence) -> None:
        """seq has ended (any reason); its blocks are freed right after this returns."""

    def request_refused(self, kv_transfer_params) -> None:
        """The engine refused a request whose params held these kv_transfer_params (any value, as
        the caller sent it): give back what they hold that the engine would have released."""

    def reset_cache(self) -> None:
        """Forget every prefix block it could supply (the engine's reset_prefix_cache, called only
        while no block is in use and no step is in flight): later prompts are computed afresh."""

    def describe(self) -> str | None:
        """A start-up line on what it does (None: nothing worth a line)."""
        return None

    def holds_blocks(self) -> bool:
        """True while it keeps device blocks from the pool (a request that does not fit now may fit
        once they go back)."""
        return False

    def process_pending(self) -> float | None:
        """Act on what came from outside the engine thread; seconds until it must run again while
        the engine is idle (None: not before the next command)."""
        return None

    def snapshot(self) -> KVConnectorStats | KVTransferStats:
        """The connector's figures for the stats."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Close sockets and threads (the engine is shutting down)."""


class KVConnectorWorker:
    """Runner side: owns the connector's buffers and issues the copies."""

    def register_kv_cache(self, kv_pool, device) -> None:
        """kv_pool: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] on device."""
        raise NotImplementedError

    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        """Queue meta's transfers; the compute stream's next work (the step's forward) runs after
        them, and nothing waits on the host."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Drop the pools it holds (the runner is giving the device memory back)."""
        self.kv_pool = None
