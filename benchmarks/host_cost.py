"""Host CPU per streamed token, per process: the API server(s), the engine core, the benchmark client.

A GPU hides host costs until the host is the limit; this harness shows them on any machine. It
writes a tiny random model (so the CPU core makes tokens faster than a server can stream them),
starts the real `minillm serve` on it with --load-format dummy, drives it with the real serving
benchmark, and reads each process's CPU seconds (utime + stime) around the run. Dividing by the
tokens streamed gives CPU microseconds per token: multiplied by a GPU's token rate, the CPU share
each process needs (an API server process at 36 us/token carries at most ~28k tokens/s on one
core, with nothing to spare).

    python -m benchmarks.host_cost --num-prompts 512 --output-len 128 --concurrency 256
    python -m benchmarks.host_cost --server-arg=--api-server-count --server-arg=2
    python -m benchmarks.host_cost --repeat 3 --concurrency 64 --concurrency 256

An API server's work is partly per token (detokenising) and partly per streamed event (the JSON
chunk, the socket write); a server that falls behind merges several tokens into one event, so
its cost per token falls as it gets slower. Each row therefore also gives the API servers' CPU
per streamed event, and the tokens per event, to compare runs by. The server's BLAS runs on one
thread (OPENBLAS_NUM_THREADS=1 unless set): idle BLAS workers spinning between the tiny model's
matrix products would otherwise be most of the core's figure, and a GPU has none of that cost.
With --repeat N each figure is the median of N runs (a fresh server each), with the range.

--step-ms paces the engine core as a GPU would: each step takes at least that long (the core
sleeps out the rest), so every stream gets one token an event, as on the H200, and the API
servers' cost per event is measured at that rate however fast this CPU runs the tiny model. The
server then starts from this module (the same run_server as `minillm serve`) and takes no
--server-arg but --api-server-count.

    python -m benchmarks.host_cost --step-ms 8 --concurrency 64 --repeat 3

--profile DIR also records each server process with py-spy (if installed) for a flame graph.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from minillm.benchmarks.cli_args import BenchError, BenchParser, run_main

# A Qwen3-shaped model small enough that a step of 256 sequences costs the CPU core little.
TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 2048,
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class ProcessCPU:
    """One process's CPU seconds over the run."""

    role: str
    pid: int
    cpu_s: float


@dataclass
class HostCost:
    """A run's tokens, time and each process's CPU."""

    num_tokens: int
    duration_s: float
    processes: list[ProcessCPU] = field(default_factory=list)

    num_events: int = 0         # streamed events that carried text, as the client counted them
    result: dict = field(default_factory=dict)

    def cpu_s(self, role: str) -> float:
        """CPU seconds of every process in a role, together."""
        return sum(p.cpu_s for p in self.processes if p.role == role)

    def per_token_us(self, role: str) -> float:
        """CPU microseconds per streamed token of every process in a role, together."""
        return 1e6 * self.cpu_s(role) / max(self.num_tokens, 1)

    def per_event_us(self, role: str) -> float:
        """CPU microseconds per streamed event of every process in a role, together."""
        return 1e6 * self.cpu_s(role) / max(self.num_events, 1)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a live process (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK   # fields 14 and 15 of stat(5)


def children(pid: int) -> list[int]:
    """Direct children of a process (Linux: /proc/PID/task/*/children)."""
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as f:
                out += [int(x) for x in f.read().split()]
        except FileNotFoundError:
            pass
    return out


def descendants(pid: int) -> list[int]:
    """Every process below pid."""
    found, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = BenchParser("python -m benchmarks.host_cost", __doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default=None, help="Where the tiny model is written (default: a temp dir).")
    p.add_argument("--port", type=int, default=8731, help="Port of the server under test.")
    p.add_argument("--num-prompts", type=int, default=512, help="Requests in the workload.")
    p.add_argument("--input-len", type=int, default=32, help="Prompt tokens per request.")
    p.add_argument("--output-len", type=int, default=128, help="Tokens each request streams.")
    p.add_argument("--concurrency", type=int, action="append", default=None,
                   help="Requests in flight (repeat for several levels).  [default: 256]")
    p.add_argument("--repeat", type=int, default=1, help="Runs per level; figures are their medians.")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--server-arg", action="append", default=[], help="An extra `minillm serve` argument (repeat).")
    p.add_argument("--client-arg", action="append", default=[], help="An extra benchmark client argument (repeat).")
    p.add_argument("--step-ms", type=float, default=None, help="Make each engine step take at least this long.")
    p.add_argument("--profile", default=None, help="Record each server process with py-spy into this directory.")
    p.add_argument("--result-file", default=None, help="Write the figures as JSON here.")
    return p.parse_args(argv)


@dataclass
class PacedSteps:
    """A core hook: each engine step starts at least step_s after the previous one started."""

    step_s: float

    def __call__(self, engine) -> None:
        real_step, next_start = engine.step, [0.0]

        def step():
            wait = next_start[0] - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            next_start[0] = time.perf_counter() + self.step_s
            return real_step()

        engine.step = step


def serve_paced(argv: list[str]) -> int:
    """`minillm serve` on the tiny model with PacedSteps: MODEL_DIR PORT MAX_NUM_SEQS STEP_MS API_SERVERS."""
    from minillm.config import EngineConfig
    from minillm.server.app import ServerOptions, run_server
    model_dir, port, max_num_seqs, step_ms, api_servers = argv
    config = EngineConfig(model=model_dir, device="cpu", load_format="dummy", max_num_seqs=int(max_num_seqs))
    return run_server(config, port=int(port), options=ServerOptions(api_server_count=int(api_servers)),
                      core_hook=PacedSteps(float(step_ms) / 1000))


def paced_api_servers(server_args: list[str]) -> int:
    """The API server count for a paced server (the one --server-arg it takes)."""
    if not server_args:
        return 1
    if len(server_args) == 2 and server_args[0] == "--api-server-count" and server_args[1].isdigit():
        return int(server_args[1])
    raise BenchError("with --step-ms the server takes no --server-arg but --api-server-count N")


def start_server(args: argparse.Namespace, model_dir: Path, log_path: Path) -> subprocess.Popen:
    """`minillm serve` on the tiny model (paced with --step-ms); returns once it answers."""
    cmd = [sys.executable, "-m", "minillm.cli", "serve", str(model_dir), "--load-format", "dummy",
           "--device", "cpu", "--port", str(args.port), "--max-num-seqs", str(max(args.concurrency, 1)),
           *args.server_arg]
    if args.step_ms is not None:
        cmd = [sys.executable, "-m", "benchmarks.host_cost", "serve-paced", str(model_dir), str(args.port),
               str(max(args.concurrency, 1)), str(args.step_ms), str(paced_api_servers(args.server_arg))]
    env = {**os.environ}
    env.setdefault("OPENBLAS_NUM_THREADS", "1")   # see the module docstring
    log = open(log_path, "w", encoding="utf-8")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"the server exited ({proc.returncode}): {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{args.port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise BenchError("the server did not come up within 300 s")


def server_roles(proc: subprocess.Popen, log_path: Path) -> dict[int, str]:
    """pid -> "api_server" / "engine_core" / "supervisor" for the server and every process it started."""
    log = log_path.read_text()
    core_pids = {int(x) for x in re.findall(r"engine core in process (\d+)", log)}
    several = re.search(r"API server \d+ in process", log) is not None
    roles = {proc.pid: "supervisor" if several else "api_server"}
    for pid in descendants(proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except FileNotFoundError:
            continue
        if b"resource_tracker" in cmdline:
            continue
        roles[pid] = "engine_core" if pid in core_pids else "api_server"
    return roles


def run_client(args: argparse.Namespace, result_file: Path) -> tuple[float, int]:
    """The serving benchmark as its own process: (its CPU seconds, with any processes of its own; exit status)."""
    cmd = [sys.executable, "-m", "minillm.benchmarks.serving", "--base-url", f"http://127.0.0.1:{args.port}",
           "--endpoint", args.endpoint, "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--max-concurrency", str(args.concurrency),
           "--vocab-range", "3", str(TINY_QWEN3["vocab_size"]), "--result-file", str(result_file), *args.client_arg]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)   # its figures are in result_file
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime, proc.returncode


def measure(args: argparse.Namespace, model_dir: Path, work: Path) -> HostCost:
    """One run: start the server, warm it, run the client, read every process's CPU."""
    log_path = work / "server.log"
    server = start_server(args, model_dir, log_path)
    spies: list[subprocess.Popen] = []
    try:
        warm = argparse.Namespace(**{**vars(args), "num_prompts": 8, "concurrency": 8})
        run_client(warm, work / "warm.json")     # first-call costs are not the steady state
        roles = server_roles(server, log_path)
        before = {pid: cpu_seconds(pid) for pid in roles}
        if args.profile and shutil.which("py-spy"):
            Path(args.profile).mkdir(parents=True, exist_ok=True)
            for pid, role in roles.items():
                spies.append(subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--threads", "--nonblocking",
                                               "--format", "raw", "--rate", "200", "--output",
                                               f"{args.profile}/{role}-{pid}.txt"],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        start = time.perf_counter()
        client_cpu, status = run_client(args, work / "result.json")
        duration = time.perf_counter() - start
        after = {pid: cpu_seconds(pid) for pid in roles}
        if status != 0:
            raise BenchError(f"the benchmark client failed (exit {status})")
        result = json.loads((work / "result.json").read_text())["results"][0]
        cost = HostCost(result["total_output_tokens"], duration, num_events=result.get("total_chunks") or 0,
                        result=result)
        cost.processes = [ProcessCPU(role, pid, after[pid] - before[pid]) for pid, role in roles.items()]
        cost.processes.append(ProcessCPU("client", 0, client_cpu))
        return cost
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            spy.wait(30)
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


ROLES = ("api_server", "engine_core", "client", "supervisor")


def _median(values: list[float]) -> str:
    """The median, with the range when there are several values."""
    mid = statistics.median(values)
    return f"{mid:.1f}" if len(values) == 1 else f"{mid:.1f} ({min(values):.1f}-{max(values):.1f})"


def format_costs(costs: list[HostCost], args: argparse.Namespace, concurrency: int) -> str:
    """One block per level: throughput, then CPU us per token (and per event) of each role."""
    results = [c.result for c in costs]
    paced = f" (steps of at least {args.step_ms:g} ms)" if args.step_ms is not None else ""
    lines = [f"{args.num_prompts} prompts x {args.output_len} tokens at concurrency {concurrency}{paced}"
             f"{f', {len(costs)} runs (median, range)' if len(costs) > 1 else ''}: "
             f"{_median([c.num_tokens / c.duration_s for c in costs])} tok/s; "
             f"ITL p50 / p99 {_median([r['itl_ms']['median'] for r in results])} / "
             f"{_median([r['itl_ms']['p99'] for r in results])} ms; "
             f"{_median([c.num_tokens / max(c.num_events, 1) for c in costs])} tokens per streamed event",
             f"{'process':<12}{'count':>6}{'us/token':>22}{'us/event':>22}{'cores':>7}"]
    for role in ROLES:
        if not any(p.role == role for p in costs[0].processes):
            continue
        count = sum(p.role == role for p in costs[0].processes)
        cores = statistics.median(c.cpu_s(role) / c.duration_s for c in costs)
        lines.append(f"{role:<12}{count:>6}{_median([c.per_token_us(role) for c in costs]):>22}"
                     f"{_median([c.per_event_us(role) for c in costs]):>22}{cores:>7.2f}")
    return "\n".join(lines)


def cost_record(cost: HostCost) -> dict:
    """One run's figures as JSON."""
    return {"num_tokens": cost.num_tokens, "num_events": cost.num_events, "duration_s": cost.duration_s,
            "itl_ms": cost.result.get("itl_ms"), "processes": [vars(p) for p in cost.processes],
            "us_per_token": {role: cost.per_token_us(role) for role in ROLES[:3]},
            "us_per_event": {role: cost.per_event_us(role) for role in ROLES[:3]}}


def main(argv: list[str] | None = None) -> int:
    """Write the model, measure each level (args.repeat times), print the tables."""
    args = parse_args(argv)
    levels = args.concurrency or [256]
    from minillm.benchmarks.workload import write_random_model_dir
    records = []
    with tempfile.TemporaryDirectory(prefix="minillm-host-cost-") as tmp:
        work = Path(tmp)
        model_dir = write_random_model_dir(Path(args.model_dir) if args.model_dir else work / "model", TINY_QWEN3)
        for concurrency in levels:
            level = argparse.Namespace(**{**vars(args), "concurrency": concurrency})
            costs = [measure(level, model_dir, work) for _ in range(max(args.repeat, 1))]
            print(format_costs(costs, args, concurrency), flush=True)
            records.append({"concurrency": concurrency, "runs": [cost_record(c) for c in costs]})
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "levels": records}, f, indent=2)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve-paced"]:
        sys.exit(serve_paced(sys.argv[2:]))
    sys.exit(run_main(main, "python -m benchmarks.host_cost"))
