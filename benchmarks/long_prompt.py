"""Time to first token of one long prompt alone, per prefill attention kernel, beside the matrix-rate floor.

    python3 -m minillm.benchmarks.long_prompt                  # 16,000 tokens, budgets 2048 and 16384
    python3 -m minillm.benchmarks.long_prompt --prompt-len 8000 --budgets 4096 --kernels flash
    python3 -m minillm.benchmarks.long_prompt --kv-cache-dtype fp8 --kernels flash mma   # FP8 KV cache

Qwen3-0.6B architecture with random bf16 weights (load_format "dummy"), one request of random
token ids (fresh ids every run, so the prefix cache never serves it), max_tokens 1: the TTFT is the
whole prefill, chunked by the token budget, plus sampling the first token, read from the request's
metrics (arrival to first token). Each (budget, kernel) runs once to warm up (kernel compilation),
then --repeats times; the median is reported. The floor is the prefill's matrix work at the bf16
GEMM rate measured first in the same run: 2 * (linear weights) * tokens for the projections plus
4 * layers * heads * head_dim * tokens * (tokens + 1) / 2 for causal attention. No decode step runs,
so the engine is eager (no CUDA graphs to capture). The kernel is picked through
minillm.ops.cuda.PREFILL_ATTENTION ("mma": paged_prefill_mma; "flash-4w", "flash-8w": the two block
shapes of prefill_attention.cu; "flash": the default, which picks one of them from the grid).
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from minillm.benchmarks.cli_args import BenchError, BenchParser, run_main
from minillm.benchmarks.workload import QWEN3_0_6B, write_random_model_dir
from minillm.ops.prefill_attention import KERNELS



def prefill_flops(c: dict, tokens: int) -> float:
    """Matrix FLOPs of one causal prefill of `tokens` tokens (the head for the last token only)."""
    h, i, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    linear = layers * (h * (q + 2 * kv) + q * h + 3 * h * i)
    attention = 4 * layers * c["num_attention_heads"] * c["head_dim"] * tokens * (tokens + 1) / 2
    return 2 * linear * tokens + attention + 2 * c["vocab_size"] * h


def parse_args(argv):
    p = BenchParser("python3 -m minillm.benchmarks.long_prompt", __doc__.splitlines()[0])
    p.add_argument("--prompt-len", type=int, default=16000, help="Tokens in the prompt.")
    p.add_argument("--budgets", type=int, nargs="+", default=[2048, 16384],
                   help="Token budgets (max_num_batched_tokens) to run, one engine each.")
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS,
                   help="Prefill attention kernels to compare.")
    p.add_argument("--repeats", type=int, default=3, help="Timed prompts per (budget, kernel).")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="The KV cache's storage (fp8: E4M3, scales calibrated by the first prefill).")
    p.add_argument("--json", type=Path, help="Also write the figures as JSON here.")
    args = p.parse_args(argv)
    if args.prompt_len < 1 or args.repeats < 1 or min(args.budgets) < 1:
        raise BenchError("--prompt-len, --repeats and every budget must be at least 1")
    if args.prompt_len + 16 > QWEN3_0_6B["max_position_embeddings"]:
        raise BenchError(f"--prompt-len must be at most {QWEN3_0_6B['max_position_embeddings'] - 16}")
    return args


def time_to_first_token(llm, rng, prompt_len: int, vocab: int) -> float:
    """Seconds from arrival to the first token of one fresh random prompt."""
    from minillm import SamplingParams

    prompt = rng.integers(0, vocab, prompt_len).tolist()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)[0]
    return out.metrics.ttft


def run_budget(model_dir: str, budget: int, args, rng) -> list[dict]:
    """One engine at this budget; the TTFT figures of every kernel."""
    from minillm import LLM
    from minillm.ops import cuda as ops

    max_model_len = args.prompt_len + 16
    blocks = 2 * -(-max_model_len // 16) + 64          # two prompts' worth: earlier ones get evicted
    rows, default = [], ops.PREFILL_ATTENTION
    with LLM(model_dir, device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=max_model_len,
             max_num_seqs=8, max_num_batched_tokens=budget, num_kv_blocks=blocks, enforce_eager=True,
             kv_cache_dtype=args.kv_cache_dtype) as llm:
        try:
            for kernel in args.kernels:
                ops.PREFILL_ATTENTION = kernel
                times = [time_to_first_token(llm, rng, args.prompt_len, QWEN3_0_6B["vocab_size"])
                         for _ in range(args.repeats + 1)][1:]
                rows.append({"budget": budget, "kernel": kernel, "ttft_s": statistics.median(times),
                             "ttft_runs_s": times})
        finally:
            ops.PREFILL_ATTENTION = default
    return rows


def main(argv: list[str] | None = None) -> int:
    """Measure the GEMM rate, then the TTFT of every (budget, kernel), and print them beside the floor."""
    args = parse_args(argv if argv is not None else sys.argv[1:])
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() == 0:
            raise RuntimeError("no CUDA device")
    except Exception as e:   # no CuPy / driver / device
        raise BenchError(f"the long-prompt benchmark needs CuPy and a CUDA GPU ({type(e).__name__}: {e})") from None
    from minillm.benchmarks.ceilings import measure_matmul_rate

    rate = measure_matmul_rate()
    floor = prefill_flops(QWEN3_0_6B, args.prompt_len) / rate
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_random_model_dir(Path(tmp) / "qwen3-0.6b-random"))
        for budget in args.budgets:
            rows += run_budget(model_dir, budget, args, rng)
    print(f"one {args.prompt_len}-token prompt alone, Qwen3-0.6B shape, random bf16 weights, KV cache "
          f"{args.kv_cache_dtype}; floor "
          f"{floor * 1e3:.1f} ms = {prefill_flops(QWEN3_0_6B, args.prompt_len) / 1e12:.1f} TFLOP of prefill "
          f"matrix work at {rate / 1e12:.0f} TFLOP/s (bf16 GEMM 8192^3, measured now)")
    print(f"{'budget':>8} {'kernel':>9} {'TTFT ms':>9} {'runs ms':>24} {'floor / TTFT':>13}")
    for r in rows:
        runs = " ".join(f"{t * 1e3:.1f}" for t in r["ttft_runs_s"])
        print(f"{r['budget']:>8} {r['kernel']:>9} {r['ttft_s'] * 1e3:9.1f} {runs:>24} {floor / r['ttft_s']:12.0%}")
    if args.json:
        args.json.write_text(json.dumps({"prompt_len": args.prompt_len, "kv_cache_dtype": args.kv_cache_dtype,
                                         "matmul_flops": rate, "floor_s": floor,
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "python3 -m minillm.benchmarks.long_prompt"))
