"""The latency of one fixed batch through LLM.generate, as `vllm bench latency` measures it.

    minillm bench latency                                # GPU: random Qwen3-0.6B-shaped weights, 8 x (32 + 128)
    minillm bench latency --model ../shared/models/stories260K --device cpu --num-iters 5
    minillm bench latency --model DIR --input-len 512 --output-len 64 --batch-size 16 --n 2 \
        --num-iters-warmup 3 --num-iters 10 --output-json out.json    # vLLM's options and JSON keys
    minillm bench latency --model DIR --profile          # one profiled batch after the warm-up

Each iteration generates --output-len tokens (ignore_eos) for each of --batch-size prompts of
--input-len dummy token ids, --n completions each (--use-beam-search: LLM.beam_search with --n beams, as
vLLM's); after --num-iters-warmup untimed iterations,
--num-iters are timed (wall time of LLM.generate) and their mean, standard deviation and 10/25/50/75/90/99th
percentiles printed. Prefix caching is off unless --enable-prefix-caching (vLLM's default here).

(python3 -m minillm.benchmarks.latency takes the same options.)
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from minillm.benchmarks.cli_args import (MAX_REQUESTS, MAX_TOKENS, BenchError, BenchParser, BenchUsageError,
                                         check_bounds, check_output_file, check_sampling_option, check_workload_tokens,
                                         resolve_model_files, run_main)
from minillm.benchmarks.workload import QWEN3_0_6B, Workload, roofline_seconds, write_random_model_dir
from minillm.cli import add_engine_arguments, engine_flag_words

PROG = "minillm bench latency"
PERCENTAGES = (10, 25, 50, 75, 90, 99)      # vLLM's
DUMMY_TOKEN_IDS = 10000                      # vLLM draws the prompts' ids from [0, 10000)
CPU_PROFILE_ROWS = 20


def parse_args(argv):
    """vLLM's options of `vllm bench latency`, the engine options `minillm generate` takes, and --seed."""
    p = BenchParser(PROG, __doc__.splitlines()[0])
    p.add_argument("--model", help="Model directory or hub id (default: random weights in the Qwen3-0.6B "
                                   "shape, on a GPU only).")
    p.add_argument("--input-len", type=int, default=32, help="Dummy token ids in each prompt.")
    p.add_argument("--output-len", type=int, default=128, help="Tokens each completion generates (ignore_eos).")
    p.add_argument("--batch-size", type=int, default=8, help="Prompts in the batch.")
    p.add_argument("--n", type=int, default=1, help="Number of generated sequences per prompt.")
    p.add_argument("--use-beam-search", action="store_true",
                   help="Time LLM.beam_search with --n beams of --output-len tokens (ignore_eos) instead of generate.")
    p.add_argument("--num-iters-warmup", type=int, default=10, help="Number of iterations to run for warmup.")
    p.add_argument("--num-iters", type=int, default=30, help="Number of iterations to run.")
    p.add_argument("--profile", action="store_true",
                   help="Profile the generation of one batch after the warm-up instead of timing: the device "
                        "kernels by kind on a GPU (torch.profiler), the host's functions on the CPU (cProfile).")
    p.add_argument("--output-json", help="Path to save the latency results in JSON format.")
    p.add_argument("--disable-detokenize", action="store_true",
                   help="Do not detokenize responses (detokenization left out of the latency).")
    p.add_argument("--seed", type=int, default=0, help="Seeds the dummy prompts and the engine's sampling.")
    p.add_argument("--no-ceiling", action="store_true", help="Skip measuring the card's ceilings.")
    engine_names = add_engine_arguments(p)
    p.set_defaults(enable_prefix_caching=False)     # as vLLM's: a cached prompt would skew the latency
    [caching] = [a for a in p._actions if a.dest == "enable_prefix_caching"]
    caching.help += (" Off here unless given: every iteration sends the same prompts, which a cache would "
                     "serve from the second on.")
    args = p.parse_args(argv)
    check_bounds(PROG, args, option_bounds())
    check_workload_tokens(PROG, "--batch-size", args.batch_size, "--input-len", args.input_len)
    if args.profile and args.output_json:
        p.error("--profile runs one profiled batch and times none, so --output-json would have no latencies; "
                "give one of them")
    args.engine_names = ["seed", *engine_names]
    check_engine_arguments(p, args)
    check_sampling_option(p, "--n", n=args.n)
    if args.use_beam_search:
        check_beam_width(p, args.n)
    return args


def check_beam_width(p: BenchParser, n: int) -> None:
    """parser.error naming --n when BeamSearchParams refuses it as the beam width."""
    from minillm.sampling_params import BeamSearchParams
    try:
        BeamSearchParams(beam_width=n, max_tokens=1)
    except ValueError as exc:
        p.error(f"--n with --use-beam-search: {exc}")


def option_bounds() -> dict[str, tuple]:
    """Each numeric option's [lo, hi]."""
    return {"input_len": (1, MAX_TOKENS), "output_len": (1, MAX_TOKENS), "batch_size": (1, MAX_REQUESTS),
            "n": (1, MAX_REQUESTS), "num_iters_warmup": (0, MAX_REQUESTS), "num_iters": (1, MAX_REQUESTS)}


def engine_arguments(args) -> dict:
    """The EngineConfig fields the command line sets (LLM's keyword arguments)."""
    return {name: getattr(args, name) for name in args.engine_names}


def check_engine_arguments(p: BenchParser, args) -> None:
    """The engine options checked as EngineConfig checks them, before anything loads."""
    from minillm.config import EngineConfig
    try:
        EngineConfig(model="", **engine_arguments(args))
    except ValueError as exc:
        p.error(engine_flag_words(exc, "seed") or " ".join(str(exc).split()))


def resolve_model(args) -> dict:
    """args.device -> "cuda" or "cpu" and args.model -> a directory (None: the random model); returns its
    config.json. A BenchError when the backend or the model is not there, or the batch cannot fit."""
    from minillm.engine import choose_backend
    try:
        backend = choose_backend(args.device)
    except ValueError as exc:
        raise BenchError(f"--device {args.device}: {exc}") from None
    if backend == "numpy" and args.model is None:
        raise BenchError("no CUDA GPU here, and the default (random Qwen3-0.6B-shaped weights) needs one; on the "
                         "CPU give a small model, e.g. --model ../shared/models/stories260K --device cpu")
    args.device = "cuda" if backend == "cuda" else "cpu"
    if args.model is None:
        config = QWEN3_0_6B
    else:
        resolve_model_files(args)
        config = json.loads((Path(args.model) / "config.json").read_text())
    check_fits(args, config.get("max_position_embeddings", MAX_TOKENS), "the model's max_position_embeddings")
    return config


def check_fits(args, max_model_len: int, what: str, remedy: str = "") -> None:
    """A BenchError naming --input-len and --output-len (and REMEDY) when a prompt and its output pass
    MAX_MODEL_LEN (WHAT sets it), or --max-model-len when that is lower."""
    if args.max_model_len is not None and args.max_model_len < max_model_len:
        max_model_len, what, remedy = args.max_model_len, "--max-model-len", ""
    needed = args.input_len + args.output_len
    if needed > max_model_len:
        raise BenchError(f"--input-len {args.input_len} + --output-len {args.output_len} = {needed} tokens do not "
                         f"fit in {what} {max_model_len}; lower them{remedy}")


def dummy_prompts(args, vocab_size: int) -> list[list[int]]:
    """--batch-size prompts of --input-len token ids drawn as vLLM draws them (below 10000, and the vocabulary)."""
    rng = np.random.default_rng(args.seed)
    return rng.integers(min(DUMMY_TOKEN_IDS, vocab_size), size=(args.batch_size, args.input_len)).tolist()


def load_llm(args, model_dir: str, dummy: bool):
    """The LLM the batch runs through; settings the model's own limits refuse are one line naming the flag."""
    from minillm import LLM
    try:
        llm = LLM(model_dir, **{**engine_arguments(args), "load_format": "dummy" if dummy else args.load_format})
    except ValueError as exc:
        message = engine_flag_words(exc, "seed")
        if message is None:
            raise
        raise BenchUsageError(PROG, message) from None
    try:
        check_fits(args, llm.model_config.max_model_len, "the engine's max_model_len",
                   ", or give the KV pool more (--num-kv-blocks, --kv-cache-memory-bytes)")
    except BenchError:
        llm.shutdown()
        raise
    return llm


def time_iterations(run_batch: Callable[[], object], count: int, desc: str) -> list[float]:
    """Wall seconds of each of COUNT runs of the batch (a progress bar on a terminal)."""
    from tqdm import tqdm
    latencies = []
    for _ in tqdm(range(count), desc=desc, disable=None):
        started = time.perf_counter()
        run_batch()
        latencies.append(time.perf_counter() - started)
    return latencies


def latency_figures(latencies: list[float]) -> dict:
    """The figures `vllm bench latency --output-json` writes, under its names."""
    values = np.array(latencies)
    return {"avg_latency": np.mean(values).item(), "std_latency": np.std(values).item(),
            "latencies": values.tolist(),
            "percentiles": dict(zip(PERCENTAGES, np.percentile(values, PERCENTAGES).tolist()))}


def print_figures(figures: dict) -> None:
    """vLLM's lines: the mean, the standard deviation and each percentile, in seconds."""
    print(f"Avg latency: {figures['avg_latency']} seconds")
    print(f"Std latency: {figures['std_latency']} seconds")
    for percentage, percentile in figures["percentiles"].items():
        print(f"{percentage}% percentile latency: {percentile} seconds")


def profile_batch(args, run_batch: Callable[[], object]) -> None:
    """One batch profiled: its device kernels by kind on a GPU, the host's busiest functions on the CPU."""
    started = time.perf_counter()
    if args.device == "cuda":
        from minillm.benchmarks.kernel_profile import profile_kernels, report
        print("Profiling with torch profiler (the device kernels of one batch)...")
        try:
            _, kernels = profile_kernels(run_batch)
        except RuntimeError as exc:
            raise BenchError(f"--profile: {exc}") from None
        print(report(kernels, time.perf_counter() - started, 0))
        return
    import cProfile
    import pstats
    print("Profiling with cProfile (the host's functions over one batch)...")
    profiler = cProfile.Profile()
    profiler.runcall(run_batch)
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(CPU_PROFILE_ROWS)


def print_ceiling(args, config: dict, prompts: list[list[int]], figures: dict) -> None:
    """The batch's roofline floor on a GPU (measured now), against the median latency."""
    if args.device != "cuda":
        print("ceiling: the roofline is measured on a GPU only (NumPy on the CPU has none to hold it against)")
        return
    from minillm.benchmarks.ceilings import measure_copy_bandwidth, measure_matmul_rate
    bw, mm = measure_copy_bandwidth(), measure_matmul_rate()
    every = Workload(prompts * args.n, [args.output_len] * (len(prompts) * args.n))
    # the n completions of a prompt share its prefill: count it once
    shared_prefill = roofline_seconds(Workload(prompts, [0] * len(prompts)), config, bw, mm) * (args.n - 1)
    floor = roofline_seconds(every, config, bw, mm) - shared_prefill
    figures |= {"floor_latency": floor, "copy_bandwidth_Bps": bw, "matmul_flops": mm}
    median = figures["percentiles"][50]
    print(f"ceiling: {floor:.4f} seconds a batch (roofline at {bw / 1e12:.2f} TB/s copy, {mm / 1e12:.0f} TFLOP/s "
          f"bf16, both measured now) -> the median batch runs at {floor / median:.0%} of its speed")


def main(argv: list[str] | None = None) -> int:
    """Time the batch and print vLLM's latency lines (and the ceiling)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    check_output_file(args.output_json, "--output-json")
    config = resolve_model(args)
    from minillm import SamplingParams
    params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len,
                            detokenize=not args.disable_detokenize)
    from minillm.sampling_params import BeamSearchParams
    beam_params = BeamSearchParams(beam_width=args.n, max_tokens=args.output_len, ignore_eos=True)
    prompts = dummy_prompts(args, config["vocab_size"])
    each = "beam(s)" if args.use_beam_search else "completion(s)"
    print(f"batch: {args.batch_size} prompts of {args.input_len} dummy tokens, {args.n} {each} of "
          f"{args.output_len} tokens each, on {args.device}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(write_random_model_dir(Path(tmp) / "qwen3-0.6b-random"))
        llm = load_llm(args, model_dir, args.model is None)
        try:
            def run_batch():
                if args.use_beam_search:
                    return llm.beam_search(prompts, beam_params)
                return llm.generate(prompts, params, use_tqdm=False)

            print("Warming up...", flush=True)
            time_iterations(run_batch, args.num_iters_warmup, "Warmup iterations")
            if args.profile:
                profile_batch(args, run_batch)
                return 0
            figures = latency_figures(time_iterations(run_batch, args.num_iters, "Bench iterations"))
        finally:
            llm.shutdown()
    print_figures(figures)
    if not args.no_ceiling:
        print_ceiling(args, config, prompts, figures)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(figures, indent=4))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, PROG))
