"""BlockManager: allocation, sharing through the prefix cache, LRU eviction, no leaks."""
import numpy as np

from minillm.block_manager import BlockManager
from minillm.sampling_params import SamplingParams
from minillm.sequence import Sequence


def make_seq(tokens, rid="r"):
    return Sequence(rid, 0, list(tokens), SamplingParams(max_tokens=8), 0.0, np.random.default_rng(0), 8)


def admit(bm, seq):
    cached = bm.find_cached_blocks(seq)
    assert bm.allocate(seq, cached, seq.num_tokens - len(cached) * bm.block_size)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return cached


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(range(10))
    admit(bm, seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []


def test_allocation_fails_without_taking_anything_when_short():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(range(12))
    assert not bm.allocate(seq, [], 12)
    assert bm.num_free_blocks == 2 and seq.block_table == []


def test_prefix_cache_shares_full_blocks_with_ref_counts():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(9)), "a")
    admit(bm, a)
    b = make_seq(list(range(8)) + [99, 100], "b")
    cached = admit(bm, b)
    assert cached == a.block_table[:2]
    assert all(bm.ref_counts[x] == 2 for x in cached)
    assert bm.prefix_cache_hits == 8 and bm.prefix_cache_queries == 19
    bm.free(a)
    assert all(bm.ref_counts[x] == 1 for x in cached)
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_cached_free_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(range(9), "a")
    admit(bm, a)
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_cached_free_blocks == 2          # two full blocks keep their content
    again = make_seq(range(9), "again")
    assert admit(bm, again) == table[:2]
    assert bm.prefix_cache_hits == 8
    bm.free(again)
    big = make_seq(range(100, 116), "big")           # needs all 4 blocks: evicts the cached ones
    admit(bm, big)
    assert bm.num_cached_free_blocks == 0 and bm.key_to_block.keys() == {k for k in big.block_hashes}
    bm.free(big)
    assert bm.num_free_blocks == 4


def test_prompt_fully_cached_still_computes_one_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(8), "a")
    admit(bm, a)
    b = make_seq(range(8), "b")
    assert len(bm.find_cached_blocks(b)) == 1        # the last block is recomputed for its logits


def test_disabled_prefix_cache_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_seq(range(8), "a")
    admit(bm, a)
    b = make_seq(range(8), "b")
    assert bm.find_cached_blocks(b) == [] and bm.num_cached_free_blocks == 0


def test_uncached_blocks_are_never_hit_and_free_as_plain_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(13), "a")
    admit(bm, a)
    kept = a.block_table[0]
    bm.uncache_blocks(a, 1)                         # their step failed: keys without K/V
    assert bm.find_cached_blocks(make_seq(range(13), "b")) == [kept] and a.block_hashes == [bm.block_keys[kept]]
    bm.free(a)
    assert bm.num_free_blocks == 8 and bm.num_cached_free_blocks == 1
    assert list(bm.key_to_block.values()) == [kept]


def test_block_keys_chain_a_digest_of_the_whole_prefix():
    """A key is SHA-256 over the parent's key and the block's tokens: equal keys mean equal whole
    prefixes, and a prefix that differs anywhere changes every key after it (not a 64-bit hash of
    the parent, which a crafted prompt could collide with)."""
    first = BlockManager.block_key(None, [1, 2, 3, 4])
    assert isinstance(first, bytes) and len(first) == 32
    assert first == BlockManager.block_key(None, [1, 2, 3, 4]) != BlockManager.block_key(None, [1, 2, 3, 5])
    second = BlockManager.block_key(first, [5, 6, 7, 8])
    other_parent = BlockManager.block_key(BlockManager.block_key(None, [0, 2, 3, 4]), [5, 6, 7, 8])
    assert second != other_parent and second != BlockManager.block_key(None, [5, 6, 7, 8])
    assert BlockManager.block_key(None, [2**40]) != BlockManager.block_key(None, [0])     # no truncation


def test_a_sequences_block_keys_are_the_block_key_chain_whether_hashed_at_once_or_block_by_block():
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = [7, 2**40, 3, 9, 11, 0, 5, 5, 1, 2, 3, 4, 8, 6]        # three full blocks and two tokens
    chain = []
    for i in range(3):
        chain.append(BlockManager.block_key(chain[-1] if chain else None, tokens[4 * i:4 * i + 4]))
    assert bm.keys_of(make_seq(tokens, "a"), 5) == chain               # no key for the partial block
    seq = make_seq(tokens, "b")
    assert bm.keys_of(seq, 1) == chain[:1] and bm.keys_of(seq, 3) == chain


def test_prompt_block_keys_are_the_keys_admission_computes():
    from minillm.block_manager import are_prompt_block_keys, prompt_block_keys
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = [5, 9, 2, 7, 1, 1, 3, 8, 6, 4, 0]                 # two full blocks and a partial one
    seq = make_seq(prompt)
    admit(bm, seq)
    keys = prompt_block_keys(prompt, 4)
    assert keys == seq.block_hashes == bm.keys_of(make_seq(prompt), 2)
    assert are_prompt_block_keys(keys, len(prompt), 4)
    assert not are_prompt_block_keys(keys[:1], len(prompt), 4)           # one short
    assert not are_prompt_block_keys([k[:16] for k in keys], len(prompt), 4)   # not digests
    assert not are_prompt_block_keys(tuple(keys), len(prompt), 4)


def test_a_sequence_with_keys_given_finds_its_prefix_without_hashing_again():
    from minillm.block_manager import prompt_block_keys
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(1, 13))
    admit(bm, make_seq(prompt, "a"))
    other = make_seq([9] * 12, "b")
    other.token_block_keys = prompt_block_keys(prompt, 4)      # keys are taken as given: no rehash
    assert len(bm.find_cached_blocks(other)) == 2              # the first prompt's blocks (at least one token left)
