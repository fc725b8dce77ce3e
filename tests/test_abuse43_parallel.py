"""Tensor parallelism and prefill/decode disaggregation abused as vLLM users abuse them: ranks
killed while the engine idles, on the engine core's thread as in its own process; start-up
settings that do not fit, alone or together in one host's memory; ranks asked of a daemonic process; a hang-up of the server's whole
process group; engines that disagree on where their KV segments live; prompts handed over at
and around block boundaries, down to one token."""
from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from test_kv_transfer import PROMPTS, claim, engines, prefill, run, wait_until_free
from test_server_helpers import running_server, started_url, wait_for

import minillm.device
import minillm.model_runner
from minillm import LLM, SamplingParams
from minillm.kv_connector.transport import SHM_DIR, SHM_DIR_ENV, KVRegion, SharedSegment, attach_segment
from minillm.parallel import TensorParallelError
from minillm.parallel.executor import WorkerGroup

REPO = Path(__file__).resolve().parents[1]


def test_a_worker_killed_while_a_thread_engine_idles_ends_it_before_any_request(stories_path):
    # --engine-core thread: the engine thread slept on its command queue, so /health said 200 until a
    # request found the worker gone (the engine core process watches its workers' sentinels).
    with running_server(stories_path, engine_core="thread", tensor_parallel_size=2) as (url, engine):
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        [worker] = engine.engine.runner.workers.pids
        os.kill(worker, signal.SIGKILL)
        assert wait_for(lambda: httpx.get(f"{url}/health", timeout=30).status_code == 503, timeout=60)
        error = httpx.get(f"{url}/health", timeout=30).json()["error"]
        assert error["code"] == "engine_dead" and "rank 1" in error["message"], error
        assert engine.has_failed


def test_a_kv_budget_that_holds_no_block_is_the_value_error_of_one_process(stories_path):
    # Each rank sizes its own pool (vLLM's kv_cache_memory_bytes is per device): rank 0's refusal was
    # wrapped as "rank 0 failed in a tensor-parallel call" (a RuntimeError), and the command line
    # answered it with a plain error, exit status 1, where one process names the flag.
    earlier = set(mp.active_children())
    with pytest.raises(ValueError, match=r"^kv_cache_memory_bytes 10 holds no KV block: a block of 16 tokens "
                                         r"takes 10240 bytes"):
        LLM(str(stories_path), device="cpu", tensor_parallel_size=2, kv_cache_memory_bytes=10)
    assert set(mp.active_children()) <= earlier                  # the group was stopped


def test_a_daemonic_process_is_told_why_it_cannot_start_ranks(stories_path, tmp_path):
    # A multiprocessing.Pool worker (daemonic) building LLM(tensor_parallel_size=2) got a bare
    # AssertionError, "daemonic processes are not allowed to have children", from Process.start().
    script = tmp_path / "pool_worker.py"
    script.write_text(textwrap.dedent(f"""
        import multiprocessing as mp

        def build(queue):
            from minillm import LLM
            try:
                LLM({str(stories_path)!r}, device="cpu", tensor_parallel_size=2)
                queue.put("built")
            except Exception as exc:
                queue.put(f"{{type(exc).__name__}}: {{exc}}")

        if __name__ == "__main__":
            ctx = mp.get_context("fork")
            queue = ctx.Queue()
            proc = ctx.Process(target=build, args=(queue,), daemon=True)
            proc.start()
            print(queue.get(timeout=120))
            proc.join(60)
    """))
    out = subprocess.run([sys.executable, str(script)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("TensorParallelError: tensor_parallel_size > 1 starts its workers as child "
                                 "processes, which a daemonic process"), out.stdout


def test_a_segment_of_another_directory_names_the_setting_both_engines_need(tmp_path, monkeypatch):
    # A prefill engine started with $MINILLM_KV_SHM_DIR and a decode engine without it: the decode
    # server refused the transfer saying the producer's pool "is not a minillm KV segment".
    monkeypatch.delenv(SHM_DIR_ENV, raising=False)
    segment = SharedSegment(4 * 2 * 2 * 3 * 4, directory=tmp_path)
    try:
        region = KVRegion("shm", str(segment.path), (2, 2, 3, 2, 1, 2), "float32")
        with pytest.raises(ValueError, match=rf"lies outside this engine's segment directory '{re.escape(str(SHM_DIR))}':"
                                             r" give both engines the same \$MINILLM_KV_SHM_DIR"):
            attach_segment(region)
        monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path))
        assert attach_segment(region).shape == (2, 2, 3, 2, 1, 2)
    finally:
        segment.unlink()


def shm_files_mapped_by(pid: int) -> set[str]:
    """The /dev/shm files a process maps (a tensor-parallel group's shared-memory segments)."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split(maxsplit=5)[5] for line in maps if len(line.split()) == 6 and "/dev/shm/" in line}


@pytest.mark.parametrize("engine_core", ["process", "thread"])
def test_a_hang_up_of_the_servers_process_group_leaves_no_segment_behind(stories_path, tmp_path, engine_core):
    # The terminal of `minillm serve -tp 2` closed (SIGHUP to its foreground group): every process died
    # by it, multiprocessing's resource tracker too, and the group's shared memory and semaphores
    # stayed in /dev/shm for good.
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "minillm", "serve", str(stories_path), "--device", "cpu",
                                 "-tp", "2", "--port", "0", "--engine-core", engine_core], cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        started_url(proc, log)
        found = re.search(r"engine core in process (\d+)", log.read_text())
        rank0 = int(found.group(1)) if found else proc.pid
        files = shm_files_mapped_by(rank0)
        assert len([f for f in files if "/psm_" in f]) >= 2, files     # the collectives' and the channel's
        os.killpg(proc.pid, signal.SIGHUP)
        proc.wait(60)
        assert wait_for(lambda: not any(os.path.exists(f) for f in files), timeout=60), \
            [f for f in files if os.path.exists(f)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def test_a_rank_killed_while_it_starts_is_said_to_be_killed(stories_path, monkeypatch):
    # Killed before it could answer (the OOM killer while it loads its shard), a worker prints nothing:
    # the error said "exit status -9; its own error is printed above" of an error nobody printed.
    started = WorkerGroup.__init__

    def start_then_kill(self, *args, **kwargs):
        started(self, *args, **kwargs)
        for pid in self.pids:            # just spawned: not yet past its imports, so it cannot have answered
            os.kill(pid, signal.SIGKILL)

    monkeypatch.setattr(WorkerGroup, "__init__", start_then_kill)
    with pytest.raises(TensorParallelError, match=r"rank 1 exited during start-up \(killed by SIGKILL\)$"):
        LLM(str(stories_path), device="cpu", tensor_parallel_size=2)


def test_prompts_at_block_boundaries_and_of_one_token_decode_as_one_engine(stories_path):
    # Blocks of 8: the decode engine loads every prompt token but the last, so 8 and 16 tokens load
    # a block it then completes, 9 and 17 whole blocks only, and 1 token nothing (its lease goes back).
    producer, consumer, plain = engines(stories_path, enable_prefix_caching=False)
    try:
        ids = plain.tokenizer.encode(PROMPTS[0], add_special_tokens=True)
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        for n in (1, 2, 8, 9, 16, 17):
            want = run(plain, f"ref-{n}", ids[:n], greedy).outputs[0].token_ids
            kv = prefill(producer, f"p-{n}", ids[:n])
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                    extra_args={"kv_transfer_params": claim(kv, ids[:n])})
            out = run(consumer, f"d-{n}", ids[:n], params)
            assert out.outputs[0].token_ids == want, n
            assert (out.kv_transfer_stats or {}).get("num_tokens", 0) == n - 1, n
            wait_until_free(producer)
        assert consumer.stats(cells=1).kv_num_used_blocks == 0
        assert producer.stats(cells=1).kv_transfer_leases_released == 6
    finally:
        for engine in (producer, consumer, plain):
            engine.shutdown()


def test_the_ranks_pools_together_are_held_to_the_hosts_memory(stories_path, monkeypatch):
    # Each rank sized its CPU pool against all of the host's available memory, as if it were alone:
    # two ranks took the default's "half the memory available" twice over, and a budget or a block
    # count that fit one pool passed for two (found only when the pools filled, by the OOM killer).
    mib = 2**20
    for module in (minillm.device, minillm.model_runner):          # rank 0's view: the group's is the least
        monkeypatch.setattr(module, "available_host_bytes", lambda: 64 * mib)
    with LLM(str(stories_path), device="cpu", tensor_parallel_size=2) as llm:
        # a block of 16 tokens takes 10240 bytes on a rank (its 2 KV heads); half of 64 MiB over 2 ranks
        assert llm.llm_engine.block_manager.num_blocks == 16 * mib // 10240
    with pytest.raises(ValueError, match=r"^kv_cache_memory_bytes 0\.0 GiB on each of 2 ranks \(0\.1 GiB together\) "
                                         r"exceeds the 0\.1 GiB of memory available"):
        LLM(str(stories_path), device="cpu", tensor_parallel_size=2, kv_cache_memory_bytes=40 * mib)
    with pytest.raises(ValueError, match=r"^num_kv_blocks 4000 needs 0\.1 GiB of KV pool over 2 ranks, more than"):
        LLM(str(stories_path), device="cpu", tensor_parallel_size=2, num_kv_blocks=4000)


def test_the_command_line_refuses_a_budget_the_ranks_together_cannot_have(stories_path):
    # Checked before the model loads, as one process's budget is: a usage error naming the flag.
    from minillm.config import available_host_bytes
    each = int(available_host_bytes() * 0.9)        # fits one pool; two are far past the memory there is
    proc = subprocess.run([sys.executable, "-m", "minillm", "generate", str(stories_path), "--device", "cpu", "-tp", "2",
                           "--kv-cache-memory-bytes", str(each), "-p", "Once"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Invalid value for '--kv-cache-memory-bytes': " in proc.stderr and " on each of 2 ranks (" in proc.stderr
