"""Tensor parallelism on the CPU under abuse, on stories260K: sharded logits against one process,
sizes that do not divide the model, a worker that dies mid-run, and what shutdown leaves behind
(processes, shared-memory segments and named semaphores in /dev/shm)."""
import json
import multiprocessing as mp
import os
import signal

import pytest

from minillm import LLM, SamplingParams
from minillm.parallel.errors import TensorParallelError

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
