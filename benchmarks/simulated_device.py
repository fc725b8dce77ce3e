"""A simulated device for host-time benchmarks: the real engine loop on the CPU backend, with the
forward pass and the sampling kernels replaced by work items on a "stream" thread that each take
a fixed device time, so the host overlaps the device as it does over a GPU under async scheduling.

    sim = SimulatedDevice(forward_s=4.5e-3, sample_s=0.3e-3, token_low=256, token_high=151643)
    sim.attach(engine)          # engine: an LLMEngine on the CPU backend

What stays real: scheduling, input preparation, the sampling metadata's packing, the structured
outputs glue (read-back, matcher advance, mask fill, the mask's host staging), the scheduler's
update and the output processor. What is simulated: the model's logits (none are computed) and the
sampler's kernels: the stream thread picks each row's token, an allowed one for a row the grammar
bitmask covers (so matchers never see a forbidden token) and a random one in [token_low,
token_high) for the others. A read-back (np.asarray of the sampled ids) blocks until the stream
has run the step's sampling, as a CUDA event does; the engine thread's time blocked there is
counted (read_back_wait_s).
"""
from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import numpy as np


class SimulatedStream:
    """Work items run in order on one thread; each lasts at least its device time (the rest of it
    is slept, GIL-free, as the host is free while a GPU works)."""

    def __init__(self) -> None:
        self._items: queue.Queue = queue.Queue()
        self.busy_s = 0.0                      # device time of the items run so far
        self._thread = threading.Thread(target=self._run, name="sim-stream", daemon=True)
        self._thread.start()

    def submit(self, fn, seconds: float) -> threading.Event:
        """Queue fn to run after the work queued before it; the event is set once its time is up."""
        done = threading.Event()
        self._items.put((fn, seconds, done))
        return done

    def _run(self) -> None:
        while True:
            item = self._items.get()
            if item is None:
                return
            fn, seconds, done = item
            start = time.perf_counter()
            if fn is not None:
                fn()
            left = start + seconds - time.perf_counter()
            if left > 0:
                time.sleep(left)
            self.busy_s += max(seconds, time.perf_counter() - start)
            done.set()

    def close(self) -> None:
        """Stop the thread once the queued work has run."""
        self._items.put(None)
        self._thread.join()


class SimulatedTokens:
    """Sampled ids still "on the device": np.asarray() waits for the stream to produce them."""

    def __init__(self, owner: "SimulatedDevice", num_rows: int) -> None:
        self._owner = owner
        self.shape = (num_rows,)
        self.values = np.zeros(num_rows, np.int32)    # written by the stream thread
        self.done: threading.Event | None = None

    def __array__(self, dtype=None, copy=None):
        if not self.done.is_set():
            start = time.perf_counter()
            self.done.wait()
            if threading.get_ident() == self._owner.host_thread:
                self._owner.read_back_wait_s += time.perf_counter() - start
        return self.values if dtype is None else self.values.astype(dtype)


class SimulatedLogits:
    """The logits of a step's sampling rows: only their shape, and the rows the mask kernel covers."""

    def __init__(self, num_rows: int, vocab: int) -> None:
        self.shape = (num_rows, vocab)
        self.masks: dict[int, np.ndarray] = {}    # row -> its bitmask words, set on the stream


class SimulatedSamplerOps:
    """The sampler's ops over simulated logits: host-side arrays as the CPU backend makes them,
    the mask and sampling kernels queued on the stream."""

    def __init__(self, sim: "SimulatedDevice", ops) -> None:
        self._sim, self._ops = sim, ops
        self.name = ops.name
        self.xp = SimpleNamespace(empty=np.empty, zeros=np.zeros)

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def apply_token_bitmask(self, logits: SimulatedLogits, bitmask: np.ndarray, rows) -> None:
        """Queue the mask: the stream copies each listed row's words for the sampling after it."""
        rows = np.asarray(rows, np.int64)

        def run() -> None:
            for r in rows[(rows >= 0) & (rows < logits.shape[0])]:
                logits.masks[int(r)] = bitmask[r].copy()
        self._sim.stream.submit(run, 0.0)

    def sample(self, logits: SimulatedLogits, temperature, top_k, top_p, min_p, uniforms) -> SimulatedTokens:
        """Queue the sampling: one token a row, inside its mask where it has one."""
        tokens = SimulatedTokens(self._sim, logits.shape[0])
        tokens.done = self._sim.stream.submit(lambda: self._sim.pick(logits, tokens.values), self._sim.sample_s)
        return tokens


class SimulatedDevice:
    """Replaces an engine's forward pass and sampling kernels with timed stream work."""

    def __init__(self, forward_s: float, sample_s: float, token_low: int, token_high: int, seed: int = 0) -> None:
        self.forward_s, self.sample_s = forward_s, sample_s
        self.token_low, self.token_high = token_low, token_high
        self.stream = SimulatedStream()
        self.rng = np.random.default_rng(seed)          # used on the stream thread only
        self.host_thread = threading.get_ident()
        self.read_back_wait_s = 0.0                     # the engine thread's time blocked on read-backs

    def attach(self, engine) -> None:
        """Route engine's logits and sampling kernels here (its runner must be on the CPU backend)."""
        runner = engine.runner
        if runner.ops.name != "numpy":
            raise ValueError("the simulated device replaces the CPU backend's forward pass")
        self.host_thread = threading.get_ident()
        vocab = engine.model_config.vocab_size

        def compute_logits(ids, positions, meta, rows, patch=None, logits_indices=None):
            if logits_indices is not None:
                raise ValueError("the simulated device runs no draft verification")
            self.stream.submit(None, self.forward_s)
            return SimulatedLogits(len(rows), vocab) if rows else None

        runner.compute_logits = compute_logits
        runner.sampler.ops = SimulatedSamplerOps(self, runner.sampler.ops)

    def pick(self, logits: SimulatedLogits, out: np.ndarray) -> None:
        """On the stream: a random token a row; in a masked row an allowed one (a random word of
        the mask, or a random one of those that allow any, then a random bit of it)."""
        out[:] = self.rng.integers(self.token_low, self.token_high, len(out))
        for r, words in logits.masks.items():
            w = int(self.rng.integers(len(words)))
            if not words[w]:
                nonzero = np.flatnonzero(words)
                if not len(nonzero):
                    raise RuntimeError("a grammar mask allows no token")
                w = int(nonzero[int(self.rng.integers(len(nonzero)))])
            word = int(words[w]) & 0xFFFFFFFF
            bits = [j for j in range(32) if word >> j & 1]
            out[r] = 32 * w + bits[int(self.rng.integers(len(bits)))]

    def close(self) -> None:
        """Stop the stream thread."""
        self.stream.close()
