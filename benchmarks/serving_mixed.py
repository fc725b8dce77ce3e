"""The mixed serving workload of `minillm bench serving --mixed-users N`: chat users streaming while
long prompts arrive.

N users each stream a request of --input-len prompt tokens and --output-len output tokens and send
the next as soon as one ends (closed loop). Three phases run against the same server: (1) one long
prompt of --long-input-len tokens alone (its TTFT alone), (2) the users alone for --duration
seconds (their throughput, held against the offline engine's at the same concurrency when
--offline-model is given), (3) the users again while a long prompt arrives every --long-every-s
seconds for --duration seconds. Each class gets the latencies --percentile-metrics and
--metric-percentiles select (mean, median and each percentile, as vLLM's); the long-prompt
issue's ceilings are printed beside them (users' ITL p99 at most 2.5x their p50, long prompts'
TTFT p50 within 3x their TTFT alone, users alone at least 90 % of the offline ceiling).
"""
from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import asdict, dataclass

import httpx

from minillm.benchmarks import serving
from minillm.urls import authorization_headers


@dataclass
class ClassFigures:
    """One class of requests in one phase (times in ms)."""

    requests: int
    failed: int
    output_tokens: int
    seconds: float
    ttft_ms: dict
    itl_ms: dict
    tpot_ms: dict
    e2el_ms: dict

    @property
    def output_tok_s(self) -> float:
        """Output tokens per second over the phase."""
        return self.output_tokens / self.seconds if self.seconds else 0.0


def _figures(results: list[serving.RequestResult], seconds: float, percentiles: list[float] = ()) -> ClassFigures:
    """A class's figures; each latency's mean, median, p99 and std, and each of percentiles."""
    ok = [r for r in results if r.ok]
    return ClassFigures(len(results), len(results) - len(ok), sum(r.output_tokens for r in ok), seconds,
                        **serving.latency_figures(ok, percentiles))


@dataclass
class MixedResult:
    """The three phases' figures."""

    long_alone_ttft_ms: float
    users_alone: ClassFigures
    users_mixed: ClassFigures
    long_mixed: ClassFigures
    offline_ceiling_tok_s: float | None = None


class _Workload:
    """Bodies of the users' and the long prompts' requests (fresh random ids: no prefix hits)."""

    def __init__(self, args: argparse.Namespace, model: str):
        self.args, self.model = args, model
        self.rng = random.Random(args.seed)

    def _ids(self, n: int) -> list[int]:
        lo, hi = self.args.vocab_range
        return [self.rng.randrange(lo, hi) for _ in range(n)]

    def user(self) -> dict:
        """A user's next request."""
        return serving.request_body(self.args, self.model, self._ids(self.args.input_len))

    def long(self) -> dict:
        """A long prompt's request."""
        body = serving.request_body(self.args, self.model, self._ids(self.args.long_input_len))
        body["max_tokens"] = self.args.long_output_len
        return body


async def _phase(args: argparse.Namespace, work: _Workload, url: str, headers: dict, users: int,
                 long_every_s: float | None) -> tuple[list, list, float]:
    """Run `users` closed-loop users (and long prompts every long_every_s) for --duration seconds;
    requests still in flight at the end are waited for and counted."""
    end = time.perf_counter() + args.duration
    user_results: list[serving.RequestResult] = []
    long_results: list[serving.RequestResult] = []

    async def user_loop() -> None:
        while time.perf_counter() < end:
            user_results.append(await serving.send_request(url, work.user(), headers, args.timeout))

    async def long_loop() -> None:
        pending = []
        while time.perf_counter() < end:
            pending.append(asyncio.create_task(serving.send_request(url, work.long(), headers, args.timeout)))
            await asyncio.sleep(long_every_s)
        long_results.extend(await asyncio.gather(*pending))

    start = time.perf_counter()
    tasks = [user_loop() for _ in range(users)]
    if long_every_s is not None:
        tasks.append(long_loop())
    await asyncio.gather(*tasks)
    return user_results, long_results, time.perf_counter() - start


async def run_mixed(args: argparse.Namespace) -> MixedResult:
    """The three phases against args.base_url."""
    base = args.base_url.rstrip("/")
    headers = authorization_headers(args.api_key)
    async with httpx.AsyncClient(headers=headers, timeout=args.timeout) as client:
        model = await serving.resolve_model(client, base, args.served_model_name or args.model)
    url = base + args.endpoint
    work = _Workload(args, model)
    await serving.send_request(url, work.user(), headers, args.timeout)            # warm-up, untimed
    alone = [await serving.send_request(url, work.long(), headers, args.timeout) for _ in range(2)]
    if not alone[-1].ok:
        raise serving.BenchError(f"the long prompt failed alone: {alone[-1].error}")
    percentiles = args.metric_percentiles
    users, _, seconds = await _phase(args, work, url, headers, args.mixed_users, None)
    users_alone = _figures(users, seconds, percentiles)
    users, longs, seconds = await _phase(args, work, url, headers, args.mixed_users, args.long_every_s)
    return MixedResult(alone[-1].ttft_s * 1e3, users_alone, _figures(users, seconds, percentiles),
                       _figures(longs, seconds, percentiles))


def offline_ceiling(args: argparse.Namespace) -> float:
    """The offline engine's output tok/s for the users alone (the same concurrency and lengths)."""
    ns = argparse.Namespace(**{**vars(args), "num_prompts": 4 * args.mixed_users, "prompt": None,
                               "prompts_file": None, "endpoint": "/v1/completions"})
    ceiling = serving.OfflineCeiling(ns)
    try:
        return ceiling.throughput(args.mixed_users)
    finally:
        ceiling.shutdown()


def format_mixed(r: MixedResult, args: argparse.Namespace) -> str:
    """One row per class and phase (the latencies --percentile-metrics and --metric-percentiles
    select), the ceilings' verdicts after them."""
    columns = ["phase", "class", "requests (failed)", "output tok/s", *serving.latency_columns(args)]
    lines = [f"Mixed serving: {args.mixed_users} users (prompt {args.input_len}, output {args.output_len}) for "
             f"{args.duration:g} s; long prompts of {args.long_input_len} tokens every {args.long_every_s:g} s",
             serving.markdown_row(columns), serving.markdown_row(["---"] * len(columns))]
    for phase, name, f in (("users alone", "users", r.users_alone), ("mixed", "users", r.users_mixed),
                           ("mixed", "long prompts", r.long_mixed)):
        lines.append(serving.markdown_row([phase, name, f"{f.requests} ({f.failed})", f"{f.output_tok_s:,.0f}",
                                           *serving.latency_cells(f, args)]))
    itl = r.users_mixed.itl_ms
    ratio = itl["p99"] / itl["median"] if itl["median"] else float("inf")
    lines.append(f"users' ITL p99 / p50 while long prompts arrive: {ratio:.2f}x "
                 f"({'within' if ratio <= 2.5 else 'over'} 2.5x)")
    ttft = r.long_mixed.ttft_ms["median"] / r.long_alone_ttft_ms if r.long_alone_ttft_ms else float("inf")
    lines.append(f"long prompts' TTFT p50 {r.long_mixed.ttft_ms['median']:.1f} ms against {r.long_alone_ttft_ms:.1f} "
                 f"ms alone: {ttft:.2f}x ({'within' if ttft <= 3.0 else 'over'} 3x)")
    if r.offline_ceiling_tok_s:
        share = r.users_alone.output_tok_s / r.offline_ceiling_tok_s
        lines.append(f"users alone: {r.users_alone.output_tok_s:,.0f} tok/s against the offline engine's "
                     f"{r.offline_ceiling_tok_s:,.0f}: {share:.2f} ({'at least' if share >= 0.9 else 'under'} 0.90)")
    return "\n".join(lines)


def main_mixed(args: argparse.Namespace) -> tuple[MixedResult, str]:
    """Run the phases, then the offline ceiling (when --offline-model is given); the table."""
    result = asyncio.run(run_mixed(args))
    if args.offline_model:
        result.offline_ceiling_tok_s = offline_ceiling(args)
    return result, format_mixed(result, args)


def as_dict(r: MixedResult, args: argparse.Namespace) -> dict:
    """The result as JSON-ready data; each class with vLLM's names of the selected metrics' figures
    (mean_ttft_ms, median_ttft_ms, std_ttft_ms, p99_ttft_ms, ...)."""
    out = asdict(r)
    for name in ("users_alone", "users_mixed", "long_mixed"):
        out[name].update(serving.vllm_metric_figures(getattr(r, name), args.percentile_metrics,
                                                     args.metric_percentiles))
    return out
