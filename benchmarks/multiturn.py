"""Multi-turn chat with and without the host KV tier: TTFT, throughput and the copy rate against
the pinned host<->device copy ceiling, all measured in one run.

    python -m minillm.benchmarks.multiturn                          # GPU: random Qwen3-0.6B-shaped weights, bf16
    python -m minillm.benchmarks.multiturn --small --device cpu     # a tiny random model on the CPU

Each conversation's turn is its whole history plus a new user message; a turn's reply becomes part
of the history. Conversations take turns round robin (a conversation comes back after every other
one has had its turn), `--concurrency` turns at a time, so a history has long left the device's
prefix cache when it returns: the device pool holds a quarter of the conversations at their
longest (`--device-share`), the host tier all of them unless told otherwise.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minillm.benchmarks.workload import QWEN3_0_6B, write_random_model_dir
from minillm.engine_stats import human_bytes

# A tiny Qwen3-shaped model for --small (the CPU runs it in seconds).
TINY = {**QWEN3_0_6B, "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096,
        "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}


@dataclass
class Workload:
    """Conversations of num_turns turns: a first prompt, then user messages; replies of output_len."""

    first_prompts: list[list[int]]
    user_messages: list[list[list[int]]]     # [conversation][turn - 1]
    output_len: int

    @property
    def num_turns(self) -> int:
        """Turns per conversation."""
        return len(self.user_messages[0]) + 1

    @property
    def longest_history(self) -> int:
        """Tokens of a conversation after its last reply."""
        return len(self.first_prompts[0]) + sum(map(len, self.user_messages[0])) + self.num_turns * self.output_len


def make_workload(num_convs: int, num_turns: int, first_len: int, user_len: int, output_len: int,
                  vocab: int, seed: int = 0) -> Workload:
    """Random token ids away from the special ones, the same for every run with the same seed."""
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(10, vocab) for _ in range(n)]  # noqa: E731
    return Workload([draw(first_len) for _ in range(num_convs)],
                    [[draw(user_len) for _ in range(num_turns - 1)] for _ in range(num_convs)], output_len)


def run_chat(llm, w: Workload, concurrency: int) -> dict:
    """Drive the engine through every turn of every conversation, round robin; returns the figures."""
    from minillm import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=w.output_len, ignore_eos=True)
    engine.add_request("warm-up", [11, 12, 13], SamplingParams(max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    before = engine.stats(cells=1)
    num_convs = len(w.first_prompts)
    history: list[list[int]] = [[] for _ in range(num_convs)]
    turn = [0] * num_convs
    ready, active = deque(range(num_convs)), {}
    ttft, replies, prompt_tokens = [], {}, 0
    started = time.perf_counter()
    while ready or active:
        while ready and len(active) < concurrency:
            c = ready.popleft()
            prompt = history[c] + (w.first_prompts[c] if turn[c] == 0 else w.user_messages[c][turn[c] - 1])
            rid = f"c{c}-t{turn[c]}"
            engine.add_request(rid, prompt, params)
            active[rid] = (c, prompt)
            prompt_tokens += len(prompt)
        for out in engine.step():
            if not out.finished:
                continue
            c, prompt = active.pop(out.request_id)
            ttft.append(out.metrics.ttft)
            replies[out.request_id] = out.outputs[0].token_ids
            history[c] = prompt + out.outputs[0].token_ids
            turn[c] += 1
            if turn[c] < w.num_turns:
                ready.append(c)
    seconds = time.perf_counter() - started
    s = engine.stats(cells=1)
    figures = {
        "seconds": seconds, "requests": len(ttft), "prompt_tokens": prompt_tokens,
        "output_tokens": len(ttft) * w.output_len,
        "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
        "prefill_tokens_computed": s.prefill_tokens_total - before.prefill_tokens_total,
        "device_hit_tokens": s.prefix_cache_hits - before.prefix_cache_hits,
        "host_hit_tokens": s.kv_offload_hits - before.kv_offload_hits,
        "preemptions": s.num_preemptions - before.num_preemptions,
    }
    worker = engine.runner.kv_connector
    if worker is not None:
        engine.device.synchronize()
        figures |= {f"copy_{k}": v for k, v in worker.copy_stats().items()}
        figures["host_blocks"] = s.kv_offload_num_blocks
    return figures | {"replies": replies}


def copy_ceilings(device: str, nbytes: int = 1 << 30, repeats: int = 5) -> tuple[float, float]:
    """(device->host, host->device) bytes/s of one large contiguous copy to and from pinned host
    memory (on the CPU: a host memcpy both ways), after a warm-up."""
    if device != "cuda":
        nbytes = min(nbytes, 256 << 20)
        a, b = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
        np.copyto(b, a)
        t0 = time.perf_counter()
        for _ in range(repeats):
            np.copyto(b, a)
        rate = nbytes * repeats / (time.perf_counter() - t0)
        return rate, rate
    import cupy as cp
    import cupyx

    rt = cp.cuda.runtime
    host = cupyx.empty_pinned(nbytes, dtype=np.uint8)
    dev = cp.empty(nbytes, dtype=cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    rates = []
    for kind, dst, src in ((rt.memcpyDeviceToHost, host.ctypes.data, dev.data.ptr),
                           (rt.memcpyHostToDevice, dev.data.ptr, host.ctypes.data)):
        rt.memcpyAsync(dst, src, nbytes, kind, stream.ptr)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(repeats):
            rt.memcpyAsync(dst, src, nbytes, kind, stream.ptr)
        stop.record(stream)
        stop.synchronize()
        rates.append(nbytes * repeats / (cp.cuda.get_elapsed_time(start, stop) / 1e3))
    del host, dev
    cp.get_default_memory_pool().free_all_blocks()
    cp.get_default_pinned_memory_pool().free_all_blocks()
    return rates[0], rates[1]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m minillm.benchmarks.multiturn", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: random weights, Qwen3-0.6B shape or tiny with --small)")
    p.add_argument("--small", action="store_true",
                   help="a tiny model and 16 conversations x 6 turns with histories to 432 tokens")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--num-conversations", type=int, default=None, help="default 128 (16 with --small)")
    p.add_argument("--num-turns", type=int, default=6)
    p.add_argument("--first-prompt-len", type=int, default=None, help="default 1408 (96 with --small)")
    p.add_argument("--user-len", type=int, default=None, help="default 384 (48 with --small)")
    p.add_argument("--output-len", type=int, default=None, help="default 128 (16 with --small)")
    p.add_argument("--concurrency", type=int, default=None, help="turns in flight (default 16; 4 with --small)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device-share", type=float, default=0.25,
                   help="share of the conversations at their longest that the device pool holds")
    p.add_argument("--kv-offload-gib", type=float, default=None,
                   help="host tier size (default: every conversation at its longest, plus 5%%)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the figures to this file")
    args = p.parse_args(argv)
    small = {"num_conversations": 16, "first_prompt_len": 96, "user_len": 48, "output_len": 16, "concurrency": 4}
    full = {"num_conversations": 128, "first_prompt_len": 1408, "user_len": 384, "output_len": 128, "concurrency": 16}
    for name, value in (small if args.small else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def engine_kwargs(args, w: Workload, model_dir: str, dummy: bool) -> dict:
    """Engine settings shared by both runs; the device pool holds device_share of the conversations."""
    blocks_per_conv = -(-w.longest_history // args.block_size)
    num_blocks = int(np.ceil(args.device_share * len(w.first_prompts))) * blocks_per_conv
    return dict(model=model_dir, device=args.device, dtype=args.dtype, load_format="dummy" if dummy else "auto",
                block_size=args.block_size, num_kv_blocks=num_blocks, max_model_len=w.longest_history,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                enforce_eager=args.enforce_eager, seed=args.seed)


def kv_bytes_per_token(config: dict, dtype: str) -> int:
    """K and V of one token across all layers."""
    itemsize = 4 if dtype == "float32" else 2
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * itemsize


def one_run(kwargs: dict, w: Workload, concurrency: int, kv_offload_gib: float) -> dict:
    """Build an engine, run the chat, give the device back."""
    from minillm.llm import LLM

    model = kwargs.pop("model")
    llm = LLM(model, kv_offload_gib=kv_offload_gib, **kwargs)
    kwargs["model"] = model
    try:
        return run_chat(llm, w, concurrency)
    finally:
        llm.engine.shutdown()


def report(name: str, f: dict, w: Workload) -> str:
    """One line of a run's figures."""
    hit = (f["device_hit_tokens"] + f["host_hit_tokens"]) / max(f["prompt_tokens"], 1)
    return (f"{name:<22} TTFT p50 {f['ttft_p50_s'] * 1e3:8.1f} ms  p99 {f['ttft_p99_s'] * 1e3:8.1f} ms  "
            f"{f['requests'] / f['seconds']:7.2f} req/s  {f['output_tokens'] / f['seconds']:8.0f} output tok/s  "
            f"prefill computed {f['prefill_tokens_computed']:>8}  prompt tokens from cache {hit:5.1%} "
            f"(host {f['host_hit_tokens']})  preemptions {f['preemptions']}")


def main(argv: list[str] | None = None) -> int:
    """Run both engines on the same conversations and print the figures beside the copy ceiling."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model_dir, dummy = args.model, False
        else:
            shape = TINY if args.small else QWEN3_0_6B
            model_dir, dummy = str(write_random_model_dir(Path(tmp) / "model", shape)), True
        config = json.loads((Path(model_dir) / "config.json").read_text())
        w = make_workload(args.num_conversations, args.num_turns, args.first_prompt_len, args.user_len,
                          args.output_len, min(config["vocab_size"], 10000), args.seed)
        per_token = kv_bytes_per_token(config, args.dtype)
        all_bytes = len(w.first_prompts) * w.longest_history * per_token
        gib = args.kv_offload_gib if args.kv_offload_gib is not None else 1.05 * all_bytes / 2**30
        kwargs = engine_kwargs(args, w, model_dir, dummy)
        d2h_ceiling, h2d_ceiling = copy_ceilings(args.device)
        plain = one_run(kwargs, w, args.concurrency, 0)
        tiered = one_run(kwargs, w, args.concurrency, gib)
    print(f"workload: {len(w.first_prompts)} conversations x {w.num_turns} turns, histories to {w.longest_history} "
          f"tokens, {args.concurrency} turns at a time; device pool {kwargs['num_kv_blocks']} blocks x "
          f"{args.block_size} ({args.device_share:.0%} of the conversations at their longest, "
          f"{human_bytes(kwargs['num_kv_blocks'] * args.block_size * per_token)}); host tier "
          f"{human_bytes(gib * 2**30)} ({human_bytes(all_bytes)} holds them all)")
    print(report("no host tier", plain, w))
    print(report("host tier", tiered, w))
    same = sum(tiered["replies"].get(k) == v for k, v in plain["replies"].items())
    print(f"speed-up with the tier: TTFT p50 {plain['ttft_p50_s'] / tiered['ttft_p50_s']:.2f}x, "
          f"p99 {plain['ttft_p99_s'] / tiered['ttft_p99_s']:.2f}x, throughput "
          f"{plain['seconds'] / tiered['seconds']:.2f}x; identical greedy replies {same} of {len(plain['replies'])}")
    rates = {}
    for way, ceiling in (("to_host", d2h_ceiling), ("to_device", h2d_ceiling)):
        moved, busy = tiered[f"copy_bytes_{way}"], tiered[f"copy_seconds_{way}"]
        rates[way] = moved / busy if busy else 0.0
        print(f"copies {way.replace('_', ' '):<10} {human_bytes(moved):>10} in {busy:7.3f} s of copy-stream time: "
              f"{rates[way] / 1e9:6.2f} GB/s against a ceiling of {ceiling / 1e9:6.2f} GB/s "
              f"({'pinned D2H' if way == 'to_host' else 'pinned H2D'} measured now"
              f"{'' if args.device == 'cuda' else '; a host memcpy on the CPU'}) -> {rates[way] / ceiling:.0%}; "
              f"{human_bytes(moved / tiered['seconds'])}/s averaged over the run")
    if args.json:
        drop = lambda f: {k: v for k, v in f.items() if k != "replies"}  # noqa: E731
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "kv_offload_gib": gib, "num_kv_blocks": kwargs["num_kv_blocks"],
            "no_tier": drop(plain), "tier": drop(tiered), "identical_replies": same,
            "ceiling_d2h_Bps": d2h_ceiling, "ceiling_h2d_Bps": h2d_ceiling, "copy_rate_Bps": rates}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
