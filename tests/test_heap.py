"""The serving processes' garbage collection: a frozen start-up heap, young collections after launches."""
import gc

import pytest

from minillm import SamplingParams
from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.engine_core import heap


@pytest.fixture
def restore_gc():
    """Put back the thresholds and unfreeze what a test froze."""
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)
    gc.unfreeze()


def test_a_step_loop_collects_the_young_generation_after_launches(restore_gc):
    class Engine:
        after_launch = None

    engine = Engine()
    heap.freeze_startup_heap(engine)
    assert engine.after_launch is heap.collect_young
    assert gc.get_threshold()[0] == heap.STEP_LOOP_GEN0_THRESHOLD > heap.YOUNG_BATCH
    kept = [[] for _ in range(100)]              # tracked objects: below the batch, nothing happens
    young = gc.get_count()[0]
    heap.collect_young()
    assert gc.get_count()[0] >= young
    kept += [[] for _ in range(heap.YOUNG_BATCH)]
    heap.collect_young()
    assert gc.get_count()[0] < 100               # collected: the young count starts again
    assert len(kept) == 100 + heap.YOUNG_BATCH


def test_without_a_step_loop_only_the_threshold_changes(restore_gc):
    heap.freeze_startup_heap()
    assert gc.get_threshold()[0] == heap.GEN0_THRESHOLD


def test_the_engine_calls_after_launch_once_a_launched_step(stories_path):
    engine = LLMEngine(EngineConfig(model=str(stories_path), device="cpu"))
    calls = []
    engine.after_launch = lambda: calls.append(engine.metrics.num_steps)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert calls == list(range(1, engine.metrics.num_steps + 1))
    engine.shutdown()
