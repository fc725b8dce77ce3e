"""A tensor-parallel worker process: one rank's ModelRunner, driven by rank 0's calls.

The worker never schedules or samples: it runs the forward passes rank 0 runs, on its own shard
and its own KV pool (its KV heads), and takes part in every collective. It ends on "shutdown",
when rank 0's process is gone, or on an error (reported on its reply pipe, then exit code 1).
"""
from __future__ import annotations

import os
import signal
import sys
import traceback
from dataclasses import dataclass

from minillm.config import EngineConfig, ModelConfig
from minillm.parallel.channel import ChannelHandle, ChannelReader
from minillm.parallel.communicator import ShmCommunicator, ShmGroupHandle
from minillm.parallel.errors import DEFAULT_TIMEOUT_S, PeerGone
from minillm.parallel.shared_arrays import SharedArraysHandle, read_shared_arrays


@dataclass
class WorkerSpec:
    """Everything a worker starts from (pickled once, when it is spawned)."""

    rank: int
    model_config: ModelConfig        # this rank's shard of the model's shape
    config: EngineConfig
    backend: str                     # ops backend: "numpy"
    dtype: str
    parent_pid: int
    comm: ShmGroupHandle
    channel: ChannelHandle
    replies: object                  # Connection (send end): ("ok", result) or ("error", message)
    weights: SharedArraysHandle      # this rank's shard, by Hugging Face name
    timeout: float = DEFAULT_TIMEOUT_S


def run_worker(spec: WorkerSpec) -> None:
    """The worker process's main function."""
    # Ctrl-C, or a service manager's SIGTERM to the whole process group, is rank 0's to handle: it stops
    # the workers once its open requests are done (a worker that died of it took the engine with it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def check_parent() -> None:
        if os.getppid() != spec.parent_pid:
            raise PeerGone()

    try:
        runner = _build_runner(spec, check_parent)
        spec.replies.send(("ok", None))
        _serve(runner, ChannelReader(spec.channel, spec.rank, check_parent), spec.replies)
    except PeerGone:
        return
    except BaseException as exc:  # noqa: BLE001  anything at all ends this rank, and rank 0 must hear why
        sys.stderr.write(f"minillm tensor-parallel rank {spec.rank} failed:\n{traceback.format_exc()}")
        try:
            spec.replies.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        sys.exit(1)


def _build_runner(spec: WorkerSpec, check_parent):
    from minillm.device import make_device
    from minillm.model_runner import ModelRunner
    from minillm.ops import get_ops
    comm = ShmCommunicator(spec.comm, spec.rank, check_parent, spec.timeout)
    weights = read_shared_arrays(spec.weights)
    return ModelRunner(spec.model_config, spec.config, get_ops(spec.backend), make_device(spec.backend),
                       weights, spec.dtype, [], comm=comm)


def _serve(runner, channel: ChannelReader, replies) -> None:
    """Run calls until "shutdown"; start-up calls answer on the reply pipe, steps do not."""
    while True:
        method, args = channel.recv()
        if method == "shutdown":
            runner.shutdown()
            channel.close()
            return
        if method == "execute_model":
            ids, positions, meta, rows, logits_indices, prompt_plan = args
            # rank 0 samples the logits and reads the prompt log-probabilities; this rank's copies go
            runner.compute_logits(ids, positions, meta, rows, None, logits_indices, prompt_plan)
            runner._prompt_logprobs = None
        elif method == "reset_kv_scales":
            runner.reset_kv_scales()
        elif method == "determine_num_blocks":
            replies.send(("ok", runner.determine_num_blocks(*args)))
        elif method == "initialize_cache":
            runner.initialize_cache(*args)
            replies.send(("ok", None))
        else:
            raise ValueError(f"unknown call {method!r}")
