"""BlockManager: the only owner of the KV block pool's bookkeeping.

Free blocks sit in one LRU queue (front = evicted first). A block that held a full, hashed block
of tokens stays reusable while free ("cached-free") until it is evicted to serve a new allocation.
Only full blocks are shared; a block's key is the SHA-256 of its parent's key and its token ids,
so equal keys mean equal whole prefixes. With Python's hash() of the parent, a prompt crafted for a
colliding 64-bit hash would read another request's cached K/V (vLLM's advisory GHSA-rm76-4mrf-v9r8;
vLLM hashes with SHA-256 by default since v0.10.2). A request with a cache salt (vLLM's cache_salt)
chains its keys from the salt's digest instead of nothing, so only requests with the same salt share
its blocks: another user cannot tell from the timing whether a prompt was cached.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from minillm.sequence import Sequence


@dataclass(frozen=True)
class BlockPoolSnapshot:
    """The pool as the stats see it: counts, the cached-free blocks and the prefix-cache counters."""

    num_blocks: int
    block_size: int
    num_used_blocks: int
    num_free_blocks: int             # cached-free included
    num_cached_free_blocks: int
    cached_free_block_ids: np.ndarray    # [num_cached_free_blocks] int64
    prefix_cache_queries: int        # prompt tokens looked up
    prefix_cache_hits: int           # prompt tokens found


def _chain_keys(keys: list[bytes], tokens: list[int], block_size: int, root: bytes = b"") -> None:
    """Append to keys (the chain so far) the keys of tokens' full blocks of block_size, each the
    SHA-256 of the key before it (root before the first) and the block's ids as 8-byte integers. The
    ids are converted in one pass and each key is one sha256() call (a prompt's 32 blocks: 40 -> 35 us
    on the development CPU)."""
    data = array("q", tokens).tobytes()                 # [len(tokens) * 8]
    width = 8 * block_size
    parent, sha256, append = keys[-1] if keys else root, hashlib.sha256, keys.append
    for start in range(0, len(data) - width + 1, width):
        parent = sha256(parent + data[start:start + width]).digest()
        append(parent)


def prompt_block_keys(prompt: list[int], block_size: int, root: bytes = b"") -> list[bytes]:
    """The prefix-cache keys of a prompt's full blocks, as the engine would compute them at
    admission (root: cache_salt_root of the request's salt); an API server process computes them
    beside the tokenizer (AddRequest's prompt_block_keys), so the engine core's one thread does not."""
    keys: list[bytes] = []
    _chain_keys(keys, prompt, block_size, root)
    return keys


def cache_salt_root(cache_salt: str | None) -> bytes:
    """The root of a request's prefix-cache key chain: nothing, or the digest of its cache salt (a 32-byte
    root, where a key's parent is 32 bytes or, first, nothing: no salt collides with another chain)."""
    if cache_salt is None:
        return b""
    return hashlib.sha256(b"minillm cache_salt\0" + cache_salt.encode("utf-8", "surrogatepass")).digest()


def are_prompt_block_keys(keys: object, num_tokens: int, block_size: int) -> bool:
    """True when keys has the shape of a prompt of num_tokens tokens' keys: one SHA-256 digest per
    full block (what an API server sent is checked, not recomputed)."""
    return (type(keys) is list and len(keys) == num_tokens // block_size
            and all(type(k) is bytes and len(k) == 32 for k in keys))


class BlockManager:
    """Allocates, shares (prefix cache) and frees fixed-size KV blocks; pure Python."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[bytes | None] = [None] * num_blocks   # key of a hashed block
        self.key_to_block: dict[bytes, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._num_cached_free = 0        # free blocks whose key is still registered
        # [num_blocks] 0/1: which blocks those are, kept as they change, so a stats snapshot finds
        # them without a pass over the free queue (tens of thousands of blocks on a GPU). A
        # bytearray, not a NumPy array: admission and freeing set it a block at a time, about 25 ns
        # an item against 80 (or 2 us to convert an index list); the snapshot reads it as NumPy.
        self._is_cached_free = bytearray(num_blocks)
        self.prefix_cache_queries = 0    # prompt tokens of new sequences looked up (not of resumed ones)
        self.prefix_cache_hits = 0       # prompt tokens found
        # Notices for a KV connector, None unless one listens: blocks freed, and (block, key) of
        # cached blocks evicted; the connector takes them each step.
        self.freed: list[int] | None = None
        self.evicted: list[tuple[int, bytes]] | None = None

    # ---- questions -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any sequence (cached-free included)."""
        return len(self.free_queue)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix block."""
        return self._num_cached_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self.free_queue)

    def snapshot(self) -> BlockPoolSnapshot:
        """A copy of the pool's state for stats; nothing in it aliases the manager's containers."""
        cached = np.flatnonzero(np.frombuffer(self._is_cached_free, dtype=np.bool_))
        return BlockPoolSnapshot(self.num_blocks, self.block_size, self.num_used_blocks, self.num_free_blocks,
                                 self._num_cached_free, cached, self.prefix_cache_queries, self.prefix_cache_hits)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens tokens."""
        return (num_tokens + self.block_size - 1) // self.block_size

    @staticmethod
    def block_key(parent: bytes | None, tokens: list[int]) -> bytes:
        """The prefix-cache key of a full block: SHA-256 of its parent's key (none for the first
        block) and its token ids as 8-byte integers (about 1.4 us a block)."""
        keys = [parent] if parent is not None else []
        _chain_keys(keys, tokens, len(tokens))
        return keys[-1]

    def keys_of(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """seq.token_block_keys hashed through its first num_blocks full blocks of known tokens
        (fewer when fewer are known); each block is hashed once in the sequence's life."""
        keys, bs = seq.token_block_keys, self.block_size
        first, end = len(keys), min(num_blocks, len(seq.token_ids) // bs)
        if end > first:
            _chain_keys(keys, seq.token_ids[first * bs:end * bs], bs, seq.block_key_root)
        return keys

    def find_cached_blocks(self, seq: Sequence) -> list[int]:
        """Blocks of the longest cached prefix of seq's full blocks (at least one token left to compute)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for key in self.keys_of(seq, max_blocks)[:max_blocks]:
            block = self.key_to_block.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    # ---- allocation ------------------------------------------------------------------------
    def _pop_free_block(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        key = self.block_keys[block]
        if key is not None:                 # evict the cached content
            if self.evicted is not None:
                self.evicted.append((block, key))
            self._num_cached_free -= 1
            self._is_cached_free[block] = 0
            del self.key_to_block[key]
            self.block_keys[block] = None
        self.ref_counts[block] = 1
        return block

    def allocate(self, seq: Sequence, cached_blocks: list[int], num_new_tokens: int, looked_up: bool = True) -> bool:
        """Admit seq: share cached_blocks, then add blocks for num_new_tokens more; False if short.
        looked_up: cached_blocks came from find_cached_blocks (False: the prefix cache was skipped, as
        for prompt_logprobs); only a lookup counts in prefix_cache_queries, as vLLM counts."""
        assert not seq.block_table, "allocate() is for sequences holding no blocks"
        num_computed = len(cached_blocks) * self.block_size
        need = self.blocks_needed(num_computed + num_new_tokens) - len(cached_blocks)
        ref_counts = self.ref_counts
        revived = [b for b in cached_blocks if not ref_counts[b]]     # cached-free: back in use
        if need > self.num_free_blocks - len(revived):
            return False
        free_queue, is_cached_free = self.free_queue, self._is_cached_free
        for block in revived:
            del free_queue[block]
            is_cached_free[block] = 0
        self._num_cached_free -= len(revived)
        for block in cached_blocks:
            ref_counts[block] += 1
        seq.block_table = list(cached_blocks)
        seq.block_hashes = [self.block_keys[b] for b in cached_blocks]
        if need > 0:
            seq.block_table.extend([self._pop_free_block() for _ in range(need)])
        # A resumed sequence is no new query, nor one that skipped the cache or found it off (vLLM's count).
        if not seq.num_preemptions and looked_up and self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_computed
        return True

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow seq's table to hold num_new_tokens more tokens; False (nothing taken) if short."""
        if seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size:
            return True                   # its blocks hold them: most decode steps
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > self.num_free_blocks:
            return False
        seq.block_table.extend(self._pop_free_block() for _ in range(max(need, 0)))
        return True

    def cache_full_blocks(self, seq: Sequence, num_computed_tokens: int | None = None) -> None:
        """Register seq's newly full, computed blocks in the prefix cache (computed: its first
        num_computed_tokens, by default seq.num_computed_tokens)."""
        if num_computed_tokens is None:
            num_computed_tokens = seq.num_computed_tokens
        known = len(seq.token_ids)
        num_full = (num_computed_tokens if num_computed_tokens < known else known) // self.block_size
        if num_full <= len(seq.block_hashes) or not self.enable_prefix_caching:
            return                                  # no block filled since the last call: most decode steps
        keys = self.keys_of(seq, num_full)
        while len(seq.block_hashes) < num_full:
            i = len(seq.block_hashes)
            key = keys[i]
            seq.block_hashes.append(key)
            block = seq.block_table[i]
            if key not in self.key_to_block and self.block_keys[block] is None:
                self.key_to_block[key] = block
                self.block_keys[block] = key

    def uncache_blocks(self, seq: Sequence, first: int) -> None:
        """Forget the prefix-cache keys of seq's blocks from index `first` on: their K/V will never
        be written (the step that was to compute them failed), so no later prompt may hit them."""
        for block in seq.block_table[first:]:
            key = self.block_keys[block]
            if key is not None:
                del self.key_to_block[key]
                self.block_keys[block] = None
        del seq.block_hashes[first:]

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks; hashed ones stay cached-free (tail evicted first), others go first."""
        self.release_blocks(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []

    def hold(self, blocks: list[int]) -> None:
        """Take one more reference on blocks in use (a KV transfer's lease keeps them past their sequence)."""
        for block in blocks:
            assert self.ref_counts[block] > 0, f"block {block} is free: only blocks in use can be held"
            self.ref_counts[block] += 1

    def release_blocks(self, blocks: list[int]) -> None:
        """Drop one reference on each block (the last one frees it, as free() does)."""
        if self.freed is not None:
            self.freed.extend(blocks)
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
                if self.block_keys[block] is None:
                    self.free_queue.move_to_end(block, last=False)
                else:
                    self._num_cached_free += 1
                    self._is_cached_free[block] = 1

    def reset_prefix_cache(self) -> None:
        """Forget every cached-free block's content."""
        for block in self.free_queue:
            key = self.block_keys[block]
            if key is not None:
                del self.key_to_block[key]
                self.block_keys[block] = None
        self._num_cached_free = 0
        self._is_cached_free[:] = bytes(self.num_blocks)
