"""Garbage collection in the serving processes: the heap made at start-up is frozen, so that a
collection walks only what serving itself allocates."""
from __future__ import annotations

import gc

# Allocations (net of frees) between two young-generation collections; Python's default is 700. A
# serving step allocates thousands of short-lived objects, nearly all freed by reference counting
# before any collection: collecting every 700 found the same few live ones again and again.
GEN0_THRESHOLD = 20_000


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now into the permanent generation (as vLLM does in
    its API server and engine core), and collect the young generation less often.

    The imported modules, the model's layers, FastAPI's routes and pydantic's validators are never
    garbage, yet every full collection walked all of them: a pause of tens of milliseconds, in the
    middle of a step or of a stream's writes, that showed up as inter-token latency.
    """
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
