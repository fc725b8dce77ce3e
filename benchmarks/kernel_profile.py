"""A run's device time, kernel by kernel: CUPTI's records (through torch.profiler), grouped by kind.

    python3 -m minillm.benchmarks.throughput --kernel-profile     # the workload's kernels by kind and shape

Kernels replayed from CUDA graphs are recorded one by one, as launched ones are. The profiler's own
cost is inside the profiled run's wall time; the plain run's figure is the one to quote.
"""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

# (kind, substrings of the kernel's name), first match wins; anything else is "other".
KINDS = (
    ("decode attention", ("paged_decode",)),
    ("prefill attention", ("prefill",)),
    ("GEMM (cuBLAS / cuBLASLt / split-K reduce)", ("gemm", "xmma", "cutlass", "nvjet", "splitk", "sm90_")),
    ("norms, rotary, KV append, embedding", ("norm", "rotary", "append", "embedding")),
    ("SiLU and multiply", ("silu",)),
    ("sampler (penalties, masks, sampling, logprobs)", ("sample", "penalt", "bitmask", "softmax", "argmax",
                                                       "bias_broadcast")),
    ("copies", ("memcpy",)),
    ("memsets", ("memset",)),
)
TRACE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


@dataclass
class KernelRow:
    """One kernel name at one grid: how often it ran and for how long."""
    name: str
    grid: tuple[int, ...]
    count: int
    total_us: float

    @property
    def kind(self) -> str:
        """The kind of work the name says this is."""
        return kind_of(self.name)


def kind_of(name: str) -> str:
    """The KINDS entry a kernel's name falls under."""
    low = name.lower()
    for kind, parts in KINDS:
        if any(p in low for p in parts):
            return kind
    return "other"


def kernel_rows(trace: dict) -> list[KernelRow]:
    """The device events of a Chrome trace (torch.profiler's export), summed by (name, grid), longest first."""
    rows: dict[tuple[str, tuple[int, ...]], KernelRow] = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or ev.get("cat") not in TRACE_CATEGORIES:
            continue
        name = str(ev.get("name", "?"))
        grid = tuple(int(g) for g in (ev.get("args") or {}).get("grid", ()))
        row = rows.setdefault((name, grid), KernelRow(name, grid, 0, 0.0))
        row.count += 1
        row.total_us += float(ev.get("dur", 0.0))
    return sorted(rows.values(), key=lambda r: -r.total_us)


def by_kind(rows: list[KernelRow]) -> list[tuple[str, int, float]]:
    """(kind, launches, total us) for each kind present, longest first."""
    sums: dict[str, list] = {}
    for r in rows:
        s = sums.setdefault(r.kind, [0, 0.0])
        s[0] += r.count
        s[1] += r.total_us
    return sorted(((k, n, us) for k, (n, us) in sums.items()), key=lambda t: -t[2])


def report(rows: list[KernelRow], wall_s: float, steps: int, top: int = 8) -> str:
    """Tables of device time by kind, then each kind's longest (kernel, grid) rows, against the run's wall time."""
    busy_us = sum(r.total_us for r in rows)
    per_step = f", {busy_us / 1e3 / steps:.2f} ms a step over {steps} steps" if steps else ""
    lines = [f"device busy {busy_us / 1e6:.2f} s of the profiled run's {wall_s:.2f} s "
             f"({busy_us / 1e6 / wall_s:.0%}){per_step}",
             "| kind | launches | seconds | share of device time | us a launch |", "| --- | --- | --- | --- | --- |"]
    kinds = by_kind(rows)
    for kind, n, us in kinds:
        lines.append(f"| {kind} | {n} | {us / 1e6:.3f} | {us / busy_us:.1%} | {us / n:.1f} |")
    lines += ["", f"each kind's {top} longest (kernel, grid):",
              "| kind | kernel | grid | launches | seconds | share | us a launch |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for kind, _, _ in kinds:
        for r in [r for r in rows if r.kind == kind][:top]:
            name = r.name if len(r.name) <= 70 else r.name[:67] + "..."
            grid = "x".join(map(str, r.grid)) or "-"
            lines.append(f"| {kind} | {name} | {grid} | {r.count} | {r.total_us / 1e6:.3f} | "
                         f"{r.total_us / busy_us:.1%} | {r.total_us / r.count:.1f} |")
    return "\n".join(lines)


def profile_kernels(run: Callable[[], object]) -> tuple[object, list[KernelRow]]:
    """run()'s result and the device kernels it ran, recorded by torch.profiler (CUPTI)."""
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError as exc:
        raise RuntimeError("--kernel-profile needs torch (its profiler reads CUPTI's kernel records)") from exc
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = run()
    fd, path = tempfile.mkstemp(suffix=".json", prefix="minillm-kernels-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    return result, kernel_rows(trace)
