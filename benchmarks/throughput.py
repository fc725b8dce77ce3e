"""Offline throughput on nano-vllm's workload, printed beside the roofline floor and a peer.

    minillm bench throughput                             # GPU: random Qwen3-0.6B-shaped weights, bf16
    minillm bench throughput --model DIR --peer hf
    minillm bench throughput --model ../shared/models/stories260K --device cpu    # a small CPU run
    minillm bench throughput --kv-cache-dtype fp8        # FP8 KV cache (floor printed for both caches)
    minillm bench throughput --kernel-profile            # also the device time by kernel (needs torch)
    minillm bench throughput --model DIR --num-prompts 100 --input-len 512 --output-len 128 \
        --output-json out.json                           # vLLM's options: its random dataset, fixed lengths
    minillm bench throughput --model DIR --input-len 64 --output-len 32 --n 4 --use-beam-search
                                                         # LLM.beam_search, 4 beams a prompt, as vLLM's

(python3 -m minillm.benchmarks.throughput takes the same options.)
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from minillm.benchmarks.cli_args import (MAX_REQUESTS, MAX_TOKENS, BenchError, BenchParser, BenchUsageError,
                                         add_kv_cache_memory_option, check_bounds, check_output_file,
                                         check_sampling_option, check_workload_tokens, resolve_model_files,
                                         run_main)
from minillm.benchmarks.workload import (QWEN3_0_6B, Workload, nano_vllm_workload, random_length_range, random_workload,
                                        roofline_seconds, write_random_model_dir)
from minillm.cli import add_engine_arguments, engine_flag_words

# nano-vllm's workload on a GPU; on the CPU (NumPy) a small one that finishes in seconds.
GPU_DEFAULTS = {"num_seqs": 256, "max_input_len": 1024, "max_output_len": 1024}
CPU_DEFAULTS = {"num_seqs": 16, "max_input_len": 128, "max_output_len": 128}
# vLLM's random dataset's lengths (its RandomDataset's defaults on a GPU; shorter prompts on the CPU).
RANDOM_GPU_DEFAULTS = {"input_len": 1024, "output_len": 128}
RANDOM_CPU_DEFAULTS = {"input_len": 128, "output_len": 128}
PROG = "minillm bench throughput"
MAX_MODEL_LEN = 4096


def parse_args(argv):
    """Command-line options; the workload sizes left out are filled in by resolve_defaults."""
    p = BenchParser("minillm bench throughput", __doc__.splitlines()[0])
    p.add_argument("--model", help="Model directory or hub id (default: random weights in the Qwen3-0.6B "
                                   "shape, on a GPU only).")
    p.add_argument("--num-seqs", type=int, help="Requests in the workload (default: 256 on a GPU, 16 on the CPU).")
    p.add_argument("--num-prompts", type=int, help="vLLM's name for --num-seqs.")
    p.add_argument("--max-input-len", type=int,
                   help="Longest prompt; lengths are drawn up from 100 (default: 1024 on a GPU, 128 on the CPU).")
    p.add_argument("--max-output-len", type=int,
                   help="Longest output; lengths are drawn up from 100 (default: 1024 on a GPU, 128 on the CPU).")
    add_random_dataset_options(p)
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="Backend; auto picks cuda when CuPy sees a GPU.")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16", "float", "half"],
                   help="Weights and activations (auto: the checkpoint's on a GPU, float32 on the CPU).")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="KV cache storage: auto (the model dtype) or fp8 (E4M3, one byte an element).")
    p.add_argument("--max-num-seqs", type=int, default=256, help="Most sequences in one step.")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384, help="Token budget of one step.")
    add_kv_cache_memory_option(p)
    p.add_argument("--max-model-len", type=int,
                   help=f"Longest prompt + output (default: {MAX_MODEL_LEN}, or the model's limit when lower).")
    p.add_argument("--seed", type=int, default=0,
                   help="Seeds vLLM's random dataset and the engine's sampling (vLLM's --seed).")
    p.add_argument("--temperature", type=float, default=0.6, help="Sampling temperature of every request.")
    p.add_argument("--n", type=int, default=1, help="Number of generated sequences per prompt (vLLM's).")
    p.add_argument("--use-beam-search", action="store_true",
                   help="Run the workload through LLM.beam_search, --n beams a prompt (ignore_eos, temperature 0, "
                        "as vLLM's): vLLM's random dataset without --random-range-ratio (one output length).")
    p.add_argument("--peer", choices=["hf"], help="Run the same workload through a peer in this run.")
    p.add_argument("--peer-num-seqs", type=int, default=None,
                   help="Requests given to the peer (default: all; a slow peer may take a prefix).")
    p.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                   help="Skip timing each step's phases (CUDA events around forward and sampling).")
    p.add_argument("--no-ceiling", action="store_true", help="Skip measuring the card's ceilings.")
    p.add_argument("--kernel-profile", action="store_true",
                   help="GPU: record every kernel of the timed run (torch.profiler, CUPTI) and print the device "
                        "time by kind and by kernel; the profiler's cost is inside that run's figure.")
    p.add_argument("--json", help="Write the figures to this file.")
    p.add_argument("--output-json", help="vLLM's name for --json.")
    engine_names = add_engine_arguments(p)
    args = p.parse_args(argv)
    if args.kernel_profile and args.device == "cpu":
        p.error("--kernel-profile: records CUDA kernels; it needs --device cuda")
    check_bounds(p.prog, args, option_bounds())
    if args.peer_num_seqs is not None and args.peer is None:
        p.error("--peer-num-seqs sizes the workload of --peer; give --peer too (or leave it out)")
    fold_vllm_names(p, args)
    args.engine_names = [*OWN_ENGINE_OPTIONS, *engine_names]
    check_engine_arguments(p, args)
    check_sampling_option(p, "--temperature", temperature=args.temperature)
    check_sampling_option(p, "--n", n=args.n)
    if args.use_beam_search:
        check_beam_search_options(p, args)
    if args.peer is not None and (args.n > 1 or args.use_beam_search):
        p.error(f"--peer {args.peer} runs one completion a request: leave out --n and --use-beam-search")
    return args


def check_beam_search_options(p: BenchParser, args) -> None:
    """parser.error naming the option --use-beam-search cannot take: an --n past the beam width's
    bound (or past --max-logprobs // 2), or a workload of more than one output length (as vLLM's, which
    asks for one)."""
    from minillm.sampling_params import BeamSearchParams
    try:
        BeamSearchParams(beam_width=args.n, max_tokens=1)
    except ValueError as exc:
        p.error(f"--n with --use-beam-search: {exc}")
    if 2 * args.n > args.max_logprobs:
        p.error(f"--n {args.n} with --use-beam-search asks each step for {2 * args.n} log-probabilities, past "
                f"--max-logprobs {args.max_logprobs}: raise --max-logprobs or lower --n")
    if args.workload != "random" or args.random_range_ratio:
        given = "--random-range-ratio" if args.workload == "random" else "nano-vllm's workload (lengths drawn)"
        p.error(f"--use-beam-search searches every prompt for one output length: give vLLM's random dataset "
                f"(--input-len / --output-len) without --random-range-ratio, not {given}")


# This benchmark's own options that set an EngineConfig field (its own defaults and help).
OWN_ENGINE_OPTIONS = ("device", "dtype", "kv_cache_dtype", "max_num_seqs", "max_num_batched_tokens",
                      "kv_cache_memory_bytes", "max_model_len", "seed")


def engine_arguments(args) -> dict:
    """The EngineConfig fields the command line sets (LLM's keyword arguments)."""
    return {name: getattr(args, name) for name in args.engine_names}


def check_engine_arguments(p: BenchParser, args) -> None:
    """The engine options checked as EngineConfig checks them, before anything loads: a bad value
    is a usage error naming its flag."""
    from minillm.config import EngineConfig
    try:
        EngineConfig(model="", **engine_arguments(args))
    except ValueError as exc:
        p.error(engine_flag_words(exc, "seed") or " ".join(str(exc).split()))


def add_random_dataset_options(p: BenchParser) -> None:
    """vLLM's random dataset, as `vllm bench throughput` takes it: every request of --input-len prompt
    and --output-len output tokens (spread by --random-range-ratio), instead of nano-vllm's workload."""
    p.add_argument("--dataset-name", help="vLLM's workload name: random (vLLM's random dataset; the only one "
                                          "without a file) (default: nano-vllm's workload).")
    p.add_argument("--input-len", type=int, help="Tokens of every prompt: vLLM's random dataset, instead of "
                                                 "--max-input-len (default: 1024 on a GPU, 128 on the CPU).")
    p.add_argument("--output-len", type=int, help="Tokens every request generates: vLLM's random dataset, instead "
                                                  "of --max-output-len (default: 128).")
    p.add_argument("--random-input-len", type=int, help="vLLM's random dataset's name for --input-len.")
    p.add_argument("--random-output-len", type=int, help="vLLM's random dataset's name for --output-len.")
    p.add_argument("--random-range-ratio", type=float,
                   help="vLLM's random dataset: each length drawn from [len * (1 - R), len * (1 + R)], R in [0, 1) "
                        "(default: 0, every request of the lengths given).")


# vLLM's names of minillm's options (dest: vLLM's dest): both given, they must agree.
VLLM_NAMES = {"num_seqs": "num_prompts", "input_len": "random_input_len", "output_len": "random_output_len",
              "json": "output_json"}
# The options of each workload: vLLM's random dataset's, then nano-vllm's.
RANDOM_OPTIONS = ("dataset_name", "input_len", "random_input_len", "output_len", "random_output_len",
                  "random_range_ratio")
NANO_OPTIONS = ("max_input_len", "max_output_len")


def fold_vllm_names(p: BenchParser, args) -> None:
    """vLLM's names folded into minillm's options (a usage error naming both when they disagree), and
    args.workload: "random" (vLLM's random dataset) or "nano-vllm"; a usage error naming the options
    of both workloads when they are mixed, or a dataset other than random."""
    args.given_as = {}
    for dest, vllm_dest in VLLM_NAMES.items():
        ours, theirs = getattr(args, dest), getattr(args, vllm_dest)
        if ours is not None and theirs is not None and ours != theirs:
            p.error(f"{_flag(dest)} {ours} and {_flag(vllm_dest)} {theirs} disagree (two names of one option); "
                    f"give one of them")
        if ours is None and theirs is not None:
            setattr(args, dest, theirs)
            args.given_as[dest] = _flag(vllm_dest)
    if args.dataset_name is not None and args.dataset_name != "random":
        p.error(f"--dataset-name {args.dataset_name}: {p.prog} reads no dataset files; the one dataset it supports "
                f"is random (vLLM's random prompts of --input-len / --output-len tokens)")
    ratio = args.random_range_ratio
    if ratio is not None and not 0 <= ratio < 1:       # NaN too
        p.error(f"--random-range-ratio must be in [0, 1), got {ratio}")
    random_given = [d for d in RANDOM_OPTIONS if getattr(args, d) is not None]
    nano_given = [d for d in NANO_OPTIONS if getattr(args, d) is not None]
    if random_given and nano_given:
        first = args.given_as.get(random_given[0], _flag(random_given[0]))
        first += " random" if random_given[0] == "dataset_name" else ""
        p.error(f"{first} and {_flag(nano_given[0])} describe two workloads (vLLM's random dataset, every request "
                f"of --input-len / --output-len tokens; nano-vllm's, lengths drawn up to --max-input-len / "
                f"--max-output-len); give the options of one")
    args.workload = "random" if random_given else "nano-vllm"


def _flag(dest: str) -> str:
    return f"--{dest.replace('_', '-')}"


def option_bounds() -> dict[str, tuple]:
    """Each numeric option's [lo, hi]: past them a run allocates or waits for nothing."""
    from minillm.config import MAX_NUM_SEQS
    return {"num_seqs": (1, MAX_REQUESTS), "num_prompts": (1, MAX_REQUESTS), "max_input_len": (1, MAX_TOKENS),
            "max_output_len": (1, MAX_TOKENS), "input_len": (1, MAX_TOKENS), "random_input_len": (1, MAX_TOKENS),
            "output_len": (1, MAX_TOKENS), "random_output_len": (1, MAX_TOKENS),
            "max_num_seqs": (1, MAX_NUM_SEQS), "max_num_batched_tokens": (1, MAX_TOKENS),
            "max_model_len": (1, MAX_TOKENS), "peer_num_seqs": (1, MAX_REQUESTS), "n": (1, MAX_REQUESTS)}


def resolve_defaults(args) -> dict:
    """Pick the backend and fill in the workload, reporting every problem now, before anything loads.

    Returns the model's config.json (the random model's when no --model is given)."""
    from minillm.engine import choose_backend

    backend = choose_backend(args.device)
    if backend == "cuda":
        try:
            import cupy
            cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:   # no CuPy, no driver, no device
            raise BenchError(f"--device cuda needs CuPy and a CUDA GPU ({type(exc).__name__}: {exc}); "
                             "install CuPy with pip install -e '.[cuda12]' or '.[cuda13]', or use --device cpu"
                             ) from None
    if backend == "numpy" and args.model is None:
        raise BenchError("no CUDA GPU here, and the default workload (random Qwen3-0.6B-shaped weights, 256 "
                         "requests of up to 1024 + 1024 tokens) needs one; on the CPU give a small model, "
                         "e.g. minillm bench throughput --model ../shared/models/stories260K")
    defaults = GPU_DEFAULTS if backend == "cuda" else CPU_DEFAULTS
    if args.workload == "random":
        lengths = RANDOM_GPU_DEFAULTS if backend == "cuda" else RANDOM_CPU_DEFAULTS
        defaults = {"num_seqs": defaults["num_seqs"], **lengths}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.kernel_profile and backend != "cuda":   # --device auto found no GPU
        raise BenchUsageError(PROG, "--kernel-profile: records CUDA kernels, and there is no CUDA GPU here "
                                    "(leave --kernel-profile out)")
    count_option = args.given_as.get("num_seqs", "--num-seqs")
    if args.peer_num_seqs is not None and args.peer_num_seqs > args.num_seqs:
        raise BenchUsageError(PROG, f"--peer-num-seqs {args.peer_num_seqs} is more than the workload's "
                                    f"{args.num_seqs} requests ({count_option})")
    if args.peer == "hf" and backend != "cuda":
        raise BenchError("--peer hf runs transformers on the GPU; there is no CUDA GPU here (leave --peer out)")
    (input_option, longest_input, input_text), (_, longest_output, output_text) = workload_lengths(args)
    check_workload_tokens(PROG, count_option, args.num_seqs, input_option, longest_input)
    if args.model is not None:
        resolve_model_files(args)
        config = json.loads((Path(args.model) / "config.json").read_text())
    else:
        config = QWEN3_0_6B
    model_max = config.get("max_position_embeddings", MAX_TOKENS)
    if args.max_model_len is None:
        args.max_model_len = min(MAX_MODEL_LEN, model_max)
    elif args.max_model_len > model_max:
        raise BenchError(f"--max-model-len {args.max_model_len} is past the model's max_position_embeddings "
                         f"{model_max}; lower it")
    needed = longest_input + longest_output
    if needed > args.max_model_len:
        raise BenchError(f"{input_text} + {output_text} = {needed} tokens do not fit in --max-model-len "
                         f"{args.max_model_len}; lower them")
    args.device = "cuda" if backend == "cuda" else "cpu"
    return config


def workload_lengths(args) -> tuple[tuple[str, int, str], tuple[str, int, str]]:
    """The longest prompt and output of the workload: each as (the option that gives it as the user
    typed it, the longest length, the two described: "--input-len 300 (up to 450 with
    --random-range-ratio 0.5)"); a usage error naming both options when vLLM's random dataset would
    draw a prompt of no token."""
    if args.workload != "random":
        return (("--max-input-len", args.max_input_len, f"--max-input-len {args.max_input_len}"),
                ("--max-output-len", args.max_output_len, f"--max-output-len {args.max_output_len}"))
    ratio = args.random_range_ratio or 0.0
    input_option = args.given_as.get("input_len", "--input-len")
    output_option = args.given_as.get("output_len", "--output-len")
    shortest_input, longest_input = random_length_range(args.input_len, ratio)
    longest_output = random_length_range(args.output_len, ratio, least=1)[1]
    if shortest_input < 1:
        raise BenchUsageError(PROG, f"{input_option} {args.input_len} with --random-range-ratio {ratio:g} draws "
                                    f"prompts of 0 tokens; raise {input_option} or lower --random-range-ratio")
    input_text, output_text = f"{input_option} {args.input_len}", f"{output_option} {args.output_len}"
    if ratio:
        input_option = f"{input_option} with --random-range-ratio {ratio:g} up to"
        input_text += f" (up to {longest_input} with --random-range-ratio {ratio:g})"
        output_text += f" (up to {longest_output})"
    return (input_option, longest_input, input_text), (output_option, longest_output, output_text)


def run_minillm(args, model_dir: str, dummy: bool, w: Workload) -> tuple[float, dict]:
    """Seconds for the whole workload through LLM.generate (or LLM.beam_search), and the engine's counters."""
    from minillm import LLM, SamplingParams
    from minillm.sampling_params import BeamSearchParams

    try:
        llm = LLM(model_dir, **{**engine_arguments(args), "load_format": "dummy" if dummy else args.load_format})
    except ValueError as exc:      # settings the model's own limits refuse ("raise --max-num-batched-tokens")
        message = engine_flag_words(exc, "seed")
        if message is None:
            raise
        raise BenchUsageError(PROG, message) from None
    params = [SamplingParams(n=args.n, temperature=args.temperature, ignore_eos=True, max_tokens=m)
              for m in w.max_tokens]
    if args.use_beam_search:
        beam = BeamSearchParams(beam_width=args.n, max_tokens=w.max_tokens[0], ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in w.prompts]

        def run():
            return llm.beam_search(prompts, beam)
    else:
        def run():
            return llm.generate(w.prompts, params, use_tqdm=False)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)          # warm-up
    llm.engine.metrics.timings.clear()
    llm.engine.runner.profile = args.breakdown
    before = llm.engine.stats()      # the engine's counters run from its start: the warm-up is taken off
    started = time.perf_counter()
    if args.kernel_profile:
        from minillm.benchmarks.kernel_profile import profile_kernels
        outs, kernels = profile_kernels(run)
    else:
        outs, kernels = run(), None
    seconds = time.perf_counter() - started
    produced = num_output_tokens(outs, w.prompts)
    expected = args.n * w.num_output_tokens
    assert produced == expected, f"produced {produced} tokens, expected {expected}"
    s = llm.engine.stats()
    return seconds, {"steps": s.num_steps - before.num_steps,
                     "preemptions": s.num_preemptions - before.num_preemptions, "kv_blocks": s.kv_num_blocks,
                     "kv_cache_dtype": s.kv_cache_dtype, "timings_s": s.step_time_breakdown_s, "kernels": kernels}


def num_output_tokens(outs: list, prompts: list[list[int]]) -> int:
    """Tokens generated: every completion's (RequestOutputs), or every beam's after its prompt (BeamSearchOutputs)."""
    from minillm.beam_search import BeamSearchOutput
    if outs and isinstance(outs[0], BeamSearchOutput):
        return sum(len(beam.tokens) - len(p) for out, p in zip(outs, prompts) for beam in out.sequences)
    return sum(len(c.token_ids) for out in outs for c in out.outputs)


def floor_seconds(w: Workload, n: int, config: dict, bandwidth: float, matmul_flops: float, **kwargs) -> float:
    """The roofline of n sequences a prompt (completions or beams): each prompt prefilled once (the
    others share its blocks), then n sequences decoding, each reading its own K/V."""
    fanned = Workload([p for p in w.prompts for _ in range(n)], [m for m in w.max_tokens for _ in range(n)])
    prefill_only = Workload(w.prompts, [0] * len(w.prompts))
    return (roofline_seconds(fanned, config, bandwidth, matmul_flops, **kwargs)
            - (n - 1) * roofline_seconds(prefill_only, config, bandwidth, matmul_flops, **kwargs))


def run_hf_peer(model_dir: str | None, w: Workload, temperature: float) -> float:
    """Seconds for the workload through transformers' continuous batching (init_continuous_batching)."""
    import torch
    import transformers
    from transformers import GenerationConfig

    if model_dir is None:
        config = transformers.Qwen3Config(**{k: v for k, v in QWEN3_0_6B.items() if k != "architectures"})
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = model.to("cuda").eval()
    gen = GenerationConfig(do_sample=True, temperature=temperature, max_new_tokens=max(w.max_tokens),
                           eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    try:
        started = time.perf_counter()
        for i, (p, m) in enumerate(zip(w.prompts, w.max_tokens)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=m)
        done, tokens = 0, 0
        while done < len(w.prompts):
            out = manager.get_result(timeout=600)
            if out is None:
                raise RuntimeError("transformers' continuous batching stopped before finishing")
            if out.is_finished():
                done += 1
                tokens += len(out.generated_tokens)
        seconds = time.perf_counter() - started
    finally:
        manager.stop(block=True)
    return seconds


def vllm_figures(num_requests: int, total_num_tokens: int, seconds: float) -> dict:
    """The figures `vllm bench throughput --output-json` writes, under its names."""
    return {"elapsed_time": seconds, "num_requests": num_requests, "total_num_tokens": total_num_tokens,
            "requests_per_second": num_requests / seconds, "tokens_per_second": total_num_tokens / seconds}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the figures beside their ceilings."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    check_output_file(args.json, args.given_as.get("json", "--json"))
    config = resolve_defaults(args)
    if args.workload == "random":
        w = random_workload(args.num_seqs, args.input_len, args.output_len, args.random_range_ratio or 0.0,
                            seed=args.seed)
        shape = (f" (vLLM's random dataset: {args.input_len} + {args.output_len} tokens each"
                 f"{f', range ratio {args.random_range_ratio:g}' if args.random_range_ratio else ''})")
    else:
        w, shape = nano_vllm_workload(args.num_seqs, args.max_input_len, args.max_output_len), ""
    if config["vocab_size"] <= 10000:     # a small test model: fold the ids into its vocabulary
        w = Workload([[t % config["vocab_size"] for t in p] for p in w.prompts], w.max_tokens)
    num_prompt_tokens, num_output = sum(map(len, w.prompts)), args.n * w.num_output_tokens
    fan_out = ""
    if args.use_beam_search or args.n > 1:
        fan_out = f", {args.n} {'beams (LLM.beam_search)' if args.use_beam_search else 'completions'} a request"
    print(f"workload: {len(w.prompts)} requests, {num_prompt_tokens} prompt tokens, "
          f"{num_output} output tokens, on {args.device}{shape}{fan_out}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(write_random_model_dir(Path(tmp) / "qwen3-0.6b-random"))
        seconds, counters = run_minillm(args, model_dir, args.model is None, w)
    kernels = counters.pop("kernels")
    tok_s = num_output / seconds
    figures = {"output_tokens": num_output, "seconds": seconds, "output_tok_s": tok_s, **counters,
               **vllm_figures(len(w.prompts), num_prompt_tokens + num_output, seconds)}
    print(f"minillm:  {tok_s:10.0f} output tok/s  ({seconds:.2f} s, {counters['steps']} steps, "
          f"{counters['preemptions']} preemptions, KV cache {counters['kv_cache_dtype']})")
    timings = counters["timings_s"]
    if args.device != "cuda":      # the CPU's "device" timers measure the host's own synchronous work again
        timings = {k: v for k, v in timings.items() if not k.endswith("_device")}
    if timings:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(timings.items(), key=lambda kv: -kv[1]))
        how = "*_device from CUDA events, the rest host time" if args.device == "cuda" else "host time"
        print(f"where the {seconds:.2f} s went (s; {how}): {parts}")
    if kernels is not None:
        from minillm.benchmarks.kernel_profile import by_kind, report
        print(report(kernels, seconds, counters["steps"]))
        figures["kernel_seconds_by_kind"] = {k: us / 1e6 for k, _, us in by_kind(kernels)}
        figures["kernels"] = [{"name": r.name, "grid": list(r.grid), "launches": r.count, "seconds": r.total_us / 1e6}
                              for r in kernels]
    if args.device != "cuda":
        print("ceiling:  the roofline is measured on a GPU only (NumPy on the CPU has none to hold it against)")
    elif not args.no_ceiling:
        from minillm.benchmarks.ceilings import measure_copy_bandwidth, measure_matmul_rate
        bw, mm = measure_copy_bandwidth(), measure_matmul_rate()
        floor = num_output / floor_seconds(w, args.n, config, bw, mm)
        figures |= {"copy_bandwidth_Bps": bw, "matmul_flops": mm, "floor_tok_s": floor}
        print(f"ceiling:  {floor:10.0f} output tok/s  (roofline at {bw / 1e12:.2f} TB/s copy, "
              f"{mm / 1e12:.0f} TFLOP/s bf16, both measured now) -> minillm at {tok_s / floor:.0%}")
        if args.kv_cache_dtype != "auto":       # the same roofline with K/V at one byte an element
            floor8 = num_output / floor_seconds(w, args.n, config, bw, mm, kv_itemsize=1)
            figures |= {"floor_fp8_kv_tok_s": floor8}
            print(f"          {floor8:10.0f} output tok/s  with K/V read at one byte (the FP8 cache's floor) "
                  f"-> minillm at {tok_s / floor8:.0%}")
    if args.peer == "hf":
        n = args.peer_num_seqs or len(w.prompts)
        sub = Workload(w.prompts[:n], w.max_tokens[:n])
        peer_s = run_hf_peer(args.model, sub, args.temperature)
        peer = sub.num_output_tokens / peer_s
        figures |= {"peer_hf_tok_s": peer, "peer_hf_requests": n}
        print(f"peer:     {peer:10.0f} output tok/s  (transformers continuous batching, {n} requests, "
              f"{peer_s:.1f} s) -> minillm at {tok_s / peer:.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "minillm bench throughput"))
