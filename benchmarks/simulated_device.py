"""A simulated device for host-time benchmarks: the real engine loop on the CPU backend, with the
forward pass and the sampling kernels replaced by work on a virtual device timeline, so the host
overlaps the "device" as it does a GPU under async scheduling.

    sim = SimulatedDevice(forward_s=4.5e-3, sample_s=0.3e-3, token_low=256, token_high=151643)
    sim.attach(engine)          # engine: an LLMEngine on the CPU backend

What stays real: scheduling, input preparation, the sampling metadata's packing, the structured
outputs glue (read-back, matcher advance, mask fill, the mask's upload calls and host staging),
the scheduler's update and the output processor. What is simulated: the model's logits (none are
computed), the sampler's kernels and the device's mask buffer (SimulatedBuffer: an upload into it
only notes which host row each row holds, as a GPU's copy engine takes that work off the host).
Each queued kernel starts when the device is free (or when it is queued, if later) and ends its
device time after; nothing runs on a thread, so the device's progress never waits for the GIL
(a GPU's does not). A read-back (np.asarray of the sampled ids)
sleeps until the sampling's end, GIL-free as a CUDA event wait is; that time is counted
(read_back_wait_s).

The sampled ids: a random one in [token_low, token_high) a row, and in a row the grammar bitmask
covers an allowed one (a random word of the mask that allows any, its lowest allowed bit), picked
on the host when the mask kernel is queued: host time the harness adds (about 0.2 ms for 64 rows),
which the benchmark reports as a part of its own.
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np


class SimulatedTokens:
    """Sampled ids still "on the device": np.asarray() waits for the sampling's end."""

    def __init__(self, owner: "SimulatedDevice", values: np.ndarray, ready_at: float) -> None:
        self._owner, self.values, self.ready_at = owner, values, ready_at
        self.shape = values.shape

    def __array__(self, dtype=None, copy=None):
        left = self.ready_at - time.perf_counter()
        if left > 0:
            time.sleep(left)
            self._owner.read_back_wait_s += time.perf_counter() - self.ready_at + left
        return self.values if dtype is None else self.values.astype(dtype)


class SimulatedLogits:
    """The logits of a step's sampling rows: their shape, and the tokens picked inside the masks."""

    def __init__(self, num_rows: int, vocab: int) -> None:
        self.shape = (num_rows, vocab)
        self.masked: dict[int, int] = {}          # row -> an allowed token of its mask


class SimulatedBuffer:
    """A [rows, W] buffer in the simulated device's memory: each row only notes the host row
    (array, index) it holds. Slicing rows gives a view; uploads copy nothing on the host."""

    def __init__(self, shape, dtype, holds: list | None = None, start: int = 0) -> None:
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self._holds = holds if holds is not None else [None] * self.shape[0]
        self._start = start
        self.flags = SimpleNamespace(c_contiguous=True)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def __getitem__(self, index: slice) -> "SimulatedBuffer":
        start, stop, step = index.indices(self.shape[0])
        if step != 1:
            raise ValueError("a simulated buffer is sliced by consecutive rows")
        return SimulatedBuffer((stop - start,) + self.shape[1:], self.dtype, self._holds, self._start + start)

    def upload(self, src: np.ndarray) -> None:
        """self[...] = src, a host-to-device copy."""
        self._holds[self._start:self._start + len(src)] = [(src, i) for i in range(len(src))]

    def held(self, row: int) -> tuple[np.ndarray, int]:
        """The host (array, row) this row holds."""
        return self._holds[self._start + row]


class SimulatedCopies:
    """The sampler's device for uploads into simulated buffers (others go to the real device)."""

    def __init__(self, sim: "SimulatedDevice", device) -> None:
        self._sim, self._device = sim, device

    def __getattr__(self, name):
        return getattr(self._device, name)

    def copy_to_device_async(self, dst, src: np.ndarray, event: bool = True):
        """Queue dst[...] = src; returns the event after it (None with event=False)."""
        if not isinstance(dst, SimulatedBuffer):
            return self._device.copy_to_device_async(dst, src, event)
        if dst.nbytes != src.nbytes:
            raise ValueError(f"copy_to_device_async needs equal sizes, got {dst.nbytes} and {src.nbytes} bytes")
        dst.upload(src)
        self._sim.queue(0.0)
        return SimpleNamespace(done=True, synchronize=lambda: None) if event else None


class SimulatedSamplerOps:
    """The sampler's ops over simulated logits: 2-D buffers in simulated device memory, a staged
    upload copying on the host as the CUDA backend's does, the mask and sampling kernels queued on
    the virtual device."""

    def __init__(self, sim: "SimulatedDevice", ops) -> None:
        self._sim, self._ops = sim, ops
        self.name = ops.name
        self.xp = SimpleNamespace(empty=self._empty, zeros=np.zeros)

    def __getattr__(self, name):
        return getattr(self._ops, name)

    @staticmethod
    def _empty(shape, dtype):
        return SimulatedBuffer(shape, dtype) if len(shape) == 2 else np.empty(shape, dtype)

    @staticmethod
    def asarray_async(a) -> np.ndarray:
        """The CUDA backend's staged upload: a host copy into page-locked memory, then an async copy."""
        return np.array(a, copy=True)

    def apply_token_bitmask(self, logits: SimulatedLogits, bitmask, rows) -> None:
        """Queue the mask kernel (no device time of its own here); the rows' tokens are picked now."""
        rows = np.asarray(rows, np.int64)
        kept = np.flatnonzero((rows >= 0) & (rows < logits.shape[0]))      # mask rows that apply
        if not kept.size:
            self._sim.queue(0.0)
            return
        if isinstance(bitmask, SimulatedBuffer):
            held = [bitmask.held(int(i)) for i in kept]
            sources = {id(a): a for a, _ in held}
            if len(sources) != 1:
                raise ValueError("the simulated mask kernel reads rows uploaded from one host array")
            source, source_rows = next(iter(sources.values())), np.array([i for _, i in held], np.int64)
        else:
            source, source_rows = bitmask, kept
        logits.masked.update(zip(rows[kept].tolist(), self._sim.pick_allowed(source, source_rows).tolist()))
        self._sim.queue(0.0)

    def sample(self, logits: SimulatedLogits, temperature, top_k, top_p, min_p, uniforms) -> SimulatedTokens:
        """Queue the sampling: one token a row, inside its mask where it has one."""
        values = self._sim.rng.integers(self._sim.token_low, self._sim.token_high, logits.shape[0]).astype(np.int32)
        for row, token in logits.masked.items():
            values[row] = token
        return SimulatedTokens(self._sim, values, self._sim.queue(self._sim.sample_s))


class SimulatedDevice:
    """Replaces an engine's forward pass and sampling kernels with a virtual device timeline."""

    def __init__(self, forward_s: float, sample_s: float, token_low: int, token_high: int, seed: int = 0) -> None:
        self.forward_s, self.sample_s = forward_s, sample_s
        self.token_low, self.token_high = token_low, token_high
        self.rng = np.random.default_rng(seed)
        self.busy_until = 0.0                # when the work queued so far ends
        self.busy_s = 0.0                    # device time queued so far
        self.read_back_wait_s = 0.0          # host time spent waiting for read-backs

    def queue(self, seconds: float) -> float:
        """Queue work of `seconds` device time behind the work already queued; returns its end."""
        self.busy_until = max(self.busy_until, time.perf_counter()) + seconds
        self.busy_s += seconds
        return self.busy_until

    def attach(self, engine) -> None:
        """Route engine's logits and sampling kernels here (its runner must be on the CPU backend)."""
        runner = engine.runner
        if runner.ops.name != "numpy":
            raise ValueError("the simulated device replaces the CPU backend's forward pass")
        vocab = engine.model_config.vocab_size

        def compute_logits(ids, positions, meta, rows, patch=None, logits_indices=None, prompt_plan=None):
            if logits_indices is not None or prompt_plan is not None:
                raise ValueError("the simulated device runs no draft verification and no prompt scoring")
            self.queue(self.forward_s)
            return SimulatedLogits(len(rows), vocab) if rows else None

        runner.compute_logits = compute_logits
        runner.sampler.ops = SimulatedSamplerOps(self, runner.sampler.ops)
        if hasattr(runner.sampler, "device"):
            runner.sampler.device = SimulatedCopies(self, runner.sampler.device)

    def pick_allowed(self, bitmask: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """bitmask: [B, W] int32 rows; rows: [N] -> [N] an allowed token of each listed row: the
        lowest allowed bit of a random word that allows any (two probes, else a random one of
        the row's nonzero words)."""
        n, num_words = len(rows), bitmask.shape[1]
        probes = self.rng.integers(0, num_words, (2, n))
        index = np.where(bitmask[rows, probes[0]] != 0, probes[0], probes[1])
        empty = np.flatnonzero(bitmask[rows, index] == 0)
        if len(empty):
            flat = np.flatnonzero(bitmask[rows[empty]] != 0)                 # rows that allow few words
            which, words = flat // num_words, flat % num_words
            starts = np.searchsorted(which, np.arange(len(empty)))
            counts = np.searchsorted(which, np.arange(len(empty)), side="right") - starts
            if (counts == 0).any():
                raise RuntimeError("a grammar mask allows no token")
            index[empty] = words[starts + (self.rng.random(len(empty)) * counts).astype(np.int64)]
        word = bitmask[rows, index].view(np.uint32).astype(np.int64)
        lowest = word & -word
        return (32 * index + np.log2(lowest).astype(np.int64)).astype(np.int32)
