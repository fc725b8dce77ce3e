"""KernelLaunch packs its arguments once, as cuLaunchKernel reads them, and binds a layer's caches per call."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from minillm.ops import cuda as cuda_ops


class FakeCuda:
    """What KernelLaunch uses of CuPy: the driver's launchKernel and the current stream."""

    def __init__(self):
        self.launches = []
        self.driver = SimpleNamespace(launchKernel=self.launch)

    def get_current_stream(self):
        return SimpleNamespace(ptr=0x5100)

    def launch(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        # read every argument back through the address array, as the driver does
        n = len(self.expected)
        addresses = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint64 * n).from_address(params))
        slots = [bytes((np.ctypeslib.ctypes.c_uint8 * 8).from_address(int(a))) for a in addresses]
        self.launches.append((fn, (gx, gy, gz), (bx, by, bz), smem, stream, slots, extra))


def args_and_bytes():
    args = [np.uint64(0x1122334455667788), np.int64(-5), np.int32(-7), cuda_ops.K_CACHE, np.float32(1.5),
            cuda_ops.V_CACHE, np.int32(2**31 - 1), cuda_ops.KV_SCALES]
    def slot(a):
        return a.tobytes().ljust(8, b"\0")
    return args, slot


def test_the_arguments_are_packed_once_in_slots_the_driver_reads(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(cuda_ops, "cupy", SimpleNamespace(cuda=fake))
    args, slot = args_and_bytes()
    fake.expected = args
    raw_kernel = SimpleNamespace(kernel=SimpleNamespace(ptr=0xF00))    # CuPy's RawKernel: .kernel is its Function
    launch = cuda_ops.KernelLaunch(raw_kernel, (3, 2), (128,), args, shared_mem=4096)
    for layer in range(2):
        launch(np.uint64(0xA000 + layer), np.uint64(0xB000 + layer), np.uint64(0xC000 + layer))
    assert len(fake.launches) == 2
    for layer, (fn, grid, block, smem, stream, slots, extra) in enumerate(fake.launches):
        assert (fn, grid, block, smem, stream, extra) == (0xF00, (3, 2, 1), (128, 1, 1), 4096, 0x5100, 0)
        bound = {3: 0xA000 + layer, 5: 0xB000 + layer, 7: 0xC000 + layer}
        for i, a in enumerate(args):
            want = np.uint64(bound[i]).tobytes() if i in bound else slot(a)
            assert slots[i] == want, f"layer {layer}, argument {i}"


@pytest.mark.parametrize("bad", [7, 1.5, np.complex128(1j), None])
def test_an_argument_that_is_not_a_small_numpy_scalar_is_refused(bad):
    with pytest.raises(TypeError, match="argument 1"):
        cuda_ops.KernelLaunch(SimpleNamespace(ptr=1), (1,), (32,), [np.int32(0), bad])
