"""What a step that mixes decodes with one prompt chunk costs against a decode-only step: the
forward pass on the device, its launch on the host, and (on a GPU) attention's share.

    python3 -m minillm.benchmarks.mixed_step                                 # GPU: Qwen3-0.6B shape, bf16
    python3 -m minillm.benchmarks.mixed_step --model ../shared/models/stories260K --device cpu \\
        --decodes 4 --prompt-len 32 --chunks 8 32 --repeats 2

--decodes requests (--prompt-len random ids, greedy, ignore_eos) decode for --warmup steps; then
--repeats times per size in --chunks a request of that many prompt tokens (max_tokens 1) joins,
so the next step carries the decodes and the whole chunk. The figures are medians: the forward
pass's device time (CUDA events around it; on the CPU its wall time), the host's time to launch
it (`forward_host`), and on a GPU the device time between the first and the last attention launch
of each layer summed over the layers, with the number of kernels a layer's attention launches.
Without --model the weights are random (load_format "dummy") in the Qwen3-0.6B shape.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from minillm.benchmarks.cli_args import (BenchError, BenchParser, add_engine_model_options, engine_model_options,
                                         require_positive, resolve_engine_device, run_main)
from minillm.benchmarks.workload import write_random_model_dir


def parse_args(argv):
    """Command-line options."""
    p = BenchParser("python3 -m minillm.benchmarks.mixed_step", __doc__.splitlines()[0])
    add_engine_model_options(p)
    p.add_argument("--decodes", type=int, default=64, help="Requests decoding beside the chunk.")
    p.add_argument("--prompt-len", type=int, default=512, help="Prompt tokens of each decoding request.")
    p.add_argument("--chunks", type=int, nargs="+", default=[16, 64, 256, 1024, 4096], help="Chunk sizes.")
    p.add_argument("--warmup", type=int, default=80, help="Decode steps before anything is timed.")
    p.add_argument("--repeats", type=int, default=5, help="Mixed steps timed per chunk size.")
    p.add_argument("--json", help="Write the figures to this file.")
    args = p.parse_args(argv)
    require_positive(args, "decodes", "prompt_len", "warmup", "repeats")
    if min(args.chunks) < 1:
        raise BenchError(f"--chunks must be at least 1, got {min(args.chunks)}")
    return args


@dataclass
class StepCost:
    """Medians over the timed steps of one kind (milliseconds)."""

    chunk: int                      # prompt tokens beside the decodes (0: a decode-only step)
    forward_device_ms: float
    forward_host_ms: float
    attention_ms: float | None      # GPU only: attention's launches, summed over the layers
    attention_kernels: int | None   # kernels a layer's attention launched


class AttentionTimer:
    """CUDA events around each attention call of the piecewise path (AttentionPlan.run_at), when on."""

    def __init__(self):
        from minillm.ops import cuda as cuda_ops
        import cupy

        self.cp, self.plan_cls, self.on, self.marks = cupy, cuda_ops.AttentionPlan, False, []
        self.original = self.plan_cls.run_at
        timer = self

        def run_at(plan, k, v, s=0):
            if not timer.on:
                return timer.original(plan, k, v, s)
            stream = timer.cp.cuda.get_current_stream()
            start, end = timer.cp.cuda.Event(), timer.cp.cuda.Event()
            start.record(stream)
            out = timer.original(plan, k, v, s)
            end.record(stream)
            timer.marks.append((start, end, len(plan.launches)))
            return out

        self.plan_cls.run_at = run_at

    def take(self) -> tuple[float, int]:
        """(ms summed over the calls since the last take, kernels a call) once the device is done."""
        self.cp.cuda.Device().synchronize()
        marks, self.marks = self.marks, []
        return sum(self.cp.cuda.get_elapsed_time(a, b) for a, b, _ in marks), (marks[0][2] if marks else 0)

    def close(self) -> None:
        self.plan_cls.run_at = self.original


def measure(args, model: str) -> list[StepCost]:
    """Decode-only steps, then mixed steps of each chunk size, on one engine."""
    from minillm import SamplingParams
    from minillm.config import EngineConfig
    from minillm.engine import LLMEngine

    options = engine_model_options(
        args, model, max_num_seqs=args.decodes + 1, max_num_batched_tokens=max(8192, args.decodes + max(args.chunks)),
        max_model_len=max(args.prompt_len + args.warmup + 8 * args.repeats * (len(args.chunks) + 1) + 64,
                          max(args.chunks) + 1))
    engine = LLMEngine(EngineConfig(**options))
    attention = AttentionTimer() if args.device == "cuda" else None
    try:
        rng = np.random.default_rng(0)
        vocab = engine.model_config.vocab_size
        keep = SamplingParams(max_tokens=options["max_model_len"] - args.prompt_len, ignore_eos=True, temperature=0)
        for i in range(args.decodes):
            engine.add_request(f"d{i}", rng.integers(0, vocab, args.prompt_len).tolist(), keep)
        for _ in range(args.warmup):
            engine.step()
        rows: list[dict] = []
        record = engine.metrics.record_timings

        def capture(timings):
            record(timings)
            if "forward_device" in timings:
                rows.append(dict(timings))
        engine.metrics.record_timings = capture
        engine.runner.profile = True
        # with async scheduling a step's timings arrive with the next call, so each is matched by position
        late = 1 if engine.async_scheduling else 0
        rows.clear()
        for _ in range(4 * args.repeats):
            engine.step()
        costs = [StepCost(0, _median(rows, "forward_device"), _median(rows, "forward_host"), None, None)]
        for chunk in args.chunks:
            samples, attn = [], []
            for r in range(args.repeats):
                engine.add_request(f"c{chunk}-{r}", rng.integers(0, vocab, chunk).tolist(),
                                   SamplingParams(max_tokens=1, temperature=0))
                rows.clear()
                if attention is not None:
                    attention.on = True
                engine.step()                       # launches the mixed step
                if attention is not None:
                    attention.on = False
                    attn.append(attention.take())
                for _ in range(2):
                    engine.step()
                samples.append(rows[late])
            costs.append(StepCost(chunk, _median(samples, "forward_device"), _median(samples, "forward_host"),
                                  statistics.median(a[0] for a in attn) if attn else None,
                                  attn[0][1] if attn else None))
        return costs
    finally:
        if attention is not None:
            attention.close()
        engine.shutdown()


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows) * 1e3


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    resolve_engine_device(args)
    with tempfile.TemporaryDirectory() as tmp:
        costs = measure(args, args.model or str(write_random_model_dir(Path(tmp) / "qwen3")))
    base = costs[0]
    print(f"A step of {args.decodes} decodes with one prompt chunk, against the decodes alone ({args.device}; "
          f"medians of {args.repeats}):")
    print("| prompt chunk | forward, device (ms) | more than decode-only | launch, host (ms) | attention (ms) |")
    print("| --- | --- | --- | --- | --- |")
    for c in costs:
        attn = f"{c.attention_ms:.3f} ({c.attention_kernels} kernels a layer)" if c.attention_ms is not None else "-"
        extra = f"+{c.forward_device_ms - base.forward_device_ms:.3f}" if c.chunk else "-"
        print(f"| {c.chunk or 'none'} | {c.forward_device_ms:.3f} | {extra} | {c.forward_host_ms:.3f} | {attn} |")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(c) for c in costs], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "python3 -m minillm.benchmarks.mixed_step"))
