"""LLM: the offline batch API, vLLM-compatible."""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import itertools
import json
import numbers
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence as Seq
from typing import TYPE_CHECKING
import numpy as np

from minillm.beam_search import BeamSearchInstance, BeamSearchOutput, best_beams, run_steps
from minillm.beam_search import step_params as beam_step_params
from minillm.config import EngineConfig
from minillm.engine import LLMEngine, check_reset_flags
from minillm.outputs import RequestOutput
from minillm.prompts import (
    PromptType, TokensPrompt, cache_salt_of, check_lora_request, checked_token_ids, text_token_ids,
    tokenization_add_special_tokens, unpack_prompt,
)
from minillm.request_queue import check_priorities
from minillm.sampling_params import BeamSearchParams, SamplingParams, short_repr
from minillm.structured_outputs_config import offline_config
from minillm.tokenizer import TEXT_PART_KEYS, check_content_format, check_unicode, template_file_text

if TYPE_CHECKING:
    from minillm.metrics_reader import Metric

_CHOOSES_GRAPHS = "minillm chooses the batch sizes it captures CUDA graphs for (enforce_eager=True turns them off)"

# vLLM's LLM arguments that minillm has no setting for, taken where the value given is what minillm
# does anyway: name -> (whether minillm honours the value, what minillm does). Any other value is a
# ValueError naming the argument.
VLLM_FIXED_ARGS = {
    # minillm runs its own decoder for every model it loads, never code from a checkpoint: either value is safe.
    "trust_remote_code": (lambda v: isinstance(v, bool), "minillm never runs a model's own code"),
    "code_revision": (lambda v: v is None, "minillm never runs a model's own code"),
    "logprobs_mode": (lambda v: v == "raw_logprobs", "minillm's log-probabilities are the model's log-softmax "
                                                     "before logit_bias, penalties, temperature and top-k/top-p/min-p "
                                                     "(vLLM's raw_logprobs)"),
    "skip_tokenizer_init": (lambda v: v is False, "minillm always loads the tokenizer"),
    "quantization": (lambda v: v is None, "minillm runs unquantized float32, float16 or bfloat16 weights"),
    "pipeline_parallel_size": (lambda v: _is_count(v, 1), "minillm has no pipeline parallelism"),
    "data_parallel_size": (lambda v: _is_count(v, 1), "minillm runs one engine"),
    "cpu_offload_gb": (lambda v: _is_count(v, 0), "minillm keeps every weight on the device"),
    # vLLM's V1 engine keeps its swap_space setting (default 4 GiB) but swaps nothing either: any size runs the same.
    "swap_space": (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool) and v >= 0,
                   "minillm keeps no CPU swap space: a preempted request is computed again"),
    "hf_overrides": (lambda v: v is None or (isinstance(v, dict) and not v),
                     "minillm reads the model's config.json as it is (edit a copy of the model directory)"),
    # the rest of vLLM's LLM() signature and common engine arguments, at what minillm does
    # vLLM's task is deprecated, default None (auto); its runner and convert default to "auto"
    "task": (lambda v: v is None or v in ("auto", "generate"), "minillm runs generative models only"),
    "runner": (lambda v: v in ("auto", "generate"), "minillm runs generative models only"),
    "convert": (lambda v: v in ("auto", "none"), "minillm runs generative models as they are, with no pooling "
                                                 "adapter"),
    "model_impl": (lambda v: v in ("auto", "vllm"), "minillm runs its own decoder for every model it loads"),
    "config_format": (lambda v: v in ("auto", "hf"), "minillm reads the model's Hugging Face config.json"),
    **dict.fromkeys(("mm_processor_kwargs", "limit_mm_per_prompt", "allowed_media_domains"),
                    (lambda v: v is None or v == {} or v == [], "minillm runs text-only models")),
    "allowed_local_media_path": (lambda v: v == "", "minillm runs text-only models"),
    **dict.fromkeys(("override_pooler_config", "pooler_config"),
                    (lambda v: v is None, "minillm runs generative models only, with no pooling")),
    "logits_processors": (lambda v: v is None or v == [], "minillm runs no Python logits processors (SamplingParams' "
                                                          "logit_bias, allowed_token_ids and bad_words shape logits)"),
    "enable_lora": (lambda v: v is None or v is False, "minillm loads no LoRA adapters"),
    "enable_sleep_mode": (lambda v: v is False, "minillm has no sleep mode (shutdown() gives the memory back)"),
    "max_seq_len_to_capture": (lambda v: _is_int(v) and v > 0, "minillm chooses the CUDA graphs it captures"),
    **dict.fromkeys(("disable_custom_all_reduce", "disable_async_output_proc"),
                    (lambda v: isinstance(v, bool), "minillm has no such switch; either value runs the same")),
    "hf_token": (lambda v: v is None or v is True, "minillm downloads with huggingface_hub's own token (set HF_TOKEN "
                                                   "or run `huggingface-cli login`)"),
    "distributed_executor_backend": (lambda v: v is None, "minillm starts its tensor-parallel workers itself"),
    # vLLM's defaults of these: 1, 1, 0, False, None (an empty list in older vLLM), None
    **dict.fromkeys(("max_num_partial_prefills", "max_long_partial_prefills"),
                    (lambda v: _is_count(v, 1), "minillm has no cap on the prompts being prefilled at once: "
                                                "they share each step within max_num_batched_tokens")),
    "long_prefill_token_threshold": (lambda v: _is_count(v, 0), "minillm sizes prompt chunks by the step's token "
                                                                "budget (max_num_batched_tokens) and its step-time "
                                                                "budget (max_step_ms), not by a prompt's length"),
    "enable_prompt_embeds": (lambda v: v is False, "minillm takes text or token ids, not embeddings"),
    "cuda_graph_sizes": (lambda v: v is None or v == [], _CHOOSES_GRAPHS),
    "max_cudagraph_capture_size": (lambda v: v is None, _CHOOSES_GRAPHS),
}


# vLLM's LLM methods that minillm has no counterpart for: name -> why, said by the AttributeError that
# names the method (hasattr() stays False, so a script that looks before it calls takes its other path).
VLLM_MISSING_METHODS = {
    **dict.fromkeys(("encode", "embed", "classify", "score", "reward"),
                    "minillm runs generative models only, with no pooling API (generate and chat give text)"),
    **dict.fromkeys(("sleep", "wake_up"), "minillm keeps its weights and KV pool in device memory until "
                                          "shutdown(), which gives them back (a new LLM loads the model again)"),
    **dict.fromkeys(("start_profile", "stop_profile"), "minillm has no torch profiler (`minillm bench throughput` "
                                                       "says where each step's time goes)"),
    **dict.fromkeys(("collective_rpc", "apply_model"), "minillm's model is its own NumPy/CuPy decoder, not a torch "
                                                      "module in worker processes"),
}


def _is_int(value) -> bool:
    """An integer, and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_count(value, expected: int) -> bool:
    """value is the number `expected` (not a bool)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == expected


# vLLM's names of settings minillm has under another name: vLLM's name -> minillm's.
VLLM_RENAMED_ARGS = {"num_gpu_blocks_override": "num_kv_blocks"}


def engine_config(model, args: dict) -> EngineConfig:
    """LLM's arguments as an EngineConfig: vLLM's names that minillm has no setting for are checked
    against what it does (VLLM_FIXED_ARGS; compilation_config turns CUDA graphs off or leaves them),
    an unknown name is a TypeError naming LLM."""
    args = renamed_args(args)
    if "compilation_config" in args:
        from minillm.compilation_config import compilation_graphs_off
        if compilation_graphs_off(args.pop("compilation_config")):
            args["enforce_eager"] = True
    if "dtype" in args:
        args["dtype"] = _dtype_name(args["dtype"])
    known = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    for name in args:
        if name not in known and name not in VLLM_FIXED_ARGS:
            close = difflib.get_close_matches(name, sorted(known | set(VLLM_FIXED_ARGS)), n=3)
            hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}{hint}")
    for name, (is_honoured, does) in VLLM_FIXED_ARGS.items():
        if name in args and not is_honoured(args[name]):
            raise ValueError(f"{name}={short_repr(args[name])} is not supported: {does}")
    args["structured_outputs_config"] = offline_config(args.get("structured_outputs_config"))
    return EngineConfig(model=model, **{k: v for k, v in args.items() if k in known})


def _dtype_name(value):
    """vLLM's dtype may be a torch.dtype (torch.bfloat16): its name, as EngineConfig takes a dtype
    (torch is not imported for it); any other value as it is."""
    if type(value).__name__ == "dtype" and type(value).__module__ == "torch":
        return str(value).removeprefix("torch.")
    return value


def renamed_args(args: dict) -> dict:
    """args with vLLM's names of minillm's settings (VLLM_RENAMED_ARGS) under minillm's; ValueError
    when both names are given different values."""
    args = dict(args)
    for vllm_name, name in VLLM_RENAMED_ARGS.items():
        if vllm_name not in args:
            continue
        value = args.pop(vllm_name)
        if name in args and args[name] is not None and value is not None and args[name] != value:
            raise ValueError(f"{vllm_name}={short_repr(value)} and {name}={short_repr(args[name])} are the same "
                             f"setting under vLLM's name and minillm's: give one")
        if value is not None:
            args[name] = value
    return args


class LLM:
    """Generate for many prompts at once through the engine's continuous batching.

    Takes EngineConfig's fields by name, and vLLM's other common arguments where their value is
    what minillm does anyway (VLLM_FIXED_ARGS). disable_log_stats (vLLM's, default True) False keeps
    the Prometheus metrics get_metrics() reads (minillm's LLM logs no periodic stats line).
    """

    def __init__(self, model: str, **engine_args):
        disable_log_stats = engine_args.pop("disable_log_stats", True)
        if not isinstance(disable_log_stats, bool):
            raise ValueError(f"disable_log_stats must be true or false, got {short_repr(disable_log_stats)}")
        self.engine = LLMEngine(engine_config(model, engine_args))
        self._metrics = None if disable_log_stats else self._new_metrics()
        self._ids = itertools.count()
        # One generate() at a time: each steps the engine and keeps only its own finished requests.
        self._generate_lock = threading.Lock()
        self._generating_thread: int | None = None     # the thread holding _generate_lock
        self._is_closing = False     # shutdown() was called: a generate() running stops after its step

    def __getattr__(self, name: str):
        """Only for names LLM lacks: vLLM's methods in VLLM_MISSING_METHODS are refused with the reason."""
        why = VLLM_MISSING_METHODS.get(name)
        if why is None:
            raise AttributeError(f"'LLM' object has no attribute {name!r}")
        raise AttributeError(f"LLM.{name}() is vLLM's and not supported: {why}")

    def _new_metrics(self):
        """The Prometheus series of minillm's server (minillm/server/metrics.py), fed by generate()."""
        from minillm.server.metrics import ServerMetrics
        config = self.engine.config
        return ServerMetrics(config.served_model_name or str(config.model), self.engine.max_model_len)

    def get_metrics(self) -> list[Metric]:
        """vLLM's: the Prometheus series now (minillm: names, as /metrics of `minillm serve` has them)
        as Counter, Gauge, Histogram and Vector objects of minillm.metrics_reader. Needs
        LLM(..., disable_log_stats=False), as vLLM's: AssertionError otherwise."""
        if self._metrics is None:
            raise AssertionError("Stat logging disabled: LLM.get_metrics() needs LLM(..., disable_log_stats=False)")
        from minillm.metrics_reader import metrics_snapshot
        with self._one_call("get_metrics"):
            self._metrics.update(self.engine.stats(summary=True))
        return metrics_snapshot(self._metrics.registry)

    @property
    def llm_engine(self) -> LLMEngine:
        """The LLMEngine underneath (vLLM's name for it)."""
        return self.engine

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """What the model serves (vLLM's LLM.supported_tasks): minillm runs generative models only."""
        return ("generate",)

    @property
    def model_config(self):
        """The engine's model config (vLLM's LLM.model_config): max_model_len, hf_config, dtype, ..."""
        return self.engine.model_config

    def get_tokenizer(self, lora_request=None):
        """The model's tokenizer (vLLM's lora_request may only be None: minillm loads no adapters)."""
        check_lora_request(lora_request)
        return self.engine.tokenizer

    def set_tokenizer(self, tokenizer) -> None:
        """vLLM's: takes back the tokenizer get_tokenizer() returned (what was changed on it, such as
        its chat_template, the engine uses already); ValueError naming tokenizer for any other."""
        if tokenizer is not self.engine.tokenizer:
            raise ValueError(f"set_tokenizer takes only the tokenizer get_tokenizer() returned, not another "
                             f"{type(tokenizer).__name__}: minillm reads one tokenizer.json at start-up (LLM's "
                             f"tokenizer argument chooses it; change that tokenizer in place, such as its "
                             f"chat_template, or give LLM.chat a chat_template)")

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget the prefix cache between generate() calls (vLLM's name), its host-memory tier's blocks
        too; False while requests hold KV blocks (added to llm_engine by hand), unless
        reset_running_requests preempts them first (LLMEngine.reset_prefix_cache)."""
        check_reset_flags(reset_running_requests, reset_connector)
        with self._one_call("reset_prefix_cache"):
            return self.engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use without sampling_params: SamplingParams() with the
        model's generation_config.json defaults (temperature, top_p, top_k, min_p,
        repetition_penalty, max_new_tokens as max_tokens), as vLLM's."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool | Callable = True, *, lora_request=None, priority: Seq[int] | None = None,
                 tokenization_kwargs: dict | None = None, prompt_adapter_request=None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        A prompt is a string, a list (or 1-D NumPy array) of token ids, {"prompt": text} or
        {"prompt_token_ids": ids}. use_tqdm (vLLM's, default True) shows a progress bar on stderr;
        it may be a tqdm-like callable that makes the bar, as in vLLM.
        priority (vLLM's): None, or an integer a prompt; with scheduling_policy "priority" a lower
        value is served earlier (and preempted later), under "fcfs" only zeros are taken.
        vLLM's other arguments are taken where minillm does what they ask: lora_request and
        prompt_adapter_request None (or lora_request a list of Nones, one a prompt), tokenization_kwargs
        None or a dict of add_special_tokens (for text prompts) and truncate_prompt_tokens (vLLM 0.17's
        place for it, as SamplingParams.truncate_prompt_tokens: a prompt's last k tokens, -1 all that fit).
        Calls from several threads run one after another.
        """
        check_lora_request(lora_request)
        if prompt_adapter_request is not None:
            raise ValueError(f"prompt_adapter_request={short_repr(prompt_adapter_request)} is not supported: "
                             f"minillm has no prompt adapters (leave it None)")
        tokenization_kwargs, truncate_prompt_tokens = split_truncation(tokenization_kwargs)
        add_special_tokens = tokenization_add_special_tokens(tokenization_kwargs)
        with self._one_call("generate"):
            return self._generate(prompts, sampling_params, use_tqdm, priority, add_special_tokens,
                                  truncate_prompt_tokens, lora_request)

    def _refuse_reentry(self, name: str) -> None:
        """RuntimeError naming LLM.<name>() when this thread is inside generate() already."""
        if self._generating_thread == threading.get_ident():
            raise RuntimeError(f"LLM.{name}() was called while this thread's generate() runs (from its use_tqdm "
                               f"progress bar?): the LLM runs one call at a time; call it after generate() returns")

    @contextlib.contextmanager
    def _one_call(self, name: str):
        """Hold _generate_lock for LLM.<name>(); RuntimeError when this thread holds it already (a
        use_tqdm callable calling back into the LLM), which would wait on itself for ever."""
        self._refuse_reentry(name)
        with self._generate_lock:
            self._generating_thread = threading.get_ident()
            try:
                yield
            finally:
                self._generating_thread = None

    def _generate(self, prompts, sampling_params, use_tqdm, priority=None, add_special_tokens: bool = True,
                  truncate_prompt_tokens: int | None = None, lora_request=None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or _is_one_id_list(prompts):
            prompts = [prompts]
        if not isinstance(prompts, Iterable) or isinstance(prompts, (bytes, bytearray)):   # bytes: not ids one by one
            raise ValueError(f"prompts must be a prompt or a list of prompts, got {short_repr(prompts)}")
        # (text, the text or ids, cache salt) of each: every prompt checked before any is queued
        prompts = list(prompts)
        unpacked = []
        for prompt in prompts:
            with _naming_prompt(len(unpacked), len(prompts)):
                unpacked.append((*unpack_prompt(prompt), cache_salt_of(prompt)))
        prompts = unpacked
        priority = check_priorities(priority, len(prompts), self.engine.config.scheduling_policy)
        if isinstance(lora_request, (list, tuple)) and len(lora_request) != len(prompts):
            raise ValueError(f"lora_request has {len(lora_request)} entries for {len(prompts)} prompts")
        if sampling_params is None:          # vLLM's get_default_sampling_params: the model's generation config
            sampling_params = self.get_default_sampling_params()
        is_list = isinstance(sampling_params, Seq) and not isinstance(sampling_params, (str, bytes))
        params = list(sampling_params) if is_list else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        wrong = [p for p in params if not isinstance(p, SamplingParams)]
        if wrong:
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {short_repr(wrong[0])}")
        params = with_truncation(params, truncate_prompt_tokens)
        bar = _progress_bar(len(prompts), use_tqdm) if use_tqdm else None   # before any request is queued
        ids: list[str] = []
        # With metrics, every step's outputs: the inter-token latency histogram times each token.
        timers = None if self._metrics is None else {}
        try:
            for (text, prompt, salt), p, rank in zip(prompts, params, priority):
                if text is not None and not isinstance(prompt, str):    # ids with their text: the output's prompt
                    prompt = TokensPrompt(prompt_token_ids=prompt, prompt=text)
                rid = str(next(self._ids))
                ids.append(rid)     # first: one interrupted inside add_request, registered or not, is aborted too
                with _naming_prompt(len(ids) - 1, len(prompts)):
                    self.engine.add_request(rid, prompt, p,
                                            output_kind="final" if timers is None else "cumulative",
                                            cache_salt=salt, priority=rank,
                                            tokenization_kwargs={"add_special_tokens": add_special_tokens})
                if timers is not None:
                    timers[rid] = self._request_timer(p)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            self._drain()
            if bar is not None:
                bar.close()
            raise
        finished: dict[str, RequestOutput] = {}
        wanted = set(ids)
        try:
            while len(finished) < len(ids):
                if self._is_closing:
                    raise RuntimeError("LLM.shutdown() was called while generate() ran: its requests were aborted")
                outputs = self.engine.step()
                if timers is not None:
                    _observe(timers, outputs)
                for out in outputs:
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            # An interrupt or a failed step: this call's other requests must not run on into the next call.
            for rid in ids:
                self.engine.abort_request(rid)
            try:
                self._drain()
            except Exception:        # the engine itself is broken: the first error is the one to report
                pass
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[rid] for rid in ids]

    def beam_search(self, prompts: PromptType | Seq[PromptType], params: BeamSearchParams, lora_request=None,
                    use_tqdm: bool | Callable = False, concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search (minillm/beam_search.py): a BeamSearchOutput a prompt, its best beams first.

        A prompt takes generate's forms; a text prompt is tokenized with special tokens. Each beam's
        tokens hold the prompt's and its text is the whole sequence decoded, as vLLM's; a beam ends
        with finish_reason "stop" on the tokenizer's EOS (unless params.ignore_eos) or "length" after
        max_tokens, or where it fills max_model_len. params.structured_outputs holds every beam to the
        constraint (each step's candidates from the masked distribution; a beam whose sentence is complete
        ends on EOS, "stop"). concurrency_limit (vLLM's) searches that many
        prompts at a time; use_tqdm shows the steps on stderr (not with concurrency_limit, as vLLM).
        lora_request may only be None (or a list of Nones, one a prompt).
        """
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {short_repr(params)}")
        params.validate()
        check_lora_request(lora_request)
        if isinstance(prompts, (str, dict)) or _is_one_id_list(prompts):
            prompts = [prompts]
        if not isinstance(prompts, Iterable) or isinstance(prompts, (bytes, bytearray)):
            raise ValueError(f"prompts must be a prompt or a list of prompts, got {short_repr(prompts)}")
        prompts = list(prompts)
        if isinstance(lora_request, (list, tuple)) and len(lora_request) != len(prompts):
            raise ValueError(f"lora_request has {len(lora_request)} entries for {len(prompts)} prompts")
        if concurrency_limit is not None and (not _is_int(concurrency_limit) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be None or an integer >= 1, got {short_repr(concurrency_limit)}")
        if 2 * params.beam_width > self.engine.config.max_logprobs:
            raise ValueError(f"beam_width must be at most max_logprobs // 2 ({self.engine.config.max_logprobs // 2}): "
                             f"each step asks for 2 * beam_width log-probabilities, got {params.beam_width}")
        instances = []
        for i, prompt in enumerate(prompts):
            with _naming_prompt(i, len(prompts)):
                instances.append(BeamSearchInstance.from_prompt(self._beam_prompt_ids(prompt), cache_salt_of(prompt)))
        step_params = SamplingParams(logprobs=2 * params.beam_width, max_tokens=1, temperature=params.temperature)
        batch_size = concurrency_limit or max(len(instances), 1)
        bar = _progress_bar(params.max_tokens, use_tqdm, "Beam search", "token") \
            if use_tqdm and concurrency_limit is None and instances else None
        tokenizer = self.get_tokenizer()
        try:
            for start in range(0, len(instances), batch_size):
                run_steps(instances[start:start + batch_size],
                          lambda batch, num_generated: self.generate(
                              batch, beam_step_params(step_params, params, num_generated), use_tqdm=False),
                          params, tokenizer.eos_token_id, self.engine.max_model_len,
                          None if bar is None else lambda: bar.update(1))
        finally:
            if bar is not None:
                bar.close()
        return [best_beams(inst, params, tokenizer.eos_token_id, tokenizer.decode) for inst in instances]

    def _beam_prompt_ids(self, prompt) -> list[int]:
        """A beam search prompt's token ids (a text prompt tokenized with special tokens); ValueError
        for one generate would refuse, or one that leaves no room under max_model_len."""
        _, prompt = unpack_prompt(prompt)
        if isinstance(prompt, str):
            ids = text_token_ids(self.engine.tokenizer, prompt)
        else:
            ids = checked_token_ids(prompt, self.engine.model_config.vocab_size)
        if len(ids) >= self.engine.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, which leaves no room under "
                             f"max_model_len {self.engine.max_model_len}")
        return ids

    def _request_timer(self, params: SamplingParams):
        """A request's feed of the metrics' latency and token histograms (as the server's)."""
        from minillm.server.metrics import RequestTimer
        return RequestTimer(self._metrics, params)

    def chat(self, messages: list[dict] | Seq[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool | Callable = True, lora_request=None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, tokenization_kwargs: dict | None = None,
             mm_processor_kwargs: dict | None = None, *, priority: Seq[int] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a batch of them, rendered with the chat template.

        chat_template replaces the model's own (a model without one needs it); each output's
        prompt is the rendered conversation. A message's content is a string or a list of parts,
        read as the server reads them: strings and text parts ({"type": "text", "text": ...};
        input_text, output_text and refusal too) joined by newlines; continue_final_message (with
        add_generation_prompt False) has the model continue the last message. tools (vLLM's) reach the
        template as `tools`, unless chat_template_kwargs sets them; it may set chat_template,
        add_generation_prompt and continue_final_message over the arguments too, as in vLLM.
        chat_template_content_format is vLLM's: how the template gets each message's content, "string" (parts joined) or "openai"
        (a list of text parts, a string content as one), "auto" picking "openai" for a template that
        loops over a message's content. lora_request and mm_processor_kwargs (vLLM's) may only be None;
        tokenization_kwargs (vLLM's) may set add_special_tokens, False by default: the template writes BOS
        itself where the model wants it; and truncate_prompt_tokens, as generate takes it. The arguments come in vLLM's order.
        priority: None, or an integer a conversation, as generate takes it.
        """
        self._refuse_reentry("chat")
        check_lora_request(lora_request)
        if mm_processor_kwargs:
            raise ValueError(f"mm_processor_kwargs={short_repr(mm_processor_kwargs)} is not supported: minillm "
                             f"runs text-only models (leave it None)")
        if not isinstance(messages, Seq) or isinstance(messages, str):
            raise ValueError(f"messages must be a list of message dicts (or a list of such lists), "
                             f"got {short_repr(messages)}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        check_priorities(priority, len(conversations), self.engine.config.scheduling_policy)
        check_template_kwargs(chat_template_kwargs)
        chat_template_kwargs, arguments = split_chat_arguments(chat_template_kwargs)
        chat_template = arguments.get("chat_template", chat_template)
        add_generation_prompt = arguments.get("add_generation_prompt", add_generation_prompt)
        continue_final_message = arguments.get("continue_final_message", continue_final_message)
        check_content_format(chat_template_content_format)
        add_special_tokens = False
        tokenization_kwargs, truncate_prompt_tokens = split_truncation(tokenization_kwargs)
        if tokenization_kwargs is not None:
            tokenization_add_special_tokens(tokenization_kwargs)       # a ValueError naming a key it cannot take
            add_special_tokens = tokenization_kwargs.get("add_special_tokens", False)
        if tools is not None:
            if not isinstance(tools, Seq) or isinstance(tools, str) or not all(isinstance(t, dict) for t in tools):
                raise ValueError(f"tools must be a list of tool dicts, got {short_repr(tools)}")
            chat_template_kwargs = {"tools": list(tools), **(chat_template_kwargs or {})}
        tokenizer = self.get_tokenizer()
        if isinstance(chat_template, str):
            check_unicode(chat_template, "chat_template")   # else named as the messages it rendered
            names = tokenizer.chat_template if isinstance(tokenizer.chat_template, dict) else {}
            chat_template = chat_template if chat_template in names else chat_template_source(chat_template)
        if chat_template is None and not tokenizer.has_chat_template:
            raise ValueError(f"the tokenizer of {tokenizer.name or 'this model'} has no chat template: pass one to "
                             f"LLM.chat as chat_template (its Jinja source), or use generate with plain prompts")
        prompts = []
        for i, conversation in enumerate(conversations):
            text = tokenizer.render_chat(
                plain_messages(conversation), chat_template, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, content_parts=chat_template_content_format,
                **(chat_template_kwargs or {}))
            check_unicode(text, "messages")
            ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
            if not ids:      # the engine's own error named the prompt, which the caller never gave
                where = f" (conversation {i})" if len(conversations) > 1 else ""
                raise ValueError(f"messages: the chat template rendered an empty prompt{where}")
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        truncation = None if truncate_prompt_tokens is None else {"truncate_prompt_tokens": truncate_prompt_tokens}
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, priority=priority,
                             tokenization_kwargs=truncation)

    def shutdown(self) -> None:
        """Release the engine's device memory (KV pool, graphs, weights); the LLM is unusable after. A
        generate() running on another thread is stopped after its current step (its requests aborted,
        a RuntimeError raised there) before the engine is shut down under it."""
        self._refuse_reentry("shutdown")      # from generate()'s own thread it would wait on itself
        self._is_closing = True
        with self._one_call("shutdown"):
            self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _drain(self) -> None:
        """Step until no request is unfinished and a step reports nothing (so none is in flight).
        Not until the engine holds no request: one that finished in a step interrupted while it made
        the outputs is never reported, and would keep this loop going for ever."""
        while self.engine.step() or self.engine.get_num_unfinished_requests():
            pass


def _observe(timers: dict, outputs: list[RequestOutput]) -> None:
    """A step's outputs into their requests' metrics timers (those of this generate() call)."""
    seen = time.time()
    for out in outputs:
        timer = timers.get(out.request_id)
        if timer is not None:
            timer.on_output(out, seen)


def split_truncation(tokenization_kwargs):
    """vLLM's tokenization_kwargs (0.17 on) as (the other keys, truncate_prompt_tokens or None): vLLM
    moved truncate_prompt_tokens there from SamplingParams."""
    if not isinstance(tokenization_kwargs, dict) or "truncate_prompt_tokens" not in tokenization_kwargs:
        return tokenization_kwargs, None
    rest = {k: v for k, v in tokenization_kwargs.items() if k != "truncate_prompt_tokens"}
    return rest, tokenization_kwargs["truncate_prompt_tokens"]


def with_truncation(params: list[SamplingParams], keep) -> list[SamplingParams]:
    """params with tokenization_kwargs' truncate_prompt_tokens set on a copy of each (the caller's are
    left as they are); ValueError naming truncate_prompt_tokens for a bad value, or for params that set
    another."""
    if keep is None:
        return params
    copies: dict[int, SamplingParams] = {}
    for p in params:
        if id(p) in copies:
            continue
        if p.truncate_prompt_tokens is not None and p.truncate_prompt_tokens != keep:
            raise ValueError(f"truncate_prompt_tokens is {short_repr(keep)} in tokenization_kwargs and "
                             f"{short_repr(p.truncate_prompt_tokens)} in sampling_params: give one")
        own = p.clone()
        own.truncate_prompt_tokens = keep
        own.validate()
        copies[id(p)] = own
    return [copies[id(p)] for p in params]


# Arguments LLM.chat passes to the renderer itself: chat_template_kwargs may not set them.
RESERVED_TEMPLATE_KWARGS = ("messages", "template", "content_parts", "tokenize")
# LLM.chat's arguments that chat_template_kwargs sets over them, as vLLM's LLM.chat merges
# chat_template_kwargs over {chat_template, add_generation_prompt, continue_final_message, tools}.
CHAT_ARGUMENT_KWARGS = ("chat_template", "add_generation_prompt", "continue_final_message")


def check_template_kwargs(kwargs) -> None:
    """ValueError unless chat_template_kwargs is None or a dict of names the renderer does not set itself."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"chat_template_kwargs must be a dict of names to values, got {short_repr(kwargs)}")
    clash = [k for k in RESERVED_TEMPLATE_KWARGS if k in kwargs]
    if clash:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)} (LLM.chat takes them as arguments)")


def split_chat_arguments(kwargs: dict | None) -> tuple[dict | None, dict]:
    """(chat_template_kwargs less LLM.chat's own arguments, the arguments it sets)."""
    if not kwargs:
        return kwargs, {}
    return ({k: v for k, v in kwargs.items() if k not in CHAT_ARGUMENT_KWARGS},
            {k: v for k, v in kwargs.items() if k in CHAT_ARGUMENT_KWARGS})


def chat_template_source(value: str) -> str:
    """LLM.chat's chat_template other than the name of one of the model's templates: the template's
    Jinja source, or the path of a file holding it, as vLLM's load_chat_template reads it (a text with
    no brace and no line break is a path); ValueError naming chat_template for a path to no file."""
    if any(c in value for c in "{}\n"):
        return value
    try:
        text = template_file_text(value)
    except ValueError as exc:
        raise ValueError(str(exc).replace("--chat-template", "chat_template")) from None
    if text is None:
        raise ValueError(f"chat_template={short_repr(value)} looks like a file path, but there is no such file "
                         f"(give the template's Jinja source, or the path of a file holding it)")
    return text


def plain_messages(conversation) -> list[dict]:
    """A conversation's messages with multi-part content as text parts {"type": "text", "text": ...}
    (as the server reads them: render_chat joins them by newlines, or keeps them for a template that
    reads parts); ValueError naming the message for any other kind of part."""
    if not isinstance(conversation, Seq) or isinstance(conversation, str):
        raise ValueError(f"messages must be a list of message dicts, got {short_repr(conversation)}")
    out = []
    for i, message in enumerate(conversation):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            parts = [{"type": "text", "text": _part_text(p, i, j)} for j, p in enumerate(content)]
            message = {**message, "content": parts}
        if isinstance(message, dict) and not isinstance(message.get("content"), (str, list, type(None))):
            raise ValueError(f"messages[{i}]['content'] must be a string or a list of text parts, "
                             f"got {short_repr(message.get('content'))}")
        if isinstance(message, dict) and isinstance(message.get("tool_calls"), list):
            message = {**message, "tool_calls": [_call_with_parsed_arguments(c, i, j)
                                                 for j, c in enumerate(message["tool_calls"])]}
        out.append(message)
    return out


def _call_with_parsed_arguments(call, i: int, j: int):
    """Tool call j of message i with its arguments as data, as templates read them (and as the server
    and vLLM's chat pass them): JSON text parsed, none or "" as {}; ValueError naming it for bad JSON."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or isinstance(function.get("arguments"), (dict, list)):
        return call
    text = function.get("arguments")
    try:
        arguments = json.loads(text) if text else {}
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"messages[{i}]['tool_calls'][{j}]['function']['arguments'] must be JSON text, "
                         f"got {short_repr(text)}: {exc}") from None
    return {**call, "function": {**function, "arguments": arguments}}


def _part_text(part, i: int, j: int) -> str:
    """The text of content part j of message i: a plain string, or a text part (TEXT_PART_KEYS)."""
    if isinstance(part, str):
        return part
    key = TEXT_PART_KEYS.get(part.get("type")) if isinstance(part, dict) else None
    if key is None or not isinstance(part.get(key), str):
        raise ValueError(f"messages[{i}]['content'][{j}] must be a string or a text part "
                         f"({', '.join(f'{{type: {t!r}, {k!r}: str}}' for t, k in TEXT_PART_KEYS.items())}); "
                         f"only text parts are supported, got {short_repr(part)}")
    return part[key]


@contextlib.contextmanager
def _naming_prompt(index: int, count: int):
    """A ValueError about the index-th of count prompts says which one ("prompt 2 of 3: ..."); one prompt: as it is."""
    try:
        yield
    except ValueError as exc:
        if count == 1:
            raise
        raise ValueError(f"prompt {index + 1} of {count}: {exc}") from exc


def _is_one_id_list(prompts) -> bool:
    """True when prompts is one prompt of token ids (a list of integers, or a 1-D NumPy array), not a batch."""
    if isinstance(prompts, np.ndarray):
        return prompts.ndim <= 1      # a 0-d array reaches array_ids, which names it
    return isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], numbers.Integral)


def _progress_bar(total: int, use_tqdm, desc: str = "generate", unit: str = "req"):
    """A tqdm bar on stderr (tqdm comes with huggingface-hub), or the one use_tqdm makes when it is
    callable; None without a stderr (sys.stderr None: pythonw, or started with it closed)."""
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="Processed prompts" if desc == "generate" else desc, dynamic_ncols=True)
    if sys.stderr is None:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit=unit, file=_BarStream(sys.stderr))


class _BarStream:
    """The progress bar's stderr: the first write or flush that fails (a full disk, a closed
    descriptor) turns the bar silent, as the bar is on by default and must never fail generate()."""

    def __init__(self, stream):
        self.stream = stream
        self.is_broken = False

    def write(self, text: str) -> None:
        self._quietly(self.stream.write, text)

    def flush(self) -> None:
        self._quietly(self.stream.flush)

    def _quietly(self, call, *args) -> None:
        if self.is_broken:
            return
        try:
            call(*args)
        except (OSError, ValueError):     # ValueError: a closed file
            self.is_broken = True

    def __getattr__(self, name: str):     # isatty, encoding, ... as tqdm reads them
        return getattr(self.stream, name)
