"""The long-running paths beside the plain server keep no per-request state once a request has ended:
prefill/decode disaggregation (the producer's leases, the consumer's claims and loads, the router),
the host KV tier (bounded by its pool), and n-gram speculative decoding (the drafter's histories).

Each test drives requests through real servers or an engine and then counts what is left in the
maps that follow a request, waiting on that state with a generous limit as a safety net.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import socket
import threading

import httpx
import uvicorn
from test_leaks16 import _api_server_counts, _drained, _end_every_way, install_with_counts
from test_server_helpers import call_utility, get_stats, running_server, wait_for

from minillm.router import RouterConfig, create_router_app

MODEL = "stories"
DRAIN_S = 30.0     # a safety net only: every wait polls state and returns as soon as it holds
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
PROMPTS = ["Once upon a time there was a little girl named Lily who loved to play in the park",
           "Tom had a big red ball. He liked to kick it high into the sky and run after it",
           "The sun was shining and the birds were singing when Ben went out to find his dog",
           "One day, a cat"]


def install_connector_counts(engine) -> None:
    """install_with_counts, plus the KV connector's and the drafter's per-request maps."""
    install_with_counts(engine)
    base = engine.per_request_counts

    def per_request_counts():
        """The engine's and core loop's counts, the connector's and the drafter's."""
        counts = base()
        connector = engine.kv_connector
        if getattr(connector, "leases", None) is not None:           # a KV producer
            connector.process_pending()
            snap = connector.leases.snapshot()
            counts.update(leases=snap.num_leases, leased_blocks=snap.num_blocks)
        if getattr(connector, "releaser", None) is not None:         # a KV consumer
            counts.update(claims=len(connector._claims), matched=len(connector._matched),
                          loads=len(connector._loads), loading=len(connector._loading),
                          load_timings=len(connector.worker._timings))
        drafter = engine.scheduler.drafter
        if drafter is not None:
            gc.collect()      # histories are weakly keyed by their sequences: gone with them
            counts["drafter_histories"] = len(drafter._histories)
        return counts

    engine.per_request_counts = per_request_counts


def _drain(url: str, engine, label: str) -> None:
    """Wait until the server's engine and API server hold nothing of any request."""
    assert wait_for(lambda: _drained(call_utility(engine, "per_request_counts")), timeout=DRAIN_S), \
        (label, call_utility(engine, "per_request_counts"))
    assert wait_for(lambda: _drained(_api_server_counts(engine)), timeout=DRAIN_S), \
        (label, _api_server_counts(engine))
    assert get_stats(url)["kv_num_used_blocks"] == 0, label


# ---------------------------------------------------------------------------------------------
# Prefill/decode disaggregation
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def running_router(prefill_url: str, decode_url: str):
    """Yield (base_url, Router) for `minillm router` on a thread of this process."""
    app = create_router_app(RouterConfig((prefill_url,), (decode_url,)))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: server.started, timeout=DRAIN_S)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app.state.router
    finally:
        server.should_exit = True
        thread.join(DRAIN_S)
        sock.close()


# (the ending, the body's extra fields, how the client behaves: "read" to the end, "hang_up" after
# that many events, "leave" at once: during the prefill or between the prefill and the decode)
PD_ENDINGS = [
    ("length", {"max_tokens": 8, "ignore_eos": True}, "read"),
    ("stop string", {"max_tokens": 40, "stop": ["the", "."]}, "read"),
    ("streamed", {"max_tokens": 12, "stream": True}, "read"),
    ("hang-up during the decode", {"max_tokens": 200, "ignore_eos": True, "stream": True}, "hang_up"),
    ("left at once", {"max_tokens": 200, "ignore_eos": True, "stream": True}, "leave"),
    ("left at once, not streamed", {"max_tokens": 200, "ignore_eos": True}, "leave"),
    ("400 on the prefill server", {"max_tokens": 5000}, "read"),
]


async def _pd_every_way(url: str, rounds: int) -> dict[str, set]:
    """Each PD ending `rounds` times through the router, 6 at a time; {ending: statuses} (hang-ups: None)."""
    return await _end_every_way(url, rounds, PD_ENDINGS, PROMPTS, concurrency=6)


def test_pd_requests_that_end_every_way_leave_nothing_behind(stories_path):
    """Through the router: finished, refused, left by the client during the prefill, between the
    prefill and the decode and during the decode, then decode requests whose producer is gone.
    Afterwards the producer holds no lease, the consumer no claim or load, and neither server any
    request; the router keeps only its bounded recent samples."""
    producer_config = {"kv_role": "kv_producer", "kv_lease_s": 30}
    consumer_config = {"kv_role": "kv_consumer"}
    kw = dict(engine_core="thread", core_hook=install_connector_counts, max_model_len=256, block_size=8)
    with running_server(stories_path, kv_transfer_config=consumer_config, num_kv_blocks=40, **kw) as (d_url, d_eng):
        with running_server(stories_path, kv_transfer_config=producer_config, **kw) as (p_url, p_eng):
            with running_router(p_url, d_url) as (r_url, _):
                seen = asyncio.run(_pd_every_way(r_url, rounds=6))
                _drain(p_url, p_eng, "producer")
                _drain(d_url, d_eng, "consumer")
                stats = get_stats(r_url)
            produced = get_stats(p_url)
            assert produced["kv_transfer_leases_released"] > 0, produced
            assert produced["kv_transfer_leases_created"] == (produced["kv_transfer_leases_released"]
                                                              + produced["kv_transfer_leases_expired"])
            # Leases the producer still holds when it goes (their consumer's claims are refused or unanswered).
            kvs = [httpx.post(f"{p_url}/v1/completions", timeout=DRAIN_S, json={
                "model": MODEL, "prompt": p, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
            ).json()["kv_transfer_params"] for p in PROMPTS]
        # The producer is gone: stopping its server (a thread core) shut its engine down, transfer
        # endpoint and pool included. Each decode request is refused, and leaves nothing behind.
        assert p_eng.engine.is_shut_down
        for prompt, kv in list(zip(PROMPTS, kvs))[:2]:
            response = httpx.post(f"{d_url}/v1/completions", timeout=DRAIN_S * 2, json={
                "model": MODEL, "prompt": prompt, "max_tokens": 8, "kv_transfer_params": kv})
            assert response.status_code in (400, 503), response.text
        _drain(d_url, d_eng, "consumer after the producer went")
    assert stats["num_requests"] == 6 * len(PD_ENDINGS)
    assert stats["num_client_closed"] > 0, stats
    assert seen["length"] == {200} and seen["streamed"] == {200}
    assert seen["400 on the prefill server"] == {400}


# ---------------------------------------------------------------------------------------------
# The host KV tier and n-gram speculative decoding
# ---------------------------------------------------------------------------------------------

def host_tier_counts(engine) -> dict:
    """The host tier's maps, checked against each other: every host block is free or holds one key."""
    tier = engine.kv_connector
    keyed = [b for b, key in enumerate(tier.block_keys) if key is not None]
    assert sorted(keyed) == sorted(tier.lru) == sorted(tier.key_to_block.values())
    assert len(tier.lru) + len(tier.free_blocks) == tier.num_blocks
    return {"host_blocks": len(tier.lru), "num_host_blocks": tier.num_blocks, "keys": len(tier.key_to_block),
            "matched": len(tier._matched), "loads": len(tier._loads), "pinned": len(tier._pinned)}


def test_the_host_tier_stays_within_its_pool_with_and_without_prefix_reuse(stories_path):
    """Many requests, first over distinct prompts (no reuse), then over shared prefixes: the host
    tier's index never holds more keys than it has blocks, its maps agree, and the step's
    per-request plans are empty once the requests have ended; the engine holds nothing of them."""
    with running_server(stories_path, engine_core="thread", core_hook=install_with_counts, max_model_len=256,
                        num_kv_blocks=32, block_size=8, kv_offload_gib=0.0005) as (url, engine):
        core = engine.engine
        rng = random.Random(0)
        words = ["cat", "dog", "sun", "tree", "ball", "park", "bird", "fish", "red", "big", "happy", "sad"]

        def run(prompts: list[str]) -> None:
            async def go():
                async with httpx.AsyncClient(timeout=DRAIN_S * 2) as client:
                    gate = asyncio.Semaphore(6)

                    async def one(prompt):
                        async with gate:
                            response = await client.post(f"{url}/v1/completions", json={
                                "model": MODEL, "prompt": prompt, "max_tokens": 6, "ignore_eos": True})
                            assert response.status_code == 200, response.text
                    await asyncio.gather(*(one(p) for p in prompts))
            asyncio.run(go())

        distinct = [" ".join(rng.choice(words) for _ in range(30)) for _ in range(120)]
        run(distinct)
        after_distinct = call_utility(engine, "per_request_counts") | host_tier_counts(core)
        shared = [f"{PROMPTS[i % 3]} and then {rng.choice(words)} {rng.choice(words)}" for i in range(120)]
        run(shared)
        _drain(url, engine, "host tier")
        counts = host_tier_counts(core)
        hit_tokens = core.kv_connector.hit_tokens
    assert hit_tokens > 0, "no prompt reused a prefix from the host tier"
    assert after_distinct["host_blocks"] == counts["num_host_blocks"], after_distinct   # it filled up, and
    assert counts["keys"] == counts["host_blocks"] <= counts["num_host_blocks"], counts   # stays within its pool
    assert counts["matched"] == counts["loads"] == counts["pinned"] == 0, counts


def test_speculative_decoding_with_aborts_and_preemption_leaves_no_drafter_state(stories_path):
    """n-gram speculation under every ending of test_leaks16 (hang-ups, clients that leave, 400s) on
    a pool small enough to preempt: the engine holds nothing of the ended requests, and the drafter's
    histories (weakly keyed by their sequences) do not grow with the requests: at most the last
    step's few sequences, still referenced by that step's output, are left."""
    with running_server(stories_path, engine_core="thread", core_hook=install_connector_counts, max_model_len=256,
                        num_kv_blocks=20, block_size=16, speculative_config=SPEC) as (url, engine):
        left = []
        for _ in range(2):
            asyncio.run(_end_every_way(url, rounds=2))
            without = lambda: {k: v for k, v in call_utility(engine, "per_request_counts").items()  # noqa: E731
                               if k != "drafter_histories"}
            assert wait_for(lambda: _drained(without()), timeout=DRAIN_S), without()
            assert wait_for(lambda: _drained(_api_server_counts(engine)), timeout=DRAIN_S)
            left.append(call_utility(engine, "per_request_counts")["drafter_histories"])
        stats = get_stats(url)
    assert stats["num_preemptions"] > 0, "the pool was large enough: nothing was preempted"
    assert stats["spec_decode"] and stats["spec_decode"].get("num_draft_tokens", 0) > 0, stats["spec_decode"]
    assert max(left) <= 8, left      # one step's sequences at most, of the ~70 requests of each round


def test_a_consumer_step_that_fails_with_its_loads_leaves_nothing_behind(stories_path):
    """A decode engine's step that fails at launch while it loads a claimed prompt: its requests
    are aborted (their leases released) and the connector forgets the step's loads, which it kept
    for ever before (each held its request's sequence), one more per such failure."""
    from test_kv_transfer import PROMPTS as LONG_PROMPTS
    from test_kv_transfer import claim, engines, prefill, wait_until_free

    from minillm.engine import StepError
    from minillm.sampling_params import SamplingParams

    producer, consumer, plain = engines(stories_path)
    launch, failing = consumer.runner.launch, []

    def failing_launch(*args, **kwargs):
        if failing:
            failing.pop()
            raise RuntimeError("injected launch fault")
        return launch(*args, **kwargs)

    consumer.runner.launch = failing_launch
    try:
        for i in range(6):
            ids = plain.tokenizer.encode(LONG_PROMPTS[i % len(LONG_PROMPTS)], add_special_tokens=True)
            kv = claim(prefill(producer, f"p{i}", ids), ids)
            consumer.add_request(f"d{i}", ids, SamplingParams(temperature=0, max_tokens=8,
                                                              extra_args={"kv_transfer_params": kv}))
            failing.append(True)
            try:
                consumer.step()        # its first step loads the prompt's blocks, and fails
                raise AssertionError("the step did not fail")
            except StepError as exc:
                assert exc.request_ids == [f"d{i}"]
            for _ in range(10):        # the next step hands out the aborted request's last output
                if not consumer.has_unfinished_requests():
                    break
                consumer.step()
            assert not consumer.has_unfinished_requests()
            wait_until_free(producer)  # the abort released the lease
        connector = consumer.kv_connector
        assert (len(connector._loading), len(connector._claims), len(connector.worker._timings)) == (0, 0, 0), \
            f"{len(connector._loading)} failed steps' loads still held"
        assert consumer.stats(cells=1).kv_num_used_blocks == 0
        assert producer.stats(cells=1).kv_transfer_leases_released == 6
    finally:
        for engine in (producer, consumer, plain):
            engine.shutdown()
