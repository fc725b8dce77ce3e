"""The KV cache under a long-running, many-user workload, on stories260K on the CPU.

A seeded generator (random.Random, the same workload on every run) builds waves of requests over
prompt families that share prefixes cut at, just before and just after block boundaries; chats
whose next turn extends an earlier turn's prompt and reply (up to the context's end); the same
prompt sent several times in one step; aborts at random steps; n > 1, seeded sampling, logprobs,
prompt_logprobs and cache salts. They run on a roomy pool, on pools small enough to preempt with
the host KV tier filling and evicting, with the FP8 cache and under async scheduling, with
reset_prefix_cache between some waves and, preempting the running requests, within some.

Checked: every greedy completion that was not aborted, its logprobs and every prompt_logprobs list
are what the request gives alone on an engine without prefix caching; each sequence's first
scheduled position (the prompt tokens it did not compute) is at most the longest prefix of full
blocks computed before it (exactly that where nothing is evicted), and none for prompt_logprobs,
as vLLM skips the prefix cache for them; RequestOutput.num_cached_tokens is that position (the
first scheduled child's while a request runs, the last finished child's at its end, as vLLM's);
after every step the pool's reference counts, free queue and prefix-key maps agree with the
running sequences and the full stats (block map, rows, token utilisation, host cells) with both;
after every wave every block is free, the host tier's maps agree, a key on both tiers holds the
same K/V, and the counters (prefix-cache queries and hits, prompt tokens by source, host hits and
bytes) count what was reused.
"""
from __future__ import annotations

import json
import math
import random
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
from test_kv_offload import assert_host_consistent

from minillm import SamplingParams
from minillm.block_manager import prompt_block_keys
from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.fp8 import decode_e4m3
from minillm.stats import CELL_CACHED, CELL_FREE

MAX_LEN = 64
BS = 4
BYTES_PER_TOKEN = 2 * 5 * 4 * 8        # K and V, 5 layers, 4 KV heads of 8: times the element's bytes


def make_engine(path, host_blocks: int = 0, **kw) -> LLMEngine:
    """An engine on the CPU, blocks of BS, with a host tier of exactly host_blocks blocks (0: none)."""
    itemsize = 1 if kw.get("kv_cache_dtype") == "fp8" else 4
    gib = (host_blocks + 0.5) * BYTES_PER_TOKEN * itemsize * BS / 2**30 if host_blocks else 0
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", max_model_len=MAX_LEN, block_size=BS,
                                    kv_offload_gib=gib, **kw), log=lambda m: None)
    if host_blocks:
        assert engine.kv_connector.num_blocks == host_blocks
    return engine


@pytest.fixture(scope="module")
def golden(stories_path) -> list[int]:
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


@pytest.fixture(scope="module")
def alone(stories_path):
    """(token ids, their logprobs and the prompt's, each as logprob_lists) of a request run alone, one
    at a time, on an engine of the same KV dtype with prefix caching off (no state carries from one
    to the next)."""
    engines, memo = {}, {}

    def run(prompt: list[int], fields: dict, kv_cache_dtype: str) -> tuple[list[int], list | None, list | None]:
        fields = {**fields, "n": 1}
        key = (tuple(prompt), repr(sorted(fields.items())), kv_cache_dtype)
        if key not in memo:
            if kv_cache_dtype not in engines:
                engines[kv_cache_dtype] = make_engine(stories_path, enable_prefix_caching=False,
                                                      kv_cache_dtype=kv_cache_dtype)
            engine = engines[kv_cache_dtype]
            engine.add_request("alone", prompt, SamplingParams(**fields), output_kind="final")
            done = None
            while engine.has_unfinished_requests():
                done = next((o for o in engine.step() if o.finished), done)
            memo[key] = (list(done.outputs[0].token_ids), logprob_lists(done.outputs[0].logprobs),
                         logprob_lists(done.prompt_logprobs))
        return memo[key]

    yield run
    for engine in engines.values():
        engine.shutdown()


def logprob_lists(entries) -> list | None:
    """logprobs or prompt_logprobs as [(sorted ids, their values)] (None for the prompt's first position)."""
    if entries is None:
        return None
    return [None if d is None else (sorted(d), [float(d[t]) for t in sorted(d)]) for d in entries]


# ---- the workload -------------------------------------------------------------------------------

@dataclass
class Spec:
    """One request of a wave: its prompt, params, salt, the step it arrives at and the step it is aborted at."""

    rid: str
    prompt: list[int]
    fields: dict
    arrival: int
    abort_at: int | None = None
    salt: str | None = None
    chat_of: str | None = None       # the earlier turn this prompt extends
    priority: int = 0                # under scheduling_policy "priority"

    @property
    def greedy(self) -> bool:
        return self.fields["temperature"] == 0


def boundary_cut(rng: random.Random, longest: int) -> int:
    """A prompt length at, just before or just after a block boundary (or anywhere, now and then)."""
    if rng.random() < 0.2:
        return rng.randint(1, longest)
    k = rng.randint(1, longest // BS)
    return max(1, min(longest, k * BS + rng.choice([-1, 0, 0, 1])))


def make_wave(rng: random.Random, wave: int, bases: list[list[int]], turns: dict[str, tuple[list[int], list[int]]],
              size: int) -> list[Spec]:
    """size requests: prefix-sharing prompts, follow-up turns of earlier greedy chats (turns: rid ->
    (prompt, reply)), copies of one prompt sent in one step; some aborted, some with n > 1, seeded
    sampling, prompt_logprobs or a cache salt."""
    specs: list[Spec] = []
    followable = [rid for rid, (p, r) in turns.items() if len(p) + len(r) + 1 < MAX_LEN]
    for i in range(size):
        rid, arrival, salt = f"w{wave}r{i}", rng.randint(0, 12), None
        kind = rng.random()
        chat_of = None
        if kind < 0.25 and followable:
            chat_of = rng.choice(followable)
            earlier, reply = turns[chat_of]
            room = MAX_LEN - 1 - len(earlier) - len(reply)     # a prompt may fill the context but for one token
            prompt = earlier + reply + rng.choice(bases)[:rng.randint(1, min(6, room))]
        elif kind < 0.4 and specs:
            twin = rng.choice(specs)     # the same prompt again, in the same step
            prompt, arrival, salt = list(twin.prompt), twin.arrival, twin.salt
        else:
            base = rng.choice(bases)
            prompt = base[:boundary_cut(rng, 40)] + [rng.randint(3, 511) for _ in range(rng.choice([0, 0, 1, 2]))]
            salt = rng.choice([None] * 6 + ["u1"])
        fields = dict(max_tokens=rng.choice([1, 3, 6, 8, None]), ignore_eos=True, n=rng.choice([1, 1, 1, 2, 3]))
        if rng.random() < 0.8:
            fields["temperature"] = 0.0
        else:
            fields.update(temperature=0.9, seed=rng.randint(0, 1000))
        if rng.random() < 0.15:
            fields["prompt_logprobs"] = 1
        if rng.random() < 0.3:
            fields["logprobs"] = 2
        abort_at = arrival + rng.randint(0, 24) if rng.random() < 0.2 else None
        specs.append(Spec(rid, prompt, fields, arrival, abort_at, salt, chat_of, rng.randint(-1, 1)))
    return specs


# ---- running it ---------------------------------------------------------------------------------

@dataclass
class Seen:
    """What the test saw of one sequence: where it was first scheduled, what it could reuse then."""

    first_step: int | None = None
    first_start: int | None = None   # prompt tokens it did not compute at its first admission
    shadow_hit: int | None = None    # longest prefix of full blocks computed before its admission, in tokens
    num_external: int = 0            # of first_start, those loaded from the host tier
    num_prompt: int = 0
    looked_up: bool = True           # its prompt was looked up in the prefix cache (not for prompt_logprobs)
    finish_step: int | None = None
    num_sampled: int = 0             # tokens reported


@dataclass
class WaveRun:
    outputs: dict[str, object] = field(default_factory=dict)      # rid -> final RequestOutput
    seen: dict[tuple[str, int], Seen] = field(default_factory=dict)
    num_loaded: int = 0              # tokens loaded from the host tier, resumed sequences' too


class Workload:
    """Runs waves on one engine, keeping a shadow of the prefix keys computed since the last reset
    (the scheduler's outputs are watched: where each sequence starts and what each step computes)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.computed_keys: set[bytes] = set()
        self.outs: list = []
        self.step = 0
        self.by_priority = engine.config.scheduling_policy == "priority"
        schedule = engine.scheduler.schedule

        def schedule_and_keep():
            out = schedule()
            self.outs.append((out, list(engine.scheduler.admitted)))
            return out
        engine.scheduler.schedule = schedule_and_keep

    def _keys(self, seq, num_tokens: int) -> list[bytes]:
        return prompt_block_keys(seq.token_ids[:num_tokens], BS, seq.block_key_root)

    def _longest_hit(self, seq) -> int:
        n = 0
        for key in self._keys(seq, (len(seq.prompt_token_ids) - 1) // BS * BS):   # first admission: the prompt
            if key not in self.computed_keys:
                break
            n += 1
        return n * BS

    def run_wave(self, specs: list[Spec], mid_resets: set[int] = frozenset()) -> WaveRun:
        """Run specs to their end; at each step of mid_resets the prefix cache is reset with the
        running requests preempted (vLLM's reset_running_requests)."""
        engine, run = self.engine, WaveRun()
        by_arrival = sorted(specs, key=lambda s: s.arrival)
        step = 0
        while len(run.outputs) < len(specs):
            for s in by_arrival:
                if s.arrival == step:
                    engine.add_request(s.rid, s.prompt, SamplingParams(**s.fields), cache_salt=s.salt,
                                       priority=s.priority if self.by_priority else 0)
                if s.abort_at == step:
                    engine.abort_request(s.rid)
            if step in mid_resets:
                self.reset(reset_running_requests=True)
            self.outs.clear()
            outputs = engine.step()
            for out, admitted in self.outs:
                self._note_step(out, admitted, run)
            for o in outputs:
                self._note_output(o, run, step)
            assert_pool_accounted(engine)
            assert_stats_agree(engine, run)
            step += 1
            assert step < 2000, "the engine made no progress"
        assert not engine.has_unfinished_requests()
        return run

    def _note_step(self, out, admitted: list, run: WaveRun) -> None:
        """Admissions are checked against the keys computed before them (earlier steps, and sequences
        admitted earlier in this step: their blocks are shared at admission; a running sequence's
        blocks filled this step are shared once it is launched); then the step's keys are added."""
        for seq in admitted:
            b = next(b for b, s in enumerate(out.seqs) if s is seq)
            seen = run.seen.setdefault((seq.request_id, seq.index), Seen())
            if seen.first_start is None:
                assert not seq.num_preemptions
                seen.first_step, seen.first_start, seen.shadow_hit = self.step, out.num_computed_tokens[b], \
                    self._longest_hit(seq)
                seen.num_external, seen.num_prompt = seq.num_external_tokens, len(seq.prompt_token_ids)
                seen.looked_up = seq.params.prompt_logprobs is None
            self.computed_keys.update(self._keys(seq, out.num_computed_tokens[b] + out.num_new_tokens[b]))
        ids = {id(s) for s in admitted}
        for seq, start in zip(out.seqs, out.num_computed_tokens):
            if seq.seq_id in out.loaded_from:
                run.num_loaded += start - out.loaded_from[seq.seq_id]
        for seq, start, n in zip(out.seqs, out.num_computed_tokens, out.num_new_tokens):
            assert run.seen[seq.request_id, seq.index].first_start is not None
            if id(seq) not in ids:
                self.computed_keys.update(self._keys(seq, start + n))
        self.step += 1

    def _note_output(self, o, run: WaveRun, step: int) -> None:
        """Finishes, and the cached count of a report before the last: the first scheduled child's."""
        for c in o.outputs:
            seen = run.seen.setdefault((o.request_id, c.index), Seen())
            seen.num_sampled = len(c.token_ids)
            if c.finish_reason is not None and seen.finish_step is None:
                seen.finish_step = step
        if o.finished:
            run.outputs[o.request_id] = o
            return
        scheduled = [(seen.first_step, i, seen.first_start) for i in range(len(o.outputs))
                     if (seen := run.seen.get((o.request_id, i))) is not None and seen.first_start is not None]
        assert o.num_cached_tokens == (min(scheduled)[2] if scheduled else 0), (o.request_id, o.num_cached_tokens)

    def reset(self, reset_running_requests: bool = False) -> None:
        assert self.engine.reset_prefix_cache(reset_running_requests=reset_running_requests)
        bm = self.engine.block_manager
        assert bm.num_cached_free_blocks == 0 and not bm.key_to_block
        if self.engine.kv_connector is not None:
            assert not self.engine.kv_connector.lru and not self.engine.kv_connector.key_to_block
        self.computed_keys.clear()


def assert_pool_accounted(engine: LLMEngine) -> None:
    """Reference counts are the running sequences' holdings, the free queue every other block once,
    the prefix-key maps one bijection, the cached-free count what the free queue holds."""
    bm, sched = engine.block_manager, engine.scheduler
    holders = Counter(b for s in sched.running for b in s.block_table)
    assert bm.ref_counts == [holders[b] for b in range(bm.num_blocks)]
    assert len(bm.free_queue) == bm.num_blocks - len(holders)
    assert not any(holders[b] for b in bm.free_queue)
    assert all(bm.block_keys[b] == k for k, b in bm.key_to_block.items())
    assert sum(k is not None for k in bm.block_keys) == len(bm.key_to_block)
    assert bm.num_cached_free_blocks == sum(bm.block_keys[b] is not None for b in bm.free_queue)
    for s in sched.waiting:
        assert not s.block_table and s.num_computed_tokens == 0
    if engine.kv_connector is not None:
        assert_host_consistent(engine.kv_connector)


def assert_stats_agree(engine: LLMEngine, run: WaveRun) -> None:
    """The full stats, a cell a block: each block's cell is cached, free or the row of a running
    sequence that holds it; each row's blocks and cached tokens are its sequence's; the token
    utilisation is the computed tokens of the used blocks; the host tier's cells are its LRU."""
    bm, sched = engine.block_manager, engine.scheduler
    host = engine.kv_connector
    stats = engine.stats(cells=max(bm.num_blocks, host.num_blocks if host else 0))
    assert stats.block_map_blocks_per_cell == 1 and len(stats.block_map) == bm.num_blocks
    running = list(sched.running)
    rows = stats.requests
    assert len(rows) == len(running) + len(sched.waiting)
    filled = Counter()
    for r, seq in enumerate(running):
        row = rows[r]
        assert row.request_id.split("#")[0] == seq.request_id and row.num_blocks == len(seq.block_table)
        assert row.num_cached_tokens == run.seen[seq.request_id, seq.index].first_start
        for i, b in enumerate(seq.block_table):
            filled[b] = max(filled[b], min(max(seq.num_computed_tokens - i * BS, 0), BS))
    for b, cell in enumerate(stats.block_map):
        if cell == CELL_CACHED:
            assert bm.ref_counts[b] == 0 and bm.block_keys[b] is not None, b
        elif cell == CELL_FREE:
            assert bm.ref_counts[b] == 0 and bm.block_keys[b] is None, b
        else:
            assert b in running[cell].block_table, b
    used = bm.num_used_blocks
    assert stats.kv_token_utilization == (sum(filled.values()) / (used * BS) if used else 0.0)
    if host is not None:
        cells = stats.kv_offload_block_map
        assert [i for i, c in enumerate(cells) if c == CELL_CACHED] == sorted(host.lru)
        assert all(c in (CELL_CACHED, CELL_FREE) for c in cells) and len(cells) == host.num_blocks


def assert_wave_whole(engine: LLMEngine, before, run: WaveRun | None = None) -> object:
    """Nothing queued or held once a wave is done; the stats agree with the pool and the host tier
    and count the wave's prompts by where their tokens came from (before: the stats before the
    wave); a key on both tiers holds the same K/V on both. Returns the stats."""
    bm = engine.block_manager
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not any(bm.ref_counts) and bm.num_free_blocks == bm.num_blocks
    stats = engine.stats(summary=True)
    assert stats.kv_num_used_blocks == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert (stats.kv_num_cached_blocks, stats.kv_num_free_blocks) == \
        (bm.num_cached_free_blocks, bm.num_blocks - bm.num_cached_free_blocks)
    assert 0 <= stats.prefix_cache_hits <= stats.prefix_cache_queries
    if run is not None:
        admitted = [s for s in run.seen.values() if s.first_start is not None]
        assert stats.prefix_cache_queries - before.prefix_cache_queries == \
            sum(s.num_prompt for s in admitted if s.looked_up)
        assert stats.prefix_cache_hits - before.prefix_cache_hits == \
            sum(s.first_start - s.num_external for s in admitted)
        # a sequence's prompt counts by source once it has a token
        sampled = [s for key, s in run.seen.items() if s.first_start is not None and s.num_sampled]
        by_source = {k: v - before.prompt_tokens_by_source[k] for k, v in stats.prompt_tokens_by_source.items()}
        assert stats.prompt_tokens_total - before.prompt_tokens_total == sum(s.num_prompt for s in sampled)
        assert by_source == {"external_kv_transfer": sum(s.num_external for s in sampled),
                             "local_cache_hit": sum(s.first_start - s.num_external for s in sampled),
                             "local_compute": sum(s.num_prompt - s.first_start for s in sampled)}
    host = engine.kv_connector
    if host is not None:
        assert_host_consistent(host)
        assert stats.kv_offload_num_used_blocks == len(host.lru) <= host.num_blocks
        copies = engine.runner.kv_connector.copy_stats()     # what the copies moved
        assert (stats.kv_offload_bytes_to_host, stats.kv_offload_bytes_to_device) == \
            (copies["bytes_to_host"], copies["bytes_to_device"])
        if run is not None:
            assert stats.kv_offload_hits - before.kv_offload_hits == run.num_loaded
            assert stats.kv_offload_bytes_to_device - before.kv_offload_bytes_to_device == \
                run.num_loaded // BS * host.bytes_per_block
        host_pool, kv_pool = engine.runner.kv_connector.host_pool, engine.runner.kv_pool
        for key, hb in host.key_to_block.items():
            if (block := bm.key_to_block.get(key)) is not None:
                assert_same_kv(np.asarray(host_pool[:, :, hb]), np.asarray(kv_pool[:, :, block]))
    return stats


def assert_same_kv(a: np.ndarray, b: np.ndarray) -> None:
    """Two copies of one prefix block's K/V, each computed in its own batch: equal to float32
    rounding (the rows beside a row move it by about 1e-6), or for FP8 bytes within one E4M3 step."""
    if a.dtype == np.uint8:
        a, b = decode_e4m3(a, 1.0), decode_e4m3(b, 1.0)
        np.testing.assert_allclose(a, b, rtol=0.125, atol=2.0 ** -9)
    else:
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def check_wave(specs: list[Spec], run: WaveRun, alone, kv_cache_dtype: str, exact_hits: bool) -> None:
    """Greedy outputs and prompt logprobs as alone; cached counts as reused and at most what was computed."""
    for s in specs:
        out = run.outputs[s.rid]
        assert len(out.outputs) == s.fields["n"], s.rid
        aborted = any(c.finish_reason == "abort" for c in out.outputs)
        assert aborted or s.abort_at is not None or all(c.finish_reason == "length" for c in out.outputs), s.rid
        limit = min(s.fields["max_tokens"] or MAX_LEN, MAX_LEN - len(s.prompt))    # the context ends it too
        for c in out.outputs:
            assert len(c.token_ids) == limit if c.finish_reason == "length" else len(c.token_ids) < limit, s.rid
        seens = [run.seen.get((s.rid, i), Seen()) for i in range(s.fields["n"])]
        for i, seen in enumerate(seens):
            if seen.first_start is None:
                continue                     # aborted before it was scheduled
            if "prompt_logprobs" in s.fields:
                assert seen.first_start == 0, (s.rid, i, "prompt_logprobs served from the cache")
                continue
            assert seen.first_start <= seen.shadow_hit, (s.rid, i, "reused blocks nobody computed",
                                                         seen.first_start, seen.shadow_hit)
            if exact_hits:
                assert seen.first_start == seen.shadow_hit, (s.rid, i, seen.first_start, seen.shadow_hit)
        # the final report's count: the last child to finish (index order within a step), as vLLM's parent's
        last = max(range(len(seens)), key=lambda i: (seens[i].finish_step, i))
        assert out.num_cached_tokens == (seens[last].first_start or 0), (s.rid, out.num_cached_tokens)
        if not s.greedy:
            continue
        # A row's float32 values move by about 1e-6 with the rows beside it (its chunk's length, the
        # batch); an FP8 byte rounded from such a value may land one E4M3 step over (6 %), the next
        # layers' bytes with it, and the logprobs move by up to about 3 % (the cached blocks' bytes are
        # those the request computes alone: the chunk after them is what moves).
        tol = dict(rel_tol=0.05, abs_tol=2e-2) if kv_cache_dtype == "fp8" else dict(abs_tol=1e-4)
        want, want_lps, want_prompt_lps = alone(s.prompt, {k: v for k, v in s.fields.items() if k != "n"},
                                                kv_cache_dtype)
        for c in out.outputs:
            if c.finish_reason == "abort":
                assert list(c.token_ids) == want[:len(c.token_ids)], (s.rid, c.index)
            else:
                assert list(c.token_ids) == want, (s.rid, c.index)
            if "logprobs" in s.fields:
                assert_logprobs_close(logprob_lists(c.logprobs), want_lps[:len(c.token_ids)], s.rid, tol)
        if "prompt_logprobs" in s.fields and not aborted:
            assert len(out.prompt_logprobs) == len(s.prompt), s.rid
            assert_logprobs_close(logprob_lists(out.prompt_logprobs), want_prompt_lps, s.rid, tol)


def assert_logprobs_close(got: list, want: list, rid: str, tol: dict) -> None:
    """The same ids at each position, their values within tol (math.isclose's)."""
    assert len(got) == len(want), rid
    for g, w in zip(got, want):
        assert (g is None) == (w is None), rid
        if g is not None:
            assert g[0] == w[0] and all(math.isclose(a, b, **tol) for a, b in zip(g[1], w[1])), (rid, g, w)


def run_workload(stories_path, golden, alone, seed: int, waves: int, size: int, resets: set[int],
                 host_blocks: int, exact_hits: bool = False, mid_resets: int = 0, **config) -> LLMEngine:
    """waves of size requests from random.Random(seed); the prefix cache is reset after the waves in
    resets, and mid_resets times at random steps of a wave with the running requests preempted."""
    rng = random.Random(seed)
    bases = [golden[:60], [1] + golden[100:160], golden[:20] + golden[150:190]]
    engine = make_engine(stories_path, host_blocks, **config)
    dtype = config.get("kv_cache_dtype", "auto")
    try:
        work, turns = Workload(engine), {}
        before = assert_wave_whole(engine, None)
        for wave in range(waves):
            specs = make_wave(rng, wave, bases, turns, size)
            run = work.run_wave(specs, {rng.randint(1, 30) for _ in range(mid_resets)})
            before = assert_wave_whole(engine, before, run)
            check_wave(specs, run, alone, dtype, exact_hits)
            for s in specs:
                out = run.outputs[s.rid]
                if s.greedy and s.abort_at is None and s.salt is None:
                    turns[s.rid] = (s.prompt, list(out.outputs[0].token_ids))
            if wave in resets:
                work.reset()
                before = assert_wave_whole(engine, None)
        return engine
    finally:
        engine.shutdown()


# ---- the scenarios --------------------------------------------------------------------------------

def test_a_roomy_pool_reuses_exactly_the_computed_prefix_blocks(stories_path, golden, alone):
    # Nothing is evicted: each admission reuses every full block computed before it, no more,
    # chunked prefills' blocks included once their chunk is launched.
    run_workload(stories_path, golden, alone, seed=1, waves=8, size=24, resets={2, 5}, host_blocks=0,
                 exact_hits=True, num_kv_blocks=600, max_num_batched_tokens=32)


def test_a_small_pool_with_a_small_host_tier_preempts_evicts_and_reloads(stories_path, golden, alone):
    engine = run_workload(stories_path, golden, alone, seed=2, waves=8, size=24, resets={3}, host_blocks=10,
                          mid_resets=1, num_kv_blocks=20, max_num_batched_tokens=24)
    assert engine.scheduler.num_preemptions and engine.kv_connector.hit_tokens


def test_an_fp8_cache_with_a_host_tier_reuses_blocks_as_it_computes_them(stories_path, golden, alone):
    engine = run_workload(stories_path, golden, alone, seed=3, waves=8, size=24, resets={1}, host_blocks=24,
                          mid_resets=1, num_kv_blocks=22, kv_cache_dtype="fp8")
    assert engine.scheduler.num_preemptions and engine.kv_connector.hit_tokens


def test_async_scheduling_on_a_pool_one_sequence_wide(stories_path, golden, alone):
    engine = run_workload(stories_path, golden, alone, seed=4, waves=8, size=20, resets=set(), host_blocks=8,
                          mid_resets=1, num_kv_blocks=MAX_LEN // BS + 1, async_scheduling=True, max_num_seqs=3)
    assert engine.scheduler.num_preemptions and engine.kv_connector.hit_tokens


# ---- the defects it found -------------------------------------------------------------------------

@pytest.mark.parametrize("enable_prefix_caching", [True, False], ids=["caching", "no-caching"])
def test_prefix_cache_queries_count_only_prompts_looked_up(stories_path, golden, enable_prefix_caching):
    # A prompt_logprobs request skips the prefix cache (every prompt token's logits are needed), and
    # with caching off nothing is looked up: as vLLM counts, neither is a query. Both were counted,
    # so the hit rate (log line, /metrics, the monitor) fell with every prompt scored or never cached.
    engine = make_engine(stories_path, enable_prefix_caching=enable_prefix_caching)
    try:
        prompts = [golden[:21], golden[:21], golden[:30], golden[:13]]
        for i, prompt in enumerate(prompts):
            fields = dict(temperature=0, max_tokens=2, prompt_logprobs=1 if i == 2 else None)
            engine.add_request(f"r{i}", prompt, SamplingParams(**fields))
            while engine.has_unfinished_requests():
                engine.step()
        stats = engine.stats(summary=True)
        if enable_prefix_caching:
            assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (21 + 21 + 13, 20 + 12)
        else:
            assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
        assert stats.prompt_tokens_total == sum(map(len, prompts))
    finally:
        engine.shutdown()


def test_skip_reading_prefix_cache_true_is_refused_saying_when_minillm_skips_the_cache():
    # The refusal said minillm reads the prefix cache for every request; it skips it for
    # prompt_logprobs requests (as vLLM's default for the field does).
    with pytest.raises(ValueError, match="skip_reading_prefix_cache=True is not supported: minillm skips the "
                                         "prefix cache for prompt_logprobs requests alone .* a cache_salt"):
        SamplingParams(skip_reading_prefix_cache=True)
