"""Garbage collection in the serving processes: the heap made at start-up is frozen, so that a
collection walks only what serving itself allocates."""
from __future__ import annotations

import gc

# Allocations (net of frees) between two young-generation collections; Python's default is 700. A
# serving step allocates thousands of short-lived objects, nearly all freed by reference counting
# before any collection: collecting every 700 found the same few live ones again and again.
GEN0_THRESHOLD = 20_000
# In a process that runs the step loop, young collections happen right after a step is launched,
# while the device runs it, once this many objects have piled up (collect_young); the automatic
# threshold stays far above it, a backstop for when no step runs.
YOUNG_BATCH = 5_000
STEP_LOOP_GEN0_THRESHOLD = 100_000


def freeze_startup_heap(engine=None) -> None:
    """Collect once, then move every object alive now into the permanent generation (as vLLM does in
    its API server and engine core), and collect the young generation less often. Given the engine
    whose step loop this process runs, young collections move to just after each launch
    (engine.after_launch = collect_young).

    The imported modules, the model's layers, FastAPI's routes and pydantic's validators are never
    garbage, yet every full collection walked all of them: a pause of tens of milliseconds, in the
    middle of a step or of a stream's writes, that showed up as inter-token latency.
    """
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD if engine is None else STEP_LOOP_GEN0_THRESHOLD, gen1, gen2)
    if engine is not None:
        engine.after_launch = collect_young


def collect_young() -> None:
    """Collect what the last steps left, now that a step is launched: the host would otherwise wait
    for the device here, while an automatic collection lands wherever an allocation trips it. While
    hundreds of new requests join (each leaving objects alive past a step) a collection walks
    thousands of them: milliseconds between two steps, seen by every stream as inter-token latency.
    The older generations follow Python's own counts (gc.get_threshold)."""
    young, middle, old = gc.get_count()
    if young < YOUNG_BATCH:
        return
    _, middle_threshold, old_threshold = gc.get_threshold()
    if middle + 1 < middle_threshold:
        gc.collect(0)
    elif old + 1 < old_threshold:
        gc.collect(1)
    else:
        gc.collect(2)
