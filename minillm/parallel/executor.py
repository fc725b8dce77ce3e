"""Rank 0 of a tensor-parallel group: the ModelRunner's interface over N processes.

    engine ── scheduler, block manager, sampler: once, here on rank 0
       │ launch(SchedulerOutput)
    TensorParallelExecutor (rank 0: a ModelRunner over shard 0)
       │ prepared inputs: ids [T], positions [T], attention metadata, logit rows
       ├──── channel (shared memory) ───> worker rank 1 .. N-1 (a ModelRunner over shard r)
       │ forward: all-reduce after embedding, o_proj, down_proj; all-gather of the logits
       └──── communicator (shared memory) <──> every rank

Workers are spawned (safe with the server's threads) and never outlive the executor: shutdown()
stops them, a finalizer does if nobody called it, and they exit by themselves when rank 0's
process is gone. A worker that dies is reported by rank 0's next wait, with the worker's error.

The seam: every forward pass of a step goes through ModelRunner.compute_logits(ids, positions,
meta, rows, logits_indices), so rank 0 sends exactly those arguments and each worker calls its
own compute_logits with them; the collectives inside then pair up call for call. Input tokens
still on the device (a step kept in flight) are filled in on the host before sending: workers
never hold sampled ids.
"""
from __future__ import annotations

import functools
import multiprocessing as mp
import os
import time
import weakref
from multiprocessing.connection import wait as wait_sentinels

import numpy as np

from minillm.exit_signals import start_resource_tracker
from minillm.model_runner import ModelRunner
from minillm.parallel.channel import ChannelWriter
from minillm.parallel.communicator import ShmCommunicator, ShmGroup
from minillm.parallel.errors import DEFAULT_TIMEOUT_S, TensorParallelError, wait_for
from minillm.parallel.shared_arrays import share_arrays
from minillm.parallel.sharding import (check_tensor_parallel_size, shard_model_config, shard_weights,
                                       vocab_shard_size)
from minillm.parallel.worker import WorkerSpec, run_worker

MAX_SLOT_BYTES = 16 << 20        # larger collectives go through in chunks; keeps /dev/shm use small
SHUTDOWN_WAIT_S = 10.0


class _Peers:
    """The workers' processes and reply pipes; calling it raises if a worker has died."""

    def __init__(self):
        self.procs: list = []            # rank r at index r - 1
        self.replies: list = []          # rank 0's receive ends of the reply pipes
        self.failure: str | None = None  # why the group stopped, once it has

    def __call__(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        for rank, (proc, conn) in enumerate(zip(self.procs, self.replies), 1):
            if not proc.is_alive():
                self.failure = f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code " \
                               f"{proc.exitcode}{_reported_error(conn)}"
                raise TensorParallelError(self.failure)


def _reported_error(conn) -> str:
    """': <error>' when the worker sent one before it died."""
    try:
        while conn.poll(0):
            status, value = conn.recv()
            if status == "error":
                return f": {value}"
    except (EOFError, OSError):
        pass
    return ""


def _close_segments(segments: list) -> None:
    for shm in segments:
        shm.close()
        shm.unlink()
    segments.clear()


def _stop(procs: list, closers: list) -> None:
    """Kill what is still running (a worker ignores SIGTERM), then remove the shared-memory segments."""
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(SHUTDOWN_WAIT_S)
    for close in closers:
        close()


class WorkerGroup:
    """Ranks 1..N-1 as spawned processes, with rank 0's ends of the channel and the communicator."""

    def __init__(self, shard_config, model_config, config, backend: str, dtype: str,
                 weights: dict[str, np.ndarray], timeout: float = DEFAULT_TIMEOUT_S):
        size = config.tensor_parallel_size
        if getattr(mp.current_process(), "_inheriting", False):
            # A spawned process imports the main script again: one that builds the engine at its top
            # level would start workers from every worker.
            raise TensorParallelError(
                "tensor_parallel_size > 1 starts its workers as new processes, which import the main script "
                "again: build the LLM under `if __name__ == \"__main__\":` in the script")
        if mp.current_process().daemon:
            # multiprocessing's own refusal is a bare AssertionError from deep inside Process.start().
            raise TensorParallelError(
                "tensor_parallel_size > 1 starts its workers as child processes, which a daemonic process (a "
                "multiprocessing.Pool worker, a Process started with daemon=True) may not have: build the LLM "
                "in the main process or in a Process that is not daemonic")
        ctx = mp.get_context("spawn")    # fork would copy the server's threads and locks mid-flight
        start_resource_tracker()         # it removes the segments below if every rank dies by a hang-up
        self.timeout = timeout
        self.peers = _Peers()
        self._segments: list = []        # weight shards, removed once every worker has read its own
        closers: list = [functools.partial(_close_segments, self._segments)]
        # Runs at shutdown(), when the group is dropped, or at exit; it holds nothing that holds self.
        self._finalizer = weakref.finalize(self, _stop, self.peers.procs, closers)
        slot = 4 * max(config.max_num_batched_tokens * model_config.hidden_size,
                       config.max_num_seqs * vocab_shard_size(model_config.vocab_size, size))
        self.group = ShmGroup(ctx, size, min(slot, MAX_SLOT_BYTES))
        closers.append(self.group.close)
        self.channel = ChannelWriter(ctx, size - 1, self.peers, timeout)
        closers.append(self.channel.close)
        for rank in range(1, size):
            shm, handle = share_arrays(shard_weights(weights, model_config, rank, size))
            self._segments.append(shm)
            recv, send = ctx.Pipe(duplex=False)
            spec = WorkerSpec(rank, shard_config, config, backend, dtype, os.getpid(), self.group.handle,
                              self.channel.handle, send, handle, timeout)
            proc = ctx.Process(target=run_worker, args=(spec,), name=f"minillm-tp-rank{rank}", daemon=True)
            proc.start()
            send.close()                 # the worker holds the only send end: its death closes the pipe
            self.peers.procs.append(proc)
            self.peers.replies.append(recv)

    def communicator(self, rank: int) -> ShmCommunicator:
        """This process's end of the collectives."""
        return ShmCommunicator(self.group.handle, rank, self.peers, self.timeout)

    def send(self, method: str, *args) -> None:
        """A call for every worker (raises at once if the group has stopped)."""
        self.peers()
        self.channel.send(method, *args)

    def replies(self) -> list:
        """Every worker's answer to the last start-up call, by rank."""
        out = []
        for rank, conn in enumerate(self.peers.replies, 1):
            wait_for(conn.poll, f"rank {rank}'s reply", self.peers, self.timeout)
            try:
                status, value = conn.recv()
            except (EOFError, OSError):       # it exited before answering; what it printed says why
                from minillm.engine_core.client import describe_exit
                proc = self.peers.procs[rank - 1]
                proc.join(5)
                code = proc.exitcode
                # A worker that failed printed its error; one killed by a signal (the OOM killer) printed nothing.
                how = (f"exit status {code}; its own error is printed above" if code is not None and code > 0
                       else describe_exit(code))
                self.peers.failure = f"tensor-parallel worker rank {rank} exited during start-up ({how})"
                raise TensorParallelError(self.peers.failure) from None
            if status == "error":
                self.peers.failure = f"tensor-parallel worker rank {rank} failed: {value}"
                raise TensorParallelError(self.peers.failure)
            out.append(value)
        return out

    def wait_ready(self) -> None:
        """Wait until every worker has built its runner, then drop the weight segments."""
        self.replies()
        _close_segments(self._segments)

    @property
    def pids(self) -> list[int]:
        """The workers' process ids, by rank."""
        return [p.pid for p in self.peers.procs]

    def shutdown(self) -> None:
        """Ask the workers to exit, wait for them (kill those that do not), remove the segments."""
        if not self._finalizer.alive:
            return
        if self.peers.failure is None:
            try:
                self.send("shutdown")
                deadline = time.monotonic() + SHUTDOWN_WAIT_S
                for proc in self.peers.procs:
                    proc.join(max(0.0, deadline - time.monotonic()))
            except TensorParallelError:
                pass
        self._finalizer()

    def terminate(self, reason: str) -> None:
        """Stop every worker now (after a failure: they may be stuck in a collective)."""
        if self.peers.failure is None:
            self.peers.failure = reason
        self._finalizer()


class TensorParallelExecutor(ModelRunner):
    """ModelRunner's interface for tensor_parallel_size > 1: rank 0's shard here, the rest in workers."""

    def __init__(self, model_config, config, ops, device, weights: dict[str, np.ndarray], dtype,
                 eos_token_ids: list[int]):
        size = config.tensor_parallel_size
        check_tensor_parallel_size(model_config, size, ops.name)
        t0 = time.perf_counter()
        shard_config = shard_model_config(model_config, size)
        self.workers = WorkerGroup(shard_config, model_config, config, ops.name, dtype, weights)
        try:
            super().__init__(shard_config, config, ops, device, shard_weights(weights, model_config, 0, size),
                             dtype, eos_token_ids, comm=self.workers.communicator(0))
            self.workers.wait_ready()
        except BaseException as exc:
            self.workers.terminate(f"start-up failed: {type(exc).__name__}: {exc}")
            raise
        self.startup_seconds = time.perf_counter() - t0     # workers spawned, weights sharded and built

    def determine_num_blocks(self, max_model_len: int) -> int:
        """The fewest KV blocks any rank can hold (each rank sizes its own pool of its heads)."""
        self._send("determine_num_blocks", max_model_len)
        mine = self._guarded(super().determine_num_blocks, max_model_len, is_startup=True)
        return min([mine] + self._guarded(self.workers.replies))

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Every rank allocates its KV pool (its KV heads) and rotary table."""
        self._send("initialize_cache", num_blocks, max_model_len)
        self._guarded(super().initialize_cache, num_blocks, max_model_len, is_startup=True)
        self._guarded(self.workers.replies)

    def reset_kv_scales(self) -> None:
        """ModelRunner.reset_kv_scales on every rank (each holds a copy of the layers' scales)."""
        self._send("reset_kv_scales")
        self._guarded(super().reset_kv_scales)

    def launch(self, out, grammar_bitmask=None, defer_sampling=False):
        """ModelRunner.launch, after checking that every worker is there: a stopped group fails
        each step at once, before anything is prepared."""
        self._guarded(self.workers.peers)
        return super().launch(out, grammar_bitmask, defer_sampling)

    def compute_logits(self, ids, positions, meta, rows, patch=None, logits_indices=None, prompt_plan=None):
        """Send the step's inputs to the workers, then run rank 0's part; logits [len(rows), V]
        (or of the token rows logits_indices names, in a step verifying draft tokens). A prompt_plan
        goes to the workers too: its rows' logits are gathered over the ranks, slice for slice."""
        ids = self._fill_placeholders(ids, patch)
        self._send("execute_model", ids, positions, meta, list(rows), logits_indices, prompt_plan)
        return self._guarded(super().compute_logits, ids, positions, meta, rows, None, logits_indices,
                             prompt_plan)

    def _fill_placeholders(self, ids: np.ndarray, patch) -> np.ndarray:
        """ids [T] with the last step's samples written where they were still on the device."""
        if patch is None:
            return ids
        dst, src, last_ids = patch
        ids = ids.copy()
        ids[dst] = self.ops.to_numpy(last_ids)[src]
        return ids

    def _send(self, method: str, *args) -> None:
        self._guarded(self.workers.send, method, *args)

    def _guarded(self, fn, *args, is_startup: bool = False):
        """fn(*args); any failure once the workers have a call leaves the ranks out of step, so it
        stops the group and is raised as a TensorParallelError. At start-up a ValueError (a setting
        that does not fit, as one process raises it) is raised as it is, once the group is stopped."""
        try:
            return fn(*args)
        except TensorParallelError as exc:
            self.workers.terminate(str(exc))
            raise
        except BaseException as exc:
            self.workers.terminate(f"rank 0 failed: {type(exc).__name__}: {exc}")
            if isinstance(exc, Exception) and not (is_startup and isinstance(exc, ValueError)):
                raise TensorParallelError(f"rank 0 failed in a tensor-parallel call, the group is "
                                          f"stopped: {type(exc).__name__}: {exc}") from exc
            raise

    def worker_sentinels(self) -> list[int]:
        """Each worker's process sentinel: readable once it has exited."""
        return [proc.sentinel for proc in self.workers.peers.procs]

    def check_workers(self) -> None:
        """TensorParallelError naming the worker when one has died. A worker whose sentinel is ready
        has closed its files on the way out but may not be reaped yet (is_alive() still true): it is
        waited for, so that the sentinel's wake-up always finds it gone."""
        ready = set(wait_sentinels(self.worker_sentinels(), timeout=0))
        for proc in self.workers.peers.procs:
            if proc.sentinel in ready:
                proc.join(SHUTDOWN_WAIT_S)
        self.workers.peers()

    def shutdown(self) -> None:
        """Stop the workers, then release rank 0's pool and weights."""
        self.workers.shutdown()
        super().shutdown()
