"""Online serving benchmark against any OpenAI-compatible server, in the manner of `vllm bench serve`.

Requests arrive as a Poisson process at --request-rate (or all at once, capped by
--max-concurrency); each streams its completion, and the client times the first token (TTFT),
the gaps between streamed chunks (ITL) and the time per output token after the first (TPOT).
With --peer-base-url the same workload is replayed against a second server (for instance vLLM
on the same model) and both are printed side by side; with --offline-model the same prompts also
run through minillm's offline engine in this process, the ceiling an HTTP server on that engine
can approach (compare at --request-rate inf, where arrivals do not limit throughput): with the
same number of requests in flight as the server had (--max-concurrency), a new one admitted as
each finishes. --concurrency-sweep runs the workload at each concurrency in turn and prints one
row per level beside the ceiling at that level. --mixed-users N runs the mixed workload instead
(benchmarks/serving_mixed.py): N streaming users, then the same users while a --long-input-len
prompt arrives every --long-every-s seconds, each class's TTFT and ITL beside the long prompt's
TTFT alone and the users' offline ceiling. The client parses events cheaply and prints its
own CPU per output token; --num-client-processes N splits the workload (and the concurrency) over
N processes, so that the client is never what limits a fast server.

    minillm bench serving --base-url http://127.0.0.1:8000 --num-prompts 200 \
        --input-len 128 --output-len 128 --request-rate 16
    minillm bench serve --host 127.0.0.1 --port 8000 --dataset-name random --random-input-len 128 \
        --random-output-len 128 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99
    python -m benchmarks.serving --num-prompts 256 --input-len 32 --output-len 128 \
        --concurrency-sweep 1,16,64,256 --offline-model MODEL --offline-arg device=cpu
    python -m benchmarks.serving --mixed-users 64 --input-len 512 --output-len 512 \
        --long-input-len 16000 --long-every-s 2 --duration 60

(python3 -m minillm.benchmarks.serving takes the same options.)
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import queue
import random
import re
import resource
import sys
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from typing import AsyncIterator, Callable

import httpx
import msgspec

from minillm.benchmarks import datasets
from minillm.benchmarks.cli_args import (MAX_REQUESTS, MAX_SECONDS, MAX_TOKENS, BenchError, BenchParser,
                                         check_bounds, check_output_file, check_seed_option, check_workload_tokens,
                                         run_main)
from minillm.urls import authorization_headers, http_url, server_base_url

WORDS = ("the", "a", "little", "girl", "boy", "dog", "cat", "sun", "tree", "happy", "big", "red",
         "ran", "saw", "played", "with", "and", "friend", "park", "ball", "day", "mom", "said", "home")


@dataclass
class RequestResult:
    """What one request measured on the client side."""

    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    num_chunks: int = 0             # events that carried text
    error: str = ""
    start_s: float = 0.0            # time.monotonic() when it was sent (one clock for every client process)
    end_s: float = 0.0              # time.monotonic() when it ended, answered or not


@dataclass
class BenchmarkResult:
    """Aggregates over a run, the way `vllm bench serve` reports them (times in ms)."""

    base_url: str
    num_prompts: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: dict
    tpot_ms: dict
    itl_ms: dict
    e2el_ms: dict
    errors: list[str]
    total_chunks: int = 0           # streamed events that carried text (tokens / chunks: tokens per event)
    client_cpu_s: float = 0.0       # CPU seconds the client itself used (every client process), for its cost
    requests: list[dict] | None = None   # --save-detailed: each request's start, TTFT and ITLs (ms)
    steps: list[dict] | None = None      # --step-trace: the engine's steps during the run (StepStats, t_ms)
    steps_missed: int = 0                # --step-trace: steps no poll saw
    start_monotonic_s: float | None = None   # --save-detailed: the run's start on the host's monotonic clock

    @property
    def client_cpu_us_per_token(self) -> float:
        """The client's own CPU microseconds per output token: it must stay far below 1e6 / tok/s."""
        return 1e6 * self.client_cpu_s / max(self.total_output_tokens, 1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = BenchParser("minillm bench serving", __doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="The server to measure, http://HOST:PORT when not given  "
                                                     "[default: http://127.0.0.1:8000]")
    p.add_argument("--host", default=None, help="The server's host, without --base-url (default: 127.0.0.1).")
    p.add_argument("--port", type=int, default=None, help="The server's port, without --base-url (default: 8000).")
    p.add_argument("--peer-base-url", default=None, help="A second server to run the same workload against.")
    p.add_argument("--endpoint", default=None, choices=["/v1/completions", "/v1/chat/completions"],
                   help="The API each request goes to (default: /v1/completions; /v1/chat/completions with "
                        "--backend openai-chat).")
    p.add_argument("--backend", default="openai", choices=list(BACKENDS),
                   help="vLLM's name for the API: vllm and openai send completions, openai-chat chat completions.")
    p.add_argument("--dataset-name", default="random", choices=list(datasets.DATASET_NAMES),
                   help="vLLM's workload name: random token ids (or --prompt / --prompts-file), a ShareGPT JSON "
                        "file or a custom JSONL file (--dataset-path).")
    datasets.add_dataset_options(p)
    p.add_argument("--model", default=None, help="Model name (default: the first one /v1/models lists).")
    p.add_argument("--served-model-name", default=None,
                   help="The model's name in requests, where the server serves --model under another (vLLM's; "
                        "default: --model); --model then names the tokenizer.")
    p.add_argument("--api-key", default=None, help="Bearer token for the server (default: $OPENAI_API_KEY, "
                                                   "as vLLM's bench serve reads it).")
    p.add_argument("--num-prompts", type=int, default=100, help="Requests in the workload.")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Requests per second (Poisson arrivals); inf: all at once.")
    p.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight (default: no cap).")
    p.add_argument("--input-len", "--random-input-len", type=int, default=128, help="Tokens per random prompt.")
    p.add_argument("--output-len", "--random-output-len", type=int, default=128,
                   help="Tokens each request generates.")
    p.add_argument("--prompt", action="append", default=None, help="A given prompt (repeat; cycled).")
    p.add_argument("--prompts-file", default=None, help="One prompt per line (cycled).")
    p.add_argument("--vocab-range", type=int, nargs=2, default=(3, 500), metavar=("LO", "HI"),
                   help="Token ids of random prompts are drawn from [LO, HI).")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="Let requests stop at EOS (default: always generate --output-len tokens).")
    p.add_argument("--ignore-eos", dest="ignore_eos", action="store_true",
                   help="vLLM's flag: generate --output-len tokens past EOS (the default here).")
    p.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature.")
    for name, kind in SAMPLING_OPTIONS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None,
                       help=f"Each request's {name}, as vLLM's bench serve sends it (default: the server's).")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="vLLM's: gaps between arrivals drawn from a gamma distribution of this shape at "
                        "--request-rate; 1 is a Poisson process, lower is burstier, higher more even.")
    p.add_argument("--seed", type=int, default=0, help="Seed of the random prompts, arrivals and sampling "
                   "(vLLM's: an integer in [0, 2**32 - 1]).")
    p.add_argument("--timeout", type=float, default=600.0, help="Seconds per request.")
    p.add_argument("--num-client-processes", type=int, default=1,
                   help="Client processes sharing the workload (and --max-concurrency), so that parsing "
                        "tens of thousands of events a second never limits what is measured; the client's "
                        "own CPU per token is printed.")
    p.add_argument("--offline-model", default=None,
                   help="Also run the prompts through minillm's offline engine on this model (the ceiling).")
    p.add_argument("--offline-device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="Backend of the offline run.")
    p.add_argument("--concurrency-sweep", type=_concurrency_list, default=None, metavar="C1,C2,...",
                   help="Run the workload once per max concurrency (e.g. 1,16,64,256) and print a row for each.")
    p.add_argument("--offline-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="An EngineConfig field for the offline engine (repeat), e.g. load_format=dummy, "
                        "dtype=bfloat16, gpu_memory_utilization=0.4 (the server holds the rest).")
    p.add_argument("--mixed-users", type=int, default=None,
                   help="Run the mixed workload: this many closed-loop streaming users, then the same users "
                        "while long prompts arrive.")
    p.add_argument("--long-input-len", type=int, default=16000, help="Mixed workload: tokens of a long prompt.")
    p.add_argument("--long-output-len", type=int, default=1, help="Mixed workload: tokens a long prompt generates.")
    p.add_argument("--long-every-s", type=float, default=2.0, help="Mixed workload: seconds between long prompts.")
    p.add_argument("--duration", type=float, default=60.0, help="Mixed workload: seconds of each phase.")
    p.add_argument("--result-file", default=None, help="Write the results as JSON here.")
    p.add_argument("--save-result", action="store_true",
                   help="Write the results as JSON into --result-dir, as vLLM does (--result-file names the file "
                        "itself).")
    p.add_argument("--result-dir", default=None,
                   help="With --save-result: the directory, made when missing (default: the current one).")
    p.add_argument("--result-filename", default=None,
                   help="With --save-result: the file's name (default, as vLLM names it: "
                        "BACKEND-RATEqps[-concurrencyN]-MODEL-YYYYMMDD-HHMMSS.json).")
    p.add_argument("--save-detailed", action="store_true",
                   help="With --result-file: also each request's start (ms from the run's start), TTFT, "
                        "inter-token latencies, output tokens and error, to place the tail in time.")
    p.add_argument("--step-trace", action="store_true",
                   help="With --result-file: also the engine's steps during each run, polled from /v1/stats "
                        "(each poll costs the engine a snapshot between two steps: trace a separate run).")
    p.add_argument("--step-trace-interval", type=float, default=0.15, metavar="S",
                   help="Seconds between two --step-trace polls (a snapshot holds the last 32 steps).")
    p.add_argument("--percentile-metrics", type=percentile_metrics, default="ttft,tpot,itl",
                   metavar="M1,M2,...", help=f"The metrics ({', '.join(METRICS)}) whose mean, median and "
                                             "percentiles are printed and saved, as vLLM's.")
    p.add_argument("--metric-percentiles", type=metric_percentiles, default="99", metavar="P1,P2,...",
                   help="The percentiles of each of --percentile-metrics (e.g. 25,50,90,99), as vLLM's.")
    p.add_argument("--disable-tqdm", action="store_true",
                   help="No progress bar (one is drawn on stderr when it is a terminal).")
    args = p.parse_args(argv)
    if args.mixed_users is not None and (args.mixed_users < 1 or args.long_input_len < 1 or args.long_output_len < 1
                                         or args.long_every_s <= 0 or args.duration <= 0):
        p.error("--mixed-users, --long-input-len and --long-output-len must be >= 1, --long-every-s and "
                "--duration > 0")
    mixed_only = [option for option, dest in _MIXED_ONLY if getattr(args, dest) != p.get_default(dest)]
    if args.mixed_users is None and mixed_only:      # passed over unread, a bad value too
        p.error(f"{', '.join(mixed_only)} {'is' if len(mixed_only) == 1 else 'are'} used by --mixed-users only "
                f"(the mixed workload of closed-loop users and long prompts); give --mixed-users N or leave "
                f"{'it' if len(mixed_only) == 1 else 'them'} out")
    if args.mixed_users is not None and (args.concurrency_sweep or args.peer_base_url):
        p.error("--mixed-users runs against one server, without --concurrency-sweep")
    unused = [option for option, dest in _UNUSED_BY_MIXED if getattr(args, dest) != p.get_default(dest)]
    if args.mixed_users is not None and unused:
        p.error(f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} not used by --mixed-users (its users "
                f"send requests of --input-len / --output-len tokens for --duration seconds)")
    if args.concurrency_sweep and args.max_concurrency is not None:
        p.error("--max-concurrency is not used by --concurrency-sweep (each run has the concurrency of its level)")
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        p.error("--num-prompts, --input-len and --output-len must be >= 1")
    if args.num_client_processes < 1:
        p.error("--num-client-processes must be >= 1")
    if not args.request_rate > 0:          # NaN too: 0 divided the Poisson draw by zero, < 0 meant all at once
        p.error(f"--request-rate must be > 0 requests per second (inf: all at once), got {args.request_rate}")
    if not 0 < args.burstiness < float("inf"):       # NaN too
        p.error(f"--burstiness must be a finite number > 0, got {args.burstiness}")
    check_sampling_options(p, args)
    datasets.check_dataset_options(p, args)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error(f"--max-concurrency must be >= 1 (leave it out for no cap), got {args.max_concurrency}")
    if not args.timeout > 0:
        p.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    check_bounds(p.prog, args, OPTION_BOUNDS)
    check_seed_option(p, args.seed)
    if not (args.prompt or args.prompts_file):
        check_workload_tokens(p.prog, "--num-prompts", args.num_prompts, "--input-len", args.input_len)
    lo, hi = args.vocab_range
    if not 0 <= lo < hi:
        p.error(f"--vocab-range LO HI needs 0 <= LO < HI (the prompts' token ids are drawn from [LO, HI)), "
                f"got {lo} {hi}")
    resolve_base_url(p, args)
    from minillm.urls import check_server_url
    for option, attr in (("--base-url", "base_url"), ("--peer-base-url", "peer_base_url")):
        if getattr(args, attr) is not None:
            try:       # the server's root: a URL given with /v1 (as OpenAI clients take it) loses it
                setattr(args, attr, check_server_url(getattr(args, attr), option))
            except ValueError as exc:
                p.error(str(exc))
            if getattr(args, attr).startswith("unix:"):
                p.error(f"{option} {getattr(args, attr)}: the benchmark's clients connect over TCP, not to a Unix "
                        "socket; serve the model on --host/--port (not --uds) to measure it")
    api_key_option = "--api-key"
    if args.api_key is None:   # vLLM's bench serve sends $OPENAI_API_KEY
        args.api_key, api_key_option = os.environ.get("OPENAI_API_KEY") or None, "$OPENAI_API_KEY"
    try:
        authorization_headers(args.api_key, api_key_option)
    except ValueError as exc:
        p.error(str(exc))
    if args.concurrency_sweep and args.peer_base_url:
        p.error("--concurrency-sweep runs against one server (leave out --peer-base-url)")
    check_result_options(p, args)
    if args.save_detailed and not (args.result_file or args.save_result):
        p.error("--save-detailed needs --result-file (or --save-result)")
    if args.step_trace and not (args.result_file or args.save_result):
        p.error("--step-trace needs --result-file (or --save-result)")
    if not 0.01 <= args.step_trace_interval <= 10:
        p.error(f"--step-trace-interval must be in [0.01, 10] seconds, got {args.step_trace_interval}")
    check_unread_options(p, args)
    try:
        args.offline_engine_args = offline_engine_args(args)
    except ValueError as exc:
        p.error(str(exc))
    return args


def check_unread_options(p: BenchParser, args: argparse.Namespace) -> None:
    """A usage error naming an option that only shapes what this run does not do (it was passed over unread)."""
    for flag, dest, unread in _READ_WITH:
        reason = unread(args) if getattr(args, dest) != p.get_default(dest) else None
        if reason is not None:
            p.error(f"{flag} {reason}")


def _random_token_prompts(args: argparse.Namespace) -> str | None:
    if args.prompt or args.prompts_file:
        return "shapes random prompts, and --prompt / --prompts-file give the prompts; leave one out"
    return None


# Options read only with another: (the option, its dest, why it is unread in ARGS or None).
_READ_WITH = [
    ("--step-trace-interval", "step_trace_interval",
     lambda a: None if a.step_trace else "sets --step-trace's polls; give --step-trace too (or leave it out)"),
    ("--offline-device", "offline_device",
     lambda a: None if a.offline_model else "is the backend of --offline-model's run; give --offline-model too"),
    ("--offline-arg", "offline_arg",
     lambda a: None if a.offline_model else "shapes --offline-model's engine; give --offline-model too"),
    ("--input-len", "input_len", _random_token_prompts),
    ("--vocab-range", "vocab_range", _random_token_prompts),
]


# The workload options the mixed workload has no use for: (the option, its dest).
# The mixed workload's own options, which no other run reads.
_MIXED_ONLY = [("--long-input-len", "long_input_len"), ("--long-output-len", "long_output_len"),
               ("--long-every-s", "long_every_s"), ("--duration", "duration")]
_UNUSED_BY_MIXED = [("--num-prompts", "num_prompts"), ("--request-rate", "request_rate"),
                    ("--burstiness", "burstiness"), ("--max-concurrency", "max_concurrency"),
                    ("--num-client-processes", "num_client_processes"), ("--prompt", "prompt"),
                    ("--prompts-file", "prompts_file"), ("--save-detailed", "save_detailed"), ("--step-trace", "step_trace")]


# Each numeric option's bounds, checked after the lower bounds above: past them a run allocates or
# waits for nothing (the prompts are drawn up front; each client process is a process).
OPTION_BOUNDS = {
    "num_prompts": (1, MAX_REQUESTS), "input_len": (1, MAX_TOKENS), "output_len": (1, MAX_TOKENS),
    "num_client_processes": (1, 256), "mixed_users": (1, MAX_REQUESTS), "long_input_len": (1, MAX_TOKENS),
    "long_output_len": (1, MAX_TOKENS), "timeout": (None, MAX_SECONDS, "seconds"),
    "long_every_s": (None, MAX_SECONDS, "seconds"), "duration": (None, MAX_SECONDS, "seconds"),
}


def resolve_base_url(p: BenchParser, args: argparse.Namespace) -> None:
    """args.base_url from --host and --port when it is not given, as vLLM builds it (http://HOST:PORT,
    an IPv6 host in brackets); a usage error naming both when --host or --port names another server
    than --base-url, or when either cannot be one."""
    if args.port is not None and not 1 <= args.port <= 65535:
        p.error(f"--port must be in [1, 65535], got {args.port}")
    if args.host is not None and not re.fullmatch(r"\[?[\w.:%-]+\]?", args.host.strip()):
        p.error(f"--host {args.host!r} is not a host name or an IP address")
    host = (args.host or "127.0.0.1").strip().strip("[]")
    port = args.port if args.port is not None else 8000
    if args.base_url is None:
        args.base_url = http_url(host, port)
        return
    try:
        parts = urllib.parse.urlsplit(server_base_url(args.base_url))
        url_host, url_port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return                       # a bad --base-url is named by its own check
    if args.host is not None and url_host != host.lower():
        p.error(f"--host {args.host} and --base-url {args.base_url} name different servers; give one of them")
    if args.port is not None and url_port != port:
        p.error(f"--port {args.port} and --base-url {args.base_url} name different servers; give one of them")


# The metrics --percentile-metrics may select, with their names as printed and vLLM's section titles.
METRICS = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


def percentile_metrics(text: str) -> list[str]:
    """--percentile-metrics: metric names of METRICS, separated by commas (each once, in the order given)."""
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected metric names separated by commas ({','.join(METRICS)}), "
                                         f"got {text!r}")
    unknown = next((name for name in names if name not in METRICS), None)
    if unknown is not None:
        raise argparse.ArgumentTypeError(f"unknown metric {unknown!r}; the metrics are {', '.join(METRICS)}")
    return list(dict.fromkeys(names))


def metric_percentiles(text: str) -> list[float]:
    """--metric-percentiles: numbers in [0, 100] separated by commas (each once, in the order given)."""
    try:
        values = [float(piece) for piece in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas (e.g. 25,50,99), got {text!r}"
                                         ) from None
    bad = next((v for v in values if not 0 <= v <= 100), None)      # NaN too
    if bad is not None:
        raise argparse.ArgumentTypeError(f"each percentile must be in [0, 100], got {percentile_word(bad)}")
    return list(dict.fromkeys(values))


def percentile_word(p: float) -> str:
    """A percentile as vLLM names it in its figures: 99 (not 99.0), 99.9."""
    return str(int(p)) if p == p and p not in (float("inf"), float("-inf")) and int(p) == p else str(p)


# vLLM's --backend names for the APIs this client speaks, and the endpoint each sends to.
BACKENDS = {"openai": "/v1/completions", "vllm": "/v1/completions", "openai-chat": "/v1/chat/completions"}


def check_result_options(p: BenchParser, args: argparse.Namespace) -> None:
    """--endpoint from --backend when not given, and a usage error for vLLM's result options that
    cannot work together (vLLM ignored --result-dir without --save-result, and saved nothing)."""
    backend_endpoint = BACKENDS[args.backend]
    if args.endpoint is None:
        args.endpoint = backend_endpoint
    elif args.backend == "openai-chat" and args.endpoint != backend_endpoint:
        p.error(f"--backend openai-chat sends to {backend_endpoint}; --endpoint {args.endpoint} is another API")
    for option in ("result_dir", "result_filename"):
        if getattr(args, option) is not None and not args.save_result:
            p.error(f"--{option.replace('_', '-')} needs --save-result (or give the file with --result-file)")
    if args.save_result and args.result_file:
        p.error("--save-result and --result-file both say where the results go; give one of them")


def saved_result_path(args: argparse.Namespace) -> str:
    """Where --save-result writes: --result-dir (made now) / --result-filename, or vLLM's name for the
    run (the model's id from the server when --model is not given); a BenchError naming --result-dir
    when it cannot be made."""
    directory = args.result_dir or "."
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise BenchError(f"--result-dir {args.result_dir} cannot be made ({exc.strerror or exc})") from None
    name = args.result_filename
    if name is None:
        model = args.model or asyncio.run(_server_model(args))
        rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate}"
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        name = f"{args.backend}-{rate}qps{concurrency}-{model.split('/')[-1]}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    return os.path.join(directory, name)


async def _server_model(args: argparse.Namespace) -> str:
    return (await _server_model_card(args))[0]


async def _server_model_card(args: argparse.Namespace) -> tuple[str, str | None]:
    """The server's first model: its name and its root (the model it loaded, as minillm serve and vLLM
    list it; None when not given)."""
    async with httpx.AsyncClient(headers=authorization_headers(args.api_key), timeout=args.timeout) as client:
        card = (await model_cards(client, args.base_url.rstrip("/")))[0]
    root = card.get("root")
    return card["id"], root if isinstance(root, str) and root else None


def _concurrency_list(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return levels


def offline_engine_args(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments of the offline engine: --offline-device, then each --offline-arg."""
    from minillm.config import EngineConfig

    fields = EngineConfig.__dataclass_fields__
    engine_args: dict = {"device": args.offline_device}
    for item in args.offline_arg:
        key, sep, text = item.partition("=")
        if not sep or key not in fields or key == "model":
            raise ValueError(f"--offline-arg takes KEY=VALUE with KEY an EngineConfig field, got {item!r}")
        try:
            engine_args[key] = json.loads(text)       # numbers, true/false, null
        except json.JSONDecodeError:
            engine_args[key] = text                   # plain strings: load_format=dummy
    return engine_args


def build_prompts(args: argparse.Namespace) -> list[str | list[int]]:
    """The dataset's prompts, given prompts (cycled), or random ones of --input-len tokens (token ids, or
    words for chat)."""
    if getattr(args, "dataset_samples", None):
        return [sample.prompt for sample in args.dataset_samples]
    given = list(args.prompt or []) + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
    if given:
        return [given[i % len(given)] for i in range(args.num_prompts)]
    rng = random.Random(args.seed)
    lo, hi = args.vocab_range
    if args.endpoint == "/v1/chat/completions":
        return [" ".join(rng.choice(WORDS) for _ in range(args.input_len)) for _ in range(args.num_prompts)]
    return [[rng.randrange(lo, hi) for _ in range(args.input_len)] for _ in range(args.num_prompts)]


def output_lens(args: argparse.Namespace) -> list[int]:
    """The tokens each request of the workload generates: the dataset's, else --output-len each."""
    if getattr(args, "dataset_samples", None):
        return [sample.expected_output_len for sample in args.dataset_samples]
    return [args.output_len] * args.num_prompts


def load_dataset(args: argparse.Namespace) -> None:
    """args.dataset_samples of --dataset-name sharegpt or custom (and --num-prompts, fewer with
    --no-oversample), counted with --tokenizer, --model or the server's model; nothing for random."""
    if args.dataset_name == "random":
        return
    datasets.read_text(args.dataset_path)        # a missing file is named before the server is asked
    if args.tokenizer or args.model:
        option = "--tokenizer" if args.tokenizer else "--model"
        tokenizer = datasets.load_tokenizer(args.tokenizer or args.model, option)
    else:
        name, root = asyncio.run(_server_model_card(args))
        tokenizer = datasets.first_tokenizer(_tokenizer_sources(name, root),
                                             f"the server's model {name} (give --tokenizer)")
    args.dataset_samples = datasets.sample_requests(args, tokenizer)
    args.num_prompts = len(args.dataset_samples)


def _tokenizer_sources(name: str, root: str | None) -> list[str]:
    """Where the tokenizer of a served model may be: its root first when that is a directory here (the
    model's own path, which a --served-model-name hides from its name), else its name, then its root."""
    if not root or root == name:
        return [name]
    return [root, name] if os.path.isdir(root) else [name, root]


def read_prompts_file(path: str) -> list[str]:
    """The prompts of --prompts-file, one a line, split as minillm generate splits its --prompts-file
    (a byte-order mark is no part of the first); a BenchError naming the option when the file cannot
    be read, is not UTF-8 or holds none (an empty one fell back to random prompts without a word)."""
    from minillm.cli import prompt_lines
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            prompts = prompt_lines(f.read())
    except UnicodeDecodeError as exc:
        raise BenchError(f"--prompts-file {path} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    except OSError as exc:
        raise BenchError(f"--prompts-file: cannot read {path}: {exc.strerror or exc}") from None
    if not prompts:
        raise BenchError(f"--prompts-file {path} holds no prompts")
    return prompts


# vLLM bench serve's sampling options, sent with each request when given: name -> type.
SAMPLING_OPTIONS = {"top_p": float, "top_k": int, "min_p": float}


def sampling_options(args: argparse.Namespace) -> dict:
    """The SAMPLING_OPTIONS given on the command line."""
    return {name: getattr(args, name) for name in SAMPLING_OPTIONS if getattr(args, name) is not None}


def check_sampling_options(p: BenchParser, args: argparse.Namespace) -> None:
    """--temperature and SAMPLING_OPTIONS checked as SamplingParams checks them: a usage error naming the flag."""
    from minillm.sampling_params import SamplingParams
    try:
        SamplingParams(temperature=args.temperature, **sampling_options(args))
    except ValueError as exc:
        name, _, rest = " ".join(str(exc).split()).partition(" ")
        p.error(f"--{name.replace('_', '-')} {rest}")


def request_body(args: argparse.Namespace, model: str, prompt: str | list[int],
                 max_tokens: int | None = None) -> dict:
    """The JSON body of one streaming request (of max_tokens, else --output-len)."""
    body = {"model": model, "max_tokens": max_tokens or args.output_len, "temperature": args.temperature,
            **sampling_options(args), "ignore_eos": args.ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": prompt if isinstance(prompt, str) else str(prompt)}]
    else:
        body["prompt"] = prompt
    return body


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    """The fields of a stream event the client reads (the rest are skipped unparsed)."""

    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: dict | None = None


_CHUNK_DECODER = msgspec.json.Decoder(_Chunk)


def _has_text(chunk: _Chunk) -> bool:
    for choice in chunk.choices or ():
        if choice.text or (choice.delta is not None and choice.delta.content):
            return True
    return False


def sse_data(buffer: bytearray, data: bytes) -> list[bytes]:
    """Append received bytes to `buffer`; the payloads of the `data:` lines now complete (a cheap
    split of the raw stream, so the client costs far less per event than the server it measures)."""
    buffer += data
    cut = buffer.rfind(b"\n")
    if cut < 0:
        return []
    lines = bytes(buffer[:cut]).split(b"\n")
    del buffer[:cut + 1]
    return [line[5:].strip() for line in lines if line.startswith(b"data:")]


class StreamClosed(ConnectionError):
    """The server closed the connection before the response ended."""


@contextlib.asynccontextmanager
async def open_stream(url: str, payload: bytes, headers: dict[str, str | bytes]):
    """POST `payload` (JSON) to `url` on a connection of its own; yields (status, the body's pieces).

    A plain HTTP/1.1 client on asyncio streams: httpx's connection pool scans every connection
    each time one is taken or returned, which with hundreds of streams in flight cost the client
    more CPU than the server spent on them."""
    parts = urllib.parse.urlsplit(url)
    secure = parts.scheme == "https"
    port = parts.port or (443 if secure else 80)
    reader, writer = await asyncio.open_connection(parts.hostname, port, ssl=True if secure else None,
                                                   limit=1 << 20)
    try:
        host = parts.netloc.rpartition("@")[2]
        head = [f"POST {parts.path or '/'} HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
                f"Content-Length: {len(payload)}", "Connection: close", "Accept: text/event-stream"]
        # latin-1 round-trips each byte: a header given as bytes (an API key's UTF-8) goes as it is
        head += [f"{k}: {v.decode('latin-1') if isinstance(v, bytes) else v}" for k, v in headers.items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + payload)
        status_line = await reader.readline()
        fields = status_line.split(None, 2)
        if len(fields) < 2 or not fields[0].startswith(b"HTTP/"):
            raise StreamClosed(f"not an HTTP response: {status_line[:80]!r}")
        response_headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            response_headers[name.strip().lower()] = value.strip()
        yield int(fields[1]), _body(reader, response_headers)
    finally:
        writer.close()


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The body as it arrives: chunked, of a Content-Length, or up to the close."""
    if "chunked" not in headers.get("transfer-encoding", "").lower():
        remaining = int(headers["content-length"]) if "content-length" in headers else -1
        while remaining:
            data = await reader.read(65536 if remaining < 0 else min(remaining, 65536))
            if not data:
                if remaining > 0:
                    raise StreamClosed("the response ended early")
                return
            remaining -= len(data) if remaining > 0 else 0
            yield data
        return
    buffer = b""
    while True:
        data = await reader.read(65536)
        if not data:
            raise StreamClosed("the response ended early")
        buffer += data
        pieces = []
        while (eol := buffer.find(b"\r\n")) >= 0:
            size = int(buffer[:eol].split(b";", 1)[0], 16)
            end = eol + 2 + size
            if size == 0:
                if pieces:
                    yield b"".join(pieces)
                return
            if len(buffer) < end + 2:
                break
            pieces.append(buffer[eol + 2:end])
            buffer = buffer[end + 2:]
        if pieces:
            yield b"".join(pieces)


async def send_request(url: str, body: dict, headers: dict[str, str | bytes], timeout: float) -> RequestResult:
    """Stream one request and time its chunks (at most `timeout` seconds)."""
    result = RequestResult(ok=False, start_s=time.monotonic())
    try:
        await asyncio.wait_for(_stream_request(url, body, headers, result), timeout)
    except (asyncio.TimeoutError, TimeoutError):
        result.error = f"no answer within {timeout:g} s"
    result.end_s = time.monotonic()
    return result


async def _stream_request(url: str, body: dict, headers: dict[str, str | bytes], result: RequestResult) -> RequestResult:
    start = last = time.perf_counter()
    num_chunks = 0
    buffer = bytearray()
    try:
        async with open_stream(url, json.dumps(body).encode(), headers) as (status, body_iter):
            if status != 200:
                result.error = f"HTTP {status}: {b''.join([piece async for piece in body_iter])[:200]!r}"
                return result
            async for data in body_iter:
                now = time.perf_counter()
                for payload in sse_data(buffer, data):
                    if payload == b"[DONE]":
                        break
                    chunk = _CHUNK_DECODER.decode(payload)
                    if chunk.error is not None:
                        result.error = str(chunk.error.get("message"))
                        return result
                    if chunk.usage is not None:
                        result.prompt_tokens = chunk.usage.prompt_tokens
                        result.output_tokens = chunk.usage.completion_tokens
                    if _has_text(chunk):
                        if num_chunks == 0:
                            result.ttft_s = now - start
                        else:
                            result.itl_s.append(now - last)
                        last, num_chunks = now, num_chunks + 1
    except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"   # msgspec.DecodeError is a ValueError
        return result
    result.latency_s = time.perf_counter() - start
    result.output_tokens = result.output_tokens or num_chunks
    result.num_chunks = num_chunks
    result.ok = num_chunks > 0
    if not result.ok:
        result.error = "no tokens streamed"
    return result


async def arrivals(n: int, rate: float, rng: random.Random, burstiness: float = 1.0):
    """Yield request indices at arrival times of a Poisson process (all at once when rate is inf), or
    as vLLM's --burstiness draws them: gamma-distributed gaps of shape burstiness and mean 1 / rate."""
    for i in range(n):
        yield i
        if rate != float("inf") and i < n - 1:
            gap = rng.expovariate(rate) if burstiness == 1 else rng.gammavariate(burstiness, 1 / (rate * burstiness))
            await asyncio.sleep(gap)


# Seconds the server has to list its models before the run: an answer that needs no engine step, so
# a server that holds it longer is stuck (the requests' own --timeout is 600 s by default).
MODEL_LIST_TIMEOUT_S = 30.0


async def resolve_model(client: httpx.AsyncClient, base_url: str, model: str | None) -> str:
    """The given model name, or the first one the server lists; BenchError when none answers."""
    response = await _model_list(client, base_url)
    return model or _listed_models(response, base_url)[0]["id"]


async def model_cards(client: httpx.AsyncClient, base_url: str) -> list[dict]:
    """The models the server lists (the first with a string id); BenchError as resolve_model's."""
    return _listed_models(await _model_list(client, base_url), base_url)


async def _model_list(client: httpx.AsyncClient, base_url: str) -> httpx.Response:
    """The server's answer to GET /v1/models; BenchError when there is no server or it refuses."""
    timeout = min(MODEL_LIST_TIMEOUT_S, client.timeout.read or MODEL_LIST_TIMEOUT_S)
    try:
        response = await client.get(f"{base_url}/v1/models", timeout=timeout)
    except httpx.TimeoutException:
        raise BenchError(f"no answer from {base_url}/v1/models within {timeout:g} s: the server takes "
                         f"connections but does not answer") from None
    except httpx.HTTPError as exc:
        raise BenchError(f"no server answers at {base_url} ({type(exc).__name__}); start one with "
                         f"minillm serve MODEL, or point --base-url at it") from None
    if response.status_code in (401, 403):
        advice = ("the key given (--api-key, else $OPENAI_API_KEY) is not one of its keys"
                  if "authorization" in client.headers else "give its key with --api-key or $OPENAI_API_KEY")
        raise BenchError(f"the server at {base_url} refused the request ({response.status_code}); {advice}")
    if response.status_code != 200:
        raise BenchError(f"{base_url}/v1/models answered {response.status_code}: is it an "
                         f"OpenAI-compatible server?")
    return response


def _listed_models(response: httpx.Response, base_url: str) -> list[dict]:
    """The model cards of a /v1/models answer; BenchError when it lists none with a string id first."""
    try:
        cards = response.json()["data"]
        if isinstance(cards[0], dict) and isinstance(cards[0]["id"], str):
            return cards
    except (ValueError, KeyError, IndexError, TypeError):
        pass
    raise BenchError(f"{base_url}/v1/models lists no model; give one with --model")


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class ClientShare:
    """What one client process drives: its requests (indices into the workload), its cap on requests in
    flight and its arrival rate; the shares of all client processes add up to the whole workload."""

    indices: list[int]
    max_concurrency: int | None
    request_rate: float
    seed: int


@dataclass
class ShareResult:
    """One client process's requests as measured, its timed span (time.monotonic()) and its CPU seconds."""

    results: list[RequestResult]
    start: float
    end: float
    cpu_s: float


def client_shares(args: argparse.Namespace) -> list[ClientShare]:
    """The workload split over --num-client-processes (no more processes than requests in flight)."""
    cap = args.max_concurrency or args.num_prompts
    n = max(1, min(args.num_client_processes, cap, args.num_prompts))
    shares = []
    for w in range(n):
        concurrency = cap // n + (1 if w < cap % n else 0)
        shares.append(ClientShare(list(range(w, args.num_prompts, n)),
                                  concurrency if args.max_concurrency else None, args.request_rate / n, args.seed + w))
    return shares


async def run_share(args: argparse.Namespace, base_url: str, share: ClientShare, barrier=None,
                    done: Callable[[], None] | None = None) -> ShareResult:
    """Drive one share of the workload against one server (after `barrier`, when given, lets every
    client process start together); `done`, when given, is called as each request ends."""
    base_url = base_url.rstrip("/")
    headers = authorization_headers(args.api_key)
    async with httpx.AsyncClient(headers=headers, timeout=args.timeout) as client:
        model = await resolve_model(client, base_url, args.served_model_name or args.model)
    prompts, max_tokens = build_prompts(args), output_lens(args)
    gate = asyncio.Semaphore(share.max_concurrency) if share.max_concurrency else None

    async def one(i: int) -> RequestResult:
        body = request_body(args, model, prompts[i], max_tokens[i])
        async with gate or contextlib.nullcontext():
            result = await send_request(base_url + args.endpoint, body, headers, args.timeout)
        if done is not None:
            done()
        return result

    if barrier is not None:
        barrier.wait()
    cpu, start = _cpu_seconds(), time.monotonic()
    tasks = [asyncio.create_task(one(share.indices[k]))
             async for k in arrivals(len(share.indices), share.request_rate, random.Random(share.seed),
                                     args.burstiness)]
    results = await asyncio.gather(*tasks)
    return ShareResult(list(results), start, time.monotonic(), _cpu_seconds() - cpu)


def _client_process(args: argparse.Namespace, base_url: str, share: ClientShare, barrier, out, w: int,
                    num_done=None) -> None:
    """A client process's entry point: its share's result, or the error, goes to `out` with its index `w`;
    each request that ends adds one to `num_done` (a shared integer) when given."""
    _exit_with_parent()

    def done() -> None:
        with num_done.get_lock():
            num_done.value += 1

    try:
        out.put((w, asyncio.run(run_share(args, base_url, share, barrier, done if num_done is not None else None))))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        barrier.abort()
        out.put((w, BenchError(f"a client process failed: {type(exc).__name__}: {exc}")))


def _exit_with_parent() -> None:
    """End this client process when the run's process ends: multiprocessing stops its daemons when
    their parent exits, not when it is killed, and they went on sending the workload (or waited at
    the start barrier) for ever."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()            # its sentinel closes when it ends, however it ends
        os._exit(1)

    threading.Thread(target=watch, name="minillm-bench-parent-watch", daemon=True).start()


def run_shares(args: argparse.Namespace, base_url: str, shares: list[ClientShare], bar=None) -> list[ShareResult]:
    """Each share in its own spawned process, all starting together; their results in the shares' order.
    bar: a progress bar, brought up to the requests the processes have ended while they run."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(len(shares)), ctx.Queue()
    num_done = ctx.Value("q", 0) if bar is not None else None
    procs = [ctx.Process(target=_client_process, args=(args, base_url, share, barrier, out, w, num_done),
                         name=f"minillm-bench-client-{w}", daemon=True) for w, share in enumerate(shares)]
    for proc in procs:
        proc.start()
    got: dict = {}
    try:
        while len(got) < len(procs):
            try:
                w, item = out.get(timeout=0.1)
                got[w] = item
            except queue.Empty:
                _check_client_processes(procs, got, out)
            if bar is not None:
                bar.update(num_done.value - bar.n)
    except BaseException:
        barrier.abort()          # the others may wait there for one that is gone
        for proc in procs:
            proc.kill()
        raise
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    for item in got.values():
        if isinstance(item, BaseException):
            raise item
    return [got[w] for w in range(len(shares))]


def _check_client_processes(procs: list, got: dict, out) -> None:
    """A BenchError naming a client process that ended without putting its result in `out` (killed,
    out of memory); a result it put before it ended is read into `got` first."""
    gone = [w for w, proc in enumerate(procs) if w not in got and proc.exitcode is not None]
    if not gone:
        return
    while True:                  # a process that ended has flushed what it put
        try:
            w, item = out.get(timeout=0.5)
        except queue.Empty:
            break
        got[w] = item
    gone = [w for w in gone if w not in got]
    if gone:
        raise BenchError(f"client process {gone[0]} of --num-client-processes ended without a result "
                         f"(exit code {procs[gone[0]].exitcode})")


def benchmark(args: argparse.Namespace, base_url: str) -> BenchmarkResult:
    """Drive the whole workload against one server, from --num-client-processes processes (one: this one)."""
    shares = client_shares(args)
    bar = progress_bar(args, args.num_prompts)
    tracer = None
    if args.step_trace:
        from minillm.benchmarks.step_trace import StepTracer
        tracer = StepTracer(base_url, args.step_trace_interval, authorization_headers(args.api_key)).start()
    try:
        if len(shares) == 1:
            parts = [asyncio.run(run_share(args, base_url, shares[0], done=None if bar is None else bar.update))]
        else:
            parts = run_shares(args, base_url, shares, bar)
    finally:
        if tracer is not None:
            tracer.stop()
        if bar is not None:
            bar.close()
    results = [r for part in parts for r in part.results]
    start = min(p.start for p in parts)
    summary = summarize(base_url.rstrip("/"), args.num_prompts, results, max(p.end for p in parts) - start,
                        sum(p.cpu_s for p in parts), args.metric_percentiles)
    if args.save_detailed:
        summary.requests = [request_detail(r, start, client) for client, part in enumerate(parts) for r in part.results]
        summary.start_monotonic_s = start      # to line the requests up with the server's own logs
    if tracer is not None:
        summary.steps, summary.steps_missed = tracer.steps(start), tracer.missed()
        if tracer.polls == 0:    # a server with no /v1/stats (another engine): say so, the run stands
            print(f"--step-trace: {base_url.rstrip('/')}/v1/stats answered no poll "
                  f"({tracer.errors[-1] if tracer.errors else 'none made'}); no steps kept", file=sys.stderr)
    return summary


def progress_bar(args: argparse.Namespace, total: int):
    """A tqdm bar of the requests ended, on stderr when it is a terminal, as vLLM draws one (None with
    --disable-tqdm, or when stderr is a file or a pipe: the bar's redraws would fill it)."""
    if args.disable_tqdm or sys.stderr is None or not sys.stderr.isatty():
        return None
    from tqdm import tqdm       # comes with huggingface-hub
    return tqdm(total=total, file=sys.stderr, unit="req", dynamic_ncols=True)


def request_detail(r: RequestResult, run_start: float, client: int = 0) -> dict:
    """One request's timings for --save-detailed (milliseconds; start from the run's start), and the
    client process that sent it: its TTFT, E2EL and ITLs are those the printed figures are made of."""
    return {"client": client, "start_ms": 1000 * (r.start_s - run_start), "end_ms": 1000 * (r.end_s - run_start),
            "ttft_ms": 1000 * r.ttft_s if r.ok else None, "e2el_ms": 1000 * r.latency_s if r.ok else None,
            "itl_ms": [1000 * x for x in r.itl_s],
            "output_tokens": r.output_tokens, "error": r.error or None}


def _percentiles(values: list[float], percentiles: list[float] = ()) -> dict:
    """mean / median / p99 (and std) in milliseconds, and each of percentiles as "p25", "p99.9", ...
    (interpolated linearly between the closest ranks, as vLLM's np.percentile; all 0 for no value)."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0, "std": 0.0, **{f"p{percentile_word(q)}": 0.0
                                                                        for q in percentiles}}
    ordered = sorted(v * 1000 for v in values)

    def pct(q: float) -> float:
        k = (len(ordered) - 1) * q / 100
        lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    mean = sum(ordered) / len(ordered)
    std = (sum((v - mean) ** 2 for v in ordered) / len(ordered)) ** 0.5
    return {"mean": mean, "median": pct(50), "p99": pct(99), "std": std,
            **{f"p{percentile_word(q)}": pct(q) for q in percentiles}}


def vllm_metric_figures(r: BenchmarkResult, metrics: list[str], percentiles: list[float]) -> dict:
    """The figures `vllm bench serve` saves for each selected metric: mean_ttft_ms, median_ttft_ms,
    std_ttft_ms and p25_ttft_ms, p99_ttft_ms, ... for each of percentiles."""
    out = {}
    for metric in metrics:
        figures = getattr(r, f"{metric}_ms")
        for stat in ("mean", "median", "std", *(f"p{percentile_word(q)}" for q in percentiles)):
            out[f"{stat}_{metric}_ms"] = figures[stat]
    return out


def result_record(r: BenchmarkResult, args: argparse.Namespace) -> dict:
    """One server's result as saved: its fields, and vLLM's names of the selected metrics' figures."""
    return {**asdict(r), **vllm_metric_figures(r, args.percentile_metrics, args.metric_percentiles)}


def latency_figures(ok: list[RequestResult], percentiles: list[float] = ()) -> dict[str, dict]:
    """ttft_ms, tpot_ms, itl_ms and e2el_ms of answered requests: each _percentiles' figures."""
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {"ttft_ms": _percentiles([r.ttft_s for r in ok], percentiles), "tpot_ms": _percentiles(tpot, percentiles),
            "itl_ms": _percentiles([x for r in ok for x in r.itl_s], percentiles),
            "e2el_ms": _percentiles([r.latency_s for r in ok], percentiles)}


def latency_columns(args: argparse.Namespace) -> list[str]:
    """A table's latency columns: one per metric of --percentile-metrics, its mean, median and each
    of --metric-percentiles, as vLLM prints them ("TTFT mean / median / P99 (ms)")."""
    stats = " / ".join(["mean", "median", *(f"P{percentile_word(q)}" for q in args.metric_percentiles)])
    return [f"{METRICS[metric][0]} {stats} (ms)" for metric in args.percentile_metrics]


def latency_cells(r, args: argparse.Namespace) -> list[str]:
    """The latency_columns' cells of a result that holds ttft_ms, tpot_ms, itl_ms and e2el_ms."""
    stats = ["mean", "median", *(f"p{percentile_word(q)}" for q in args.metric_percentiles)]
    return [" / ".join(f"{getattr(r, f'{metric}_ms')[stat]:.1f}" for stat in stats)
            for metric in args.percentile_metrics]


def summarize(base_url: str, num_prompts: int, results: list[RequestResult], duration: float,
              client_cpu_s: float = 0.0, percentiles: list[float] = ()) -> BenchmarkResult:
    """Turn per-request measurements into throughput and latency figures (percentiles: those kept
    beside the median and p99 of each latency)."""
    ok = [r for r in results if r.ok]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    return BenchmarkResult(
        base_url=base_url, num_prompts=num_prompts, completed=len(ok), failed=len(results) - len(ok),
        duration_s=duration, total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=len(ok) / duration, output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration, **latency_figures(ok, percentiles),
        errors=sorted({r.error for r in results if not r.ok})[:5],
        total_chunks=sum(r.num_chunks for r in ok), client_cpu_s=client_cpu_s)


class OfflineCeiling:
    """The same prompts through minillm's engine in this process: no HTTP, no JSON, no client."""

    def __init__(self, args: argparse.Namespace) -> None:
        from minillm import LLM, SamplingParams

        self.prompts = build_prompts(args)
        self.params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len,
                                     ignore_eos=args.ignore_eos, seed=args.seed, **sampling_options(args))
        self.llm = LLM(args.offline_model, **args.offline_engine_args)
        # warm-up: first-call costs are not throughput
        self.llm.generate(self.prompts[:1], self.params, use_tqdm=False)

    def throughput(self, concurrency: int | None) -> float:
        """Output tok/s with `concurrency` requests in flight (all at once when None), a new one admitted
        as each finishes, as the server's client does."""
        engine, prompts = self.llm.engine, list(enumerate(self.prompts))
        limit = concurrency or len(prompts)
        produced = 0
        start = time.perf_counter()
        while prompts and len(engine.requests) < limit:
            i, prompt = prompts.pop(0)
            engine.add_request(f"ceiling-{i}", prompt, self.params, output_kind="final")
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    produced += sum(len(c.token_ids) for c in out.outputs)
                    if prompts:
                        i, prompt = prompts.pop(0)
                        engine.add_request(f"ceiling-{i}", prompt, self.params, output_kind="final")
        return produced / (time.perf_counter() - start)

    def shutdown(self) -> None:
        """Release the engine's memory."""
        self.llm.shutdown()


def offline_ceiling(args: argparse.Namespace) -> float:
    """Output tok/s of the same prompts through minillm's offline engine, at --max-concurrency."""
    ceiling = OfflineCeiling(args)
    try:
        return ceiling.throughput(args.max_concurrency)
    finally:
        ceiling.shutdown()


def format_results(results: list[BenchmarkResult], args: argparse.Namespace, ceiling: float | None = None) -> str:
    """A vLLM-style table; with a peer, one column per server and our/peer ratios."""
    rows: list[tuple[str, list[str]]] = [
        ("Successful requests", [str(r.completed) for r in results]),
        ("Failed requests", [str(r.failed) for r in results]),
        ("Benchmark duration (s)", [f"{r.duration_s:.2f}" for r in results]),
        ("Total input tokens", [str(r.total_input_tokens) for r in results]),
        ("Total generated tokens", [str(r.total_output_tokens) for r in results]),
        ("Request throughput (req/s)", [f"{r.request_throughput:.2f}" for r in results]),
        ("Output token throughput (tok/s)", [f"{r.output_throughput:.2f}" for r in results]),
        ("Total token throughput (tok/s)", [f"{r.total_token_throughput:.2f}" for r in results]),
        ("Output tokens per streamed event", [f"{r.total_output_tokens / max(r.total_chunks, 1):.2f}"
                                              for r in results]),
        ("Client CPU per output token (us)", [_cpu_per_token(r) for r in results]),
    ]
    for metric in args.percentile_metrics:          # as vLLM prints them: a section each, mean, median, P...
        title, header = METRICS[metric]
        rows.append((f"{header:-^60}", []))
        for stat in ("mean", "median", *(f"p{percentile_word(q)}" for q in args.metric_percentiles)):
            rows.append((f"{stat.capitalize()} {title} (ms)",
                         [f"{getattr(r, f'{metric}_ms')[stat]:.2f}" for r in results]))
    rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}"
    lines = [f"Traffic: request rate {rate} req/s, max concurrency {args.max_concurrency or 'none'}, "
             f"{args.num_prompts} prompts, {workload_shape(args)}",
             "{:=^60}".format(" Serving Benchmark Result ")]
    if len(results) > 1:
        lines.append(f"{'':<36}{'server':>12}{'peer':>12}")
    for name, values in rows:
        lines.append(f"{name + ':':<36}" + "".join(f"{v:>12}" for v in values) if values else name)
    if len(results) > 1 and results[1].output_throughput > 0:
        ratio = results[0].output_throughput / results[1].output_throughput
        lines.append(f"{'Output throughput vs peer:':<36}{ratio:>12.2f}x")
    if ceiling:
        lines.append(f"{'Offline engine ceiling (tok/s):':<36}{ceiling:>12.2f}")
        lines.append(f"{'Server output throughput / ceiling:':<36}{results[0].output_throughput / ceiling:>12.2f}")
    for r in results:
        for err in r.errors:
            lines.append(f"error ({r.base_url}): {err}")
    lines.append("=" * 60)
    return "\n".join(lines)


def workload_shape(args: argparse.Namespace) -> str:
    """The prompts' shape as the traffic line says it: random lengths, or the dataset and its output tokens."""
    if args.prompt or args.prompts_file:      # their lengths are the prompts' own, not --input-len's
        return f"given by --prompt / --prompts-file (cycled), output {args.output_len} tokens"
    if not getattr(args, "dataset_samples", None):
        return f"input {args.input_len} / output {args.output_len} tokens"
    lens = output_lens(args)
    return (f"dataset {args.dataset_name} {args.dataset_path}, output {min(lens)}-{max(lens)} tokens "
            f"({sum(lens)} in all)")


def _cpu_per_token(r: BenchmarkResult) -> str:
    """The client's CPU per output token as printed: "-" when no token came (nothing to divide by)."""
    return f"{r.client_cpu_us_per_token:.1f}" if r.total_output_tokens else "-"


def format_sweep(rows: list[tuple[int, BenchmarkResult, float | None]], args: argparse.Namespace) -> str:
    """One row per concurrency: the server's output throughput beside the offline ceiling at that level,
    and the latencies --percentile-metrics and --metric-percentiles select."""
    rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}"
    columns = ["max concurrency", "server output tok/s", "offline ceiling tok/s", "server / ceiling",
               *latency_columns(args), "failed", "tokens / event", "client CPU us / token"]
    lines = [f"Traffic: request rate {rate} req/s, {args.num_prompts} prompts, {workload_shape(args)}",
             markdown_row(columns), markdown_row(["---"] * len(columns))]
    for level, r, ceiling in rows:
        ratio = f"{r.output_throughput / ceiling:.2f}" if ceiling else "-"
        ceiling_text = f"{ceiling:,.0f}" if ceiling else "-"
        lines.append(markdown_row([str(level), f"{r.output_throughput:,.0f}", ceiling_text, ratio,
                                   *latency_cells(r, args), str(r.failed),
                                   f"{r.total_output_tokens / max(r.total_chunks, 1):.2f}", _cpu_per_token(r)]))
    for _, r, _ in rows:
        for err in r.errors:
            lines.append(f"error ({r.base_url}): {err}")
    return "\n".join(lines)


def markdown_row(cells: list[str]) -> str:
    """One row of a Markdown table."""
    return "| " + " | ".join(cells) + " |"


def run_sweep(args: argparse.Namespace) -> tuple[list[tuple[int, BenchmarkResult, float | None]], str]:
    """The workload at each concurrency of the sweep against the server, then the ceiling at each."""
    # One request first, untimed, as `vllm bench serve` does: first-call costs are not throughput.
    benchmark(argparse.Namespace(**{**vars(args), "num_prompts": 1, "max_concurrency": 1, "step_trace": False,
                                    "disable_tqdm": True}), args.base_url)
    results = []
    for level in args.concurrency_sweep:
        results.append((level, benchmark(argparse.Namespace(**{**vars(args), "max_concurrency": level}),
                                         args.base_url)))
    ceilings: list[float | None] = [None] * len(results)
    if args.offline_model:
        ceiling = OfflineCeiling(args)
        try:
            ceilings = [ceiling.throughput(level) for level, _ in results]
        finally:
            ceiling.shutdown()
    rows = [(level, r, c) for (level, r), c in zip(results, ceilings)]
    return rows, format_sweep(rows, args)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table; 0 when every request succeeded."""
    args = parse_args(argv)
    if args.save_result:
        args.result_file = saved_result_path(args)
        check_output_file(args.result_file, "--result-dir" if args.result_filename is None else "--result-filename")
    else:
        check_output_file(args.result_file, "--result-file")
    if args.prompts_file:
        read_prompts_file(args.prompts_file)        # before connecting: a bad file is found at once
    load_dataset(args)
    saved_args = {k: v for k, v in vars(args).items() if k not in ("api_key", "dataset_samples")}
    if args.mixed_users is not None:
        from minillm.benchmarks import serving_mixed
        mixed, table = serving_mixed.main_mixed(args)
        print(table)
        if args.result_file:
            with open(args.result_file, "w", encoding="utf-8") as f:
                json.dump({"args": saved_args, "mixed": serving_mixed.as_dict(mixed, args)}, f, indent=2, default=str)
        return 0 if mixed.users_mixed.failed == 0 and mixed.long_mixed.failed == 0 else 1
    if args.concurrency_sweep:
        rows, table = run_sweep(args)
        print(table)
        if args.result_file:
            with open(args.result_file, "w", encoding="utf-8") as f:
                json.dump({"args": saved_args, "sweep": [{"max_concurrency": level, "result": result_record(r, args),
                                                          "offline_ceiling_tok_s": c} for level, r, c in rows]},
                          f, indent=2, default=str)
        return 0 if all(r.failed == 0 for _, r, _ in rows) else 1
    urls = [args.base_url] + ([args.peer_base_url] if args.peer_base_url else [])
    results = [benchmark(args, url) for url in urls]
    ceiling = offline_ceiling(args) if args.offline_model else None
    print(format_results(results, args, ceiling))
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump({"args": saved_args, "results": [result_record(r, args) for r in results],
                       "offline_ceiling_tok_s": ceiling},
                      f, indent=2, default=str)
    return 0 if all(r.failed == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(run_main(main, "minillm bench serving"))
