"""Structured outputs in the engine: the decode step time of a batch with JSON-schema requests
against the same batch unconstrained, and the bitmask-fill time per step.

    python -m minillm.benchmarks.structured_step                               # H200: Qwen3-0.6B shape, bf16
    python -m minillm.benchmarks.structured_step --device cpu --shape tiny --batch 16 --constrained 4 --steps 8
    python -m minillm.benchmarks.structured_step --device sim                  # host time, CPU only

The model has random weights (load_format "dummy") in the Qwen3-0.6B shape (--shape tiny: two small
layers over the same 151,936-row head, for a CPU check) and the byte-level tokenizer that
benchmarks/structured.py builds with Qwen3's sizes, so the grammar masks have the vocabulary of the
real model. A warm-up request builds llguidance's tokenizer and compiles the schema first (both
off the step loop in serving, and cached). Each run adds --batch requests (prompts of --prompt-len random ids, temperature 1.0,
seeded, ignore_eos), steps until every request decodes and --warmup steps more, then times --steps
engine.step() calls (wall time; async scheduling as the engine chooses: on for CUDA). The
constrained run gives --constrained of the requests a JSON schema (default: the free-strings schema,
as maxLength strings cost milliseconds a row to fill over this vocabulary). Runs alternate,
--repeats times each, on one engine; medians are reported, and the overhead is the median over the
repeats of each constrained run against the unconstrained run just before it (a host whose speed
drifts from run to run, as the H200's does, moves both runs of a pair alike).

--device sim measures the host's side alone (benchmarks/simulated_device.py): the real engine loop on
the CPU backend with the tiny shape, async scheduling on, the forward pass and the sampling kernels
replaced by a virtual device timeline on which they take --sim-forward-ms and --sim-sample-ms a
step, so the host overlaps the "device" as it does a GPU. Each step's host time is
split into its parts on the engine thread (wall, and the thread's CPU time, which a busy host's
other processes leave out): the wait for a read-back, the matcher advance, the mask fill (what
the engine thread spends starting it and waiting for it: the fill runs on the mask thread), the
mask's upload and apply (host side), scheduling, inputs, sampling, the scheduler's update, the
detokenizer, the outputs, the rest, and the simulated kernels' own host time (picking tokens
inside the masks, the harness's cost); the device's idle share says how much of the step it
waited for the host. "Mask fill per step" is the fill's wall time on the mask thread (until it
holds the GIL again), "the engine thread's wait for the masks" what of it the step waited for.

With random weights the constrained requests walk wherever the sampled tokens take them: mostly
inside the schema's first string (a token that closes it is rare among 151k). benchmarks/structured.py
times the fill at every place in the schema. The ceiling: the structured-outputs issue allows the
constrained batch at most 10% more step time than the unconstrained one.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minillm.benchmarks.structured import QWEN_TOKENIZER_VOCAB, SCHEMAS, SPECIALS, synthetic_byte_level_tokenizer  # noqa: E402
from minillm.benchmarks.workload import QWEN3_0_6B  # noqa: E402

ALLOWED_OVERHEAD = 0.10
SHAPES = {
    "qwen3-0.6b": QWEN3_0_6B,
    "tiny": {**QWEN3_0_6B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "torch_dtype": "float32"},
}


# Host-time parts (--device sim): functions timed on the engine thread, each exclusive of the parts
# it calls (work on other threads, such as masks filled on the mask thread, counts only where the
# engine thread waits for it). The first five are the structured outputs' own.
HOST_PARTS = [
    ("minillm.model_runner", "InFlightStep", "wait", "wait"),    # on a GPU (the simulator counts its own)
    ("minillm.structured_output", "GrammarMatcher", "accept_token", "advance"),
    ("minillm.structured_output", "StructuredOutputManager", "advance", "advance"),
    ("minillm.structured_output", "StructuredOutputManager", "start_fill", "fill"),
    ("minillm.structured_output", "StructuredOutputManager", "fill_bitmask", "fill"),
    ("minillm.structured_output", "StructuredOutputManager", "grammar_bitmask", "fill"),
    ("minillm.structured_output", "PendingBitmask", "result", "fill"),      # waiting for the mask thread
    ("minillm.sampler", "Sampler", "apply_grammar_bitmask", "upload"),
    ("minillm.scheduler", "Scheduler", "schedule", "schedule"),
    ("minillm.model_runner", "ModelRunner", "prepare_inputs", "prepare"),
    ("minillm.sampler", "Sampler", "sample_no_sync", "sample"),
    ("minillm.scheduler", "Scheduler", "update_from_output", "update"),
    ("minillm.output_processor", "TextOutputs", "add_token", "detokenize"),
    ("minillm.engine_core.core", "TokenOutputs", "add_token", "detokenize"),
    ("minillm.engine", "LLMEngine", "_take_outputs", "outputs"),
    # The simulated kernels' own host time (picking tokens inside the masks): the harness's, not the engine's.
    ("minillm.benchmarks.simulated_device", "SimulatedSamplerOps", "apply_token_bitmask", "simulator"),
    ("minillm.benchmarks.simulated_device", "SimulatedSamplerOps", "sample", "simulator"),
]
PART_NAMES = {"wait": "read-back wait", "advance": "matcher advance", "fill": "mask fill",
              "upload": "mask upload/apply", "schedule": "schedule", "prepare": "inputs", "sample": "sampling",
              "update": "update", "detokenize": "per-token output", "outputs": "outputs", "rest": "the rest",
              "simulator": "simulated kernels"}


class HostParts:
    """Seconds (wall and the engine thread's CPU) in each part of HOST_PARTS, exclusive of nested parts."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self.cpu_seconds: Counter[str] = Counter()
        self.thread = threading.get_ident()
        self._nested: list[tuple[float, float]] = []     # per open call: (wall, CPU) seconds in parts it called

    @contextlib.contextmanager
    def timing(self):
        """Wrap the HOST_PARTS functions while the block runs."""
        saved = []
        for module, cls_name, attr, part in HOST_PARTS:
            cls = getattr(importlib.import_module(module), cls_name, None)
            if cls is None or attr not in vars(cls):
                continue
            fn = vars(cls)[attr]
            saved.append((cls, attr, fn))
            setattr(cls, attr, self._timed(fn, part))
        try:
            yield self
        finally:
            for cls, attr, fn in saved:
                setattr(cls, attr, fn)

    def _timed(self, fn, part: str):
        parts = self

        def timed(*args, **kwargs):
            if threading.get_ident() != parts.thread:
                return fn(*args, **kwargs)
            parts._nested.append((0.0, 0.0))
            start, cpu_start = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
                nested, nested_cpu = parts._nested.pop()
                parts.seconds[part] += elapsed - nested
                parts.cpu_seconds[part] += cpu - nested_cpu
                if parts._nested:
                    parts._nested[-1] = (parts._nested[-1][0] + elapsed, parts._nested[-1][1] + cpu)
        return timed


def write_model_dir(out: Path, config: dict) -> Path:
    """config.json and the synthetic byte-level tokenizer (EOS: <|im_end|>, Qwen3's id 151645)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    (out / "tokenizer.json").write_text(synthetic_byte_level_tokenizer())
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert QWEN_TOKENIZER_VOCAB - len(SPECIALS) + SPECIALS.index("<|im_end|>") == config["eos_token_id"]
    return out


def wait_until_decoding(engine, request_ids: list[str], max_steps: int = 10_000) -> None:
    """Step until every request has its first token and no prefill is left."""
    for _ in range(max_steps):
        engine.step()
        rows = {r.request_id: r for r in engine.stats(cells=1).requests}
        if all(rows[r].output_tokens > 0 for r in request_ids if r in rows) \
                and engine.metrics.recent_steps[-1].num_prefill_tokens == 0 \
                and engine.scheduler.num_waiting == 0:
            return
    raise RuntimeError("the batch never reached decode")


def warm_up(engine, schema: dict) -> None:
    """One constrained request to the end: llguidance's tokenizer is built (seconds at this
    vocabulary), the schema compiled and cached, the mask kernel loaded, before any timed run."""
    from minillm import SamplingParams, StructuredOutputsParams

    engine.add_request("warm-up", [256, 257, 258], SamplingParams(
        max_tokens=4, structured_outputs=StructuredOutputsParams(json=schema)))
    while engine.has_unfinished_requests():
        engine.step()


def timed_run(engine, args, num_constrained: int, schema: dict, run: int, core=None) -> dict:
    """Per-step wall seconds of --steps decode steps, with num_constrained requests under schema
    (with core, an EngineCore over engine: each step also encodes its message)."""
    from minillm import SamplingParams, StructuredOutputsParams
    from minillm.engine_core.messages import encoder

    encode = encoder().encode

    rng = np.random.default_rng(run)
    max_tokens = args.warmup + args.steps + 64
    structured = StructuredOutputsParams(json=schema)
    ids = []
    for i in range(args.batch):
        rid = f"r{run}-{i}"
        prompt = rng.integers(256, QWEN_TOKENIZER_VOCAB - len(SPECIALS), args.prompt_len).tolist()
        engine.add_request(rid, prompt, SamplingParams(
            temperature=1.0, seed=run * 100_000 + i, max_tokens=max_tokens, ignore_eos=True,
            structured_outputs=structured if i < num_constrained else None))
        ids.append(rid)
    wait_until_decoding(engine, ids)
    for _ in range(args.warmup):
        engine.step()
    before = engine.stats(cells=1)
    times, batch = [], []
    sim, parts = getattr(engine, "simulated_device", None), HostParts()
    if sim is not None:
        wait0, busy0 = sim.read_back_wait_s, sim.busy_s
    cpu0 = time.thread_time()
    step = engine.step if core is None else lambda: encode(core.step())   # core: the step's message, as sent
    with parts.timing() if sim is not None or args.host_parts else contextlib.nullcontext():
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
            batch.append(engine.metrics.recent_steps[-1].num_seqs)
    cpu = time.thread_time() - cpu0
    after = engine.stats(cells=1)
    host = {}
    if sim is not None or args.host_parts:
        total = sum(times)
        if sim is not None:
            parts.seconds["wait"] = sim.read_back_wait_s - wait0
        parts.seconds["rest"] = total - sum(parts.seconds.values())
        parts.cpu_seconds["rest"] = cpu - sum(parts.cpu_seconds.values())
        host = {"parts_ms": {k: parts.seconds[k] / args.steps * 1e3 for k in PART_NAMES},
                "parts_cpu_ms": {k: parts.cpu_seconds[k] / args.steps * 1e3 for k in PART_NAMES},
                "host_cpu_ms": cpu / args.steps * 1e3}
        if sim is not None:
            host["device_idle"] = max(0.0, 1 - (sim.busy_s - busy0) / total)
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    fill_steps = after.num_grammar_fill_steps - before.num_grammar_fill_steps
    waited = after.step_time_breakdown_s.get("grammar_fill_wait", 0.0) - before.step_time_breakdown_s.get(
        "grammar_fill_wait", 0.0)
    return {"run": run, "constrained": num_constrained, "step_ms_median": statistics.median(times) * 1e3,
            "step_ms_mean": statistics.fmean(times) * 1e3, "batch_mean": statistics.fmean(batch),
            "fill_ms_per_step": (after.grammar_fill_time_s - before.grammar_fill_time_s) / fill_steps * 1e3
            if fill_steps else 0.0,
            "fill_wait_ms_per_step": waited / args.steps * 1e3,
            "fill_steps": fill_steps, "finished_in_window": args.batch - min(batch), **host}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m minillm.benchmarks.structured_step", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda, cpu, or sim (the CPU backend with a simulated device)")
    p.add_argument("--sim-forward-ms", type=float, default=4.5, help="--device sim: device time of a forward pass")
    p.add_argument("--sim-sample-ms", type=float, default=0.3, help="--device sim: device time of the sampling")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--constrained", type=int, default=64, help="requests of the batch under the JSON schema")
    p.add_argument("--schema", choices=sorted(SCHEMAS), default="free strings")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--order", choices=("alternate", "plain-first"), default="alternate",
                   help="alternate: every other repeat runs its constrained batch first, so a drift of the host "
                        "within a pair favours neither; plain-first: the unconstrained batch first in every pair")
    p.add_argument("--host-parts", action="store_true",
                   help="on a GPU too: time the engine thread's parts of each step (always on with --device sim)")
    p.add_argument("--outputs", choices=("core", "text"), default="core",
                   help="core: the engine as `minillm serve` runs it in its engine core process (token ids out, "
                        "the API server detokenises); text: the in-process engine's cumulative text outputs "
                        "(`--engine-core thread`)")
    p.add_argument("--grammar-process", action=argparse.BooleanOptionalAction, default=None,
                   help="the matchers in a grammar process (default: the engine's, on with a GPU)")
    p.add_argument("--json", help="write the figures to this file")
    return p.parse_args(argv)


def main(argv=None) -> None:
    from minillm.config import EngineConfig
    from minillm.engine import LLMEngine
    from minillm.engine_core.core import EngineCore
    from minillm.engine_core.heap import freeze_startup_heap

    args = parse_args(argv)
    simulated = args.device == "sim"
    if simulated:
        args.shape = "tiny"                          # the forward pass is simulated: the model only loads
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp) / "model", SHAPES[args.shape])
        config = EngineConfig(
            model=str(model_dir), device="cpu" if simulated else args.device, dtype=dtype, load_format="dummy",
            max_num_seqs=args.batch, max_num_batched_tokens=max(8192, args.batch * args.prompt_len),
            max_model_len=args.prompt_len + args.warmup + args.steps + 128,
            async_scheduling=True if simulated else None, grammar_process=args.grammar_process)
        core = EngineCore(config) if args.outputs == "core" else None
        engine = core.engine if core is not None else LLMEngine(config)
        if simulated:
            from minillm.benchmarks.simulated_device import SimulatedDevice
            engine.simulated_device = SimulatedDevice(args.sim_forward_ms / 1e3, args.sim_sample_ms / 1e3,
                                                      256, QWEN_TOKENIZER_VOCAB - len(SPECIALS))
            engine.simulated_device.attach(engine)
        runs = []
        try:
            warm_up(engine, SCHEMAS[args.schema])
            if core is not None:
                freeze_startup_heap()    # as the core process does once it has started
            for r in range(args.repeats):
                held_first = args.order == "alternate" and r % 2 == 1
                for num_constrained in ((args.constrained, 0) if held_first else (0, args.constrained)):
                    runs.append(timed_run(engine, args, num_constrained, SCHEMAS[args.schema], len(runs), core))
                    print(f"# {json.dumps(runs[-1])}", file=sys.stderr)
            compile_s = engine.stats(cells=1).grammar_compile_time_s
        finally:
            engine.shutdown()
    report(args, runs, compile_s)


def report(args, runs: list[dict], compile_s: float) -> None:
    plain = statistics.median(r["step_ms_median"] for r in runs if r["constrained"] == 0)
    held = [r for r in runs if r["constrained"] > 0]
    constrained = statistics.median(r["step_ms_median"] for r in held)
    fill = statistics.median(r["fill_ms_per_step"] for r in held)
    fill_wait = statistics.median(r.get("fill_wait_ms_per_step", 0.0) for r in held)
    # Each repeat runs its unconstrained and constrained batches back to back: the ratio within a
    # pair is what a slower or faster stretch of the host leaves alone, so its median is the figure.
    couples = [sorted(runs[i:i + 2], key=lambda r: r["constrained"]) for i in range(0, len(runs) - 1, 2)]
    pairs = [held_run["step_ms_median"] / plain_run["step_ms_median"] - 1 for plain_run, held_run in couples]
    overhead = statistics.median(pairs)
    print(f"Structured outputs in the step: {args.shape} shape, random weights, vocabulary 151,936 (byte-level "
          f"tokenizer), {args.device}, {args.outputs} outputs; batch {args.batch} decoding, {args.constrained} under the "
          f"{args.schema!r} JSON schema; medians of {args.repeats} runs x {args.steps} steps; the last column is the "
          f"median over the repeats of the constrained run's step against the unconstrained run just before it. "
          f"Ceiling: {ALLOWED_OVERHEAD:.0%} more step time than unconstrained.")
    print("| batch | constrained | step (ms) | mask fill per step (ms) | engine thread's wait for the masks (ms) "
          "| step time vs unconstrained |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| {args.batch} | 0 | {plain:.2f} | - | - | - |")
    print(f"| {args.batch} | {args.constrained} | {constrained:.2f} | {fill:.2f} | {fill_wait:.2f} | {overhead:+.1%} "
          f"({'within' if overhead <= ALLOWED_OVERHEAD else 'over'} the {ALLOWED_OVERHEAD:.0%} ceiling) |")
    print("each repeat's pair (unconstrained -> constrained; * the constrained run went first): " + ", ".join(
        f"{r['step_ms_median']:.2f} -> {h['step_ms_median']:.2f} ms ({x:+.1%}){'*' if h['run'] < r['run'] else ''}"
        for (r, h), x in zip(couples, pairs)))
    print(f"grammar compile (once, on the pool, tokenizer build excluded): {compile_s * 1e3:.1f} ms; "
          f"mean batch in the constrained windows: {statistics.fmean(r['batch_mean'] for r in held):.1f}")
    if "parts_ms" in runs[0]:
        report_host_parts(args, runs)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "step_ms": plain, "step_ms_constrained": constrained,
                                               "fill_ms_per_step": fill, "fill_wait_ms_per_step": fill_wait,
                                               "overhead": overhead, "pair_overheads": pairs}, indent=2))


def report_host_parts(args, runs: list[dict]) -> None:
    """The engine thread's time per step by part (--device sim), medians over the runs."""
    sim = args.device == "sim"
    where = (f"simulated device: forward {args.sim_forward_ms:g} ms, sampling {args.sim_sample_ms:g} ms a step"
             if sim else f"{args.device}; the read-back wait is the device's time past the host's")
    print(f"\nHost time per step on the engine thread ({where}), ms:")
    print("| constrained | step | " + " | ".join(PART_NAMES.values()) + " | engine thread CPU | device idle |")
    print("| --- " * (len(PART_NAMES) + 4) + "|")
    for num in (0, args.constrained):
        rs = [r for r in runs if r["constrained"] == num]
        med = lambda f: statistics.median(f(r) for r in rs)   # noqa: E731
        cells = [f"{med(lambda r: r['parts_ms'][k]):.2f}" for k in PART_NAMES]
        idle = f"{med(lambda r: r['device_idle']):.0%}" if sim else "-"
        print(f"| {num} | {med(lambda r: r['step_ms_mean']):.2f} | " + " | ".join(cells)
              + f" | {med(lambda r: r['host_cpu_ms']):.2f} | {idle} |")
    net = {num: statistics.median(r["step_ms_mean"] - r["parts_ms"]["simulator"] for r in runs
                                  if r["constrained"] == num) for num in (0, args.constrained)}
    print(f"Less the simulated kernels' host time: {net[0]:.2f} against {net[args.constrained]:.2f} ms a step, "
          f"{net[args.constrained] / net[0] - 1:+.1%}.")
    print("\nThe same parts in the engine thread's CPU time, ms a step (what a busier host adds to the wall"
          " figures above stays out):")
    print("| constrained | " + " | ".join(PART_NAMES.values()) + " | total |")
    print("| --- " * (len(PART_NAMES) + 2) + "|")
    for num in (0, args.constrained):
        rs = [r for r in runs if r["constrained"] == num]
        cells = [f"{statistics.median(r['parts_cpu_ms'][k] for r in rs):.2f}" for k in PART_NAMES]
        print(f"| {num} | " + " | ".join(cells) + f" | {statistics.median(r['host_cpu_ms'] for r in rs):.2f} |")


if __name__ == "__main__":
    main()
