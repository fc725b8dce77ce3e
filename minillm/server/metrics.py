"""Prometheus metrics with minillm: names mirroring vLLM's, one CollectorRegistry per app.

Gauges and counters are read from the latest EngineStats snapshot at scrape time (the engine
counts them); histograms are fed by the server from each request's RequestMetrics and the
times its tokens were seen on the engine thread.
"""
from __future__ import annotations

import copy
import os
from bisect import bisect_left

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from minillm.metrics_tracker import ITERATION_TOKEN_BOUNDS
from minillm.outputs import RequestMetrics, RequestOutput
from minillm.sampling_params import SamplingParams
from minillm.spec_decode.metrics import COUNTERS as SPEC_DECODE_COUNTERS
from minillm.spec_decode.metrics import PER_POSITION_COUNTER
from minillm.stats import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's bucket bounds (vllm/v1/metrics/loggers.py), so that a dashboard built for vLLM (histogram_quantile
# over the `le` labels) reads these histograms alike.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
PER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
# The finish reasons a request_success series exists for from the start, as vLLM's (a request whose
# grammar failed to compile ends with "error"; one whose output repeats, with repetition_detection, "repetition").
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")

# (name, help, EngineStats field) for the snapshot-backed series.
_GAUGES = (
    ("minillm:num_requests_running", "Number of requests in the running batch.", "num_running"),
    ("minillm:num_requests_waiting", "Number of requests waiting to be scheduled.", "num_waiting"),
    ("minillm:kv_cache_usage_perc", "KV-cache usage: 1 means every block is in use.", "kv_usage"),
)
_COUNTERS = (
    ("minillm:prefix_cache_queries", "Prompt tokens of new requests looked up in the prefix cache.",
     "prefix_cache_queries"),
    ("minillm:prefix_cache_hits", "Prompt tokens of new requests found in the prefix cache.", "prefix_cache_hits"),
    ("minillm:num_preemptions", "Cumulative number of preemptions.", "num_preemptions"),
    ("minillm:prompt_tokens", "Number of prompt tokens: each request's whole prompt, once.", "prompt_tokens_total"),
    ("minillm:generation_tokens", "Number of generation tokens processed.", "generation_tokens_total"),
    ("minillm:prefill_tokens", "Number of prompt tokens computed, counting those recomputed after a preemption.",
     "prefill_tokens_total"),
)


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's bounds of token counts (prompt, generation,
    max_tokens) with max_value its max_model_len."""
    bounds, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return bounds
            bounds.append(mantissa * scale)
        scale *= 10


class _SnapshotCollector(Collector):
    """Yields gauges and counters from the most recent EngineStats."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def collect(self):
        stats = self.stats
        if stats is None:
            return
        yield from _one_value_families(GaugeMetricFamily, self.model_name,
                                       ((name, doc, getattr(stats, attr)) for name, doc, attr in _GAUGES))
        yield from _one_value_families(CounterMetricFamily, self.model_name,
                                       ((name, doc, getattr(stats, attr)) for name, doc, attr in _COUNTERS))
        success = CounterMetricFamily("minillm:request_success", "Count of finished requests by reason.",
                                      labels=["model_name", "finished_reason"])
        for reason in sorted(set(stats.num_requests_finished) | set(FINISH_REASONS)):
            success.add_metric([self.model_name, reason], float(stats.num_requests_finished.get(reason, 0)))
        yield success
        yield from prompt_token_families(stats, self.model_name)
        yield from iteration_token_families(stats, self.model_name)
        yield from kv_offload_families(stats, self.model_name)
        yield from kv_transfer_families(stats, self.model_name)
        yield from _structured_output_summaries(self.model_name, stats)
        yield from spec_decode_families(stats, self.model_name)


def _one_value_families(kind, model_name: str, entries):
    """A family of `kind` (GaugeMetricFamily or CounterMetricFamily) per (name, doc, value), each
    holding the one value under the model's label."""
    for name, doc, value in entries:
        family = kind(name, doc, labels=["model_name"])
        family.add_metric([model_name], float(value))
        yield family


def prompt_token_families(stats: EngineStats, model_name: str):
    """vLLM's prompt tokens by source (computed, prefix cache, KV connector) and cached."""
    by_source = CounterMetricFamily("minillm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                                    labels=["model_name", "source"])
    for source, count in stats.prompt_tokens_by_source.items():
        by_source.add_metric([model_name, source], float(count))
    yield by_source
    cached = stats.prompt_tokens_by_source.get("local_cache_hit", 0) \
        + stats.prompt_tokens_by_source.get("external_kv_transfer", 0)
    yield from _one_value_families(CounterMetricFamily, model_name, (
        ("minillm:prompt_tokens_cached", "Number of cached prompt tokens (prefix cache or KV connector).", cached),))


def iteration_token_families(stats: EngineStats, model_name: str):
    """vLLM's iteration_tokens_total: the engine's steps by the tokens each computed."""
    counts = stats.iteration_tokens_buckets
    if len(counts) != len(ITERATION_TOKEN_BOUNDS) + 1:
        return      # a snapshot from an engine that does not count them
    family = HistogramMetricFamily("minillm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                   labels=["model_name"])
    cumulative, buckets = 0, []
    for bound, count in zip((*ITERATION_TOKEN_BOUNDS, float("inf")), counts):
        cumulative += count
        buckets.append((floatToGoString(bound), float(cumulative)))
    family.add_metric([model_name], buckets, float(stats.iteration_tokens_sum))
    yield family


def kv_offload_families(stats: EngineStats, model_name: str):
    """The host tier of the prefix cache (--kv-offload-gib): blocks, hits, bytes each way; none when off."""
    if not stats.kv_offload_num_blocks:
        return
    yield from _one_value_families(GaugeMetricFamily, model_name, (
        ("minillm:kv_offload_blocks_total", "Blocks the host KV tier holds at most.", stats.kv_offload_num_blocks),
        ("minillm:kv_offload_blocks_used", "Host KV tier blocks holding a prefix block.",
         stats.kv_offload_num_used_blocks)))
    yield from _one_value_families(CounterMetricFamily, model_name, (
        ("minillm:kv_offload_hits", "Prompt tokens loaded from the host KV tier.", stats.kv_offload_hits),))
    moved = CounterMetricFamily("minillm:kv_offload_bytes", "Bytes copied between the KV pool and the host tier.",
                                labels=["model_name", "direction"])
    moved.add_metric([model_name, "to_host"], float(stats.kv_offload_bytes_to_host))
    moved.add_metric([model_name, "to_device"], float(stats.kv_offload_bytes_to_device))
    yield moved


def kv_transfer_families(stats: EngineStats, model_name: str):
    """Prefill/decode disaggregation (--kv-role): a prefill server's leases, a decode server's loads
    (prompt tokens transferred, against minillm:prompt_tokens computed); none without a role."""
    if not stats.kv_transfer_role:
        return
    yield from _one_value_families(GaugeMetricFamily, model_name, (
        ("minillm:kv_transfer_leases", "KV leases a prefill engine holds for decode engines.",
         stats.kv_transfer_num_leases),
        ("minillm:kv_transfer_leased_blocks", "KV blocks held under those leases.",
         stats.kv_transfer_num_leased_blocks)))
    leases = CounterMetricFamily("minillm:kv_transfer_lease_ends", "KV leases ended, by how.",
                                 labels=["model_name", "outcome"])
    leases.add_metric([model_name, "released"], float(stats.kv_transfer_leases_released))
    leases.add_metric([model_name, "expired"], float(stats.kv_transfer_leases_expired))
    yield leases
    yield from _one_value_families(CounterMetricFamily, model_name, (
        ("minillm:kv_transfer_requests", "Requests whose prompt KV was loaded from a prefill engine.",
         stats.kv_transfer_num_requests),
        ("minillm:kv_transfer_blocks", "KV blocks loaded from prefill engines.", stats.kv_transfer_blocks),
        ("minillm:kv_transfer_tokens", "Prompt tokens loaded from prefill engines (not computed).",
         stats.kv_transfer_tokens),
        ("minillm:kv_transfer_bytes", "Bytes of KV loaded from prefill engines.", stats.kv_transfer_bytes),
        ("minillm:kv_transfer_seconds", "Seconds spent copying KV from prefill engines.",
         stats.kv_transfer_seconds),
        ("minillm:kv_transfer_stale_claims", "Claimed leases that ran out before their load: the prompt was "
         "computed here instead.", stats.kv_transfer_stale_claims)))


def _structured_output_summaries(model_name: str, stats: EngineStats):
    """Structured outputs: grammar compiles (off the step loop) and per-step bitmask fills, as
    count and sum (their ratio is the mean; both zero until a request asks for structure)."""
    for name, doc, count, seconds in (
            ("minillm:structured_output_compile_seconds", "Seconds each grammar took to compile.",
             stats.num_grammars_compiled, stats.grammar_compile_time_s),
            ("minillm:structured_output_bitmask_fill_seconds",
             "Seconds each step spent filling grammar bitmasks on the host.",
             stats.num_grammar_fill_steps, stats.grammar_fill_time_s)):
        family = SummaryMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([model_name], count_value=count, sum_value=seconds)
        yield family


class BatchedHistogram:
    """A histogram child fed once per streamed token: each value costs a bisect here, and the counts
    are added to the Prometheus child in one go (each lock and, with several API servers, each
    write to the shared files once per batch instead of once per token).

    flush() runs every FLUSH_EVERY values, at every scrape of this server and whenever a request
    finishes, so a scrape after a request ends sees all of its values. It reads the child's bucket
    bounds and adds to its bucket and sum values (prometheus_client's Histogram fields).
    """

    FLUSH_EVERY = 1024

    def __init__(self, child: Histogram) -> None:
        self.child = child
        self.bounds: list[float] = list(child._upper_bounds)      # ends with +Inf
        self.counts = [0] * len(self.bounds)                      # per bucket, not cumulative (as the child's)
        self.total = 0.0
        self.num_pending = 0

    def observe(self, value: float) -> None:
        """Count one value (a bucket holds the values <= its bound, as Histogram.observe counts)."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.num_pending += 1
        if self.num_pending >= self.FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        """Add what was counted since the last flush to the Prometheus histogram."""
        if not self.num_pending:
            return
        counts, total = self.counts, self.total
        self.counts, self.total, self.num_pending = [0] * len(self.bounds), 0.0, 0
        for bucket, count in zip(self.child._buckets, counts):
            if count:
                bucket.inc(count)
        self.child._sum.inc(total)


class ServerMetrics:
    """The app's registry: snapshot series plus request-latency histograms (token counts bucketed up to
    max_model_len, as vLLM's)."""

    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()     # what /metrics renders
        self._snapshot = _SnapshotCollector(model_name)
        self.registry.register(self._snapshot)
        # One of several API servers (--api-server-count): every server's histograms live in files
        # there, and a scrape of any server adds them all up (prometheus_client's multiprocess mode).
        multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        histograms = self.registry
        if multiprocess_dir:
            from prometheus_client.multiprocess import MultiProcessCollector
            MultiProcessCollector(self.registry, multiprocess_dir)
            histograms = CollectorRegistry()    # this process's own, written to the files, not rendered

        token_buckets = buckets_1_2_5(max_model_len)

        def histogram(name: str, doc: str, buckets: tuple | list) -> Histogram:
            return Histogram(name, doc, labelnames=["model_name"], buckets=buckets,
                             registry=histograms).labels(model_name)

        self.ttft = histogram("minillm:time_to_first_token_seconds",
                              "Time to first token in seconds.", TTFT_BUCKETS)
        self.itl = BatchedHistogram(histogram("minillm:inter_token_latency_seconds",
                                              "Time between consecutive tokens of a request in seconds.",
                                              PER_TOKEN_BUCKETS))
        self.e2e = histogram("minillm:e2e_request_latency_seconds",
                             "End-to-end request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.prompt_len = histogram("minillm:request_prompt_tokens",
                                    "Prompt tokens per finished request.", token_buckets)
        self.generation_len = histogram("minillm:request_generation_tokens",
                                        "Generated tokens per finished request.", token_buckets)
        # A finished request's phases, as vLLM splits them: waiting (arrival to first scheduled),
        # prefill (to the first token), decode (first to last token), inference (scheduled to last token).
        self.queue_time = histogram("minillm:request_queue_time_seconds",
                                    "Time a request spent waiting before it was first scheduled.",
                                    REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("minillm:request_prefill_time_seconds",
                                      "Time from a request's first scheduling to its first token.",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("minillm:request_decode_time_seconds",
                                     "Time from a request's first token to its last.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("minillm:request_inference_time_seconds",
                                        "Time from a request's first scheduling to its last token.",
                                        REQUEST_LATENCY_BUCKETS)
        # What requests asked for (vLLM's): n once per request, max_tokens once per finished completion,
        # and the most tokens a completion of the request generated.
        self.params_n = histogram("minillm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.params_max_tokens = histogram("minillm:request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", token_buckets)
        self.max_generation_len = histogram("minillm:request_max_num_generation_tokens",
                                            "Histogram of maximum number of requested generation tokens.",
                                            token_buckets)
        self.time_per_output_token = histogram("minillm:request_time_per_output_token_seconds",
                                               "Mean time per output token after the first, per request.",
                                               PER_TOKEN_BUCKETS)

    def update(self, stats: EngineStats) -> None:
        """Remember the latest snapshot for the next scrape."""
        self._snapshot.stats = stats

    def render(self, names: list[str] | None = None) -> bytes:
        """The Prometheus text exposition; with names (/metrics?name[]=...), only the series of those
        sample names, as prometheus_client's own /metrics app (vLLM's) restricts it."""
        self.itl.flush()
        return generate_latest(self.registry if names is None else _NamedSeries(self.registry, names))


class _NamedSeries:
    """A registry's families holding only the samples of the given names (families left empty are left out)."""

    def __init__(self, registry: CollectorRegistry, names: list[str]) -> None:
        self.registry = registry
        self.names = frozenset(names)

    def collect(self):
        for family in self.registry.collect():
            samples = [sample for sample in family.samples if sample.name in self.names]
            if samples:
                kept = copy.copy(family)
                kept.samples = samples
                yield kept


class RequestTimer:
    """Feeds one request's token intervals and its final latencies into the histograms. Each of a
    request's n completions counts as a request, as vLLM counts each (and as request_success counts
    them here): its own token gaps, latencies and token counts."""

    def __init__(self, metrics: ServerMetrics, params: SamplingParams | None = None) -> None:
        self.metrics = metrics
        self.max_tokens = params.max_tokens if params is not None else None
        self.n = params.n if params is not None else 1
        self.num_tokens: dict[int, int] = {}        # completion index -> its tokens so far
        self.last_seen: dict[int, float] = {}       # completion index -> when its last token was seen

    def on_output(self, output: RequestOutput, seen: float) -> None:
        """Record each completion's interval since its previous token (seen: engine-thread time)."""
        for comp in output.outputs:
            num_tokens = len(comp.token_ids)
            if num_tokens > self.num_tokens.get(comp.index, 0):
                last_seen = self.last_seen.get(comp.index)
                if last_seen is not None:
                    self.metrics.itl.observe(max(0.0, seen - last_seen))
                self.last_seen[comp.index] = seen
                self.num_tokens[comp.index] = num_tokens
        if output.finished:
            self._on_finish(output, seen)

    def _on_finish(self, output: RequestOutput, seen: float) -> None:
        metrics = self.metrics
        metrics.itl.flush()     # a scrape after the request sees all its gaps, on any API server
        longest = None
        for comp in output.outputs:
            if comp.finish_reason == "abort":
                continue  # an aborted completion's latency says nothing about serving speed
            num_tokens = self.num_tokens.get(comp.index, 0)
            longest = max(longest or 0, num_tokens)
            if self.max_tokens:
                metrics.params_max_tokens.observe(self.max_tokens)
            times = output.metrics
            if times is not None:
                self._observe_times(times, self.last_seen.get(comp.index, times.last_token_time), seen, num_tokens)
            metrics.prompt_len.observe(len(output.prompt_token_ids))
            metrics.generation_len.observe(num_tokens)
        if longest is not None:
            metrics.params_n.observe(self.n)
            metrics.max_generation_len.observe(longest)

    def _observe_times(self, times: RequestMetrics, last_token: float | None, seen: float, num_tokens: int) -> None:
        """One completion's latencies: TTFT, end to end and vLLM's phases (those whose times are known)."""
        metrics = self.metrics
        if times.ttft is not None:
            metrics.ttft.observe(times.ttft)
        metrics.e2e.observe(max(0.0, (times.finished_time or seen) - times.arrival_time))
        scheduled, first_token = times.first_scheduled_time, times.first_token_time
        if scheduled is not None:
            metrics.queue_time.observe(max(0.0, scheduled - times.arrival_time))
        if scheduled is not None and first_token is not None:
            metrics.prefill_time.observe(max(0.0, first_token - scheduled))
        if first_token is not None and last_token is not None:
            decode = max(0.0, last_token - first_token)
            metrics.decode_time.observe(decode)
            if num_tokens > 1:
                metrics.time_per_output_token.observe(decode / (num_tokens - 1))
        if scheduled is not None and last_token is not None:
            metrics.inference_time.observe(max(0.0, last_token - scheduled))


def spec_decode_families(stats: EngineStats, model_name: str):
    """vLLM's spec_decode counters from the snapshot (nothing when speculation is off)."""
    spec = stats.spec_decode
    if spec is None:
        return
    yield from _one_value_families(CounterMetricFamily, model_name,
                                   ((name, doc, getattr(spec, attr)) for name, doc, attr in SPEC_DECODE_COUNTERS))
    name, doc, label = PER_POSITION_COUNTER
    family = CounterMetricFamily(name, doc, labels=["model_name", label])
    for position, count in enumerate(spec.num_accepted_tokens_per_pos):
        family.add_metric([model_name, str(position)], float(count))
    yield family
