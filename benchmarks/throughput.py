"""Offline throughput on nano-vllm's workload, printed beside the roofline floor and a peer.

    minillm bench throughput                             # GPU: random Qwen3-0.6B-shaped weights, bf16
    minillm bench throughput --model DIR --peer hf
    minillm bench throughput --model ../shared/models/stories260K --device cpu    # a small CPU run
    minillm bench throughput --kv-cache-dtype fp8        # FP8 KV cache (floor printed for both caches)

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
                                         check_workload_tokens, run_main)
from minillm.benchmarks.workload import QWEN3_0_6B, Workload, nano_vllm_workload, roofline_seconds, write_random_model_dir

# nano-vllm's workload on a GPU; on the CPU (NumPy) a small one that finishes in seconds.
GPU_DEFAULTS = {"num_seqs": 256, "max_input_len": 1024, "max_output_len": 1024}
CPU_DEFAULTS = {"num_seqs": 16, "max_input_len": 128, "max_output_len": 128}
MAX_MODEL_LEN = 4096


def parse_args(argv):
    """Command-line options; the workload sizes left out are filled in by resolve_defaults."""
    p = BenchParser("minillm bench throughput", __doc__.splitlines()[0])
    p.add_argument("--model", help="Model directory or hub id (default: random weights in the Qwen3-0.6B "
                                   "shape, on a GPU only).")
    p.add_argument("--num-seqs", type=int, help="Requests in the workload (default: 256 on a GPU, 16 on the CPU).")
    p.add_argument("--max-input-len", type=int,
                   help="Longest prompt; lengths are drawn up from 100 (default: 1024 on a GPU, 128 on the CPU).")
    p.add_argument("--max-output-len", type=int,
                   help="Longest output; lengths are drawn up from 100 (default: 1024 on a GPU, 128 on the CPU).")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="Backend; auto picks cuda when CuPy sees a GPU.")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="Weights and activations (auto: the checkpoint's on a GPU, float32 on the CPU).")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="KV cache storage: auto (the model dtype) or fp8 (E4M3, one byte an element).")
    p.add_argument("--max-num-seqs", type=int, default=256, help="Most sequences in one step.")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384, help="Token budget of one step.")
    add_kv_cache_memory_option(p)
    p.add_argument("--max-model-len", type=int,
                   help=f"Longest prompt + output (default: {MAX_MODEL_LEN}, or the model's limit when lower).")
    p.add_argument("--enforce-eager", action="store_true", help="Never capture CUDA graphs.")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false", default=None,
                   help="Read each step's tokens before launching the next.")
    p.add_argument("--temperature", type=float, default=0.6, help="Sampling temperature of every request.")
    p.add_argument("--peer", choices=["hf"], help="Run the same workload through a peer in this run.")
    p.add_argument("--peer-num-seqs", type=int, default=None,
                   help="Requests given to the peer (default: all; a slow peer may take a prefix).")
    p.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                   help="Skip timing each step's phases (CUDA events around forward and sampling).")
    p.add_argument("--no-ceiling", action="store_true", help="Skip measuring the card's ceilings.")
    p.add_argument("--json", help="Write the figures to this file.")
    args = p.parse_args(argv)
    check_bounds(p.prog, args, option_bounds())
    from minillm.sampling_params import SamplingParams
    try:
        SamplingParams(temperature=args.temperature)
    except ValueError as exc:
        p.error(f"--temperature: {exc}")
    return args


def option_bounds() -> dict[str, tuple]:
    """Each numeric option's [lo, hi]: past them a run allocates or waits for nothing."""
    from minillm.config import MAX_NUM_SEQS
    return {"num_seqs": (1, MAX_REQUESTS), "max_input_len": (1, MAX_TOKENS), "max_output_len": (1, MAX_TOKENS),
            "max_num_seqs": (1, MAX_NUM_SEQS), "max_num_batched_tokens": (1, MAX_TOKENS),
            "max_model_len": (1, MAX_TOKENS), "peer_num_seqs": (1, MAX_REQUESTS)}


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
    for name, value in (GPU_DEFAULTS if backend == "cuda" else CPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.peer == "hf" and backend != "cuda":
        raise BenchError("--peer hf runs transformers on the GPU; there is no CUDA GPU here (leave --peer out)")
    if args.peer_num_seqs is not None and args.peer_num_seqs > args.num_seqs:
        raise BenchUsageError("minillm bench throughput", f"--peer-num-seqs {args.peer_num_seqs} is more than "
                              f"the workload's {args.num_seqs} requests (--num-seqs)")
    check_workload_tokens("minillm bench throughput", "--num-seqs", args.num_seqs, "--max-input-len",
                          args.max_input_len)
    if args.model is not None:
        from minillm.loader import resolve_model_path
        args.model = str(resolve_model_path(args.model))
        config = json.loads((Path(args.model) / "config.json").read_text())
    else:
        config = QWEN3_0_6B
    model_max = config.get("max_position_embeddings", MAX_TOKENS)
    if args.max_model_len is None:
        args.max_model_len = min(MAX_MODEL_LEN, model_max)
    elif args.max_model_len > model_max:
        raise BenchError(f"--max-model-len {args.max_model_len} is past the model's max_position_embeddings "
                         f"{model_max}; lower it")
    needed = args.max_input_len + args.max_output_len
    if needed > args.max_model_len:
        raise BenchError(f"--max-input-len {args.max_input_len} + --max-output-len {args.max_output_len} = "
                         f"{needed} tokens do not fit in --max-model-len {args.max_model_len}; lower them")
    args.device = "cuda" if backend == "cuda" else "cpu"
    return config


def run_minillm(args, model_dir: str, dummy: bool, w: Workload) -> tuple[float, dict]:
    """Seconds for the whole workload through LLM.generate, and the engine's counters."""
    from minillm import LLM, SamplingParams

    llm = LLM(model_dir, device=args.device, dtype=args.dtype, load_format="dummy" if dummy else "auto",
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
              async_scheduling=args.async_scheduling, kv_cache_dtype=args.kv_cache_dtype,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=m) for m in w.max_tokens]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8))          # warm-up
    llm.engine.metrics.timings.clear()
    llm.engine.runner.profile = args.breakdown
    before = llm.engine.stats()      # the engine's counters run from its start: the warm-up is taken off
    started = time.perf_counter()
    outs = llm.generate(w.prompts, params)
    seconds = time.perf_counter() - started
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == w.num_output_tokens, f"produced {produced} tokens, expected {w.num_output_tokens}"
    s = llm.engine.stats()
    return seconds, {"steps": s.num_steps - before.num_steps,
                     "preemptions": s.num_preemptions - before.num_preemptions, "kv_blocks": s.kv_num_blocks,
                     "kv_cache_dtype": s.kv_cache_dtype, "timings_s": s.step_time_breakdown_s}


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


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the figures beside their ceilings."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    check_output_file(args.json, "--json")
    config = resolve_defaults(args)
    w = nano_vllm_workload(args.num_seqs, args.max_input_len, args.max_output_len)
    if config["vocab_size"] <= 10000:     # a small test model: fold the ids into its vocabulary
        w = Workload([[t % config["vocab_size"] for t in p] for p in w.prompts], w.max_tokens)
    print(f"workload: {len(w.prompts)} requests, {sum(map(len, w.prompts))} prompt tokens, "
          f"{w.num_output_tokens} output tokens, on {args.device}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(write_random_model_dir(Path(tmp) / "qwen3-0.6b-random"))
        seconds, counters = run_minillm(args, model_dir, args.model is None, w)
    tok_s = w.num_output_tokens / seconds
    figures = {"output_tokens": w.num_output_tokens, "seconds": seconds, "output_tok_s": tok_s, **counters}
    print(f"minillm:  {tok_s:10.0f} output tok/s  ({seconds:.2f} s, {counters['steps']} steps, "
          f"{counters['preemptions']} preemptions, KV cache {counters['kv_cache_dtype']})")
    timings = counters["timings_s"]
    if args.device != "cuda":      # the CPU's "device" timers measure the host's own synchronous work again
        timings = {k: v for k, v in timings.items() if not k.endswith("_device")}
    if timings:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(timings.items(), key=lambda kv: -kv[1]))
        how = "*_device from CUDA events, the rest host time" if args.device == "cuda" else "host time"
        print(f"where the {seconds:.2f} s went (s; {how}): {parts}")
    if args.device != "cuda":
        print("ceiling:  the roofline is measured on a GPU only (NumPy on the CPU has none to hold it against)")
    elif not args.no_ceiling:
        from minillm.benchmarks.ceilings import measure_copy_bandwidth, measure_matmul_rate
        bw, mm = measure_copy_bandwidth(), measure_matmul_rate()
        floor = w.num_output_tokens / roofline_seconds(w, config, bw, mm)
        figures |= {"copy_bandwidth_Bps": bw, "matmul_flops": mm, "floor_tok_s": floor}
        print(f"ceiling:  {floor:10.0f} output tok/s  (roofline at {bw / 1e12:.2f} TB/s copy, "
              f"{mm / 1e12:.0f} TFLOP/s bf16, both measured now) -> minillm at {tok_s / floor:.0%}")
        if args.kv_cache_dtype != "auto":       # the same roofline with K/V at one byte an element
            floor8 = w.num_output_tokens / roofline_seconds(w, config, bw, mm, kv_itemsize=1)
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
