"""LLMEngine: add requests, step the scheduler and the model, hand back RequestOutputs."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np

from minillm.block_manager import BlockManager
from minillm.config import EngineConfig
from minillm.loader import load_model_config, load_weights, resolve_model_path
from minillm.metrics_tracker import MetricsTracker
from minillm.model_runner import ModelRunner
from minillm.models.dummy import dummy_weights
from minillm.ops import get_ops
from minillm.output_processor import CompletionState, add_token, completion_output, new_state
from minillm.outputs import RequestMetrics, RequestOutput
from minillm.sampling_params import SamplingParams
from minillm.scheduler import Scheduler
from minillm.sequence import Sequence, SequenceStatus
from minillm.stats import EngineStats
from minillm.tokenizer import Tokenizer


@dataclass
class Request:
    """A request: its prompt, its n sequences and their output states."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    states: list[CompletionState]
    metrics: RequestMetrics
    final_only: bool = False          # report only once finished (offline batch)

    @property
    def is_finished(self) -> bool:
        """True when every sequence has finished and has no token still on its way."""
        return all(s.is_finished and not s.num_pending for s in self.seqs)


def _needs_own_tokens(seq: Sequence) -> bool:
    """Penalties read the counts of every earlier token; logprobs come back with the tokens."""
    p = seq.params
    return (p.logprobs is not None or p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0)


def choose_backend(device: str) -> str:
    """'cpu' -> numpy, 'cuda' -> cuda, 'auto' -> cuda when CuPy sees a GPU."""
    if device == "cpu":
        return "numpy"
    if device == "cuda":
        return "cuda"
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return "cuda"
    except Exception:  # no CuPy, no driver or no device: the CPU it is
        pass
    return "numpy"


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
    """The engine loop: not thread-safe, call everything from one thread."""

    def __init__(self, config: EngineConfig, log=None):
        self.config = config
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        path = resolve_model_path(config.model, config.download_dir)
        self.model_path = path
        self.model_config = load_model_config(path)
        self.tokenizer = Tokenizer.from_pretrained(path)
        self.backend = choose_backend(config.device)
        if config.device == "auto":
            self.log(f"minillm: device auto -> {'cuda (CuPy sees a GPU)' if self.backend == 'cuda' else 'cpu (NumPy)'}")
        self.ops = get_ops(self.backend)
        self.dtype = resolve_dtype(config, self.backend, self.model_config.torch_dtype)
        model_max = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                             f"max_position_embeddings {model_max}")
        requested_len = config.max_model_len or model_max
        if config.load_format == "dummy":
            weights = dummy_weights(self.model_config, self.dtype, config.seed)
        else:
            weights = load_weights(path, self.model_config, self.dtype)
        self.runner = ModelRunner(self.model_config, config, self.ops, weights, self.dtype, requested_len)
        del weights
        self.max_model_len = self._fit_max_model_len(requested_len)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        eos = sorted(set(self.model_config.eos_token_id) | set(self.tokenizer.eos_token_ids))
        self.eos_token_ids = eos
        self.runner.sampler.eos_token_ids = eos
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, eos)
        self.requests: dict[str, Request] = {}
        self._aborted: list[Request] = []
        self._pending = None                 # a launched step whose tokens are not read yet
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.backend == "cuda")
        self._seed_rng = np.random.default_rng(config.seed)
        self.metrics = MetricsTracker()
        self.model_name = config.served_model_name or config.model

    def _fit_max_model_len(self, requested: int) -> int:
        capacity = self.runner.num_blocks * self.config.block_size
        if requested <= capacity:
            return requested
        if self.config.max_model_len is not None:
            raise ValueError(f"max_model_len {requested} needs {-(-requested // self.config.block_size)} "
                             f"KV blocks but the pool has {self.runner.num_blocks}; lower max_model_len "
                             f"or raise num_kv_blocks")
        return capacity

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, output_kind: str = "cumulative") -> None:
        """Validate and queue a request; raises ValueError naming the bad field.

        output_kind "cumulative" reports the request every step it changes; "final" only once done.
        """
        if output_kind not in ("cumulative", "final"):
            raise ValueError(f"output_kind must be 'cumulative' or 'final', got {output_kind!r}")
        params = params or SamplingParams()
        params.validate()
        params.validate_for_vocab(self.model_config.vocab_size)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, which leaves no room under "
                             f"max_model_len {self.max_model_len}")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens {max_tokens} plus the prompt's {len(ids)} tokens exceeds "
                             f"max_model_len {self.max_model_len}")
        now = arrival_time if arrival_time is not None else time.time()
        seqs = []
        for i in range(params.n):
            seed = params.seed + i if params.seed is not None else int(self._seed_rng.integers(2**62))
            seqs.append(Sequence(request_id, i, list(ids), params, now, np.random.default_rng(seed), max_tokens))
        incremental = output_kind == "cumulative"
        req = Request(request_id, text, list(ids), seqs, [new_state(self.tokenizer, s, incremental) for s in seqs],
                      RequestMetrics(arrival_time=now), final_only=not incremental)
        self.requests[request_id] = req
        for seq in seqs:
            self.scheduler.add(seq)

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
        vocab = self.model_config.vocab_size
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {t!r}")
        return None, [int(t) for t in prompt]

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; the next step() reports it with 'abort'."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return
        for seq in req.seqs:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self._aborted.append(req)

    def has_unfinished_requests(self) -> bool:
        """True while any request is queued, running or has an unreported abort."""
        return bool(self.requests) or bool(self._aborted) or self._pending is not None

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch one forward pass, then process the tokens of the last finished one.

        On the GPU the host works ahead: step t+1 is scheduled and launched (its inputs for the
        tokens of step t taken on the device) before the tokens of step t are read back and
        processed, so the host's bookkeeping overlaps the device's work. Outputs then trail the
        launch by one step. Sequences with penalties or logprobs need their tokens first and
        run step by step.
        """
        started = time.time()
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        self.runner.timings["schedule"] += time.perf_counter() - t0
        changed: dict[str, Request] = {r.request_id: r for r in self._aborted}
        self._aborted = []
        if out.is_empty:
            if self._pending is not None:
                self._resolve(self._pending, changed)
                self._pending = None
            elif self.scheduler.has_unfinished() and not self.scheduler.running:
                raise RuntimeError("the waiting request cannot be scheduled: the KV pool is too small")
            return self._finish_outputs(changed, time.time())
        overlap = self.async_scheduling and not any(_needs_own_tokens(s) for s in out.seqs)
        if self._pending is not None and not overlap:
            self._resolve(self._pending, changed)
            self._pending = None
        for seq in out.seqs:
            req = self.requests.get(seq.request_id)
            if req is not None and req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = started
                req.metrics.num_cached_tokens = seq.num_cached_tokens
        launched = self.runner.launch(out)
        self.scheduler.advance(out)
        previous, self._pending = (self._pending, launched) if overlap else (launched, None)
        if previous is not None:
            self._resolve(previous, changed)
        now = time.time()
        self.metrics.record_step(out, started, now, self.config.max_num_batched_tokens)
        outputs = self._finish_outputs(changed, now)
        return outputs

    def _resolve(self, pending, changed: dict[str, "Request"]) -> None:
        """Read a launched step's tokens into its sequences and their outputs."""
        waited = time.time()
        step_out = pending.wait()
        t1 = time.perf_counter()
        touched = self.scheduler.resolve(pending.seqs, [step_out.sampled[s.seq_id] for s in pending.seqs])
        now = time.time()
        for seq in touched:
            req = self.requests.get(seq.request_id)
            if req is None:
                continue
            token = seq.token_ids[len(seq.token_ids) - seq.num_pending - 1]
            stop = add_token(req.states[seq.index], seq, token, step_out.logprobs.get(seq.seq_id))
            if stop is not None:
                seq.stop_reason = stop
                if seq.is_finished:          # length-finished at launch, its last token completed a stop
                    seq.status = SequenceStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
            self._note_token(req, now)
            changed[req.request_id] = req
        self.metrics.record_generated(len(touched), waited, now)
        self.runner.timings["update_and_outputs"] += time.perf_counter() - t1

    def _note_token(self, req: Request, now: float) -> None:
        m = req.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            self.metrics.record_ttft(now - m.arrival_time)
        elif m.last_token_time is not None and now > m.last_token_time:
            self.metrics.record_itl(now - m.last_token_time)
        m.last_token_time = now

    def _finish_outputs(self, changed: dict[str, Request], now: float) -> list[RequestOutput]:
        outputs = []
        for req in changed.values():
            finished = req.is_finished
            if req.final_only and not finished:
                continue
            if finished and req.metrics.finished_time is None:
                req.metrics.finished_time = now
                self.requests.pop(req.request_id, None)
                for seq in req.seqs:
                    self.metrics.record_finish(seq.status.finish_reason)
            outputs.append(RequestOutput(req.request_id, req.prompt, req.prompt_token_ids,
                                         [completion_output(st, s) for st, s in zip(req.states, req.seqs)],
                                         finished, req.metrics))
        return outputs

    # ---- stats -------------------------------------------------------------------------------
    def stats(self, cells: int = 64) -> EngineStats:
        """A snapshot of queues, KV pool, throughput and latency."""
        from minillm.engine_stats import build_stats
        return build_stats(self, cells)
