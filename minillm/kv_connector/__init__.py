"""KV connectors: KV blocks beyond the device pool (see base.py for the interface).

make_kv_connector() builds the configured one, or nothing: with no connector configured the
engine holds none and no hook runs.
"""
from __future__ import annotations

from minillm.kv_connector.base import (KVConnectorMetadata, KVConnectorScheduler, KVConnectorStats,
                                       KVConnectorWorker)

__all__ = ["KVConnectorMetadata", "KVConnectorScheduler", "KVConnectorStats", "KVConnectorWorker",
           "make_kv_connector"]


def make_kv_connector(config, runner, block_manager) -> KVConnectorScheduler | None:
    """The configured connector: its runner side is handed to runner (whose KV pool exists), its
    scheduler side returned; None when none is configured."""
    if not config.kv_offload_gib:
        return None
    from minillm.kv_connector.host_tier import HostTierScheduler, HostTierWorker
    bytes_per_block = int(runner.kv_pool.nbytes) // runner.num_blocks
    num_host_blocks = int(config.kv_offload_gib * 2**30) // bytes_per_block
    if num_host_blocks < 1:
        raise ValueError(f"kv_offload_gib {config.kv_offload_gib:g} holds no KV block "
                         f"({bytes_per_block} bytes each); raise kv_offload_gib")
    runner.register_kv_connector(HostTierWorker(num_host_blocks))
    return HostTierScheduler(block_manager, num_host_blocks, bytes_per_block)
