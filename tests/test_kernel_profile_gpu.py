"""The kernel profile on the GPU: kernels replayed from a CUDA graph are recorded one by one."""
from __future__ import annotations

import pytest

from minillm.benchmarks.kernel_profile import profile_kernels

from gpu_support import HAS_GPU, cupy
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]

PROBE = 'extern "C" __global__ void minillm_probe_add(float* x) { x[threadIdx.x] += 1.0f; }'


def test_launched_and_graph_replayed_kernels_are_counted_by_grid():
    pytest.importorskip("torch")
    kernel = cupy.RawKernel(PROBE, "minillm_probe_add")
    x = cupy.zeros(32, cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        kernel((1,), (32,), (x,))
        stream.synchronize()
        stream.begin_capture()
        for _ in range(5):
            kernel((1,), (32,), (x,))
        graph = stream.end_capture()

    def run():
        with stream:
            for _ in range(3):
                graph.launch(stream)
            kernel((2,), (32,), (x,))
            stream.synchronize()

    _, rows = profile_kernels(run)
    assert {r.grid: r.count for r in rows if r.name == "minillm_probe_add"} == {(1, 1, 1): 15, (2, 1, 1): 1}
    assert float(x[0]) == 17.0
