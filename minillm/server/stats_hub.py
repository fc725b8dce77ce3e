"""Stats for many watchers at the cost of one: shared snapshots, per-resolution views, a subscriber cap.

The engine hands out snapshots whose block map has one cell per block; each caller gets a view
downsampled to the cells it asked for. /v1/stats/stream subscribers share one snapshot per
`min_interval` (however many they are) and one serialised event per resolution per snapshot.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import TYPE_CHECKING

import numpy as np

from minillm.engine_stats import downsample_block_map
from minillm.server.errors import APIError
from minillm.stats import EngineStats

if TYPE_CHECKING:
    from minillm.server.async_engine import EngineClient


# The fields that depend on the resolution asked for; the rest of a snapshot is the same for all.
PER_RESOLUTION = ("block_map", "block_map_blocks_per_cell", "kv_offload_block_map")


def with_cells(full: EngineStats, cells: int) -> EngineStats:
    """The snapshot with its full-resolution block maps (the KV pool's, the host tier's)
    downsampled to at most `cells` cells each."""
    states = np.asarray(full.block_map, dtype=np.int64)   # [num_blocks]
    block_map, per = downsample_block_map(states, cells)
    offload = full.kv_offload_block_map                    # [host tier blocks], empty without one
    if offload:
        offload = downsample_block_map(np.asarray(offload, dtype=np.int64), cells)[0]
    return dataclasses.replace(full, block_map=block_map, block_map_blocks_per_cell=per,
                               kv_offload_block_map=offload)


class StatsHub:
    """Shares engine snapshots between stats-stream subscribers; at most max_subscribers at a time."""

    def __init__(self, engine: "EngineClient", min_interval: float, max_subscribers: int) -> None:
        self.engine = engine
        self.min_interval = min_interval
        self.max_subscribers = max_subscribers
        self.num_subscribers = 0
        self._snapshot: EngineStats | None = None
        self._taken_at = float("-inf")
        self._pending: asyncio.Future | None = None
        self._events: dict[int, str] = {}     # cells -> the SSE event of the current snapshot
        self._head: str | None = None          # the current snapshot's JSON without its block map

    def subscribe(self) -> None:
        """Count a new subscriber in; 503 when the server already feeds as many as it will."""
        if self.num_subscribers >= self.max_subscribers:
            raise APIError(503, f"too many stats streams open (at most {self.max_subscribers}); "
                           "poll /v1/stats instead or try again later", code="too_many_stats_streams")
        self.num_subscribers += 1

    def unsubscribe(self) -> None:
        """Count a subscriber out."""
        self.num_subscribers -= 1

    async def snapshot(self) -> EngineStats:
        """The shared full-resolution snapshot: reused while younger than min_interval, fetched once when not."""
        if time.monotonic() - self._taken_at < self.min_interval and self._snapshot is not None:
            return self._snapshot
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._fetch())
        return await asyncio.shield(self._pending)

    async def _fetch(self) -> EngineStats:
        try:
            snapshot = await self.engine.get_full_stats()
            self._snapshot, self._taken_at = snapshot, time.monotonic()
            self._events, self._head = {}, None
            return snapshot
        finally:
            self._pending = None

    async def event(self, cells: int) -> str:
        """The current snapshot as one server-sent event with at most `cells` block-map cells."""
        snapshot = await self.snapshot()
        if snapshot is not self._snapshot:   # a newer one replaced it while we waited: use the newest
            snapshot = self._snapshot
        text = self._events.get(cells)
        if text is None:
            text = self._events[cells] = self._render(snapshot, cells)
        return text

    def _render(self, snapshot: EngineStats, cells: int) -> str:
        if self._head is None:
            # Everything but the block maps is the same for every resolution: serialise it once.
            rest = dataclasses.replace(snapshot, block_map=[], kv_offload_block_map=[]).to_dict()
            for name in PER_RESOLUTION:
                del rest[name]
            self._head = json.dumps(rest, separators=(",", ":"), ensure_ascii=False)[:-1]
        maps = with_cells(snapshot, cells)
        tail = json.dumps({name: getattr(maps, name) for name in PER_RESOLUTION}, separators=(",", ":"))
        return f"data: {self._head},{tail[1:]}\n\n"
