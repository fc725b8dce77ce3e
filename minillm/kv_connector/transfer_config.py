"""KVTransferConfig: vLLM's `--kv-transfer-config` for prefill/decode disaggregation.

    minillm serve MODEL --kv-transfer-config '{"kv_connector": "PDConnector", "kv_role": "kv_producer"}'
    minillm serve MODEL --kv-role producer            # the same, shorter

A producer (the prefill server) holds a prompt's KV blocks under a lease after its request ends
and says where they are in the response's `kv_transfer_params`; a consumer (the decode server)
copies them into its own pool through its transfer endpoint; kv_both does either. The role has no
default: a connector without one is refused, as vLLM's KVTransferConfig refuses it.
"""
from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

from minillm.sampling_params import short_repr

KV_CONNECTORS = ("PDConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_BUFFER_DEVICES = ("auto", "cpu", "cuda")
DEFAULT_LEASE_S = 30.0


@dataclass(frozen=True)
class KVTransferConfig:
    """How this engine takes part in a KV transfer (vLLM's names where it has them)."""

    kv_connector: str = "PDConnector"
    kv_role: str | None = None           # "kv_producer" | "kv_consumer" | "kv_both": vLLM's, no default
    # Where the exported KV lives: "cpu" host shared memory (the CPU backend), "cuda" the GPU pool
    # exported by CUDA IPC (both engines on one GPU); "auto" picks the backend's own.
    kv_buffer_device: str = "auto"
    kv_ip: str = "127.0.0.1"             # the transfer endpoint's address (a producer binds it)
    kv_port: int = 0                     # its port; 0 picks a free one
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    kv_lease_s: float = DEFAULT_LEASE_S  # how long a producer keeps blocks nobody has released

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector must be one of {', '.join(KV_CONNECTORS)}, "
                             f"got {short_repr(self.kv_connector)}")
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {', '.join(KV_ROLES)}, "
                             f"got {short_repr(self.kv_role)}")
        if self.kv_buffer_device not in KV_BUFFER_DEVICES:
            raise ValueError(f"kv_transfer_config.kv_buffer_device must be one of {', '.join(KV_BUFFER_DEVICES)}, "
                             f"got {short_repr(self.kv_buffer_device)}")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(f"kv_transfer_config.kv_ip must be a host address, got {short_repr(self.kv_ip)}")
        if isinstance(self.kv_port, bool) or not isinstance(self.kv_port, int) or not 0 <= self.kv_port <= 65535:
            raise ValueError(f"kv_transfer_config.kv_port must be an integer in [0, 65535], "
                             f"got {short_repr(self.kv_port)}")
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ValueError(f"kv_transfer_config.engine_id must be a non-empty string, "
                             f"got {short_repr(self.engine_id)}")
        lease = self.kv_lease_s
        if isinstance(lease, bool) or not isinstance(lease, (int, float)) or lease <= 0 \
                or isinstance(lease, float) and not math.isfinite(lease):
            raise ValueError(f"kv_transfer_config.kv_lease_s must be a positive number of seconds, "
                             f"got {short_repr(lease)}")
        if self.kv_role is None:
            raise ValueError(f"kv_transfer_config.kv_role must be given with kv_connector {self.kv_connector}: "
                             f"one of {', '.join(KV_ROLES)}")

    @property
    def is_kv_producer(self) -> bool:
        """True when this engine hands out its prompts' KV (kv_producer or kv_both)."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        """True when this engine loads prompts' KV from a producer (kv_consumer or kv_both)."""
        return self.kv_role in ("kv_consumer", "kv_both")

    def check_backend(self, backend: str) -> None:
        """ValueError when kv_buffer_device does not fit the backend ('numpy' or 'cuda')."""
        if self.kv_buffer_device == "cuda" and backend != "cuda":
            raise ValueError("kv_transfer_config.kv_buffer_device cuda needs the GPU backend; the CPU backend "
                             "shares KV through host memory (kv_buffer_device cpu)")
        if self.kv_buffer_device == "cpu" and backend == "cuda":
            raise ValueError("kv_transfer_config.kv_buffer_device cpu (host staging) is not supported on the GPU; "
                             "use cuda, with both engines on one GPU (CUDA IPC)")

    @classmethod
    def from_any(cls, value: "KVTransferConfig | dict[str, Any] | str") -> "KVTransferConfig":
        """From a KVTransferConfig, its dict, or its JSON (unknown keys are an error naming them)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_transfer_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        # Sorted as text: a dict from Python may have keys of several types, which do not compare.
        unknown = sorted(set(value) - known, key=repr)
        if unknown:
            names = ", ".join(k if isinstance(k, str) else repr(k) for k in unknown)
            raise ValueError(f"kv_transfer_config has unknown keys {names} (known: {', '.join(sorted(known))})")
        return cls(**value)


def role_config(role: str, lease_s: float = DEFAULT_LEASE_S, base: dict | None = None) -> dict:
    """The config dict of `--kv-role producer|consumer|both` (over a --kv-transfer-config's dict)."""
    out = dict(base or {})
    out.setdefault("kv_connector", "PDConnector")
    out["kv_role"] = role if role.startswith("kv_") else f"kv_{role}"
    out.setdefault("kv_lease_s", lease_s)
    return out
