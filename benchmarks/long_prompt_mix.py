"""Long prompts among many decoders, offline in one process: step times, users' inter-token latency
and the long prompts' TTFT, with the token budget alone and with a step-time budget.

    python3 -m minillm.benchmarks.long_prompt_mix                              # GPU: Qwen3-0.6B shape, bf16
    python3 -m minillm.benchmarks.long_prompt_mix --users 64 --num-long 30 --long-every-s 2
    python3 -m minillm.benchmarks.long_prompt_mix --model ../shared/models/stories260K --device cpu \\
        --users 4 --user-prompt-len 16 --user-output-len 64 --long-prompt-len 400 --max-num-batched-tokens 64

Without --model the weights are random (load_format "dummy") in the Qwen3-0.6B shape. Each run
builds an engine, times one --long-prompt-len prompt alone (after one untimed: its TTFT alone),
starts --users closed-loop users (a prompt of --user-prompt-len random ids, then greedy outputs of
--user-output-len tokens give or take half, ignore_eos; a user whose request ends sends the next at
once), runs until the users are in their steady state (every user has finished a request, so
their contexts spread over the output lengths as they will while the long prompts arrive), measures
the plain decode step there (the median engine step with no prompt tokens, over --decode-steps
steps: what the users' tokens take without long prompts), then sends --num-long long prompts (max_tokens 1)
--long-every-s seconds apart and runs until each has its first token. Run (a) has the token budget
alone; run (b) sets max_step_ms to --step-budget-factor times run (a)'s plain decode step (or to
--max-step-ms), on a fresh engine. A step is one engine.step() call, timed on the wall clock
(with async scheduling each call launches one step and reads back the one before). The ceilings
are the long-prompt issue's: users' ITL p99 at most 2.5x their ITL p50, and the long prompts'
TTFT p50 within 3x their TTFT alone, with the step budget at twice the plain decode step.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from minillm.benchmarks.cli_args import BenchError, BenchParser, run_main
from minillm.benchmarks.workload import QWEN3_0_6B, write_random_model_dir

ITL_CEILING = 2.5            # users' ITL p99 / p50
TTFT_CEILING = 3.0           # long prompts' TTFT p50 / their TTFT alone
STALL_S = 600.0              # a long prompt without its first token this long after the last arrival: stuck
GPU_DEFAULTS = {"users": 128, "user_prompt_len": 512, "user_output_len": 1024, "long_prompt_len": 16_000,
                "max_num_batched_tokens": 2048}
CPU_DEFAULTS = {"users": 4, "user_prompt_len": 16, "user_output_len": 64, "long_prompt_len": 400,
                "max_num_batched_tokens": 64}


def parse_args(argv):
    """Command-line options; sizes left out are filled in by resolve_defaults."""
    p = BenchParser("python3 -m minillm.benchmarks.long_prompt_mix", __doc__.splitlines()[0])
    p.add_argument("--model", help="Model directory (default: random weights in the Qwen3-0.6B shape, GPU only).")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="Backend.")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="Weights and activations.")
    p.add_argument("--users", type=int, help="Users decoding (default: 128 on a GPU, 4 on the CPU).")
    p.add_argument("--user-prompt-len", type=int, help="Each user request's prompt (default: 512 / 16).")
    p.add_argument("--user-output-len", type=int, help="Each user request's mean output (default: 1024 / 64).")
    p.add_argument("--long-prompt-len", type=int, help="The long prompt (default: 16000 / 400).")
    p.add_argument("--num-long", type=int, default=1, help="Long prompts sent, --long-every-s apart.")
    p.add_argument("--long-every-s", type=float, default=2.0, help="Seconds between long prompts.")
    p.add_argument("--max-num-batched-tokens", type=int, help="Token budget of one step (default: 2048 / 64).")
    p.add_argument("--step-budget-factor", type=float, default=2.0,
                   help="Run (b)'s max_step_ms as a multiple of run (a)'s plain decode step.")
    p.add_argument("--max-step-ms", type=float, help="Run (b)'s max_step_ms (instead of the factor).")
    p.add_argument("--decode-steps", type=int, default=64, help="Steps that measure the plain decode step.")
    p.add_argument("--enforce-eager", action="store_true", help="Never capture CUDA graphs.")
    p.add_argument("--seed", type=int, default=0, help="Seeds the random prompts and output lengths.")
    p.add_argument("--json", help="Write the figures to this file.")
    return p.parse_args(argv)


def resolve_defaults(args) -> dict:
    """Pick the backend, fill in the sizes and check them; returns the model's config.json."""
    from minillm.engine import choose_backend

    backend = choose_backend(args.device)
    if backend == "numpy" and args.model is None:
        raise BenchError("no CUDA GPU here, and the default (random Qwen3-0.6B-shaped weights, 128 users, a "
                         "16,000-token prompt) needs one; on the CPU give a small model, e.g. --model "
                         "../shared/models/stories260K --device cpu")
    for name, value in (GPU_DEFAULTS if backend == "cuda" else CPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("users", "user_prompt_len", "user_output_len", "long_prompt_len", "num_long",
                 "max_num_batched_tokens", "decode_steps"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    bad_budget = args.max_step_ms is not None and args.max_step_ms <= 0
    if args.long_every_s < 0 or args.step_budget_factor <= 0 or bad_budget:
        raise BenchError("--long-every-s must be >= 0, --step-budget-factor and --max-step-ms > 0")
    if args.model is not None:
        from minillm.loader import resolve_model_path
        args.model = str(resolve_model_path(args.model))
        config = json.loads((Path(args.model) / "config.json").read_text())
    else:
        config = QWEN3_0_6B
    args.max_model_len = max(args.long_prompt_len + 1, args.user_prompt_len + args.user_output_len * 3 // 2 + 1)
    if args.max_model_len > config["max_position_embeddings"]:
        raise BenchError(f"the long prompt or a user's request needs {args.max_model_len} positions; the model "
                         f"has {config['max_position_embeddings']}")
    args.device = "cuda" if backend == "cuda" else "cpu"
    return config


@dataclass
class RunFigures:
    """One run's figures (milliseconds unless named otherwise)."""

    max_step_ms: float | None
    ttft_alone_ms: float
    plain_decode_step_ms: float
    user_requests_before_measure: int = 0         # user requests sent when the decode step was measured
    long_ttft_ms: list[float] = field(default_factory=list)
    steps_while_long_prefills: int = 0
    step_ms_p50: float = 0.0
    step_ms_p99: float = 0.0
    step_ms_worst: float = 0.0
    itl_ms_p50: float = 0.0
    itl_ms_p99: float = 0.0
    user_prefill_tokens_in_window: int = 0
    step_cost: dict = field(default_factory=dict)   # the cost model's figures (run b)


class Users:
    """Closed-loop users: each request's tokens are timed; a finished request is followed at once."""

    def __init__(self, engine, args, vocab: int, rng: np.random.Generator):
        from minillm import SamplingParams
        self.engine, self.args, self.vocab, self.rng, self.SamplingParams = engine, args, vocab, rng, SamplingParams
        self.num_tokens: dict[str, int] = {}      # request id -> tokens seen
        self.last_token_at: dict[str, float] = {}
        self.num_sent = 0
        self.itl: list[float] = []                # seconds, collected while is_recording
        self.is_recording = False

    def send(self) -> None:
        """A new request from a user: a fresh prompt, an output length around the mean."""
        a = self.args
        rid = f"user-{self.num_sent}"
        self.num_sent += 1
        prompt = self.rng.integers(3, self.vocab, a.user_prompt_len).tolist()
        max_tokens = int(self.rng.integers(max(1, a.user_output_len // 2), a.user_output_len * 3 // 2 + 1))
        self.engine.add_request(rid, prompt, self.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        self.num_tokens[rid] = 0

    def observe(self, out, now: float) -> None:
        """A user's RequestOutput from a step that returned at `now`."""
        n = len(out.outputs[0].token_ids)
        if n > self.num_tokens[out.request_id]:
            if self.is_recording and out.request_id in self.last_token_at:
                self.itl.append(now - self.last_token_at[out.request_id])
            self.last_token_at[out.request_id] = now
            self.num_tokens[out.request_id] = n
        if out.finished:
            del self.num_tokens[out.request_id]
            self.last_token_at.pop(out.request_id, None)
            self.send()

    def all_decoding(self) -> bool:
        """True once every live request has a token."""
        return all(n > 0 for n in self.num_tokens.values())


def timed_step(engine, users: Users, others: dict[str, float] | None = None) -> tuple[float, list]:
    """One engine.step(); (its wall seconds, the outputs that are not users')."""
    t0 = time.perf_counter()
    outs = engine.step()
    now = time.perf_counter()
    rest = []
    for out in outs:
        if out.request_id.startswith("user-"):
            users.observe(out, now)
        else:
            rest.append(out)
    return now - t0, rest


def ttft_alone(engine, args, rng, vocab: int) -> float:
    """Seconds to the first token of a long prompt in an idle engine (after one untimed)."""
    from minillm import SamplingParams
    seconds = 0.0
    for k in range(2):
        engine.add_request(f"alone-{k}", rng.integers(3, vocab, args.long_prompt_len).tolist(),
                           SamplingParams(temperature=0, max_tokens=1))
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        seconds = time.perf_counter() - t0
    return seconds


def run(args, model_dir: str, dummy: bool, vocab: int, max_step_ms: float | None) -> RunFigures:
    """One engine: TTFT alone, the plain decode step, then the long prompts among the users."""
    from minillm import SamplingParams
    from minillm.config import EngineConfig
    from minillm.engine import LLMEngine

    engine = LLMEngine(EngineConfig(
        model=model_dir, device=args.device, dtype=args.dtype, load_format="dummy" if dummy else "auto",
        max_model_len=args.max_model_len, max_num_seqs=args.users + args.num_long + 2,
        max_num_batched_tokens=args.max_num_batched_tokens, max_step_ms=max_step_ms,
        enforce_eager=args.enforce_eager, seed=args.seed))
    rng = np.random.default_rng(args.seed)
    try:
        alone = ttft_alone(engine, args, rng, vocab)
        users = Users(engine, args, vocab, rng)
        for _ in range(args.users):
            users.send()
        while not users.all_decoding():
            timed_step(engine, users)
        # Steady state: as many requests ended as there are users. Measured at the first token
        # instead, every context is one prompt long and the decode step is short of what the users
        # see later (2.5 against 3.5 ms on the H200 at 64 users of 512 + ~1,024 tokens).
        for _ in range(4 * args.user_output_len + 16):
            if users.num_sent >= 2 * args.users:
                break
            timed_step(engine, users)
        decode_steps = []
        for _ in range(args.decode_steps):
            seconds, _ = timed_step(engine, users)
            if engine.metrics.recent_steps[-1].num_prefill_tokens == 0:
                decode_steps.append(seconds)
        if not decode_steps:
            raise BenchError("no decode-only step among the --decode-steps measured; raise --decode-steps")
        figures = RunFigures(max_step_ms, alone * 1e3, statistics.median(decode_steps) * 1e3, users.num_sent)
        _long_prompts(engine, args, users, rng, vocab, figures, SamplingParams)
        if max_step_ms is not None:
            s = engine.stats(cells=1)
            figures.step_cost = {"coefficients_s": s.step_cost_coefficients, "error_p50": s.step_cost_error_p50,
                                 "num_refits": s.step_cost_num_refits}
    finally:
        engine.shutdown()
    return figures


def _long_prompts(engine, args, users: Users, rng, vocab: int, figures: RunFigures, SamplingParams) -> None:
    """Send the long prompts on their schedule among the users; step until each has its first token."""
    arrivals: dict[str, float] = {}
    steps, prefill_before = [], engine.metrics.prefill_tokens_total
    long_tokens = 0
    users.is_recording = True
    start = time.perf_counter()
    deadline = start + args.num_long * args.long_every_s + STALL_S
    while len(figures.long_ttft_ms) < args.num_long:
        now = time.perf_counter()
        if now > deadline:
            raise BenchError(f"the long prompts did not all get a first token within {STALL_S} s of the last arrival")
        if len(arrivals) < args.num_long and now >= start + len(arrivals) * args.long_every_s:
            rid = f"long-{len(arrivals)}"
            engine.add_request(rid, rng.integers(3, vocab, args.long_prompt_len).tolist(),
                               SamplingParams(temperature=0, max_tokens=1))
            arrivals[rid] = time.perf_counter()
            long_tokens += args.long_prompt_len
        prefilling = len(arrivals) > len(figures.long_ttft_ms)
        seconds, outs = timed_step(engine, users)
        if prefilling:
            steps.append(seconds)
        for out in outs:
            if out.request_id in arrivals and out.outputs[0].token_ids:
                figures.long_ttft_ms.append((time.perf_counter() - arrivals[out.request_id]) * 1e3)
    users.is_recording = False
    ms = np.asarray(steps) * 1e3
    itl = np.asarray(users.itl) * 1e3
    figures.steps_while_long_prefills = len(steps)
    figures.step_ms_p50, figures.step_ms_p99 = float(np.percentile(ms, 50)), float(np.percentile(ms, 99))
    figures.step_ms_worst = float(ms.max())
    if len(itl):
        figures.itl_ms_p50, figures.itl_ms_p99 = float(np.percentile(itl, 50)), float(np.percentile(itl, 99))
    figures.user_prefill_tokens_in_window = engine.metrics.prefill_tokens_total - prefill_before - long_tokens


def report(args, runs: list[tuple[str, RunFigures]]) -> None:
    """The table, each figure beside its ceiling."""
    shape = "random Qwen3-0.6B-shaped weights" if args.model is None else Path(args.model).name
    print(f"Long prompts among decoders: {shape}, {args.device}; {args.users} users (prompt {args.user_prompt_len}, "
          f"output ~{args.user_output_len}), {args.num_long} prompt(s) of {args.long_prompt_len} tokens "
          f"{args.long_every_s:g} s apart; token budget {args.max_num_batched_tokens}.")
    print(f"Ceilings: users' ITL p99 <= {ITL_CEILING}x ITL p50; long TTFT p50 <= {TTFT_CEILING}x TTFT alone "
          f"(with max_step_ms = 2x the plain decode step).")
    print("| run | max_step_ms | plain decode step | steps while long prefills: p50 / p99 / worst | worst / plain "
          "| users' ITL p50 / p99 | ITL p99 / p50 | long TTFT p50 (max) | TTFT alone | TTFT / alone |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, f in runs:
        ttft = statistics.median(f.long_ttft_ms)
        itl_ratio = f.itl_ms_p99 / f.itl_ms_p50 if f.itl_ms_p50 else float("nan")
        budget = "-" if f.max_step_ms is None else f"{f.max_step_ms:.2f}"
        print(f"| {name} | {budget} | {f.plain_decode_step_ms:.2f} ms | {f.step_ms_p50:.2f} / {f.step_ms_p99:.2f} / "
              f"{f.step_ms_worst:.2f} ms ({f.steps_while_long_prefills} steps) | "
              f"{f.step_ms_worst / f.plain_decode_step_ms:.1f}x | {f.itl_ms_p50:.2f} / {f.itl_ms_p99:.2f} ms | "
              f"{itl_ratio:.2f}x ({'within' if itl_ratio <= ITL_CEILING else 'over'} {ITL_CEILING}x) | "
              f"{ttft:.1f} ({max(f.long_ttft_ms):.1f}) ms | {f.ttft_alone_ms:.1f} ms | "
              f"{ttft / f.ttft_alone_ms:.2f}x ({'within' if ttft / f.ttft_alone_ms <= TTFT_CEILING else 'over'} "
              f"{TTFT_CEILING:g}x) |")
    for name, f in runs:
        if f.step_cost:
            coefs = ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in f.step_cost["coefficients_s"].items())
            error = f.step_cost["error_p50"]
            print(f"run {name}: step cost model per unit: {coefs}; median |estimate - measured| / measured "
                  f"{error if error is None else f'{error:.1%}'} after {f.step_cost['num_refits']} refits")
        if f.user_prefill_tokens_in_window:
            print(f"run {name}: {f.user_prefill_tokens_in_window} prompt tokens of new user requests were "
                  f"prefilled while the long prompts were")


def main(argv: list[str] | None = None) -> int:
    """Runs (a) and (b) and prints them side by side."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    config = resolve_defaults(args)
    runs: list[tuple[str, RunFigures]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(write_random_model_dir(Path(tmp) / "qwen3-0.6b-random"))
        token_budget = run(args, model_dir, args.model is None, config["vocab_size"], None)
        runs.append(("a: token budget", token_budget))
        print(f"# {json.dumps(asdict(token_budget))}", file=sys.stderr, flush=True)
        max_step_ms = args.max_step_ms or args.step_budget_factor * token_budget.plain_decode_step_ms
        stepped = run(args, model_dir, args.model is None, config["vocab_size"], max_step_ms)
        runs.append(("b: step budget", stepped))
    report(args, runs)
    if args.json:
        Path(args.json).write_text(json.dumps({name: asdict(f) for name, f in runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "python3 -m minillm.benchmarks.long_prompt_mix"))
