"""Tensor parallelism: one model split over N processes (tensor_parallel_size=N).

    sharding.py       which rows or columns of each weight a rank holds; a rank's ModelConfig
    communicator.py   the collectives the decoder calls (all_reduce, all_gather); CPU: shared memory
    channel.py        rank 0 -> workers: each step's prepared inputs through shared memory
    worker.py         a worker process: one rank's ModelRunner
    executor.py       rank 0: the ModelRunner's interface, driving the workers

The engine imports executor.py only when tensor_parallel_size > 1; a single rank runs none of it.
"""
from minillm.parallel.errors import TensorParallelError

__all__ = ["TensorParallelError"]
