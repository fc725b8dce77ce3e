"""EngineStats: the snapshot the engine publishes for /v1/stats, /metrics and the monitor."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from minillm.spec_decode.metrics import SpecDecodeStats

# Block map cell values: a request row index (>= 0) for a used block, or one of these.
CELL_FREE = -1
CELL_CACHED = -2
CELL_LEASED = -3         # held by a KV transfer's lease for a decode engine (a prefill engine's)


@dataclass
class StepStats:
    """Composition and duration of one engine step."""

    step: int
    time: float                  # time.time() when its scheduling ended (it is launched next)
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    token_budget: int
    step_time_s: float
    estimated_step_s: float | None = None   # the step cost model's estimate (with a step-time budget)
    device_step_s: float | None = None      # measured on the device: forward and sampling (likewise)
    step_limit_s: float | None = None       # the step-time limit its prompt chunks were sized under


@dataclass
class RequestStats:
    """One row of the request table."""

    request_id: str
    state: str                   # "waiting" | "running" | "preempted" | "finished"
    prompt_tokens: int
    output_tokens: int
    num_blocks: int
    num_cached_tokens: int
    ttft_s: float | None
    is_structured: bool = False  # its output is constrained (structured outputs)


@dataclass
class StructuredOutputStats:
    """Structured outputs so far: grammar compiles (on the compile pool) and bitmask fills (on
    the host, one per step with a constrained row, while the forward pass runs)."""

    num_grammars_compiled: int
    grammar_compile_time_s: float      # summed over compiles
    num_grammar_fill_steps: int
    grammar_fill_time_s: float         # summed over steps
    grammar_fill_p50_s: float | None   # per step, over recent steps
    grammar_fill_p99_s: float | None


@dataclass
class MemoryStats:
    """Device (or host, on the CPU backend) memory split in bytes."""

    weights_bytes: int
    kv_pool_bytes: int
    other_bytes: int
    total_bytes: int


@dataclass
class EngineStats:
    """A point-in-time snapshot of the engine; plain data, serialised with to_dict()."""

    time: float
    model: str
    device: str
    dtype: str
    num_running: int
    num_waiting: int
    num_preempted: int           # waiting requests that were preempted and will resume
    num_preemptions: int         # total so far
    kv_num_blocks: int
    kv_num_used_blocks: int
    kv_num_free_blocks: int      # truly free (no cached content)
    kv_num_cached_blocks: int    # free but holding a reusable prefix block
    kv_usage: float              # used / total, in [0, 1]
    kv_token_utilization: float | None  # tokens held / slots in used blocks, in [0, 1]; None in a summary
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    prefix_cache_queries: int    # prompt tokens of new sequences looked up in the prefix cache (not resumed ones)
    prefix_cache_hits: int       # prompt tokens found there
    num_steps: int
    prompt_tokens_total: int     # each sequence's whole prompt, once, at its first token (vLLM's)
    generation_tokens_total: int
    num_requests_finished: dict[str, int]   # finish reason -> count
    prompt_throughput: float     # tok/s over the last few seconds
    generation_throughput: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    memory: MemoryStats
    # block_map[i]: the state of cell i (CELL_FREE, CELL_CACHED or a row index into requests);
    # each cell covers block_map_blocks_per_cell consecutive blocks and shows their commonest state.
    block_map: list[int] = field(default_factory=list)
    block_map_blocks_per_cell: int = 1
    recent_steps: list[StepStats] = field(default_factory=list)
    requests: list[RequestStats] = field(default_factory=list)
    # Where the steps' time went so far: phase -> seconds summed over steps ("schedule", "prepare",
    # "forward_host", "sample_host", "wait", "update"; "forward_device" and "sample_device" when profiling;
    # with structured outputs "grammar_advance" (matchers take read-back tokens), "grammar_fill" (on the
    # mask thread) and "grammar_fill_wait" (the engine thread waiting for the masks)).
    step_time_breakdown_s: dict[str, float] = field(default_factory=dict)
    # Speculative decoding totals (drafts, draft tokens, accepted, accepted per position); None when off.
    spec_decode: SpecDecodeStats | None = None
    # The host-memory tier of the prefix cache (--kv-offload-gib); zeros and [] when it is off.
    kv_offload_num_blocks: int = 0
    kv_offload_num_used_blocks: int = 0
    kv_offload_hits: int = 0                 # prompt tokens loaded from the host tier (a second kind of prefix hit)
    kv_offload_bytes_to_host: int = 0        # totals moved each way
    kv_offload_bytes_to_device: int = 0
    kv_offload_to_host_bytes_per_s: float = 0.0     # over the last few seconds
    kv_offload_to_device_bytes_per_s: float = 0.0
    # The host blocks as cells of CELL_CACHED (holds a block) or CELL_FREE, downsampled like block_map.
    kv_offload_block_map: list[int] = field(default_factory=list)
    # Prefill/decode disaggregation (--kv-role); "" and zeros when this engine takes no part.
    kv_transfer_role: str = ""               # "kv_producer" | "kv_consumer" | "kv_both"
    kv_transfer_engine_id: str = ""
    kv_transfer_num_leases: int = 0          # producer: leases held now
    kv_transfer_num_leased_blocks: int = 0
    kv_transfer_leases_created: int = 0
    kv_transfer_leases_released: int = 0     # released by the decode engine that copied them
    kv_transfer_leases_expired: int = 0      # ran out first
    kv_transfer_num_requests: int = 0        # consumer: requests whose prompt KV was loaded
    kv_transfer_blocks: int = 0
    kv_transfer_tokens: int = 0              # prompt tokens loaded, not computed
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0         # copy time
    kv_transfer_bytes_per_s: float = 0.0     # over the last few seconds
    kv_transfer_stale_claims: int = 0        # claims that ran out before their load: computed here instead
    # Structured outputs (StructuredOutputStats' fields; zero until a request asks for structure).
    num_grammars_compiled: int = 0
    grammar_compile_time_s: float = 0.0
    num_grammar_fill_steps: int = 0
    grammar_fill_time_s: float = 0.0
    grammar_fill_p50_s: float | None = None
    grammar_fill_p99_s: float | None = None
    # The step-time budget (--max-step-ms, --max-step-factor; None: off) and the step cost model that sizes prompt chunks
    # under it: seconds per unit of each feature (base, mixed, tokens, attention, kv_read), the
    # newest completed step's estimate and measured device time, and the median relative error.
    max_step_ms: float | None = None
    max_step_factor: float | None = None     # --max-step-factor: the budget relative to the decode rows' step
    step_cost_coefficients: dict[str, float] = field(default_factory=dict)
    step_estimated_ms: float | None = None
    step_measured_ms: float | None = None
    step_cost_error_p50: float | None = None
    step_cost_num_refits: int = 0
    # Prompt tokens the steps computed (tokens recomputed after a preemption again; cached ones not),
    # and prompt_tokens_total split by where the tokens came from ("local_compute", "local_cache_hit",
    # "external_kv_transfer").
    prefill_tokens_total: int = 0
    # Steps by the tokens each computed: a count per bucket of metrics_tracker.ITERATION_TOKEN_BOUNDS
    # then +Inf (not cumulative), and those tokens summed (vLLM's iteration_tokens_total histogram).
    iteration_tokens_buckets: list[int] = field(default_factory=list)
    iteration_tokens_sum: int = 0
    prompt_tokens_by_source: dict[str, int] = field(default_factory=dict)
    # What the KV pool stores: the model dtype ("bfloat16", ...) or "fp8_e4m3" (kv_cache_dtype="fp8").
    kv_cache_dtype: str = ""
    # A random id the engine chose when it started: a snapshot with another comes from another engine (a
    # server restarted), whatever its counters say; "" from a server or recording that had none.
    run_id: str = ""
    # A summary (the counters and gauges of the throughput log and /metrics): no request rows, block
    # map, latency percentiles or recent steps, and kv_token_utilization None.
    is_summary: bool = False

    def to_dict(self) -> dict:
        """A JSON-ready dict with the same field names."""
        return asdict(self)
