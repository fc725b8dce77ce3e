"""Builds EngineStats snapshots from the snapshots the block manager and the scheduler hand out."""
from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass
from itertools import chain

import numpy as np

from minillm.block_manager import BlockPoolSnapshot
from minillm.kv_connector.base import KVConnectorStats, KVTransferStats
from minillm.metrics_tracker import MetricsTracker, percentiles
from minillm.scheduler import SchedulerSnapshot
from minillm.sequence import SequenceView
from minillm.stats import (CELL_CACHED, CELL_FREE, CELL_LEASED, EngineStats, MemoryStats, RequestStats,
                           StructuredOutputStats)

MAX_WAITING_ROWS = 256


def downsample_block_map(states: np.ndarray, cells: int) -> tuple[list[int], int]:
    """states: [num_blocks] int -> (at most `cells` values, blocks per cell); each the commonest state."""
    n = len(states)
    per = max(1, -(-n // max(cells, 1)))
    num_cells = -(-n // per)
    grid = np.pad(states, (0, num_cells * per - n), mode="edge").reshape(num_cells, per)
    if per == 1:
        return grid[:, 0].tolist(), 1
    ordered = np.sort(grid, axis=1)
    idx = np.arange(per)
    starts = np.ones_like(ordered, dtype=bool)
    starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    run_start = np.maximum.accumulate(np.where(starts, idx, 0), axis=1)
    best = np.argmax(idx - run_start, axis=1)       # end of the longest run in each row
    return ordered[np.arange(num_cells), best].tolist(), per


@dataclass(frozen=True)
class EngineInfo:
    """What the stats say about the engine's configuration."""

    model: str
    device: str
    dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    kv_cache_dtype: str = ""     # what the KV pool stores: the model dtype or "fp8_e4m3"
    run_id: str = ""             # chosen when the engine started (see EngineStats.run_id)


def build_stats(info: EngineInfo, pool: BlockPoolSnapshot, sched: SchedulerSnapshot, metrics: MetricsTracker,
                memory: MemoryStats, ttft: dict[str, float | None], cells: int,
                connector: KVConnectorStats | KVTransferStats | None = None,
                structured: StructuredOutputStats | None = None, summary: bool = False) -> EngineStats:
    """An EngineStats snapshot from the block pool's, the scheduler's (and the KV connector's)
    snapshots and the metrics.

    ttft: request id -> its time to first token (None before the first token); structured: the
    structured-output manager's figures, None when no request has asked for structure. summary:
    the counters and gauges alone (the throughput log's and /metrics' figures), none of the per-
    request rows, block map, latency percentiles or recent steps, whose cost grows with the batch.
    """
    now = time.time()
    rows: list[RequestStats] = []
    block_map, per, token_utilization = [], 1, None
    transfer = connector if isinstance(connector, KVTransferStats) else None
    used = pool.num_used_blocks
    if not summary:
        states = np.full(pool.num_blocks, CELL_FREE, dtype=np.int64)
        states[pool.cached_free_block_ids] = CELL_CACHED
        if transfer is not None:
            states[transfer.leased_block_ids] = CELL_LEASED    # running sequences sharing one repaint it below
        running = sched.running
        rows.extend(_row(seq, ttft) for seq in running)
        # Every running sequence's blocks at once (hundreds of sequences hold tens of thousands of blocks).
        lengths = np.fromiter((len(seq.block_table) for seq in running), np.int64, len(running))     # [R]
        blocks = np.fromiter(chain.from_iterable(seq.block_table for seq in running), np.int64,
                             int(lengths.sum()))                                                      # [N]
        owner = np.repeat(np.arange(len(running)), lengths)                                           # [N]
        states[blocks] = owner                # a block two sequences share shows the later one, as before
        computed = np.fromiter((seq.num_computed_tokens for seq in running), np.int64, len(running))
        index = np.arange(len(blocks)) - np.repeat(np.cumsum(lengths) - lengths, lengths)            # [N] i in its table
        held = np.clip(computed[owner] - index * pool.block_size, 0, pool.block_size)                # [N] tokens
        filled = np.zeros(pool.num_blocks, np.int64)   # block -> tokens it holds (a shared block counts once)
        np.maximum.at(filled, blocks, held)
        token_utilization = int(filled.sum()) / (used * pool.block_size) if used else 0.0
        rows.extend(_row(seq, ttft) for seq in sched.waiting)
        block_map, per = downsample_block_map(states, cells)
    prompt_tps, gen_tps = metrics.throughput(now)
    m = metrics
    (ttft_p50, ttft_p99), (itl_p50, itl_p99) = ((None, None), (None, None)) if summary else (
        percentiles(m.ttft, (50, 99)), percentiles(m.itl, (50, 99)))
    return EngineStats(
        time=now, run_id=info.run_id, model=info.model, device=info.device, dtype=info.dtype,
        num_running=sched.num_running, num_waiting=sched.num_waiting,
        num_preempted=sched.num_preempted_waiting,
        num_preemptions=sched.num_preemptions, kv_num_blocks=pool.num_blocks, kv_num_used_blocks=used,
        kv_num_free_blocks=pool.num_free_blocks - pool.num_cached_free_blocks,
        kv_num_cached_blocks=pool.num_cached_free_blocks, kv_usage=used / pool.num_blocks,
        kv_token_utilization=token_utilization,
        block_size=pool.block_size, max_num_seqs=info.max_num_seqs,
        max_num_batched_tokens=info.max_num_batched_tokens, max_model_len=info.max_model_len,
        prefix_cache_queries=pool.prefix_cache_queries, prefix_cache_hits=pool.prefix_cache_hits,
        num_steps=m.num_steps, prompt_tokens_total=m.prompt_tokens_total,
        prefill_tokens_total=m.prefill_tokens_total, iteration_tokens_buckets=list(m.iteration_tokens_buckets),
        iteration_tokens_sum=m.iteration_tokens_sum, prompt_tokens_by_source=dict(m.prompt_tokens_by_source),
        generation_tokens_total=m.generation_tokens_total, num_requests_finished=dict(m.finished),
        prompt_throughput=prompt_tps, generation_throughput=gen_tps,
        ttft_p50_s=ttft_p50, ttft_p99_s=ttft_p99, itl_p50_s=itl_p50, itl_p99_s=itl_p99,
        memory=memory, block_map=block_map, block_map_blocks_per_cell=per,
        # Copies: a step's measured device time is written into its row when the step completes.
        recent_steps=[] if summary else [copy.copy(s) for s in list(m.recent_steps)[-32:]], requests=rows,
        kv_cache_dtype=info.kv_cache_dtype,
        step_time_breakdown_s=m.step_time_breakdown(), spec_decode=copy.deepcopy(m.spec_decode),
        **(_offload_fields(connector, cells) if isinstance(connector, KVConnectorStats) else {}),
        **_transfer_fields(transfer), **(asdict(structured) if structured else {}), **_step_cost_fields(sched),
        is_summary=summary)


def _step_cost_fields(sched: SchedulerSnapshot) -> dict:
    """EngineStats' step-time budget fields (none when it is off)."""
    cost = sched.step_cost
    if (sched.max_step_ms is None and sched.max_step_factor is None) or cost is None:
        return {}
    ms = lambda s: None if s is None else s * 1e3   # noqa: E731
    return dict(max_step_ms=sched.max_step_ms, max_step_factor=sched.max_step_factor,
                step_cost_coefficients=dict(cost.coefficients),
                step_estimated_ms=ms(cost.last_estimated_s), step_measured_ms=ms(cost.last_measured_s),
                step_cost_error_p50=cost.relative_error_p50, step_cost_num_refits=cost.num_refits)


def _offload_fields(offload: KVConnectorStats | None, cells: int) -> dict:
    """EngineStats' kv_offload_* fields from the connector's snapshot (none when it is off)."""
    if offload is None:
        return {}
    states = np.full(offload.num_blocks, CELL_FREE, dtype=np.int64)
    states[offload.used_block_ids] = CELL_CACHED
    return dict(kv_offload_num_blocks=offload.num_blocks, kv_offload_num_used_blocks=offload.num_used_blocks,
                kv_offload_hits=offload.hit_tokens, kv_offload_bytes_to_host=offload.bytes_to_host,
                kv_offload_bytes_to_device=offload.bytes_to_device,
                kv_offload_to_host_bytes_per_s=offload.to_host_bytes_per_s,
                kv_offload_to_device_bytes_per_s=offload.to_device_bytes_per_s,
                kv_offload_block_map=downsample_block_map(states, cells)[0])


def _transfer_fields(t: KVTransferStats | None) -> dict:
    """EngineStats' kv_transfer_* fields from the connector's snapshot (none without one)."""
    if t is None:
        return {}
    return dict(kv_transfer_role=t.role, kv_transfer_engine_id=t.engine_id, kv_transfer_num_leases=t.num_leases,
                kv_transfer_num_leased_blocks=t.num_leased_blocks, kv_transfer_leases_created=t.num_leases_created,
                kv_transfer_leases_released=t.num_leases_released, kv_transfer_leases_expired=t.num_leases_expired,
                kv_transfer_num_requests=t.num_requests, kv_transfer_blocks=t.num_blocks,
                kv_transfer_tokens=t.num_tokens, kv_transfer_bytes=t.num_bytes, kv_transfer_seconds=t.seconds,
                kv_transfer_bytes_per_s=t.bytes_per_s, kv_transfer_stale_claims=t.num_stale_claims)


def _row(seq: SequenceView, ttft: dict[str, float | None]) -> RequestStats:
    rid = seq.request_id if seq.n == 1 else f"{seq.request_id}#{seq.index}"
    return RequestStats(rid, seq.state, seq.num_prompt_tokens, seq.num_output_tokens, len(seq.block_table),
                        seq.num_cached_tokens, ttft.get(seq.request_id), seq.is_structured)


def human_bytes(num: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num) < 1024 or unit == "GiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1024
    return f"{num:.1f} GiB"


def describe_engine(stats: EngineStats) -> str:
    """The load report: backend, dtype, weights, KV pool and concurrency at max_model_len."""
    num_tokens = stats.kv_num_blocks * stats.block_size
    blocks_per_seq = -(-stats.max_model_len // stats.block_size)
    kv_dtype = f" {stats.kv_cache_dtype}" if stats.kv_cache_dtype else ""
    return (f"minillm: backend {stats.device}, dtype {stats.dtype}, weights "
            f"{human_bytes(stats.memory.weights_bytes)}; KV pool{kv_dtype} {stats.kv_num_blocks} blocks x "
            f"{stats.block_size} = {num_tokens} tokens ({human_bytes(stats.memory.kv_pool_bytes)}); "
            f"max concurrency at max_model_len {stats.max_model_len}: "
            f"{stats.kv_num_blocks / blocks_per_seq:.2f}x")
