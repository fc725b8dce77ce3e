"""Prefill/decode disaggregation on one GPU against one server with chunked prefill.

    python3 -m minillm.benchmarks.pd_disagg                        # H200: Qwen3-0.6B shape, random weights
    python3 -m minillm.benchmarks.pd_disagg --small --device cpu   # a smoke run of the same on the CPU

Everything runs as real processes on loopback: a prefill server (`minillm serve --kv-transfer-config
'{"kv_role": "kv_producer", ...}'`), a decode server (kv_consumer) and `minillm router`; on the GPU
both servers share the one device and the KV moves by CUDA IPC (kv_buffer_device cuda).

1. Equality (fp32): greedy requests through the router against the prefill server answering them
   itself (a single server); every text must match, and the decode server must have computed one
   prompt token per request and loaded the rest.
2. The long-prompt mixed workload (bf16): --users streaming users (a prompt of --user-prompt
   tokens, --user-output tokens out, the next request as soon as one ends) while a --long-prompt
   request arrives every --long-every seconds, for --duration seconds; through the router, then
   against one server with chunked prefill (--single-budget tokens a step). TTFT and ITL p50/p99
   of each class side by side, the KV transfer rate (bytes over copy time, the decode server's
   stats) and the transfer's share of TTFT (the decode server's per-request claim + copy times,
   passed on by the router, against the client's TTFT).

The two servers time-share the GPU's SMs: a prefill on the prefill server slows the decode
server's steps as it would slow a single server's, so this shows the protocol's cost, not what
two GPUs would give.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

import minillm
from minillm.benchmarks.cli_args import (MAX_REQUESTS, MAX_SECONDS, MAX_TOKENS, BenchError, BenchParser,
                                         check_bounds, check_output_file, check_seed_option,
                                         run_main)
from minillm.benchmarks.workload import QWEN3_0_6B, weight_bytes, write_random_model_dir
from minillm.config import available_host_bytes
from minillm.engine_stats import human_bytes

MODEL = "bench"
KV_HEADER = "x-minillm-kv-transfer"
STARTUP_TIMEOUT_S = 600.0
# A tiny Qwen3-shaped model for --small (the CPU runs it in seconds; head_dim 64, as the GPU's
# fastest attention kernels take it).
TINY = {**QWEN3_0_6B, "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096,
        "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}
# The options only one phase reads.
PHASE_OPTIONS = {"equality": ("num_equality", "equality_prompt", "equality_output", "equality_dtype"),
                 "mixed": ("dtype", "users", "user_prompt", "user_output", "long_prompt", "long_output", "long_every",
                           "duration", "single_blocks")}
# The servers' --dtype values, and those the CPU backend runs.
DTYPES = ("auto", "float32", "float16", "bfloat16", "float", "half")
CPU_DTYPES = ("auto", "float32", "float")
# --small: the same phases at sizes the CPU gets through in a minute or two.
SMALL = {"num_equality": 8, "equality_prompt": 48, "equality_output": 12, "users": 4, "user_prompt": 48,
         "user_output": 24, "long_prompt": 600, "long_output": 8, "long_every": 2.0, "duration": 8.0,
         "prefill_blocks": 1024, "decode_blocks": 1024, "single_blocks": 1024, "max_model_len": 1024,
         "single_budget": 128, "prefill_budget": 2048, "max_num_seqs": 16}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = BenchParser("minillm bench pd_disagg", __doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="Backend of both servers.")
    p.add_argument("--model", default=None, help="A model directory (default: random weights of the Qwen3-0.6B "
                   "shape, or of a tiny Qwen3 with --small).")
    p.add_argument("--small", action="store_true", help="Small sizes for a smoke run (with --device cpu).")
    p.add_argument("--phases", default="equality,mixed", help="Which phases: equality, mixed or both.")
    p.add_argument("--num-equality", type=int, default=32, help="Greedy requests of the equality check.")
    p.add_argument("--equality-prompt", type=int, default=256, help="Tokens per equality prompt.")
    p.add_argument("--equality-output", type=int, default=32, help="Tokens each equality request generates.")
    p.add_argument("--equality-dtype", default=None, choices=DTYPES,
                   help="dtype of the equality check's servers (default: float32).")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="dtype of the mixed workload's servers (default: bfloat16; float32 with --device cpu).")
    p.add_argument("--users", type=int, default=32, help="Streaming users of the mixed workload.")
    p.add_argument("--user-prompt", type=int, default=512, help="Tokens per user prompt.")
    p.add_argument("--user-output", type=int, default=256, help="Tokens each user request generates.")
    p.add_argument("--long-prompt", type=int, default=16000, help="Tokens per long prompt.")
    p.add_argument("--long-output", type=int, default=64, help="Tokens each long request generates.")
    p.add_argument("--long-every", type=float, default=2.0, help="Seconds between long prompts.")
    p.add_argument("--duration", type=float, default=40.0, help="Seconds of the mixed workload per setup.")
    p.add_argument("--prefill-blocks", type=int, default=4096, help="KV blocks of the prefill server.")
    p.add_argument("--decode-blocks", type=int, default=8192, help="KV blocks of the decode server.")
    p.add_argument("--single-blocks", type=int, default=8192, help="KV blocks of the single server.")
    p.add_argument("--max-model-len", type=int, default=17408, help="Longest prompt + output.")
    p.add_argument("--max-num-seqs", type=int, default=128, help="Most sequences a step (decode and single).")
    p.add_argument("--prefill-budget", type=int, default=16384, help="Token budget of the prefill server's steps.")
    p.add_argument("--single-budget", type=int, default=2048,
                   help="Token budget of the decode server's steps and the single server's (its chunked "
                        "prefill).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the prompts (vLLM's: an integer in [0, 2**32 - 1]).")
    p.add_argument("--log-dir", default=None, help="Where the servers' logs go (default: a temporary directory).")
    p.add_argument("--result-file", default=None, help="Write the figures as JSON here.")
    args = p.parse_args(argv)
    given = {a.dest for a in p._actions if a.dest != "help" and getattr(args, a.dest) != a.default}
    if args.small:
        defaults = {a.dest: a.default for a in p._actions}
        for key, value in SMALL.items():
            if getattr(args, key) == defaults[key]:
                setattr(args, key, value)
    if not args.long_every > 0 or not args.duration > 0:
        p.error(f"--long-every and --duration must be > 0 seconds, got {args.long_every} and {args.duration}")
    check_bounds(p.prog, args, option_bounds())
    check_seed_option(p, args.seed)
    for name, flag, gpu_default in (("equality_dtype", "--equality-dtype", "float32"), ("dtype", "--dtype", "bfloat16")):
        value = getattr(args, name)
        if args.device == "cpu" and value not in (None, *CPU_DTYPES):
            p.error(f"{flag} {value}: the CPU's servers run float32 (leave {flag} out, or run with --device cuda)")
        setattr(args, name, value or (gpu_default if args.device == "cuda" else "float32"))
    args.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    if not args.phases or set(args.phases) - {"equality", "mixed"}:
        p.error("--phases takes equality, mixed or both, comma-separated")
    for phase, names in PHASE_OPTIONS.items():
        unread = [n for n in names if n in given] if phase not in args.phases else []
        if unread:
            flags = ["--" + n.replace("_", "-") for n in unread]
            named = flags[0] if len(flags) == 1 else f"{', '.join(flags[:-1])} and {flags[-1]}"
            p.error(f"{named} only shape{'s' * (len(flags) == 1)} the {phase} phase, which --phases "
                    f"{','.join(args.phases)} leaves out")
    return args


def option_bounds() -> dict[str, tuple]:
    """Each numeric option's bounds: past them the servers are started only to fail, or the run waits
    for nothing."""
    from minillm.config import MAX_NUM_SEQS
    counts = {name: (1, MAX_REQUESTS) for name in ("num_equality", "users")}
    tokens = {name: (1, MAX_TOKENS) for name in ("equality_prompt", "equality_output", "user_prompt", "user_output",
                                                 "long_prompt", "long_output", "max_model_len", "prefill_budget",
                                                 "single_budget")}
    blocks = {name: (1, MAX_TOKENS) for name in ("prefill_blocks", "decode_blocks", "single_blocks")}
    seconds = {name: (None, MAX_SECONDS, "seconds") for name in ("long_every", "duration")}
    return counts | tokens | blocks | seconds | {"max_num_seqs": (1, MAX_NUM_SEQS)}


def check_cpu_memory(args: argparse.Namespace, config: dict) -> None:
    """On the CPU, a BenchError naming the block options when the servers that run at once (prefill and
    decode, then the single server) would not fit the memory there is, with the blocks that do; before
    any server starts (each would find it out alone, after the others had loaded)."""
    available = available_host_bytes()
    if args.device != "cpu" or available is None:
        return
    config = {"head_dim": config["hidden_size"] // config["num_attention_heads"],
              "num_key_value_heads": config["num_attention_heads"], **config}
    # the CPU servers run float32 (4 bytes an element): K and V of every layer, block_size 16 tokens
    per_block = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 16 * 4
    weights = weight_bytes(config, 4)
    together = [(("--prefill-blocks", args.prefill_blocks), ("--decode-blocks", args.decode_blocks))]
    if "mixed" in args.phases:
        together.append((("--single-blocks", args.single_blocks),))
    for servers in together:
        blocks = sum(count for _, count in servers)
        need = blocks * per_block + len(servers) * weights
        if need > available:
            named = " and ".join(f"{option} {count}" for option, count in servers)
            fit = max(0, (available - len(servers) * weights) // per_block)
            raise BenchError(
                f"{named} need{'s' if len(servers) == 1 else ''} {need / 2**30:.1f} GiB on the CPU "
                f"({human_bytes(per_block)} a block, {human_bytes(weights)} of weights a server), more than the "
                f"{available / 2**30:.1f} GiB of memory available: {fit} blocks fit"
                f"{' between them' if len(servers) > 1 else ''}; lower "
                f"{' or '.join(option for option, _ in servers)}, or run with --small")


def log(message: str) -> None:
    """A progress line with the time (a long run shows where it is)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------

def free_port() -> int:
    """A port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A `minillm` command on a free port, its output in a log file."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        # The same minillm as this process's, installed or a checkout.
        root = str(Path(minillm.__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "minillm.cli", *args, "--port", str(self.port)],
                                         stdout=out, stderr=subprocess.STDOUT, env=env)

    def wait_up(self, timeout: float = STARTUP_TIMEOUT_S) -> "Process":
        """Wait until /health answers 200; BenchError with the log's tail if it exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.name} exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise BenchError(f"{self.name} did not come up in {timeout:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        """The end of its log."""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """Terminate it and wait (its engine core exits with it)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def server_args(args: argparse.Namespace, model: str, dummy: bool, dtype: str, blocks: int, budget: int,
                max_num_seqs: int, role: str | None = None, eager: bool = False) -> list[str]:
    """`minillm serve` arguments of one server."""
    out = ["serve", model, "--device", args.device, "--dtype", dtype, "--served-model-name", MODEL,
           "--num-kv-blocks", str(blocks), "--max-model-len", str(args.max_model_len),
           "--max-num-batched-tokens", str(budget), "--max-num-seqs", str(max_num_seqs)]
    if dummy:
        out += ["--load-format", "dummy"]
    if eager:
        out += ["--enforce-eager"]
    if role is not None:
        buffer = "cuda" if args.device == "cuda" else "cpu"
        out += ["--kv-transfer-config", json.dumps({"kv_connector": "PDConnector", "kv_role": role,
                                                    "kv_buffer_device": buffer})]
    return out


def start_disaggregated(args, model: str, dummy: bool, dtype: str, log_dir: Path) -> list[Process]:
    """A prefill server, a decode server and the router, all up; [prefill, decode, router]."""
    # The prefill server never decodes: no decode graphs to capture.
    prefill = Process(f"prefill-{dtype}", server_args(args, model, dummy, dtype, args.prefill_blocks,
                                                      args.prefill_budget, 16, "kv_producer", eager=True), log_dir)
    decode = Process(f"decode-{dtype}", server_args(args, model, dummy, dtype, args.decode_blocks,
                                                    args.single_budget, args.max_num_seqs, "kv_consumer"), log_dir)
    running = [prefill, decode]
    try:
        prefill.wait_up()
        decode.wait_up()
        router = Process(f"router-{dtype}", ["router", "--prefill", prefill.url, "--decode", decode.url], log_dir)
        running.append(router)
        router.wait_up()
    except BaseException:
        for p in running:
            p.stop()
        raise
    return running


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------

@dataclass
class Result:
    """One streamed request as the client saw it."""

    cls: str
    ok: bool
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    transfer_ms: float | None = None      # claim + copy, from the decode server's header
    error: str = ""


async def stream(client: httpx.AsyncClient, url: str, cls: str, prompt: list[int], max_tokens: int) -> Result:
    """Stream one completion; time its first token and the gaps between chunks."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    result = Result(cls, ok=False)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            if KV_HEADER in response.headers:
                kv = json.loads(response.headers[KV_HEADER])
                result.transfer_ms = kv.get("claim_ms", 0.0) + kv.get("copy_ms", 0.0)
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                if any(c.get("text") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if result.output_tokens == 0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    result.output_tokens += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.ok = result.output_tokens > 0
    return result


def random_prompts(rng: random.Random, count: int, length: int, vocab: int) -> list[list[int]]:
    """Token ids away from the special ones, no two prompts sharing a prefix block."""
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(count)]


async def complete_texts(url: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """Greedy completions of every prompt at once (non-streaming); their texts in order."""
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(prompt):
            r = await client.post(f"{url}/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
            if r.status_code != 200:
                raise BenchError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
            return r.json()["choices"][0]["text"]
        return await asyncio.gather(*map(one, prompts))


def stats_of(url: str) -> dict:
    """GET /v1/stats."""
    return httpx.get(f"{url}/v1/stats", timeout=30).json()


# ---------------------------------------------------------------------------------------------
# Phases
# ---------------------------------------------------------------------------------------------

def equality_phase(args, model: str, dummy: bool, vocab: int, log_dir: Path) -> dict:
    """Greedy requests through the router against the prefill server alone; same texts?"""
    dtype = args.equality_dtype if args.device == "cuda" else "float32"
    log(f"equality: starting prefill, decode and router ({dtype})")
    prefill, decode, router = start_disaggregated(args, model, dummy, dtype, log_dir)
    try:
        prompts = random_prompts(random.Random(args.seed), args.num_equality, args.equality_prompt, vocab)
        before = stats_of(decode.url)
        log(f"equality: {len(prompts)} greedy requests through the router")
        routed = asyncio.run(complete_texts(router.url, prompts, args.equality_output))
        after = stats_of(decode.url)
        log("equality: the same requests on the prefill server alone")
        alone = asyncio.run(complete_texts(prefill.url, prompts, args.equality_output))
    finally:
        for p in (router, decode, prefill):
            p.stop()
    matches = sum(a == b for a, b in zip(routed, alone))
    return {"dtype": dtype, "num_requests": len(prompts), "num_equal": matches,
            "transferred_tokens": after["kv_transfer_tokens"] - before["kv_transfer_tokens"],
            "expected_transferred_tokens": len(prompts) * (args.equality_prompt - 1),
            "decode_prompt_tokens_computed": after["prefill_tokens_total"] - before["prefill_tokens_total"],
            "mismatched": [i for i, (a, b) in enumerate(zip(routed, alone)) if a != b][:8]}


async def mixed_workload(url: str, args, vocab: int) -> list[Result]:
    """Users in closed loops and long prompts at a fixed period, for args.duration seconds."""
    rng = random.Random(args.seed + 1)
    results: list[Result] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        # Untimed first requests of each class: first-call costs are not latency.
        await stream(client, url, "warmup", random_prompts(rng, 1, args.user_prompt, vocab)[0], 4)
        await stream(client, url, "warmup", random_prompts(rng, 1, args.long_prompt, vocab)[0], 4)
        end = time.monotonic() + args.duration

        async def user() -> None:
            while time.monotonic() < end:
                prompt = random_prompts(rng, 1, args.user_prompt, vocab)[0]
                results.append(await stream(client, url, "user", prompt, args.user_output))

        async def longs() -> None:
            pending = []
            while time.monotonic() < end:
                prompt = random_prompts(rng, 1, args.long_prompt, vocab)[0]
                pending.append(asyncio.create_task(stream(client, url, "long", prompt, args.long_output)))
                await asyncio.sleep(args.long_every)
            results.extend(await asyncio.gather(*pending))

        await asyncio.gather(longs(), *(user() for _ in range(args.users)))
    return results


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (linear), or None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(results: list[Result], duration: float) -> dict:
    """Per class: requests, failures, TTFT and ITL p50/p99 (ms), output tok/s, mean transfer (ms)."""
    out = {}
    for cls in ("user", "long"):
        rs = [r for r in results if r.cls == cls]
        ok = [r for r in rs if r.ok]
        ttft = [r.ttft_s * 1e3 for r in ok]
        itl = [x * 1e3 for r in ok for x in r.itl_s]
        transfer = [r.transfer_ms for r in ok if r.transfer_ms is not None]
        out[cls] = {"requests": len(rs), "failed": len(rs) - len(ok),
                    "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
                    "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99),
                    "output_tok_s": sum(r.output_tokens for r in ok) / duration,
                    "transfer_mean_ms": sum(transfer) / len(transfer) if transfer else None,
                    "ttft_mean_ms": sum(ttft) / len(ttft) if ttft else None,
                    "errors": sorted({r.error for r in rs if not r.ok})[:3]}
    return out


def mixed_phase(args, model: str, dummy: bool, vocab: int, log_dir: Path) -> dict:
    """The mixed workload through the router, then against one server with chunked prefill."""
    dtype = args.dtype if args.device == "cuda" else "float32"
    log(f"mixed: starting prefill, decode and router ({dtype})")
    prefill, decode, router = start_disaggregated(args, model, dummy, dtype, log_dir)
    try:
        log(f"mixed: {args.users} users + a {args.long_prompt}-token prompt every {args.long_every:g} s for "
            f"{args.duration:g} s, through the router")
        before = stats_of(decode.url)
        routed = asyncio.run(mixed_workload(router.url, args, vocab))
        after = stats_of(decode.url)
        router_stats = httpx.get(f"{router.url}/v1/stats", timeout=30).json()
    finally:
        for p in (router, decode, prefill):
            p.stop()
    log(f"mixed: starting one server with chunked prefill ({args.single_budget} tokens a step)")
    single = Process(f"single-{dtype}", server_args(args, model, dummy, dtype, args.single_blocks,
                                                    args.single_budget, args.max_num_seqs), log_dir)
    try:
        single.wait_up()
        log("mixed: the same workload against the single server")
        alone = asyncio.run(mixed_workload(single.url, args, vocab))
    finally:
        single.stop()
    moved = after["kv_transfer_bytes"] - before["kv_transfer_bytes"]
    seconds = after["kv_transfer_seconds"] - before["kv_transfer_seconds"]
    return {"dtype": dtype, "disaggregated": summarize(routed, args.duration),
            "single": summarize(alone, args.duration),
            "kv_transfer": {"requests": after["kv_transfer_num_requests"] - before["kv_transfer_num_requests"],
                            "tokens": after["kv_transfer_tokens"] - before["kv_transfer_tokens"],
                            "bytes": moved, "copy_seconds": seconds,
                            "bytes_per_s": moved / seconds if seconds > 0 else None,
                            "stale_claims": after["kv_transfer_stale_claims"] - before["kv_transfer_stale_claims"]},
            "router": {k: router_stats[k] for k in ("prefill_ms", "kv_transfer_ms", "kv_copy_ms",
                                                    "decode_first_token_ms", "ttft_ms")}}


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def format_report(args, report: dict) -> str:
    """The phases' figures as markdown tables."""
    lines = []
    eq = report.get("equality")
    if eq:
        lines += [f"Equality ({eq['dtype']}, {eq['num_requests']} greedy requests of {args.equality_prompt} tokens, "
                  f"{args.equality_output} out): {eq['num_equal']}/{eq['num_requests']} texts equal to the single "
                  f"server's; the decode server loaded {eq['transferred_tokens']} prompt tokens (expected "
                  f"{eq['expected_transferred_tokens']}) and computed {eq['decode_prompt_tokens_computed']}"
                  + (f"; mismatched requests {eq['mismatched']}" if eq["mismatched"] else ""), ""]
    mixed = report.get("mixed")
    if mixed:
        d, s = mixed["disaggregated"], mixed["single"]
        lines += [f"Mixed workload ({mixed['dtype']}, {args.duration:g} s each): {args.users} users "
                  f"({args.user_prompt} in / {args.user_output} out) + a {args.long_prompt}-token prompt "
                  f"({args.long_output} out) every {args.long_every:g} s",
                  "| class | figure | prefill + decode servers, router | one server, chunked prefill "
                  f"({args.single_budget}) |", "| --- | --- | --- | --- |"]
        for cls, name in (("user", "users"), ("long", "long prompts")):
            for label, key in (("TTFT p50 / p99 (ms)", "ttft"), ("ITL p50 / p99 (ms)", "itl")):
                lines.append(f"| {name} | {label} | {_ms(d[cls][key + '_p50_ms'])} / {_ms(d[cls][key + '_p99_ms'])} "
                             f"| {_ms(s[cls][key + '_p50_ms'])} / {_ms(s[cls][key + '_p99_ms'])} |")
            lines.append(f"| {name} | requests (failed), output tok/s | {d[cls]['requests']} ({d[cls]['failed']}), "
                         f"{d[cls]['output_tok_s']:,.0f} | {s[cls]['requests']} ({s[cls]['failed']}), "
                         f"{s[cls]['output_tok_s']:,.0f} |")
        kv = mixed["kv_transfer"]
        rate = f"{human_bytes(kv['bytes_per_s'])}/s" if kv["bytes_per_s"] else "-"
        lines += ["", f"KV transfer: {kv['requests']} requests, {kv['tokens']:,} prompt tokens, "
                  f"{human_bytes(kv['bytes'])} copied in {kv['copy_seconds'] * 1e3:,.1f} ms of copy time: {rate} "
                  f"({kv['stale_claims']} stale claims)"]
        for cls, name in (("user", "users"), ("long", "long prompts")):
            t, f = d[cls]["transfer_mean_ms"], d[cls]["ttft_mean_ms"]
            if t is not None and f:
                lines.append(f"- {name}: transfer (claim + copy) {t:.2f} ms mean = {100 * t / f:.2f} % of the "
                             f"mean TTFT {f:,.1f} ms")
        r = mixed["router"]
        lines.append(f"- router, mean ms: prefill {_ms(r['prefill_ms']['mean'])}, kv transfer "
                     f"{_ms(r['kv_transfer_ms']['mean'])}, decode first token {_ms(r['decode_first_token_ms']['mean'])}")
        for setup, figures in (("disaggregated", d), ("single", s)):
            for cls in ("user", "long"):
                for error in figures[cls]["errors"]:
                    lines.append(f"error ({setup}, {cls}): {error}")
    return "\n".join(lines)


def make_log_dir(path: str) -> None:
    """Create --log-dir (and its parents); a BenchError naming the option when it cannot be."""
    if Path(path).exists() and not Path(path).is_dir():
        raise BenchError(f"--log-dir {path} is a file, not a directory")
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as exc:       # a file on its path, or no permission
        raise BenchError(f"--log-dir {path}: cannot create it: {exc.strerror or exc}") from None


def model_config(model: str) -> dict:
    """The config.json of the model directory MODEL; a BenchError naming --model when it has none to read."""
    if not Path(model).is_dir():
        what = "a file, not a model directory" if Path(model).exists() else "no such directory"
        raise BenchError(f"--model {model}: {what}")
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BenchError(f"--model {model}: no config.json there (give a model directory)") from None
    except (OSError, ValueError) as exc:
        raise BenchError(f"--model {model}: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not isinstance(config, dict):
        raise BenchError(f"--model {model}: {path} is not a JSON object")
    return config


def main(argv: list[str] | None = None) -> int:
    """Run the phases; print the report; 0 when the texts matched and nothing failed."""
    args = parse_args(argv)
    # Before the servers start: a bad path found after the run lost minutes of figures.
    check_output_file(args.result_file, "--result-file")
    if args.log_dir is not None:
        make_log_dir(args.log_dir)
    if args.device == "cuda":
        try:
            import cupy
            if cupy.cuda.runtime.getDeviceCount() < 1:
                raise BenchError("no CUDA device; run with --device cpu (and --small)")
        except ImportError:
            raise BenchError("CuPy is not installed; run with --device cpu (and --small)") from None
    with tempfile.TemporaryDirectory(prefix="minillm-pd-") as tmp:
        log_dir = Path(args.log_dir or tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        dummy = args.model is None
        model = args.model or str(write_random_model_dir(Path(tmp) / "model", TINY if args.small else QWEN3_0_6B))
        model_json = model_config(model)
        if model_json.get("max_position_embeddings", args.max_model_len) < args.max_model_len:
            raise BenchError(f"--max-model-len {args.max_model_len} is past --model {model}'s max_position_embeddings "
                             f"{model_json['max_position_embeddings']}; lower it")
        check_cpu_memory(args, model_json)
        vocab = min(model_json["vocab_size"], 10000)
        report: dict = {"args": vars(args)}
        if "equality" in args.phases:
            report["equality"] = equality_phase(args, model, dummy, vocab, log_dir)
            print(format_report(args, {"equality": report["equality"]}), flush=True)
        if "mixed" in args.phases:
            report["mixed"] = mixed_phase(args, model, dummy, vocab, log_dir)
            print(format_report(args, {"mixed": report["mixed"]}), flush=True)
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(report, indent=2, default=str))
    eq, mixed = report.get("equality"), report.get("mixed")
    failed = eq is not None and eq["num_equal"] != eq["num_requests"]
    if mixed is not None:
        failed |= any(mixed[setup][cls]["failed"] for setup in ("disaggregated", "single") for cls in ("user", "long"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_main(main, "minillm bench pd_disagg"))
