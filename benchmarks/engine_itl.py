"""Inter-token latency as the engine core makes it, with no HTTP: closed-loop streaming users through
the core's step, and where the long gaps come from.

    python3 -m minillm.benchmarks.engine_itl                                 # GPU: Qwen3-0.6B shape, bf16
    python3 -m minillm.benchmarks.engine_itl --users 256 --step-budget-factor 1.3
    python3 -m minillm.benchmarks.engine_itl --model ../shared/models/stories260K --device cpu \\
        --users 8 --num-requests 24 --prompt-len 32 --output-len 16

The serving benchmark measures ITL at the client, after the API server and the network; this one
runs the engine as `minillm serve` runs it in its engine core process (token ids out, each step's
message encoded, the start-up heap frozen) and times each request's tokens when the step that
carries them returns. --users requests start at once (--prompt-len random ids, --output-len greedy
tokens, ignore_eos) and a request that ends is followed at once by the next, until --num-requests
have ended: the shape of `benchmarks/serving.py --max-concurrency N`. Without --model the weights
are random (load_format "dummy") in the Qwen3-0.6B shape.

It reports ITL p50 / p90 / p99 over every request, and the step intervals (one engine step call to
the next) by what the step read back held: decode rows only, or prompt tokens as well. With
--step-budget-factor F the same loop runs a second time on a fresh engine with max_step_ms set to
F times the first run's ITL p50 (or --max-step-ms), or with the engine's relative budget
(--max-step-factor: each step with prompt rows within that factor of the batch's decode step).
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from minillm.benchmarks.cli_args import (BenchError, BenchParser, add_engine_model_options, engine_model_options,
                                         require_positive, resolve_engine_device, run_main)
from minillm.benchmarks.workload import write_random_model_dir

PROMPT_BUCKETS = (("decode only", 0, 0), ("1-512 prompt tokens", 1, 512), ("over 512 prompt tokens", 513, None))


def parse_args(argv):
    """Command-line options."""
    p = BenchParser("python3 -m minillm.benchmarks.engine_itl", __doc__.splitlines()[0])
    add_engine_model_options(p)
    p.add_argument("--users", type=int, default=64, help="Requests in flight.")
    p.add_argument("--num-requests", type=int, default=512, help="Requests to finish.")
    p.add_argument("--prompt-len", type=int, default=512, help="Prompt tokens of each request (random ids).")
    p.add_argument("--output-len", type=int, default=256, help="Output tokens of each request.")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="Token budget (default: the engine's).")
    p.add_argument("--step-budget-factor", type=float, default=None,
                   help="Run again with max_step_ms at this factor times the first run's ITL p50.")
    p.add_argument("--max-step-ms", type=float, default=None, help="Run again with this max_step_ms.")
    p.add_argument("--max-step-factor", type=float, default=None,
                   help="Run again with the engine's relative budget (max_step_factor) at this value.")
    p.add_argument("--seed", type=int, default=0, help="Seeds the random prompts.")
    p.add_argument("--json", help="Write the figures to this file.")
    args = p.parse_args(argv)
    require_positive(args, "users", "num_requests", "prompt_len", "output_len")
    if (args.step_budget_factor is not None and args.step_budget_factor <= 0) or \
            (args.max_step_ms is not None and args.max_step_ms <= 0):
        raise BenchError("--step-budget-factor and --max-step-ms must be > 0")
    if args.max_step_factor is not None and args.max_step_factor < 1:
        raise BenchError("--max-step-factor must be at least 1")
    if sum(a is not None for a in (args.step_budget_factor, args.max_step_ms, args.max_step_factor)) > 1:
        raise BenchError("give one of --step-budget-factor, --max-step-ms and --max-step-factor, not both")
    return args


@dataclass
class StepGroup:
    """Step intervals (ms) of the steps whose read-back held this many prompt tokens."""

    name: str
    steps: int
    interval_ms_p50: float
    interval_ms_p99: float
    mean_prompt_tokens: float


@dataclass
class RunFigures:
    """One run's figures (milliseconds unless named otherwise)."""

    max_step_ms: float | None
    max_step_factor: float | None
    steps: int
    decode_tokens_per_s: float
    itl_ms_p50: float
    itl_ms_p90: float
    itl_ms_p99: float
    share_of_steps_with_prompt_tokens: float
    groups: list[StepGroup] = field(default_factory=list)
    # With a step budget: the cost model at the end (ms per unit of each feature) and its median error.
    step_cost_ms: dict[str, float] = field(default_factory=dict)
    step_cost_error_p50: float | None = None

    @property
    def itl_p99_over_p50(self) -> float:
        return self.itl_ms_p99 / self.itl_ms_p50


def run(args, model: str, max_step_ms: float | None, max_step_factor: float | None = None) -> RunFigures:
    """One closed loop on a fresh engine core."""
    from minillm import SamplingParams
    from minillm.config import EngineConfig
    from minillm.engine_core.core import EngineCore
    from minillm.engine_core.heap import freeze_startup_heap
    from minillm.engine_core.messages import encoder

    options = engine_model_options(args, model, max_num_seqs=args.users, max_step_ms=max_step_ms,
                                   max_step_factor=max_step_factor, max_model_len=args.prompt_len + args.output_len + 16)
    if args.max_num_batched_tokens is not None:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    core = EngineCore(EngineConfig(**options))
    engine, encode = core.engine, encoder().encode
    try:
        freeze_startup_heap()
        rng = np.random.default_rng(args.seed)
        vocab = engine.model_config.vocab_size
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
        sent = 0

        def send():
            nonlocal sent
            engine.add_request(f"r{sent}", rng.integers(0, vocab, args.prompt_len).tolist(), params)
            sent += 1

        for _ in range(min(args.users, args.num_requests)):
            send()
        last: dict[str, float] = {}
        itl: list[float] = []
        intervals: list[tuple[float, int, int]] = []     # (seconds, prompt tokens, decode tokens) of a read-back
        finished = 0
        before = time.perf_counter()
        while finished < args.num_requests:
            message = core.step()
            encode(message)
            msg_time = time.perf_counter()
            recent = engine.metrics.recent_steps
            # With async scheduling a call launches one step and returns the one before it.
            step = recent[-2] if engine.async_scheduling and len(recent) > 1 else recent[-1]
            intervals.append((msg_time - before, step.num_prefill_tokens, step.num_decode_tokens))
            before = msg_time
            for out in message.outputs:
                if out.seqs[0].new_token_ids:
                    if out.request_id in last:
                        itl.append(msg_time - last[out.request_id])
                    last[out.request_id] = msg_time
                if out.finished:
                    finished += 1
                    last.pop(out.request_id, None)
                    if sent < args.num_requests:
                        send()
        cost = engine.scheduler.step_cost.snapshot() if engine.scheduler.step_cost is not None else None
    finally:
        engine.shutdown()
    f = figures(max_step_ms, max_step_factor, itl, intervals)
    if cost is not None:
        f.step_cost_ms = {name: value * 1e3 for name, value in cost.coefficients.items()}
        f.step_cost_error_p50 = cost.relative_error_p50
    return f


def figures(max_step_ms, max_step_factor, itl: list[float], intervals: list[tuple[float, int, int]]) -> RunFigures:
    """Percentiles of the ITL samples and the step intervals by prompt tokens."""
    if not itl:
        raise BenchError("no request got two tokens: nothing to measure")
    ms = np.asarray(itl) * 1e3
    seconds = np.asarray([i[0] for i in intervals])
    prompt = np.asarray([i[1] for i in intervals])
    decode = sum(i[2] for i in intervals)
    groups = []
    for name, low, high in PROMPT_BUCKETS:
        mask = (prompt >= low) & (prompt <= (high if high is not None else prompt.max(initial=0)))
        if mask.any():
            groups.append(StepGroup(name, int(mask.sum()), float(np.percentile(seconds[mask], 50) * 1e3),
                                    float(np.percentile(seconds[mask], 99) * 1e3), float(prompt[mask].mean())))
    return RunFigures(max_step_ms, max_step_factor, len(intervals), decode / float(seconds.sum()),
                      *(float(np.percentile(ms, q)) for q in (50, 90, 99)), float(np.mean(prompt > 0)), groups)


def format_run(f: RunFigures) -> str:
    """A run's lines."""
    budget = (f"max_step_ms {f.max_step_ms:g}" if f.max_step_ms is not None else
              f"max_step_factor {f.max_step_factor:g}" if f.max_step_factor is not None else "token budget only")
    lines = [f"{budget}: {f.steps} steps, {f.decode_tokens_per_s:,.0f} decode tok/s; ITL p50 {f.itl_ms_p50:.2f} "
             f"/ p90 {f.itl_ms_p90:.2f} / p99 {f.itl_ms_p99:.2f} ms (p99 {f.itl_p99_over_p50:.2f}x p50); "
             f"{f.share_of_steps_with_prompt_tokens:.1%} of the steps carried prompt tokens"]
    lines += [f"  {g.name:24s} {g.steps:6d} steps  interval p50 {g.interval_ms_p50:.2f} p99 {g.interval_ms_p99:.2f} ms"
              f"  prompt tokens a step {g.mean_prompt_tokens:.0f}" for g in f.groups]
    if f.step_cost_ms:
        error = f", median error {f.step_cost_error_p50:.1%}" if f.step_cost_error_p50 is not None else ""
        lines.append("  step cost model at the end (ms a unit): "
                     + ", ".join(f"{name} {v:.3g}" for name, v in f.step_cost_ms.items()) + error)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    resolve_engine_device(args)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(write_random_model_dir(Path(tmp) / "qwen3"))
        print(f"Engine-side inter-token latency: {args.users} users, {args.num_requests} requests of "
              f"{args.prompt_len} prompt / {args.output_len} output tokens, {args.device}, no HTTP")
        runs = [run(args, model, None)]
        print(format_run(runs[0]), flush=True)
        budget = args.max_step_ms
        if args.step_budget_factor is not None:
            budget = round(args.step_budget_factor * runs[0].itl_ms_p50, 3)
        if budget is not None or args.max_step_factor is not None:
            runs.append(run(args, model, budget, args.max_step_factor))
            print(format_run(runs[1]))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in runs], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "python3 -m minillm.benchmarks.engine_itl"))
