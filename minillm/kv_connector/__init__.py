"""KV connectors: KV blocks beyond the device pool (see base.py for the interface).

make_kv_connector() builds the configured one, or nothing: with no connector configured the
engine holds none and no hook runs. Two connectors: the host-memory tier of the prefix cache
(host_tier.py, --kv-offload-gib) and prefill/decode disaggregation (pd_connector.py,
--kv-transfer-config).
"""
from __future__ import annotations

from minillm.kv_connector.base import (KVConnectorMetadata, KVConnectorScheduler, KVConnectorStats,
                                       KVConnectorWorker, KVTransferStats)

__all__ = ["KVConnectorMetadata", "KVConnectorScheduler", "KVConnectorStats", "KVConnectorWorker",
           "KVTransferStats", "make_kv_connector"]


def make_kv_connector(config, runner, block_manager) -> KVConnectorScheduler | None:
    """The configured connector: its runner side is handed to runner (whose KV pool exists), its
    scheduler side returned; None when none is configured."""
    if config.kv_transfer_config is not None:
        from minillm.kv_connector.fingerprint import model_fingerprint
        from minillm.kv_connector.pd_connector import make_pd_connector
        return make_pd_connector(config.kv_transfer_config, runner, block_manager, model_fingerprint(config))
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
