"""Tensor parallelism on the CPU under abuse, on stories260K: sharded logits against one process,
sizes that do not divide the model, a worker that dies mid-run, and what shutdown leaves behind
(processes, shared-memory segments and named semaphores in /dev/shm)."""
import dataclasses
import json
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from minillm import LLM, SamplingParams
from minillm.loader import load_model_config, load_weights
from minillm.parallel.errors import TensorParallelError
from minillm.parallel.sharding import check_tensor_parallel_size, shard_model_config, shard_weights

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def golden(stories_path) -> list[int]:
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


@pytest.fixture(scope="module")
def prompts(golden) -> list[list[int]]:
    """Passages that repeat themselves (n-gram drafts find them) of several lengths."""
    return [[1] + golden[s:s + n] * 2 for s, n in [(1, 9), (30, 4), (61, 12), (90, 6)]]


def ipc_names(llm: LLM) -> list[str]:
    """The /dev/shm names of the group's segments and semaphores (rank 0's ends)."""
    workers = llm.engine.runner.workers
    sems = workers.channel.handle.ready + [workers.channel.handle.ack] + workers.group.handle.arrivals
    return ([workers.group.shm.name, workers.channel.handle.shm_name]
            + ["sem." + s._semlock.name.lstrip("/") for s in sems])


def left_in_dev_shm(names: list[str]) -> list[str]:
    return [n for n in names if os.path.exists(os.path.join("/dev/shm", n))]


def assert_gone(pids: list[int]) -> None:
    assert mp.active_children() == []
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX shared memory is not under /dev/shm here")
def test_shutdown_removes_every_segment_and_semaphore_at_once(stories_path, prompts):
    """shutdown() left the group's named semaphores in /dev/shm for as long as the LLM object lived
    (they went only when it was garbage collected); a stopped group, after a worker died, too."""
    llm = LLM(str(stories_path), device="cpu", tensor_parallel_size=2)
    names, pids = ipc_names(llm), llm.engine.runner.workers.pids
    assert len(left_in_dev_shm(names)) == len(names) == 2 + 4
    llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.shutdown()
    assert_gone(pids)
    assert left_in_dev_shm(names) == []
    llm.shutdown()                                  # a second shutdown is a no-op

    llm = LLM(str(stories_path), device="cpu", tensor_parallel_size=2)
    names, pids = ipc_names(llm), llm.engine.runner.workers.pids
    os.kill(pids[0], signal.SIGKILL)
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_gone(pids)
    assert left_in_dev_shm(names) == []
    llm.shutdown()


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_stories_give_the_logprobs_and_tokens_of_one_process(stories_path, prompts, tp):
    """stories260K over 2 and 4 processes (its 4 KV heads and MLP width 172 split whole), greedy
    with the top-5 log-probabilities of every token: the same tokens, values within float error."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    want = LLM(str(stories_path), device="cpu").generate(prompts, params, use_tqdm=False)
    with LLM(str(stories_path), device="cpu", tensor_parallel_size=tp) as llm:
        pids = llm.engine.runner.workers.pids
        got = llm.generate(prompts, params, use_tqdm=False)
    assert_gone(pids)
    for g, w in zip(got, want):
        a, b = g.outputs[0], w.outputs[0]
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            np.testing.assert_allclose([x[t] for t in x], [y[t] for t in x], rtol=1e-4, atol=1e-4)


def test_stories_shards_put_back_together_are_the_weights(stories_path):
    config = load_model_config(str(stories_path))
    weights = load_weights(str(stories_path), config, "float32")
    shards = [shard_weights(weights, config, r, 4) for r in range(4)]
    for name, w in weights.items():
        parts = [s[name] for s in shards]
        if all(p is w for p in parts):                 # replicated: the norms
            assert name.endswith("norm.weight")
            continue
        axis = 1 if name.split(".")[-2] in ("o_proj", "down_proj") else 0
        np.testing.assert_array_equal(np.concatenate(parts, axis=axis), w)
    rank = shard_model_config(config, 4)
    assert (rank.num_heads, rank.num_kv_heads, rank.intermediate_size) == (2, 1, 43)


def test_sizes_that_do_not_divide_name_both_numbers(stories_path):
    # 8 ranks would replicate its 4 KV heads, but its MLP width 172 does not split over them (vLLM's refusal too)
    for size, what in ((3, r"num_attention_heads \(8\)"), (8, r"intermediate_size \(172\)")):
        with pytest.raises(ValueError, match=rf"tensor_parallel_size {size} must divide the model's {what}"):
            LLM(str(stories_path), device="cpu", tensor_parallel_size=size)
    assert mp.active_children() == []
    config = dataclasses.replace(load_model_config(str(stories_path)), intermediate_size=170)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 must divide the model's intermediate_size \(170\)"):
        check_tensor_parallel_size(config, 4, "numpy")


def test_a_worker_killed_while_drafts_are_verified_is_an_error_not_a_hang(stories_path, prompts):
    """Speculation over 2 processes with a step kept in flight: rank 1 is killed while a launched
    step verifies drafts; the next step raises naming it, quickly, and nothing is left behind."""
    llm = LLM(str(stories_path), device="cpu", tensor_parallel_size=2, async_scheduling=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3})
    engine = llm.engine
    names, pids = ipc_names(llm), engine.runner.workers.pids
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    while not any(s.spec_token_ids for s in engine.scheduler.running):
        engine.step()
    os.kill(pids[0], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - t0 < 30
    assert_gone(pids)
    assert left_in_dev_shm(names) == []
    llm.shutdown()
    assert left_in_dev_shm(names) == []
