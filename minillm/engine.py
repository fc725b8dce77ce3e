"""LLMEngine: add requests, step the scheduler and the model, hand back RequestOutputs."""
from __future__ import annotations

import math
import numbers
import random
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NoReturn

from minillm.block_manager import BlockManager, are_prompt_block_keys, cache_salt_root
from minillm.config import EngineConfig, check_max_model_len_in_model, check_unchunked_prefill, model_length
from minillm.device import make_device
from minillm.engine_stats import MAX_WAITING_ROWS, EngineInfo, build_stats
from minillm.generation_config import (defaults_source, describe as describe_defaults, folder_stop_token_ids,
                                       model_sampling_defaults)
from minillm.kv_connector import make_kv_connector
from minillm.kv_connector.base import refuse_kv_transfer_params
from minillm.loader import load_model_config, load_weights, resolve_model_path
from minillm.metrics_tracker import MetricsTracker
from minillm.model_config_view import EngineModelConfig, engine_model_config
from minillm.model_runner import InFlightStep, ModelRunner
from minillm.models.dummy import dummy_weights
from minillm.ops import get_ops
from minillm.output_processor import TextOutputs, note_finishes, prompt_logprobs_context
from minillm.parallel.errors import TensorParallelError
from minillm.outputs import RequestMetrics, RequestOutput
from minillm.prompts import (
    PromptType, cache_salt_of, checked_token_ids, request_add_special_tokens, text_token_ids, unpack_prompt,
)
from minillm.sampling_params import (
    RequestOutputKind, SamplingParams, check_truncate_prompt_tokens, short_repr, truncate_prompt,
)
from minillm.request_queue import check_priority
from minillm.scheduler import Scheduler
from minillm.sequence import Sequence, SequenceStatus
from minillm.stats import EngineStats
from minillm.step import SchedulerOutput, StepOutput
from minillm.step_cost import measured_seconds
from minillm.tokenizer import Tokenizer, engine_tokenizer


@dataclass(eq=False)
class Request:
    """A request: its prompt, its n sequences and their output states (hashed by identity: an
    aborted request and a new one that took its id are two requests until the first is reported)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    states: list                      # per sequence, the output processor's state
    metrics: RequestMetrics
    final_only: bool = False          # report only once finished (offline batch)
    is_delta: bool = False            # report only what is new (RequestOutputKind.DELTA)
    is_prompt_logprobs_sent: bool = False   # a delta request's prompt_logprobs go out once, whole
    # With params.prompt_logprobs: one entry per prompt token, None for the first (its own module:
    # minillm/prompt_logprobs.py); filled as the prompt's chunks run.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    finish_order: dict[int, None] = field(default_factory=dict)   # n > 1: its sequences' indices as they finished

    @property
    def is_finished(self) -> bool:
        """True when every sequence has finished."""
        for seq in self.seqs:            # a loop, not all(): asked of every request every step
            if not seq.is_finished:
                return False
        return True


# add_request's output_kind names, as vLLM's RequestOutputKind members.
OUTPUT_KINDS = {"cumulative": RequestOutputKind.CUMULATIVE, "delta": RequestOutputKind.DELTA,
                "final": RequestOutputKind.FINAL_ONLY}


# An engine whose waiting requests do not fit while a KV connector holds blocks (a prefill engine's
# leases) looks again this often: a lease ends when its consumer releases it, or within lease_s.
KV_LEASE_WAIT_S = 0.01


class StepError(RuntimeError):
    """A step failed on what its requests brought: they are aborted and the engine goes on."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids
        self.cause = cause


def own_sampling_params(params: SamplingParams) -> SamplingParams:
    """A request's own copy of validated params (vLLM clones them too): a caller that reuses one
    SamplingParams and changes it for its next request must not change this one's sampling and
    stops. The containers the engine reads are copied; the structured-output constraint is fixed
    once built and is shared; extra_args holds the caller's data and is copied one level deep."""
    own = object.__new__(type(params))      # a shallow copy (copy.copy's reduce protocol: 10 us more)
    own.__dict__.update(params.__dict__)
    own.stop_token_ids = list(params.stop_token_ids)
    if isinstance(params.stop, list):
        own.stop = list(params.stop)
    if params.logit_bias is not None:
        own.logit_bias = dict(params.logit_bias)
    if params.allowed_token_ids is not None:
        own.allowed_token_ids = list(params.allowed_token_ids)
    if params.bad_words is not None:
        own.bad_words = list(params.bad_words)
    if params.extra_args is not None:
        own.extra_args = dict(params.extra_args)
    return own


def check_arrival_time(arrival_time: float | None) -> None:
    """ValueError unless arrival_time is None or a finite number: the loop subtracts it from clock
    times (TTFT, latency), where a string or NaN would fail or poison them."""
    if arrival_time is not None and (isinstance(arrival_time, bool) or not isinstance(arrival_time, numbers.Real)
                                     or not math.isfinite(arrival_time)):
        raise ValueError(f"arrival_time must be a finite number of seconds, got {short_repr(arrival_time)}")


def check_reset_flags(reset_running_requests: object, reset_connector: object) -> None:
    """ValueError naming reset_prefix_cache's argument that is not true or false."""
    for name, value in (("reset_running_requests", reset_running_requests), ("reset_connector", reset_connector)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {short_repr(value)}")


def sequence_seed(seed: int, index: int) -> int:
    """The generator seed of a request's index-th sequence: seed + index as an unsigned 64-bit value
    (a negative seed reads as its two's complement), what NumPy's generator takes."""
    return (seed + index) % 2**64


def choose_backend(device: str) -> str:
    """'cpu' -> numpy, 'cuda' -> cuda, 'auto' -> cuda when CuPy sees a GPU."""
    if device == "cpu":
        return "numpy"
    if device == "cuda":
        try:
            import cupy
        except ImportError as exc:
            raise ValueError(f"device 'cuda' needs CuPy, which does not import ({exc}): install it with "
                             f"pip install -e '.[cuda12]', or '.[cuda13]' for a CUDA 13 driver") from None
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:          # no driver, or CuPy built for another CUDA
            raise ValueError(f"device 'cuda': CuPy finds no usable GPU ({type(exc).__name__}: {exc})") from None
        if count == 0:
            raise ValueError("device 'cuda': CuPy finds no GPU")
        return "cuda"
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return "cuda"
    except Exception:  # no CuPy, no driver or no device: the CPU it is
        pass
    return "numpy"


def fit_max_model_len(config: EngineConfig, requested: int, num_blocks: int) -> int:
    """max_model_len that the pool can hold: the requested one, or the pool's capacity when the
    model's default is larger (an explicit max_model_len that does not fit is an error)."""
    capacity = num_blocks * config.block_size
    if requested < 2:                     # no request could have a prompt token and a generated one
        raise ValueError(f"max_model_len {requested} leaves no room for a prompt and a generated token; "
                         f"raise max_model_len")
    if requested <= capacity:
        return requested
    if config.max_model_len is not None:
        raise ValueError(f"max_model_len {requested} needs {-(-requested // config.block_size)} "
                         f"KV blocks but the pool has {num_blocks}; lower max_model_len "
                         f"or raise {pool_size_knob(config)}")
    if capacity < 2:                      # the model's length, cut to a pool of one token
        raise ValueError(f"max_model_len {capacity} leaves no room for a prompt and a generated token; "
                         f"raise {pool_size_knob(config)} (the pool holds {capacity} token)")
    return capacity


def pool_size_knob(config: EngineConfig) -> str:
    """The setting that sized the KV pool, for an error that asks for a larger one."""
    if config.num_kv_blocks is not None:
        return "num_kv_blocks"
    if config.kv_cache_memory_bytes is not None:
        return "kv_cache_memory_bytes"
    return "kv_cache_memory_bytes (or gpu_memory_utilization on a GPU) or num_kv_blocks"


def resolve_dtype(config: EngineConfig, backend: str, checkpoint_dtype: str) -> str:
    """The compute dtype: float32 on the CPU, the checkpoint's own (or the asked) dtype on the GPU."""
    if backend == "numpy":
        if config.dtype not in ("auto", "float32"):
            raise ValueError(f"dtype {config.dtype!r} is not supported on the CPU backend; use float32")
        return "float32"
    if config.dtype != "auto":
        return config.dtype
    return checkpoint_dtype if checkpoint_dtype in ("float32", "float16", "bfloat16") else "bfloat16"


class LLMEngine:
    """The engine loop: not thread-safe, call everything from one thread.

    Start-up runs forward: load, size the KV pool, fit max_model_len to it, then build what depends
    on it. shutdown() (or leaving a `with` block) gives the device memory back.
    """

    def __init__(self, config: EngineConfig, log=None, output_processor=TextOutputs):
        self.config = config
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        path = resolve_model_path(config.model, config.download_dir, config.revision)
        self.model_path = path
        self.model_config = load_model_config(path)
        # An engine core's outputs are token ids: the API servers render chats and detokenize.
        self.tokenizer = engine_tokenizer(config, path, renders_chat=output_processor is TextOutputs)
        # structured_outputs_config's reasoning parser: the thinking tags constraints wait for (a bad tokenizer
        # fails here, before the weights load, as vLLM's parser fails at start-up)
        so_config = config.structured_outputs_config
        self._thinking_ids = so_config.thinking_token_ids(self.tokenizer) if so_config is not None else None
        # What a request that leaves them unset samples with (LLM.generate without params, the server).
        self.sampling_defaults = model_sampling_defaults(config, self.tokenizer)
        if self.sampling_defaults:
            self.log(f"minillm: sampling defaults from {defaults_source(config)}: "
                     f"{describe_defaults(self.sampling_defaults)}")
        # Text and stop strings per sequence; an engine core passes one that reports token ids only.
        self.output_processor = output_processor(self.tokenizer)
        self.backend = choose_backend(config.device)
        if config.kv_transfer_config is not None:    # before the weights load: a bad transport fails fast
            config.kv_transfer_config.check_backend(self.backend)
        if config.device == "auto":
            self.log(f"minillm: device auto -> {'cuda (CuPy sees a GPU)' if self.backend == 'cuda' else 'cpu (NumPy)'}")
        self.ops = get_ops(self.backend)
        self.device = make_device(self.backend)
        self.dtype = resolve_dtype(config, self.backend, self.model_config.torch_dtype)
        runner_cls = ModelRunner
        if config.tensor_parallel_size > 1:       # checked before the weights load: a bad size fails fast
            from minillm.parallel.executor import TensorParallelExecutor as runner_cls
            from minillm.parallel.sharding import check_tensor_parallel_size
            check_tensor_parallel_size(self.model_config, config.tensor_parallel_size, self.ops.name)
        model_max = model_length(self.model_config)[0]
        if config.max_model_len is not None and (warning := check_max_model_len_in_model(config.max_model_len,
                                                                                          self.model_config)):
            self.log(f"minillm: warning: {warning}")
        requested_len = config.max_model_len or model_max
        window = self.model_config.sliding_window
        if window is not None and requested_len > window:
            # Attention here is full-context: it is the model's windowed attention only for sequences
            # of at most `window` tokens (vLLM's --disable-sliding-window caps max_model_len the same way).
            if config.max_model_len is not None:
                raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's sliding_window "
                                 f"{window}: attention here is full-context, the model's own only up to "
                                 f"{window} tokens (give max_model_len {window} or less)")
            requested_len = window
            self.log(f"minillm: max_model_len {window}, the model's sliding_window (attention here is "
                     f"full-context, the model's own up to that length)")
        self.eos_token_ids = sorted(set(self.tokenizer.eos_token_ids))    # the files' EOS ids (Tokenizer)
        # vLLM's update_from_generation_config: the EOS ids beyond the tokenizer's own (the model's, and a
        # generation_config folder's) stop a request as its stop token ids do, so the one that ends it
        # is its stop_reason. A bad folder fails here, before the weights load.
        primary = self.tokenizer.eos_token_id
        self.extra_eos_token_ids = [t for t in self.eos_token_ids if t != primary]
        self.extra_eos_token_ids += [t for t in folder_stop_token_ids(config.generation_config, primary,
                                                                      self.model_config.vocab_size)
                                     if t not in self.extra_eos_token_ids]
        if config.load_format == "dummy":
            weights = dummy_weights(self.model_config, self.dtype, config.seed)
        else:
            weights = load_weights(path, self.model_config, self.dtype)
        self.runner = runner_cls(self.model_config, config, self.ops, self.device, weights, self.dtype,
                                 self.eos_token_ids)
        del weights
        num_blocks = self.runner.determine_num_blocks(requested_len)
        self.max_model_len = fit_max_model_len(config, requested_len, num_blocks)
        if self.max_model_len < requested_len:     # the model's own length does not fit: said once, here
            self.log(f"minillm: max_model_len {self.max_model_len}, the {num_blocks} KV blocks' capacity (the "
                     f"model allows {requested_len}; more KV memory or num_kv_blocks raises it)")
        if not config.enable_chunked_prefill:     # the model's length, fitted: known only now
            check_unchunked_prefill(config, self.max_model_len)
        self.runner.initialize_cache(num_blocks, self.max_model_len)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        step_cost = self._calibrate_step_cost() if config.has_step_budget else None
        self.kv_connector = make_kv_connector(config, self.runner, self.block_manager)   # None when off
        if self.kv_connector is not None and (line := self.kv_connector.describe()):
            self.log(f"minillm: {line}")
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, self.eos_token_ids, kv_connector=self.kv_connector,
                                   speculative_config=config.speculative_config, step_cost=step_cost,
                                   max_step_ms=config.max_step_ms, max_step_factor=config.max_step_factor,
                                   max_mixed_tokens=self.runner.max_mixed_graph_tokens,
                                   scheduling_policy=config.scheduling_policy,
                                   enable_chunked_prefill=config.enable_chunked_prefill)
        # By id: the unfinished requests, and finished ones until their last report (or until a new
        # request takes the id of an aborted one, as vLLM's engines take it at once).
        self.requests: dict[str, Request] = {}
        # Requests with news for the next outputs, in the order of their first news (an ordered set:
        # an aborted request's last report comes before those of a new request with its id).
        self._changed: dict[Request, None] = {}
        self._in_flight: deque[tuple[SchedulerOutput, InFlightStep]] = deque()   # launched, not read back
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.backend == "cuda")
        self._seed_rng = random.Random(config.seed)   # unseeded requests' seeds (0.1 us a draw; NumPy's: 6 us)
        spec = config.speculative_config
        self.metrics = MetricsTracker(num_spec_tokens=spec.num_speculative_tokens if spec else None)
        self.model_name = config.served_model_name or config.model
        self.run_id = uuid.uuid4().hex     # this engine's, in its stats: a restarted server's engine has another
        # From here the shape plus the values the engine runs with, as vLLM's model_config holds them
        # (llm.llm_engine.model_config.max_model_len); the runner keeps the plain shape it was built with.
        self.model_config = engine_model_config(self.model_config, config, path, self.max_model_len, self.dtype,
                                                self.model_name)
        self.structured_outputs = None   # StructuredOutputManager, built when a request first asks for structure
        self._fill_due = None            # (step, its masks) whose fill starts once the step before is read back
        self._deferred_out = None        # the step launched without its sampling (structured outputs)
        self.is_shut_down = False

    @classmethod
    def from_engine_args(cls, engine_args, usage_context=None, stat_loggers=None, enable_multiprocessing: bool = False,
                         log=None) -> LLMEngine:
        """vLLM's constructor from an EngineArgs (minillm.EngineArgs): its create_engine_config()'s engine.
        usage_context labels vLLM's usage statistics (minillm keeps none: any value is taken);
        stat_loggers (None) and enable_multiprocessing (False) are taken at what minillm does, a
        ValueError naming them otherwise. log: where start-up lines go (minillm's; default stderr)."""
        from minillm.engine_args import EngineArgs
        if not isinstance(engine_args, EngineArgs):
            raise TypeError(f"engine_args must be an EngineArgs, got {type(engine_args).__name__}")
        if stat_loggers is not None:
            raise ValueError(f"stat_loggers={short_repr(stat_loggers)} is not supported: minillm logs no stats "
                             f"lines; engine.stats() and the server's /metrics give them")
        if enable_multiprocessing is not False:
            raise ValueError(f"enable_multiprocessing={short_repr(enable_multiprocessing)} is not supported: "
                             f"LLMEngine runs in this process (minillm serve runs its engine core in its own)")
        return cls(engine_args.create_engine_config(usage_context), log=log)

    def _calibrate_step_cost(self):
        """The step cost model, fitted on dummy steps timed on the device (before any request, with
        the whole pool free); from then on each step is timed on the device to correct it."""
        from minillm.step_cost import calibrate
        c = self.config
        model, seconds = calibrate(self.runner, self.block_manager, c.max_num_seqs, c.max_num_batched_tokens,
                                   self.max_model_len)
        self.runner.profile = True
        coefs = ", ".join(f"{name} {value * 1e3:.3g} ms" for name, value in model.snapshot().coefficients.items())
        limits = ([f"{c.max_step_ms:g} ms"] if c.max_step_ms is not None else []) + \
            ([f"{c.max_step_factor:g}x the batch's decode step"] if c.max_step_factor is not None else [])
        self.log(f"minillm: step cost model fitted on {len(model.anchor_y)} timed steps in {seconds:.1f} s "
                 f"(per unit: {coefs}); step budget {' and '.join(limits)}")
        return model

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, output_kind: str | RequestOutputKind | None = None,
                    prompt_block_keys: list[bytes] | None = None, cache_salt: str | None = None, *,
                    lora_request=None, priority: int = 0, tokenization_kwargs: dict | None = None,
                    trace_headers=None) -> None:
        """Validate and queue a request; raises ValueError naming the bad field.

        prompt takes vLLM's forms, as LLM.generate does: a string, a list of token ids,
        {"prompt": text} or {"prompt_token_ids": ids} (with "prompt", the ids' text, as the output's prompt).
        output_kind "cumulative" reports the request every step it changes; "delta" only what is new
        each time; "final" only once done (or vLLM's RequestOutputKind members); None: params.output_kind.
        prompt_block_keys: the token-id prompt's prefix-cache keys from block_manager.prompt_block_keys
        (an API server's, hashed off the engine's thread); used when they fit the prompt as queued.
        cache_salt: vLLM's (also a prompt dict's "cache_salt"); the request shares prefix-cache blocks
        only with requests of the same salt. priority: vLLM's, an integer; with scheduling_policy
        "priority" a lower value is served earlier (and preempted later), under "fcfs" only 0 is taken.
        vLLM's lora_request (None), trace_headers (None) and tokenization_kwargs (None or
        {"add_special_tokens": bool}) are taken where minillm does what they ask, and named by a
        ValueError otherwise.
        """
        if self.is_shut_down:                 # its runner has let go of the weights and the KV pool
            raise RuntimeError("the engine is shut down: it takes no more requests")
        if output_kind is not None and not isinstance(output_kind, RequestOutputKind) and not (
                isinstance(output_kind, str) and output_kind in OUTPUT_KINDS):
            raise ValueError(f"output_kind must be 'cumulative', 'delta', 'final' or a RequestOutputKind, "
                             f"got {short_repr(output_kind)}")
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {short_repr(request_id)}")
        add_special_tokens = request_add_special_tokens(lora_request, tokenization_kwargs, trace_headers)
        priority = check_priority(priority, self.config.scheduling_policy)
        check_arrival_time(arrival_time)
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        params = own_sampling_params(params)
        if output_kind is not None:      # the request's own copy: the caller's params keep theirs
            params.output_kind = OUTPUT_KINDS.get(output_kind, output_kind)
        self._queue_request(request_id, prompt, params, arrival_time, prompt_block_keys, cache_salt, add_special_tokens,
                            priority)

    def add_request_with_own_params(self, request_id: str, prompt: PromptType, params: SamplingParams,
                                    arrival_time: float | None = None, prompt_block_keys: list[bytes] | None = None,
                                    cache_salt: str | None = None, priority: int = 0) -> None:
        """add_request for params the caller has just built and hands over (the engine core's path):
        their constructor validated them and nothing else holds them, so they are neither validated
        again nor copied (about 5 us a request on the development CPU)."""
        if self.is_shut_down:
            raise RuntimeError("the engine is shut down: it takes no more requests")
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {short_repr(request_id)}")
        priority = check_priority(priority, self.config.scheduling_policy)
        check_arrival_time(arrival_time)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        self._queue_request(request_id, prompt, params, arrival_time, prompt_block_keys, cache_salt, True, priority)

    def _queue_request(self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None,
                       prompt_block_keys: list[bytes] | None, cache_salt: str | None, add_special_tokens: bool,
                       priority: int = 0) -> None:
        """The rest of add_request, for validated params that are the request's own."""
        params.validate_for_vocab(self.model_config.vocab_size)
        check_truncate_prompt_tokens(params.truncate_prompt_tokens, self.max_model_len)
        for name in ("logprobs", "prompt_logprobs"):
            if (value := getattr(params, name)) is not None and value > self.config.max_logprobs:
                raise ValueError(f"{name} must be at most max_logprobs ({self.config.max_logprobs}), got {value}")
        # Tokenized here for the sampler (the API server asked first: remembered); no words clears
        # token ids the caller's params may carry from an earlier update_from_tokenizer.
        params.update_from_tokenizer(self.tokenizer, self.model_config.vocab_size)
        if not params.ignore_eos:
            # As vLLM checks EOS before stop_token_ids, the tokenizer's EOS ends a request with no
            # stop_reason even where the caller lists it among them.
            params.stop_token_ids = [t for t in params.stop_token_ids if t != self.tokenizer.eos_token_id]
            params.stop_token_ids += [t for t in self.extra_eos_token_ids if t not in params.stop_token_ids]
        params.check_masks(self.eos_token_ids, self.model_config.vocab_size)
        if params.structured_outputs is not None and (so_config := self.config.structured_outputs_config):
            params.structured_outputs = so_config.applied(params.structured_outputs, self._thinking_ids)
        held = self.requests.get(request_id)
        if held is not None and not held.is_finished:
            raise ValueError(f"request_id {request_id!r} is already in use")
        cache_salt = cache_salt_of(prompt, cache_salt)
        text, prompt = unpack_prompt(prompt)
        ids = self._prompt_ids(prompt, add_special_tokens)
        num_given = len(ids)
        ids = truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len)   # the text stays as given
        self._check_kv_transfer(ids, params)
        if len(ids) >= self.max_model_len:
            # -1 keeps the whole context, as vLLM's LLM keeps it (its server keeps the context less max_tokens)
            hint = (": truncate_prompt_tokens -1 keeps max_model_len tokens offline; give "
                    "truncate_prompt_tokens=max_model_len - max_tokens" if params.truncate_prompt_tokens == -1 else "")
            raise ValueError(f"prompt has {len(ids)} tokens, which leaves no room under "
                             f"max_model_len {self.max_model_len}{hint}")
        # As in vLLM, generation stops with "length" where the context ends, whatever max_tokens asks
        # (one long prompt of a batch must not fail the rest); the server refuses such a request first.
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        now = time.time()
        if arrival_time is not None and arrival_time < now:   # one in the future counts from now: it is here
            now = arrival_time
        seqs, key_root = [], cache_salt_root(cache_salt)
        for i in range(params.n):
            seed = sequence_seed(params.seed, i) if params.seed is not None else self._seed_rng.getrandbits(62)
            seqs.append(Sequence(request_id, i, list(ids), params, now, seed, max_tokens, block_key_root=key_root,
                                 priority=priority))
        if prompt_block_keys is not None and len(ids) == num_given and are_prompt_block_keys(
                prompt_block_keys, len(ids), self.block_manager.block_size):
            for seq in seqs:
                seq.token_block_keys = list(prompt_block_keys)
        incremental = params.output_kind is not RequestOutputKind.FINAL_ONLY
        states = [self.output_processor.new_state(s, incremental) for s in seqs]
        req = Request(request_id, text, list(ids), seqs, states,
                      RequestMetrics(arrival_time=now), final_only=not incremental,
                      is_delta=params.output_kind is RequestOutputKind.DELTA,
                      prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        try:
            if params.structured_outputs is not None:
                self._structured_output_manager().attach(seqs, params.structured_outputs)
            self.requests[request_id] = req
            for seq in seqs:
                self.scheduler.add(seq)
        except BaseException:
            # Whatever stopped the add half way (an interrupt), the request leaves no trace: none of
            # its sequences waits or compiles a grammar, and an aborted request it was to replace
            # is back, its last report still to come.
            for seq in seqs:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            if held is not None:
                self.requests[request_id] = held
            elif self.requests.get(request_id) is req:
                del self.requests[request_id]
            raise

    def _check_kv_transfer(self, ids: list[int], params: SamplingParams) -> None:
        """A request's kv_transfer_params are the KV connector's to check; without one, an error."""
        if self.kv_connector is not None:
            self.kv_connector.check_request(ids, params)
        else:
            refuse_kv_transfer_params(params)

    def _structured_output_manager(self):
        """The StructuredOutputManager, built on first use (llguidance is not even imported before)."""
        if self.structured_outputs is None:
            from minillm.structured_output import StructuredOutputManager
            self.structured_outputs = StructuredOutputManager.from_tokenizer(
                self.tokenizer, self.model_config.vocab_size, self.config.max_num_seqs, self.eos_token_ids,
                empty_host=self.device.empty_pinned, register_host=self.device.register_host,
                grammar_process=(self.config.grammar_process if self.config.grammar_process is not None
                                 else self.backend == "cuda"),
                num_speculative_tokens=spec.num_speculative_tokens if (spec := self.config.speculative_config) else 0,
                max_num_batched_tokens=self.config.max_num_batched_tokens)
        return self.structured_outputs

    def _prompt_ids(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return text_token_ids(self.tokenizer, prompt, add_special_tokens)
        return checked_token_ids(prompt, self.model_config.vocab_size)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop a request now and free its blocks and its id (a new request may take the id at once,
        as vLLM's engines allow); the next step() reports it with 'abort', before any report of
        the new one (an unknown or finished id is ignored). A list of ids aborts each, as vLLM's takes them."""
        if not isinstance(request_id, (str, bytes)) and isinstance(request_id, Iterable):
            for one in list(request_id):
                if isinstance(one, str):
                    self.abort_request(one)
            return
        req = self.requests.get(request_id) if isinstance(request_id, str) else None
        if req is None or req.is_finished:
            return
        for seq in req.seqs:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self._changed[req] = None

    def stop_sequence(self, request_id: str, index: int, stop_string: str) -> None:
        """End completion `index` of a request with a stop string its text completed (found by an
        API server that detokenises apart from the engine); unknown or retired requests are ignored."""
        req = self.requests.get(request_id) if isinstance(request_id, str) else None
        if req is None or not isinstance(index, int) or not 0 <= index < len(req.seqs):
            return
        self.scheduler.stop(req.seqs[index], stop_string)
        self._changed[req] = None

    def service_kv_transfers(self) -> float | None:
        """For an idle engine loop: let the KV connector act on what came from outside (a prefill
        engine frees the blocks of released or expired leases); seconds until it needs the loop
        again, None when only a new command can give it work."""
        return self.kv_connector.process_pending() if self.kv_connector is not None else None

    def _kv_connector_holds_blocks(self) -> bool:
        return self.kv_connector is not None and self.kv_connector.holds_blocks()

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (vLLM's LLMEngine.get_tokenizer)."""
        return self.tokenizer

    def get_model_config(self) -> EngineModelConfig:
        """The model's shape and the values the engine runs with (vLLM's LLMEngine.get_model_config)."""
        return self.model_config

    def has_unfinished_requests(self) -> bool:
        """True while any request is queued, running or unreported, or a step is in flight."""
        return bool(self.requests) or bool(self._changed) or bool(self._in_flight)

    def get_num_unfinished_requests(self) -> int:
        """Requests added and not yet finished or aborted (vLLM's LLMEngine.get_num_unfinished_requests);
        a finished one whose last output step() has not returned yet is not counted."""
        return sum(not req.is_finished for req in self.requests.values())

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prompt block, the host tier's too, so later prompts are computed afresh
        (vLLM's name, for benchmarks and changed weights); False, with nothing forgotten, while any
        block is in use, as vLLM's BlockPool refuses. Requests that hold none (queued, waiting for
        their grammar, preempted) stay queued and compute their prompts afresh once admitted.
        reset_running_requests (vLLM's): the running requests are preempted first, once the steps
        in flight are read back, and compute their tokens so far again when they resume (after new
        weights, with those). reset_connector (vLLM's) is taken as true or false: the host tier,
        whose blocks are the prefix cache's, is reset either way."""
        check_reset_flags(reset_running_requests, reset_connector)
        if self.is_shut_down:
            raise RuntimeError("the engine is shut down: its KV pool is released")
        if reset_running_requests and self.scheduler.num_running:
            self._sample_deferred()
            while self._in_flight:
                self._complete(*self._in_flight.popleft())
            self.scheduler.preempt_running()
        if not self.scheduler.num_running:
            # Steps launched ahead whose sequences have all ended or been preempted since: read back
            # first, so that no block they fill (registered at launch) is cached after the reset.
            self._sample_deferred()
            while self._in_flight:
                self._complete(*self._in_flight.popleft())
        in_use = self.block_manager.num_used_blocks
        if in_use:
            self.log(f"minillm: reset_prefix_cache: nothing was reset ({in_use} KV blocks in use, "
                     f"{self.scheduler.num_running} sequences running)")
            return False
        self.block_manager.reset_prefix_cache()
        if self.kv_connector is not None:     # the host tier would serve the same prompts again
            self.kv_connector.reset_cache()
        return True

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step, then read back the one before it (on the GPU one step stays
        in flight, so the host's bookkeeping overlaps the device's work)."""
        if self.structured_outputs is not None:
            if self.structured_outputs.num_compiling:     # else no grammar can have failed
                self._finish_failed_grammars()
            self._sample_deferred()
        if self._in_flight and self.scheduler.needs_output_tokens():
            self._complete(*self._in_flight.popleft())        # penalties need the tokens first
        out = self._schedule()
        if not out.is_empty:
            self._in_flight.append((out, self._launch(out)))
        elif not self._in_flight and self.structured_outputs is not None:
            self.structured_outputs.wait_for_compile(timeout=0.02)   # nothing runs until a grammar is ready
        elif not self._in_flight and self.scheduler.has_unfinished() and self._kv_connector_holds_blocks():
            time.sleep(KV_LEASE_WAIT_S)   # the pool is lent out (KV leases): nothing fits until some come back
        depth = 1 if self.async_scheduling and not out.is_empty else 0
        while len(self._in_flight) > depth:
            self._complete(*self._in_flight.popleft())
        return self._take_outputs()

    def _schedule(self) -> SchedulerOutput:
        started, t0 = time.time(), time.perf_counter()
        out = self.scheduler.schedule()
        self.metrics.record_timings({"schedule": time.perf_counter() - t0})
        if out.is_empty and not self._in_flight and self.scheduler.has_unfinished() \
                and not self.scheduler.num_running \
                and not (self.structured_outputs is not None and self.structured_outputs.num_compiling) \
                and not self._kv_connector_holds_blocks():
            raise RuntimeError("the waiting request cannot be scheduled: the KV pool is too small")
        # A request scheduled the first time: its first child. Only a sequence the scheduler took off
        # the waiting queue this step can be one (every running one was, in an earlier step); one a
        # priority preemption took back out of the step is waiting again.
        firsts: dict[int, tuple[Request, Sequence]] = {}
        for seq in self.scheduler.admitted:
            if seq.status is not SequenceStatus.RUNNING:
                continue
            req = self._request_of(seq)
            if req is not None and req.metrics.first_scheduled_time is None:
                first = firsts.get(id(req))
                if first is None or seq.index < first[1].index:    # one-token rows come first: a sibling may lead
                    firsts[id(req)] = (req, seq)
        for req, seq in firsts.values():
            req.metrics.first_scheduled_time = started
            req.metrics.num_cached_tokens = seq.num_cached_tokens
        if not out.is_empty:
            self.metrics.record_step(out, started, time.time(), self.config.max_num_batched_tokens)
        return out

    def _launch(self, out: SchedulerOutput) -> InFlightStep:
        """runner.launch(out); a failure that leaves the device sound aborts the step's requests.

        A step with constrained rows whose previous token is still in flight is launched with its
        sampling deferred: its masks are filled on the mask thread from the moment that token is
        read back (_complete) while this thread goes on, and the sampling is queued at the start
        of the next step (_sample_deferred), so the device still runs it before the next forward
        pass and the host never waits for the masks in between."""
        grammar_bitmask, masks, defer = None, [], False
        manager = self.structured_outputs
        if manager is not None and out.structured_rows:
            if self._in_flight and manager.has_token_in_flight(out.structured_rows):
                self._fill_due, defer = (out, masks), True
            else:
                masks.append(self._start_fill(out))   # every matcher is current: fill during the forward pass
            grammar_bitmask = lambda: self._grammar_bitmask(out, masks)   # noqa: E731
        try:
            in_flight = self.runner.launch(out, grammar_bitmask, defer)
        except Exception as exc:
            self._fill_due = None
            if masks and masks[0] is not None:
                masks[0].abandon()
            self._fail_step(out, exc)
        if in_flight.sampled_by is not None:
            self._deferred_out = out
        return in_flight

    def _fail_step(self, out: SchedulerOutput, exc: Exception) -> NoReturn:
        """Raise for a step that failed to launch or sample: exc itself when it leaves the device
        unsound, else a StepError after aborting the step's requests (the engine goes on)."""
        if self.device.is_fatal(exc) or isinstance(exc, TensorParallelError):
            raise exc
        self.scheduler.forget_step_blocks(out)
        # The step's requests that the engine still holds (not an aborted one whose id a new
        # request has taken since the step was launched: that one was not in the step).
        requests = dict.fromkeys(req for seq in out.seqs if (req := self._request_of(seq)) is not None)
        for req in requests:
            self.abort_request(req.request_id)
        raise StepError(sorted(req.request_id for req in requests), exc) from exc

    def _start_fill(self, out: SchedulerOutput):
        """Start filling out's masks; a failure is kept for the sampling to raise (that step's error)."""
        from minillm.structured_output import PendingBitmask
        try:
            return self.structured_outputs.start_fill(out.structured_rows, out.scheduled_spec_decode_tokens)
        except Exception as exc:
            return PendingBitmask.failed(exc)

    def _sample_deferred(self) -> None:
        """Queue the deferred sampling of the last step (its masks are filled by now, or nearly);
        a failure that leaves the device sound aborts that step's requests."""
        out, self._deferred_out = self._deferred_out, None
        if out is None:
            return
        try:
            self.runner.sample_deferred()
        except Exception as exc:
            self._fail_step(out, exc)

    def _grammar_bitmask(self, out: SchedulerOutput, masks: list):
        """The runner's call for out's masks, just before its sampling is queued. A step sampled
        at once whose previous token is in flight reads that step back here first (which starts
        the fill: _complete); only the sampling waits for the masks."""
        if not masks:
            if not self._in_flight or self._in_flight[0][0] is out:
                raise RuntimeError("a step's masks were asked for before the step before it was read back")
            self._complete(*self._in_flight.popleft())
        pending = masks[0]
        if pending is None:
            return None
        t0 = time.perf_counter()
        mask = pending.result()
        self.metrics.record_timings({"grammar_fill": pending.fill_time_s,
                                     "grammar_fill_wait": time.perf_counter() - t0})
        return mask

    def _finish_failed_grammars(self) -> None:
        """A sequence whose grammar failed to compile finishes with finish_reason 'error'."""
        for seq, message in self.structured_outputs.take_failed():
            req = self._request_of(seq)
            self.log(f"minillm: request {seq.request_id}: {message}")
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR, message)
            if req is not None:
                self._changed[req] = None

    def _complete(self, out: SchedulerOutput, in_flight: InFlightStep) -> None:
        """Wait for a launched step and hand its tokens to the scheduler and the outputs. With
        structured outputs the constrained matchers take them first, and the fill of the next
        step's masks (if due) starts then, beside the scheduler's work."""
        waited = time.time()
        step = in_flight.wait()
        t0 = time.perf_counter()
        if step.prompt_logprobs:
            self._add_prompt_logprobs(out, step.prompt_logprobs)
        if self.structured_outputs is not None:
            self.structured_outputs.advance(out.structured_rows, step.sampled)
            if self._fill_due is not None:
                due, masks = self._fill_due
                self._fill_due = None
                masks.append(self._start_fill(due))
            self.metrics.record_timings({"grammar_advance": time.perf_counter() - t0})
        now = time.time()
        # Drafts count once their tokens reach a request: not those of a sequence ended (aborted,
        # stopped by the API server) since the launch, whose tokens are dropped (vLLM skips it too).
        spec = out.scheduled_spec_decode_tokens
        drafts = {s.seq_id: spec[s.seq_id] for s in out.sampling_seqs
                  if s.seq_id in spec and s.num_output_placeholders} if spec else None
        appended = self.scheduler.update_from_output(out, step, self._token_reporter(step, now),
                                                     self.structured_outputs is not None
                                                     and self.structured_outputs.answers_pending())
        while self.scheduler.masked_out:        # finished with no token: on_token did not report them
            if (req := self._request_of(self.scheduler.masked_out.pop())) is not None:
                self._changed[req] = None
        if drafts:
            self.metrics.record_spec_decode(drafts, step.num_accepted_tokens)
        self.metrics.record_generated(len(appended), waited, now)
        self.metrics.record_timings({**step.timings, "update": time.perf_counter() - t0})
        if self.scheduler.step_cost is not None and (seconds := measured_seconds(step.timings)) is not None:
            self.scheduler.record_step_time(out, seconds)
            self.metrics.record_device_step_time(out, seconds)

    def _add_prompt_logprobs(self, out: SchedulerOutput, entries: dict) -> None:
        """A step's prompt log-probabilities into their requests' lists as vLLM's Logprobs (rank and
        decoded token on each, as a completion's); entries a prompt computed again after a
        preemption, or by another of the request's n sequences, are there already."""
        by_id = {seq.seq_id: seq for seq in out.seqs}
        for seq_id, (first, dicts) in entries.items():
            seq = by_id.get(seq_id)
            req = self._request_of(seq) if seq is not None else None
            if req is None or req.prompt_logprobs is None:
                continue
            have = len(req.prompt_logprobs)
            if first <= have < first + len(dicts):
                shape, prompt = self.output_processor.prompt_logprobs_entry, req.prompt_token_ids
                req.prompt_logprobs.extend(shape(entry, seq.params, prompt[i], prompt_logprobs_context(prompt, i))
                                           for i, entry in enumerate(dicts[have - first:], start=have))
                self._changed[req] = None

    def _token_reporter(self, step: StepOutput, now: float) -> Callable[[Sequence, int], str | None]:
        """The scheduler's on_token for a step read back at now: feeds seq's i-th new token of the
        step to its request's output and returns the stop string it completed, if any (the
        scheduler then ends the sequence there). Called for every token: _request_of is spelled
        out in it, and what it reads each time is bound once here (so it is used at once, while
        self._changed is the dict it holds)."""
        requests, changed, metrics = self.requests, self._changed, self.metrics
        add_token, logprobs_of, record_itl = self.output_processor.add_token, step.logprobs, metrics.itl.append
        # An engine core's token outputs read a token only for its log-probabilities or its grammar's state.
        every_token = getattr(self.output_processor, "reads_every_token", True)

        def on_token(seq: Sequence, i: int) -> str | None:
            req = requests.get(seq.request_id)
            index = seq.index
            if req is None or index >= len(req.seqs) or req.seqs[index] is not seq:
                return None
            logprobs = logprobs_of.get(seq.seq_id) if logprobs_of else None
            token_ids = seq.token_ids
            if every_token or logprobs or seq.structured_output is not None:
                stop = add_token(req.states[index], seq, token_ids[-1], logprobs[i] if logprobs else None)
            else:
                stop = None
            if len(token_ids) == len(seq.prompt_token_ids) + 1:     # its first token: its prompt counts now
                metrics.record_prompt(seq.num_prompt_tokens, seq.num_cached_tokens, seq.num_external_tokens)
            m = req.metrics
            last = m.last_token_time
            if m.first_token_time is None:
                m.first_token_time = now
                metrics.record_ttft(now - m.arrival_time)
            elif last is not None and now > last:
                record_itl(now - last)
            m.last_token_time = now
            changed[req] = None
            return stop
        return on_token

    def _request_of(self, seq: Sequence) -> Request | None:
        """The request seq belongs to while the engine holds it (None once it is retired, or once a
        new request has taken the id of the aborted one it belonged to, with as many completions
        or fewer: a step in flight still holds the old sequences)."""
        req = self.requests.get(seq.request_id)
        if req is None or seq.index >= len(req.seqs) or req.seqs[seq.index] is not seq:
            return None
        return req

    def _take_outputs(self) -> list:
        """The reports (the output processor's request_output: a RequestOutput, or an engine core's
        message) of the requests with news since the last call; finished ones are retired."""
        now = time.time()
        changed, self._changed = self._changed, {}
        outputs = []
        request_output = self.output_processor.request_output
        requests = self.requests
        pending = iter(changed)
        try:
            for req in pending:
                seqs = req.seqs
                if len(seqs) > 1:
                    note_finishes(req)
                    finished = req.is_finished
                else:                                   # Request.is_finished of one sequence, spelled out
                    finished = seqs[0].status._finished
                if req.final_only and not finished:
                    continue
                if finished and req.metrics.finished_time is None:
                    req.metrics.finished_time = now
                    if requests.get(req.request_id) is req:    # not a new request that took its id
                        del requests[req.request_id]
                    for seq in req.seqs:
                        self.metrics.record_finish(seq.status.finish_reason)
                if (report := request_output(req, finished)) is not None:
                    outputs.append(report)
        except BaseException:
            # A report that raised (an interrupt, a detokenizer's error) loses only its own news: the
            # requests after it are reported by the next call, not left unfinished for ever.
            self._changed.update(dict.fromkeys(pending))
            raise
        return outputs

    # ---- stats and lifetime ------------------------------------------------------------------
    def stats(self, cells: int = 64, summary: bool = False) -> EngineStats:
        """A snapshot of queues, KV pool, throughput and latency; with summary, its counters and
        gauges alone (a fraction of the cost at hundreds of requests: see EngineStats.is_summary)."""
        c = self.config
        info = EngineInfo(self.model_name, self.backend, self.dtype, c.max_num_seqs, c.max_num_batched_tokens,
                          self.max_model_len, self.runner.kv_cache_dtype, self.run_id)
        ttft = {} if summary else {rid: req.metrics.ttft for rid, req in self.requests.items()}
        structured = self.structured_outputs.stats() if self.structured_outputs is not None else None
        return build_stats(info, self.block_manager.snapshot(),
                           self.scheduler.snapshot(MAX_WAITING_ROWS, views=not summary),
                           self.metrics, self.runner.memory_stats(), ttft, cells,
                           self.kv_connector.snapshot() if self.kv_connector else None, structured, summary)

    def shutdown(self) -> None:
        """Abort every request, wait for the device, and release the KV pool, graphs and weights."""
        if self.is_shut_down:
            return
        self.is_shut_down = True
        for request_id in list(self.requests):
            self.abort_request(request_id)
        self._in_flight.clear()
        self._fill_due = self._deferred_out = None
        if self.structured_outputs is not None:
            self.structured_outputs.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        self.runner.shutdown()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        # Memory must not go back to the pool while the device may still write to it.
        if getattr(self, "runner", None) is not None and not getattr(self, "is_shut_down", True):
            self.shutdown()
