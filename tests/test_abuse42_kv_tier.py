"""KV block management at its edges on stories260K on the CPU: pools of one to three blocks, blocks of
one token and of 1024, prompts that share a prefix and part at every block boundary, prefill/decode
transfers of prompts cut at block boundaries into a decode pool that holds one sequence, and the
start-up errors of a pool too small for any request.

After each scenario every block is back on the free list (no reference held, the prefix cache's
maps agree), the stats' KV usage is 0, and each greedy output equals the request's output alone in
a large pool without a prefix cache."""
from __future__ import annotations

import pytest

from minillm import SamplingParams
from minillm.config import EngineConfig
from minillm.engine import LLMEngine

BASE = [(37 * i + 11) % 497 + 2 for i in range(300)]     # a fixed prompt family's longest member


def make(stories_path, block_size: int, num_kv_blocks: int, max_model_len: int, **kw) -> LLMEngine:
    """A CPU engine with the given pool."""
    engine = LLMEngine(EngineConfig(str(stories_path), device="cpu", block_size=block_size,
                                    num_kv_blocks=num_kv_blocks, max_model_len=max_model_len, **kw))
    engine.log = lambda *args, **kwargs: None
    return engine


def run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]]) -> dict[str, list[list[int]]]:
    """Add the requests at once and step until every one is done: each one's outputs' token ids."""
    for request_id, ids, params in requests:
        engine.add_request(request_id, ids, params)
    outputs: dict[str, list[list[int]]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = [c.token_ids for c in out.outputs]
    return outputs


def assert_pool_idle(engine: LLMEngine) -> None:
    """Every block free, no reference left, the prefix cache's maps in agreement, KV usage 0."""
    bm = engine.block_manager
    assert bm.num_used_blocks == 0 and not any(bm.ref_counts)
    assert sorted(bm.free_queue) == list(range(bm.num_blocks))
    keyed = [b for b in range(bm.num_blocks) if bm.block_keys[b] is not None]
    assert {bm.key_to_block[bm.block_keys[b]] for b in keyed} == set(keyed) and len(bm.key_to_block) == len(keyed)
    assert bm.num_cached_free_blocks == len(keyed) == sum(bm._is_cached_free)
    stats = engine.stats()
    assert (stats.kv_num_used_blocks, stats.kv_usage, stats.kv_num_cached_blocks) == (0, 0, len(keyed))


@pytest.fixture(scope="module")
def alone(stories_path):
    """The greedy output of one prompt alone in a large pool without a prefix cache."""
    engine = make(stories_path, 16, 40, 320, enable_prefix_caching=False)
    memo: dict[tuple, list[int]] = {}

    def output(ids: list[int], max_tokens: int) -> list[int]:
        key = (tuple(ids), max_tokens)
        if key not in memo:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            memo[key] = run(engine, [("alone", ids, params)])["alone"][0]
        return memo[key]
    return output


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)


def test_a_pool_too_small_for_any_request_names_the_pool_not_a_max_model_len_nobody_set(stories_path):
    # One block of one token: max_model_len 2 needs two blocks. The error said "max_model_len 1 leaves
    # no room ...; raise max_model_len", a value nobody set and advice that cannot help.
    with pytest.raises(ValueError, match=r"max_model_len 2 needs 2 KV blocks but the pool has 1; .*num_kv_blocks"):
        make(stories_path, 1, 1, 2)
    with pytest.raises(ValueError) as info:          # the model's own length, over a pool of one token
        LLMEngine(EngineConfig(str(stories_path), device="cpu", block_size=1, num_kv_blocks=1))
    message = str(info.value)       # max_model_len fitted to the pool's one token, which only a larger pool raises
    assert "raise num_kv_blocks" in message and "raise max_model_len" not in message
    with pytest.raises(ValueError, match=r"max_model_len 1 leaves no room .*raise max_model_len"):
        make(stories_path, 4, 3, 1)
    assert make(stories_path, 1, 2, 2).max_model_len == 2      # the smallest pool that serves a request


@pytest.mark.parametrize("block_size,num_kv_blocks,max_model_len", [(16, 1, 16), (8, 2, 16), (4, 3, 12),
                                                                    (1, 3, 3), (1024, 1, 300)])
def test_pools_of_one_to_three_blocks_serve_prompts_parting_at_every_block_boundary(
        stories_path, alone, block_size, num_kv_blocks, max_model_len):
    engine = make(stories_path, block_size, num_kv_blocks, max_model_len, async_scheduling=True)
    bs = min(block_size, max_model_len - 1)
    lengths = sorted({n for k in range(0, max_model_len // bs + 1) for n in (k * bs - 1, k * bs, k * bs + 1)
                      if 1 <= n < max_model_len})
    requests = []
    for n in lengths:       # each prompt: the family's first n tokens, then one of its own at n
        ids = BASE[:n - 1] + [500 - n]
        requests.append((f"r{n}", ids, greedy(min(3, max_model_len - n), n=2 if n % 2 else 1)))
    for wave in range(2):   # the second wave meets the first's cached blocks
        outputs = run(engine, requests)
        assert_pool_idle(engine)
        for request_id, ids, params in requests:
            assert outputs[request_id] == [alone(ids, params.max_tokens)] * params.n, (wave, request_id)
    assert engine.reset_prefix_cache() is True
    assert_pool_idle(engine)
    assert engine.block_manager.num_cached_free_blocks == 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompts_cut_at_block_boundaries_load_into_a_decode_pool_of_one_sequence(stories_path, alone,
                                                                                 async_scheduling):
    from test_kv_transfer import claim, prefill, wait_until_free
    bs, max_model_len = 4, 24
    producer = LLMEngine(EngineConfig(str(stories_path), device="cpu", block_size=bs, max_model_len=max_model_len,
                                      num_kv_blocks=64, kv_transfer_config={"kv_role": "kv_producer",
                                                                            "kv_lease_s": 60}))
    consumer = make(stories_path, bs, max_model_len // bs, max_model_len, async_scheduling=async_scheduling,
                    kv_transfer_config={"kv_role": "kv_consumer"})
    try:
        requests = []
        for n in (1, 2, bs - 1, bs, bs + 1, 2 * bs - 1, 2 * bs, 2 * bs + 1):
            ids = BASE[:n - 1] + [400 + n]
            kv = prefill(producer, f"p{n}", ids)
            params = SamplingParams(temperature=0, max_tokens=max_model_len - n, ignore_eos=True,
                                    extra_args={"kv_transfer_params": claim(kv, ids)})
            requests.append((f"d{n}", ids, params))
        outputs = run(consumer, requests)      # one sequence fits the pool at a time: the others preempt or wait
        assert_pool_idle(consumer)
        for request_id, ids, params in requests:
            assert outputs[request_id] == [alone(ids, params.max_tokens)], request_id
        stats = consumer.stats()
        assert stats.kv_transfer_num_requests + stats.kv_transfer_stale_claims <= len(requests)
        assert stats.kv_transfer_num_requests >= 1
        wait_until_free(producer)
        assert_pool_idle(producer)
    finally:
        producer.shutdown()
        consumer.shutdown()
