"""FP8 KV cache accuracy: teacher-forced log-probabilities with the FP8 cache against the model-dtype cache.

    python3 -m minillm.benchmarks.kv_fp8_accuracy                  # stories260K on the CPU; on a GPU also
                                                                    # random Qwen3-0.6B / Llama-3.2-1B shapes
    python3 -m minillm.benchmarks.kv_fp8_accuracy --prompt-lens 100,1000,4000,8000 --models qwen3,llama

Teacher forcing: a fixed token sequence runs through the decoder (prefill in chunks, then the last
--decode-steps tokens one by one through the decode kernel), once with the KV cache in the model's
dtype and once with kv_cache_dtype="fp8" (scales 1.0, and calibrated from the first chunk as
calculate_kv_scales does). At every position the reference run's top-5 tokens are looked up in
the FP8 run: the table gives the max and mean absolute error of those log-probabilities and the
share of positions whose greedy token agrees. The reference is the model-dtype cache run; for
stories260K also transformers' logits in reference.json (its prompt), and the share of the 200
golden greedy tokens an FP8 engine reproduces. Random weights give flat distributions: their
greedy agreement measures near-ties as much as the cache, the log-probability errors are the figure.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from minillm.attention import AttentionMetadata
from minillm.benchmarks.cli_args import BenchParser, run_main

TOP_K = 5
STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"
# Llama-3.2-1B's architecture (config.json of the public checkpoint).
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "bos_token_id": 128000, "eos_token_id": 128001,
}


@dataclass
class TopK:
    """Per teacher-forced position: the reference run's top-k ids and log-probabilities, or
    another run's log-probabilities at those ids; and each position's greedy token."""

    ids: np.ndarray        # [N, k] int64
    logprobs: np.ndarray   # [N, k] float32
    argmax: np.ndarray     # [N] int64


@dataclass
class Row:
    model: str
    kv_cache: str
    reference: str
    prompt_len: int
    positions: int
    max_abs_err: float
    mean_abs_err: float
    greedy_agreement: float


def kv_pool(ops, mc, num_tokens: int, block_size: int, fp8: bool, dtype):
    """[L, 2, blocks, block_size, Hk, Dh] zeros: uint8 E4M3 bits or the model dtype."""
    xp = ops.xp
    blocks = -(-num_tokens // block_size)
    return xp.zeros((mc.num_layers, 2, blocks, block_size, mc.num_kv_heads, mc.head_dim),
                    dtype=xp.dtype(xp.uint8) if fp8 else xp.dtype(dtype))


def _top_k(ops, lp, ref_ids):
    """lp: [n, V] log-probabilities -> (ids [n, k], values [n, k], argmax [n]) on the host; with
    ref_ids the values are lp at those ids."""
    xp = ops.xp
    rows = xp.arange(lp.shape[0])
    argmax = lp.argmax(axis=1)
    if ref_ids is not None:
        ids = ops.asarray(ref_ids.astype(np.int64))
        vals = xp.stack([lp[rows, ids[:, j]] for j in range(ids.shape[1])], axis=1)
        return ref_ids, ops.to_numpy(vals), ops.to_numpy(argmax)
    work, ids, vals = lp.copy(), [], []
    for _ in range(TOP_K):                      # k argmax passes: cheaper than a sort of the vocabulary
        idx = work.argmax(axis=1)
        ids.append(idx)
        vals.append(work[rows, idx])
        work[rows, idx] = -np.inf
    return (ops.to_numpy(xp.stack(ids, axis=1)).astype(np.int64), ops.to_numpy(xp.stack(vals, axis=1)),
            ops.to_numpy(argmax))


def teacher_forced(model, ops, ids: np.ndarray, pool, block_size: int, chunk: int = 1024, decode_steps: int = 0,
                   calibrate: bool = False, ref: TopK | None = None) -> TopK:
    """Run ids [N] through the model with the paged cache `pool` (one sequence on blocks 0, 1, ...):
    prefill chunks, then the last decode_steps tokens one at a time. Returns the top-k at every
    position (or, given ref, the log-probabilities at ref's ids). calibrate: the first chunk sets
    the model's kv_scales (calculate_kv_scales)."""
    a, n = ops.asarray, len(ids)
    table = a(np.arange(pool.shape[2], dtype=np.int32)[None])
    prefill_end = n - decode_steps
    spans = [(s, min(s + chunk, prefill_end)) for s in range(0, prefill_end, chunk)]
    spans += [(s, s + 1) for s in range(prefill_end, n)]
    out_ids, out_vals, out_argmax = [], [], []
    for i, (start, end) in enumerate(spans):
        pos = np.arange(start, end, dtype=np.int32)
        decode = end - start == 1 and start >= prefill_end
        meta = AttentionMetadata(a(np.array([0, end - start], np.int32)), a(np.array([end], np.int32)), table,
                                 a(pos), end - start, end, decode)
        hidden = model.forward(a(np.asarray(ids[start:end], np.int32)), a(pos), meta, pool,
                               calculate_kv_scales=calibrate and i == 0)
        lp = ops.log_softmax(model.compute_logits(hidden))
        top = _top_k(ops, lp, ref.ids[start:end] if ref is not None else None)
        for acc, part in zip((out_ids, out_vals, out_argmax), top):
            acc.append(part)
    return TopK(np.concatenate(out_ids), np.concatenate(out_vals), np.concatenate(out_argmax))


def compare(ref: TopK, got: TopK) -> tuple[float, float, float]:
    """(max |delta logprob|, mean |delta logprob| over the reference's top-k, greedy agreement)."""
    err = np.abs(got.logprobs.astype(np.float64) - ref.logprobs.astype(np.float64))
    return float(err.max()), float(err.mean()), float((got.argmax == ref.ids[:, 0]).mean())


def fp8_rows(name: str, model, ops, ids: np.ndarray, dtype, block_size: int = 16, chunk: int = 1024,
             decode_steps: int = 32) -> list[Row]:
    """Teacher-forced FP8 runs (scales 1.0, and calibrated) against the model-dtype cache run."""
    mc, n = model.config, len(ids)
    decode_steps = min(decode_steps, n - 1)
    run = lambda fp8, **kw: teacher_forced(model, ops, ids, kv_pool(ops, mc, n, block_size, fp8, dtype),   # noqa: E731
                                           block_size, chunk, decode_steps, **kw)
    ref = run(False)
    rows = []
    for label, calibrate in (("fp8 scale 1.0", False), ("fp8 calibrated", True)):
        model.kv_scales[...] = 1.0
        got = run(True, calibrate=calibrate, ref=ref)
        rows.append(Row(name, label, f"{np.dtype(dtype).name} cache", n, n, *compare(ref, got)))
    model.kv_scales[...] = 1.0
    return rows


# ---- stories260K on the CPU ------------------------------------------------------------------

def stories_rows(path: Path) -> list[Row]:
    """stories260K (NumPy, float32): teacher-forced on its 200 golden tokens against the float32
    cache, on its prompt against transformers' logits, and the golden tokens an FP8 engine reproduces."""
    from minillm import LLM, SamplingParams
    from minillm.loader import load_model_config, load_weights
    from minillm.models.decoder import DecoderModel
    from minillm.ops import get_ops

    ref_json = json.loads((path / "reference.json").read_text())
    golden = np.asarray(ref_json["greedy_from_bos_200_ids"], np.int64)        # BOS + 200 tokens
    mc = load_model_config(path)
    ops = get_ops("numpy")
    model = DecoderModel(mc, load_weights(path, mc, "float32"), ops, np.float32, 1024)
    rows = fp8_rows("stories260K", model, ops, golden, np.float32, block_size=4, chunk=64, decode_steps=32)
    prompt = np.asarray(ref_json["prompt_ids"], np.int64)
    logits = np.asarray(ref_json["prompt_logits_fp32"], np.float32)            # transformers, [5, V]
    lp = ops.log_softmax(logits)
    hf = TopK(*_top_k(ops, lp, None))
    for label, fp8, calibrate in (("float32", False, False), ("fp8 scale 1.0", True, False),
                                  ("fp8 calibrated", True, True)):
        model.kv_scales[...] = 1.0
        got = teacher_forced(model, ops, prompt, kv_pool(ops, mc, len(prompt), 4, fp8, np.float32), 4,
                             calibrate=calibrate, ref=hf)
        rows.append(Row("stories260K", label, "transformers", len(prompt), len(prompt), *compare(hf, got)))
    model.kv_scales[...] = 1.0
    greedy = SamplingParams(temperature=0, max_tokens=len(golden) - 17, ignore_eos=True)
    for label, calibrate in (("fp8 scale 1.0", False), ("fp8 calibrated", True)):
        llm = LLM(str(path), device="cpu", kv_cache_dtype="fp8", calculate_kv_scales=calibrate,
                  num_kv_blocks=64, block_size=4)
        # The prompt holds the first 16 golden tokens so that a calibration sees more than BOS.
        out = llm.generate([golden[:17].tolist()], greedy, use_tqdm=False)[0].outputs[0]
        matched = np.asarray(out.token_ids) == golden[17:]
        rows.append(Row("stories260K", f"{label} (engine)", "golden greedy ids", 17, int(matched.size),
                        float("nan"), float("nan"), float(matched.mean())))
    return rows


# ---- random models of real shapes on the GPU -------------------------------------------------

def random_model(config: dict, ops, dtype: str, max_positions: int, seed: int = 0):
    """A DecoderModel with random weights (load_format='dummy') of the config's shape."""
    from minillm.loader import load_model_config
    from minillm.models.decoder import DecoderModel
    from minillm.models.dummy import dummy_weights

    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "config.json").write_text(json.dumps(config))
        mc = load_model_config(tmp)
    return DecoderModel(mc, dummy_weights(mc, dtype, seed), ops, dtype, max_positions)


def checkpoint_model(path: str, ops, dtype: str, max_positions: int):
    """A DecoderModel with a checkpoint's weights."""
    from minillm.loader import load_model_config, load_weights
    from minillm.models.decoder import DecoderModel

    mc = load_model_config(path)
    return DecoderModel(mc, load_weights(path, mc, dtype), ops, dtype, max_positions)


def gpu_rows(models: list[str], prompt_lens: list[int], dtype: str, model_dir: str | None) -> list[Row]:
    """Teacher-forced FP8 against the model-dtype cache on the GPU, at each prompt length."""
    from minillm.benchmarks.workload import QWEN3_0_6B
    from minillm.ops import get_ops

    ops = get_ops("cuda")
    configs = {"qwen3": ("Qwen3-0.6B shape", QWEN3_0_6B), "llama": ("Llama-3.2-1B shape", LLAMA_3_2_1B)}
    max_positions = max(prompt_lens) + 1
    if model_dir is not None:
        todo = [(Path(model_dir).name, lambda: checkpoint_model(model_dir, ops, dtype, max_positions))]
    else:
        todo = [(configs[m][0], lambda c=configs[m][1]: random_model(c, ops, dtype, max_positions)) for m in models]
    rng = np.random.default_rng(0)
    rows = []
    for name, build in todo:
        model = build()
        for n in prompt_lens:
            ids = rng.integers(0, model.config.vocab_size, n)
            rows += fp8_rows(name, model, ops, ids, dtype)
            print_rows(rows[-2:])
        del model
        ops.xp.get_default_memory_pool().free_all_blocks()
    return rows


def print_rows(rows: list[Row], header: bool = False) -> None:
    if header:
        print(f"{'model':20} {'kv cache':26} {'against':18} {'prompt':>7} {'positions':>9} "
              f"{'top-5 |dlogp| max':>17} {'mean':>10} {'greedy agree':>12}")
    for r in rows:
        print(f"{r.model:20} {r.kv_cache:26} {r.reference:18} {r.prompt_len:7d} {r.positions:9d} "
              f"{r.max_abs_err:17.5f} {r.mean_abs_err:10.6f} {r.greedy_agreement:12.1%}", flush=True)


def _has_gpu() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, driver or device
        return False


def main(argv: list[str] | None = None) -> int:
    parser = BenchParser("python3 -m minillm.benchmarks.kv_fp8_accuracy", __doc__.splitlines()[0])
    parser.add_argument("--stories", type=Path, default=Path(os.environ.get("MINILLM_TEST_MODEL", STORIES)),
                        help="The stories260K directory (skipped when absent).")
    parser.add_argument("--models", default="qwen3,llama", help="Random-weight shapes on the GPU: qwen3, llama.")
    parser.add_argument("--model", help="A checkpoint directory to measure on the GPU instead of random shapes.")
    parser.add_argument("--prompt-lens", default="100,1000,4000,8000", help="Teacher-forced lengths on the GPU.")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="GPU model dtype.")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="cpu: stories260K only; cuda / auto with a GPU: both.")
    parser.add_argument("--json", type=Path, help="Also write the rows as JSON here.")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    rows: list[Row] = []
    print_rows([], header=True)
    if (args.stories / "reference.json").exists():
        rows += stories_rows(args.stories)
        print_rows(rows)
    else:
        print(f"(stories260K not found at {args.stories}: skipped)")
    if args.device != "cpu" and (args.device == "cuda" or _has_gpu()):
        lens = [int(x) for x in args.prompt_lens.split(",")]
        rows += gpu_rows([m.strip() for m in args.models.split(",")], lens, args.dtype, args.model)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "kv_fp8_accuracy"))
