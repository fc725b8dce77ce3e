"""The host-memory tier of the prefix cache, the first KV connector (--kv-offload-gib).

Full, hashed blocks that the device's cached-free LRU evicts are copied to a host pool (pinned
memory on the GPU) before their device block is reused. A prefix lookup that misses the device
goes on into the host tier with the same chained keys; its hits are copied back into newly
allocated device blocks before the forward pass that reads them and count as computed. The host
tier has its own LRU; a block loaded back stays there too, so evicting it again costs no copy.

    HostTierScheduler  host block <-> key maps, the host LRU, the step's planned copies (pure Python)
    HostTierWorker     the host pool [num_layers, 2, num_host_blocks, block_size, kv_heads, head_dim]
                       and the copies

Ordering on the GPU. A step's copies go on one copy stream: saves (device -> host) first, then
loads (host -> device), because a load may land in the very block whose old content a save of the
same step reads out. Device blocks are moved only while free, but a step still running may touch
one: a sequence that finished or was aborted after its last step was launched frees blocks that
step still writes. So each copy carries the last step that may touch its device block (stamped
when the block was freed): copies whose steps are done start at once, beside the step in flight;
the others first wait for an event after the work queued on the compute stream. The compute
stream then waits for an event after all the copies before the step's forward pass. Host blocks
need no such care: only copy-stream work touches them, in stream order, and a host block that a
step copies from or to is pinned for that step, so no other copy of the step reuses it.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from minillm.block_manager import BlockManager
from minillm.kv_connector.base import KVConnectorMetadata, KVConnectorScheduler, KVConnectorStats, KVConnectorWorker
from minillm.sequence import Sequence
from minillm.step import SchedulerOutput

RATE_WINDOW_S = 5.0


@dataclass(frozen=True)
class BlockCopies:
    """One direction of a step's copies: device_blocks[i] <-> host_blocks[i]."""

    device_blocks: np.ndarray        # [n] int64
    host_blocks: np.ndarray          # [n] int64
    last_steps: np.ndarray           # [n] int64: the last step that may touch device_blocks[i] (-1: none)

    @staticmethod
    def of(pairs: list[tuple[int, int]], last_step: np.ndarray) -> "BlockCopies":
        """From (device block, host block) pairs, stamped from last_step: [num_device_blocks]."""
        a = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        return BlockCopies(a[:, 0], a[:, 1], last_step[a[:, 0]])

    @property
    def num_blocks(self) -> int:
        """Blocks moved."""
        return len(self.device_blocks)

    def split(self, done_through: int) -> tuple["BlockCopies", "BlockCopies"]:
        """(copies free to start now, copies that wait for the steps after done_through)."""
        ready = self.last_steps <= done_through
        pick = lambda m: BlockCopies(self.device_blocks[m], self.host_blocks[m], self.last_steps[m])  # noqa: E731
        return pick(ready), pick(~ready)


@dataclass(frozen=True)
class HostTierMetadata(KVConnectorMetadata):
    """One step's copies; steps are numbered in launch order from 0."""

    step: int
    saves: BlockCopies               # device -> host: blocks evicted from the device prefix cache
    loads: BlockCopies               # host -> device: host prefix hits into newly allocated blocks
    save_keys: tuple[bytes, ...] = ()   # the prefix key each save's host block was given


class HostTierScheduler(KVConnectorScheduler):
    """The host tier's bookkeeping: which key each host block holds, its LRU, the step's copies."""

    def __init__(self, block_manager: BlockManager, num_blocks: int, bytes_per_block: int):
        self.block_manager = block_manager
        block_manager.freed, block_manager.evicted = [], []     # listen to its notices
        self.num_blocks = num_blocks
        self.bytes_per_block = bytes_per_block
        self.block_keys: list[bytes | None] = [None] * num_blocks
        self.key_to_block: dict[bytes, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()   # host blocks holding a key, least recent first
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.num_steps = 0               # metadata built so far: the next step's number
        # Per device block: the last step that may still touch it (it was freed after that step's launch).
        self.last_step = np.full(block_manager.num_blocks, -1, dtype=np.int64)
        self._matched: dict[int, tuple[int, list[int]]] = {}   # seq_id -> (first block index, host blocks)
        self._loads: list[tuple[int, int]] = []                # (device block, host block) this step
        self._pinned: set[int] = set()   # host blocks this step copies from or to: not evicted in the step
        self.hit_tokens = 0
        self.bytes_to_host = self.bytes_to_device = 0
        self._window: deque[tuple[float, int, int]] = deque()  # (time, bytes to host, bytes to device)
        self._started = time.time()

    # ---- lookups and allocation ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        """Tokens of the host tier's consecutive hits after the device's, in whole blocks."""
        bm, bs = self.block_manager, self.block_manager.block_size
        first = num_computed_tokens // bs
        max_blocks = (seq.num_tokens - 1) // bs          # at least one token is left to compute
        if first >= max_blocks or not self.key_to_block:
            return 0
        hits: list[int] = []
        for key in bm.keys_of(seq, max_blocks)[first:max_blocks]:
            host = self.key_to_block.get(key)
            if host is None:
                break
            hits.append(host)
        if hits:
            self._matched[seq.seq_id] = (first, hits)
        return len(hits) * bs

    def update_state_after_alloc(self, seq: Sequence, num_external_tokens: int) -> None:
        """Plan the loads of the matched host blocks into seq's newly allocated blocks."""
        first, hits = self._matched.pop(seq.seq_id)
        for i, host in enumerate(hits[:num_external_tokens // self.block_manager.block_size]):
            self._loads.append((seq.block_table[first + i], host))
            self._pinned.add(host)
            self.lru.move_to_end(host)
        self.hit_tokens += num_external_tokens

    # ---- the step --------------------------------------------------------------------------------
    def build_connector_meta(self, out: SchedulerOutput) -> HostTierMetadata | None:
        """Save the blocks the device evicted this step, load the planned hits; None when nothing
        runs (the notices then wait for the next step)."""
        if out.is_empty:
            self._matched.clear()
            return None
        bm, step = self.block_manager, self.num_steps
        freed, bm.freed = bm.freed, []
        if freed:                        # freed after step - 1 was launched: it may still touch them
            self.last_step[np.asarray(freed, dtype=np.int64)] = step - 1
        evicted, bm.evicted = bm.evicted, []
        stored = [(block, host, key) for block, key in evicted if (host := self._store(key)) is not None]
        saves = [(block, host) for block, host, _ in stored]
        meta = HostTierMetadata(step, BlockCopies.of(saves, self.last_step),
                                BlockCopies.of(self._loads, self.last_step), tuple(key for *_, key in stored))
        self._count(len(saves), len(self._loads))
        self._loads, self._matched = [], {}
        self._pinned.clear()
        self.num_steps += 1
        return meta

    def step_failed(self, out: SchedulerOutput) -> None:
        """A failed step's saves may never have been copied: their host blocks forget the keys they
        were given (a later prompt computes those blocks again rather than load what nobody wrote)."""
        meta = out.kv_connector_metadata
        if not isinstance(meta, HostTierMetadata):
            return
        for host, key in zip(meta.saves.host_blocks.tolist(), meta.save_keys):
            if self.block_keys[host] == key:
                self._forget(host)
                self.free_blocks.append(host)

    def _forget(self, host: int) -> None:
        """Host block `host` no longer holds its key."""
        del self.lru[host]
        del self.key_to_block[self.block_keys[host]]
        self.block_keys[host] = None

    def _store(self, key: bytes) -> int | None:
        """The host block to save key's block into; None when it is there already or no block is free."""
        host = self.key_to_block.get(key)
        if host is not None:
            self.lru.move_to_end(host)
            return None
        host = self._take_block()
        if host is not None:
            self.key_to_block[key] = host
            self.block_keys[host] = key
            self.lru[host] = None
            self._pinned.add(host)       # one copy per host block a step: the next save takes another
        return host

    def _take_block(self) -> int | None:
        """A free host block, else the least recently used one not pinned (its key is forgotten)."""
        if self.free_blocks:
            return self.free_blocks.popleft()
        host = next((h for h in self.lru if h not in self._pinned), None)
        if host is not None:
            self._forget(host)
        return host

    def reset_cache(self) -> None:
        """Forget every host block's key (no step is in flight: none copies to or from them), and
        the device evictions not saved yet: a later prompt hits neither."""
        self.key_to_block.clear()
        self.block_keys = [None] * self.num_blocks
        self.lru.clear()
        self.free_blocks = deque(range(self.num_blocks))
        self._matched.clear()
        self._loads.clear()
        self._pinned.clear()
        self.block_manager.evicted.clear()

    def _count(self, num_saved: int, num_loaded: int) -> None:
        to_host, to_device = num_saved * self.bytes_per_block, num_loaded * self.bytes_per_block
        self.bytes_to_host += to_host
        self.bytes_to_device += to_device
        now = time.time()
        if to_host or to_device:
            self._window.append((now, to_host, to_device))
        while self._window and self._window[0][0] < now - RATE_WINDOW_S:
            self._window.popleft()

    # ---- stats -----------------------------------------------------------------------------------
    def snapshot(self) -> KVConnectorStats:
        """Host blocks used and total, hits, bytes moved (totals and per second over the last 5 s)."""
        now = time.time()
        recent = [w for w in self._window if w[0] >= now - RATE_WINDOW_S]
        span = max(min(RATE_WINDOW_S, now - self._started), 1e-3)
        return KVConnectorStats(self.num_blocks, len(self.lru), self.hit_tokens, self.bytes_to_host,
                                self.bytes_to_device, sum(w[1] for w in recent) / span,
                                sum(w[2] for w in recent) / span, list(self.lru))


class HostTierWorker(KVConnectorWorker):
    """The host pool and the copies between it and the device's KV pool."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.device = self.kv_pool = self.host_pool = self.stream = None
        self._step_ends: deque[tuple[int, object]] = deque()   # (step, event after its compute work)
        self._last_step: int | None = None                     # the step launched last
        self._done_through = -1          # every step up to this one has finished on the device
        self._timings: deque[tuple] = deque()   # (bytes to host, bytes to device, e0, e1, e2) not read yet
        self.bytes_to_host = self.bytes_to_device = 0
        self.seconds_to_host = self.seconds_to_device = 0.0    # copy-stream time spent each way

    def register_kv_cache(self, kv_pool, device) -> None:
        """Allocate the host pool in the KV pool's layout and a copy stream."""
        self.device, self.kv_pool = device, kv_pool
        self.host_pool = device.empty_host_like(kv_pool, self.num_blocks)   # [L, 2, num_host_blocks, bs, H, D]
        self.stream = device.copy_stream()

    def start_load_kv(self, meta: HostTierMetadata | None) -> None:
        """Queue the step's saves and loads on the copy stream; the compute stream waits for them."""
        if meta is None:
            return
        dev = self.device
        after = dev.record_event()       # after all compute work queued so far: every earlier step
        if self._last_step is not None:
            self._step_ends.append((self._last_step, after))
        self._last_step = meta.step
        while self._step_ends and self._step_ends[0][1].done:
            self._done_through = self._step_ends.popleft()[0]
        self._read_timings()
        if not (meta.saves.num_blocks or meta.loads.num_blocks):
            return
        saves_now, saves_later = meta.saves.split(self._done_through)
        loads_now, loads_later = meta.loads.split(self._done_through)
        self._copy(saves_now, loads_now)
        if saves_later.num_blocks or loads_later.num_blocks:
            dev.wait_event(after, self.stream)
            self._copy(saves_later, loads_later)
        dev.wait_event(dev.record_event(self.stream))

    def _copy(self, saves: BlockCopies, loads: BlockCopies) -> None:
        """Saves then loads on the copy stream, bracketed by events that time each direction."""
        dev, s = self.device, self.stream
        per_block = self.host_pool.nbytes // self.num_blocks
        e0 = dev.record_event(s)
        if saves.num_blocks:
            dev.copy_blocks(self.host_pool, saves.host_blocks, self.kv_pool, saves.device_blocks, s)
        e1 = dev.record_event(s)
        if loads.num_blocks:
            dev.copy_blocks(self.kv_pool, loads.device_blocks, self.host_pool, loads.host_blocks, s)
        e2 = dev.record_event(s)
        self._timings.append((saves.num_blocks * per_block, loads.num_blocks * per_block, e0, e1, e2))

    def _read_timings(self) -> None:
        while self._timings and self._timings[0][4].done:
            to_host, to_device, e0, e1, e2 = self._timings.popleft()
            self.bytes_to_host += to_host
            self.bytes_to_device += to_device
            self.seconds_to_host += self.device.elapsed_seconds(e0, e1) if to_host else 0.0
            self.seconds_to_device += self.device.elapsed_seconds(e1, e2) if to_device else 0.0

    def copy_stats(self) -> dict[str, float]:
        """Bytes moved and copy-stream seconds each way, for the copies finished so far."""
        self._read_timings()
        return {"bytes_to_host": self.bytes_to_host, "bytes_to_device": self.bytes_to_device,
                "seconds_to_host": self.seconds_to_host, "seconds_to_device": self.seconds_to_device}
