"""The producer's lease table: which KV blocks it holds for which consumer, and until when.

A request asked for by a decode server (`do_remote_decode`) ends holding its prompt's blocks; a
lease keeps them from the pool until the consumer says it has copied them (release) or the lease
runs out. A consumer first claims the lease, naming the prompt it wants (its token count and
hash), so blocks of another prompt are never handed over; a claim gives the copy a fresh window of
lease_s seconds. Ended leases (released or expired) wait in the table until the engine thread
takes them and frees their blocks: only that thread touches the block manager.

Thread-safe: the transfer endpoint's thread claims and releases, the engine thread creates leases
and takes the ended ones.
"""
from __future__ import annotations

import hashlib
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

MAX_REMEMBERED = 4096     # ended lease ids kept to say why a late claim is refused


def prompt_hash(token_ids) -> str:
    """A short hash of a prompt's token ids (the same on every engine for the same ids)."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes()).hexdigest()[:32]


class LeaseError(Exception):
    """A claim is refused; the message says why in words a client can act on."""


@dataclass
class Lease:
    """Blocks held for one prompt's consumer."""

    lease_id: str
    block_ids: list[int]
    prompt_hash: str
    num_tokens: int
    created: float
    deadline: float              # created + lease_s, or claimed + lease_s once claimed
    is_claimed: bool = False


@dataclass(frozen=True)
class LeaseStats:
    """The table as the stats see it."""

    num_leases: int              # held now (ended but not yet freed ones included)
    num_blocks: int
    block_ids: list[int]
    num_created: int
    num_released: int
    num_expired: int


class LeaseTable:
    """Leases by id; the clock is injectable for tests (seconds, monotonic)."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic):
        self.lease_s = lease_s
        self.clock = clock
        self._lock = threading.Lock()
        self._active: dict[str, Lease] = {}
        self._ended: list[Lease] = []                        # ended, blocks not yet taken
        self._gone: OrderedDict[str, str] = OrderedDict()    # ended lease id -> "released" | "expired"
        self.num_created = self.num_released = self.num_expired = 0

    def create(self, block_ids: list[int], prompt_hash: str, num_tokens: int) -> Lease:
        """Hold block_ids for the prompt with this hash and length."""
        now = self.clock()
        lease = Lease(uuid.uuid4().hex, list(block_ids), prompt_hash, num_tokens, now, now + self.lease_s)
        with self._lock:
            self._active[lease.lease_id] = lease
            self.num_created += 1
        return lease

    def claim(self, lease_id: str, prompt_hash: str, num_tokens: int) -> Lease:
        """The lease for a consumer about to copy it (its deadline moves to now + lease_s); LeaseError
        when it does not exist, has ended, is claimed already or holds another prompt."""
        now = self.clock()
        with self._lock:
            self._expire(now)
            lease = self._active.get(lease_id)
            if lease is None:
                gone = self._gone.get(lease_id)
                if gone == "expired":
                    raise LeaseError(f"lease {lease_id} has expired (leases last {self.lease_s:g} s)")
                if gone == "released":
                    raise LeaseError(f"lease {lease_id} was already released by the engine that copied it")
                raise LeaseError(f"lease {lease_id} does not exist")
            if lease.is_claimed:
                raise LeaseError(f"lease {lease_id} is already claimed by another request")
            if (lease.num_tokens, lease.prompt_hash) != (num_tokens, prompt_hash):
                raise LeaseError(f"lease {lease_id} holds the KV of another prompt ({lease.num_tokens} tokens, "
                                 f"hash {lease.prompt_hash[:12]}) than this request's ({num_tokens} tokens, "
                                 f"hash {prompt_hash[:12]})")
            lease.is_claimed = True
            lease.deadline = now + self.lease_s
            return lease

    def release(self, lease_id: str) -> bool:
        """The consumer is done with the lease (copied, or gave up); False for an unknown or ended one."""
        with self._lock:
            return self._release(lease_id, if_unclaimed=False)

    def give_back(self, lease_id: str) -> bool:
        """Release a lease nobody has claimed (a router's, for a request no decode server took);
        False for a claimed one, which its claimer releases once no copy reads its blocks."""
        with self._lock:
            return self._release(lease_id, if_unclaimed=True)

    def _release(self, lease_id: str, if_unclaimed: bool) -> bool:
        lease = self._active.get(lease_id)
        if lease is None or (if_unclaimed and lease.is_claimed):
            return False
        del self._active[lease_id]
        self._end(lease, "released")
        self.num_released += 1
        return True

    def take_ended(self) -> list[Lease]:
        """Leases released or expired since the last call, whose blocks the caller now frees."""
        with self._lock:
            self._expire(self.clock())
            ended, self._ended = self._ended, []
            return ended

    def has_leases(self) -> bool:
        """True while any lease holds blocks (ended ones until the engine takes them)."""
        with self._lock:
            return bool(self._active or self._ended)

    def seconds_to_deadline(self) -> float | None:
        """Seconds until the earliest deadline (0 when one has passed or a lease waits to be freed);
        None when no lease is held."""
        with self._lock:
            if self._ended:
                return 0.0
            if not self._active:
                return None
            return max(min(lease.deadline for lease in self._active.values()) - self.clock(), 0.0)

    def snapshot(self) -> LeaseStats:
        """Counts and the blocks held now (ended ones until the engine frees them)."""
        with self._lock:
            held = list(self._active.values()) + self._ended
            blocks = [b for lease in held for b in lease.block_ids]
            return LeaseStats(len(held), len(blocks), blocks, self.num_created, self.num_released, self.num_expired)

    def _expire(self, now: float) -> None:
        for lease in [lease for lease in self._active.values() if lease.deadline <= now]:
            del self._active[lease.lease_id]
            self._end(lease, "expired")
            self.num_expired += 1

    def _end(self, lease: Lease, why: str) -> None:
        self._ended.append(lease)
        self._gone[lease.lease_id] = why
        while len(self._gone) > MAX_REMEMBERED:
            self._gone.popitem(last=False)
