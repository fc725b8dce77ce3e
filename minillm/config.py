"""Frozen configuration: the model's shape (from config.json) and the engine's knobs."""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from minillm.generation_config import check_generation_config, override_sampling_defaults
from minillm.sampling_params import MAX_LOGPROBS, short_repr
from minillm.seeds import check_engine_seed

if TYPE_CHECKING:
    from minillm.kv_connector.transfer_config import KVTransferConfig
    from minillm.spec_decode.config import SpeculativeConfig
    from minillm.structured_outputs_config import StructuredOutputsConfig


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer, read from a Hugging Face config.json."""

    architecture: str            # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False     # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False            # per-head RMSNorm on q and k before rotary (Qwen3)
    rope_scaling: dict | None = None  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    torch_dtype: str = "float32"     # dtype the checkpoint was saved in
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    # The attention window transformers gives some layer (Mistral, Qwen2/3 with use_sliding_window);
    # attention here is full-context, which equals it for sequences of at most this many tokens.
    sliding_window: int | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token across all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine is told at start-up; run-time values are returned, never written here."""

    model: str
    device: str = "auto"                 # "cpu" | "cuda" | "auto"
    dtype: str = "auto"                  # "auto" | "float32" | "float16" | "bfloat16" (vLLM's "float", "half")
    block_size: int = 16
    num_kv_blocks: int | None = None     # None: sized from the memory budget
    # Bytes the KV pool may take (None: on the GPU what gpu_memory_utilization leaves; on the CPU
    # VLLM_CPU_KVCACHE_SPACE GiB, else 4 GiB as vLLM's CPU backend; there capped by what it can use)
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_step_ms: float | None = None     # step-time budget while decodes run (None: the token budget only)
    # A budget relative to the batch: a step with prompt rows may take this many times the estimated
    # step of the batch's decode rows, the prompts waiting to join it counted as the rows they become
    # (None: off; with max_step_ms too, the tighter of the two applies).
    max_step_factor: float | None = None
    # vLLM's: "fcfs" serves requests in arrival order; "priority" by each request's priority (lower
    # first, then arrival), and preempts the lowest first (minillm/request_queue.py).
    scheduling_policy: str = "fcfs"
    max_model_len: int | None = None     # None: the model's length (model_length: max_position_embeddings, or
                                         # as a linear or yarn rope_scaling stretches it)
    # vLLM's: prompts split into chunks that fit the step's token budget; False runs each prompt whole
    # in one step (it waits for a step with room for it), so max_num_batched_tokens must hold max_model_len.
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    seed: int = 0
    download_dir: str | None = None      # None: the Hugging Face cache (model_store.hf_hub_cache)
    revision: str | None = None          # a hub model's branch, tag or commit (None: main)
    # vLLM's tokenizer: a directory or hub id whose tokenizer.json, tokenizer_config.json and chat
    # templates are read in place of the model's (None: the model's own); config.json and
    # generation_config.json stay the model's. tokenizer_revision: its hub version (None: revision).
    tokenizer: str | None = None
    tokenizer_revision: str | None = None
    tokenizer_mode: str = "auto"         # vLLM's; "auto" and "hf" both read tokenizer.json (the fast tokenizer)
    # vLLM's served_model_name: a name, or a list of names of which the engine goes by the first
    # (None or []: the model as given; an empty name is refused, as the server refuses it)
    served_model_name: str | list[str] | None = None
    async_scheduling: bool | None = None  # launch step t+1 before reading step t (None: on the GPU)
    # constrained requests' matchers in a process of their own (grammar_process.py; None: on the GPU)
    grammar_process: bool | None = None
    load_format: str = "auto"            # "auto" ("safetensors"): the checkpoint; "dummy": random weights of its shape
    # vLLM's speculative_config: a SpeculativeConfig, its dict or its JSON (None: no speculation)
    speculative_config: "SpeculativeConfig | dict[str, Any] | str | None" = None
    tensor_parallel_size: int = 1        # processes the model is split over (minillm/parallel/)
    kv_offload_gib: float = 0            # host-memory tier of the prefix cache, GiB (0: off)
    # vLLM's kv_transfer_config: prefill/decode disaggregation (a KVTransferConfig, its dict or its
    # JSON; None: this engine takes no part in KV transfers)
    kv_transfer_config: "KVTransferConfig | dict[str, Any] | str | None" = None
    # vLLM's cache dtype: "auto" stores K/V in the model's dtype; "fp8" (or "fp8_e4m3") stores FP8
    # E4M3 bytes with a per-layer k_scale / v_scale (1.0, or from the first prefill when
    # calculate_kv_scales), so the same memory holds twice the tokens.
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    # vLLM's generation_config: "auto" takes the sampling defaults of the model's
    # generation_config.json for what a request leaves unset; "vllm" ignores the file.
    generation_config: str = "auto"
    # vLLM's override_generation_config: sampling defaults by generation_config.json's names
    # ({"temperature": 0.5, "max_new_tokens": 64}) over the file's ("auto") or alone ("vllm").
    override_generation_config: dict | None = None
    max_logprobs: int = MAX_LOGPROBS     # the most log-probabilities a request may ask for, a token
    # vLLM's structured_outputs_config: a StructuredOutputsConfig, its dict or its JSON (None: each
    # constraint as given, as an API server's engine core takes them; LLM and EngineArgs give vLLM's defaults)
    structured_outputs_config: "StructuredOutputsConfig | dict[str, Any] | str | None" = None

    @property
    def has_step_budget(self) -> bool:
        """True when prompt chunks are sized by a step-time budget (max_step_ms or max_step_factor)."""
        return self.max_step_ms is not None or self.max_step_factor is not None

    def __post_init__(self) -> None:
        if isinstance(self.max_model_len, numbers.Integral) and self.max_model_len == -1:   # vLLM's "auto"
            object.__setattr__(self, "max_model_len", None)
        check_field_types(self)
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {short_repr(self.device)}")
        if isinstance(self.dtype, str) and self.dtype in DTYPE_ALIASES:
            object.__setattr__(self, "dtype", DTYPE_ALIASES[self.dtype])
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32 (float), float16 (half) or bfloat16, "
                             f"got {short_repr(self.dtype)}")
        object.__setattr__(self, "served_model_name", first_served_name(self.served_model_name))
        if self.revision is not None and not isinstance(self.revision, str):
            raise ValueError(f"revision must be a branch, tag or commit of a hub model, "
                             f"got {short_repr(self.revision)}")
        check_tokenizer_fields(self)
        if self.download_dir is not None and not isinstance(self.download_dir, (str, os.PathLike)):
            # it was read only to fetch a hub model, where it failed as "expected str, bytes or os.PathLike"
            raise ValueError(f"download_dir must be a directory path, got {short_repr(self.download_dir)}")
        if isinstance(self.download_dir, str) and not self.download_dir.strip():
            # "" read as the Hugging Face cache, " " as a folder of that name here (an unset variable, most likely)
            raise ValueError(f"download_dir is {'empty' if not self.download_dir else 'blank'}: give a directory, "
                             f"or None for the Hugging Face cache")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be an integer in [0, {MAX_LOGPROBS}] (minillm returns at most "
                             f"{MAX_LOGPROBS} log-probabilities a token), got {short_repr(self.max_logprobs)}")
        if self.load_format == "safetensors":
            object.__setattr__(self, "load_format", "auto")     # vLLM's name: "auto" reads the safetensors
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' (the checkpoint's safetensors; 'safetensors' is taken "
                             f"as 'auto') or 'dummy', got {short_repr(self.load_format)}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        check_generation_config(self.generation_config)
        try:
            override_sampling_defaults(self.override_generation_config)
        except ValueError as exc:
            raise ValueError(f"override_generation_config: {exc}") from None
        if self.override_generation_config is not None:    # the caller's dict may change; this may not
            object.__setattr__(self, "override_generation_config", dict(self.override_generation_config))
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two in [1, {MAX_BLOCK_SIZE}], "
                             f"got {short_repr(self.block_size)}")
        if self.seed is not None:
            check_engine_seed(self.seed)
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1 (or None: sized by the engine), "
                             f"got {short_repr(self.kv_cache_memory_bytes)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {short_repr(self.num_kv_blocks)}")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, "
                             f"got {short_repr(self.tensor_parallel_size)}")
        if not 1 <= self.max_num_seqs <= MAX_NUM_SEQS:
            raise ValueError(f"max_num_seqs must be in [1, {MAX_NUM_SEQS}], got {short_repr(self.max_num_seqs)}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {short_repr(self.max_num_batched_tokens)}")
        if self.max_step_ms is not None and (isinstance(self.max_step_ms, bool)
                                             or not isinstance(self.max_step_ms, (int, float))
                                             or not _is_finite(self.max_step_ms) or self.max_step_ms <= 0):
            raise ValueError(f"max_step_ms must be a finite number > 0 (or None: off), "
                             f"got {short_repr(self.max_step_ms)}")
        if self.max_step_factor is not None and (isinstance(self.max_step_factor, bool)
                                                 or not isinstance(self.max_step_factor, (int, float))
                                                 or not _is_finite(self.max_step_factor)
                                                 or self.max_step_factor < 1):
            raise ValueError(f"max_step_factor must be a finite number >= 1 (or None: off), "
                             f"got {short_repr(self.max_step_factor)}")
        if not self.enable_chunked_prefill:
            check_unchunked_prefill(self, self.max_model_len)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {short_repr(self.scheduling_policy)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {short_repr(self.max_model_len)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {short_repr(self.gpu_memory_utilization)}")
        if self.speculative_config is not None:
            from minillm.spec_decode.config import SpeculativeConfig
            try:
                spec = SpeculativeConfig.from_any(self.speculative_config)
            except (TypeError, ValueError) as e:
                message = str(e)
                raise ValueError(message if message.startswith("speculative_config")
                                 else f"speculative_config: {message}") from None
            # Parsed once here, as given: the frozen config holds the one parsed form.
            object.__setattr__(self, "speculative_config", spec)
        if self.structured_outputs_config is not None:
            from minillm.structured_outputs_config import StructuredOutputsConfig
            object.__setattr__(self, "structured_outputs_config",
                               StructuredOutputsConfig.from_any(self.structured_outputs_config))
        if self.kv_transfer_config is not None:
            from minillm.kv_connector.transfer_config import KVTransferConfig
            object.__setattr__(self, "kv_transfer_config", KVTransferConfig.from_any(self.kv_transfer_config))
            if self.kv_offload_gib:
                raise ValueError("kv_transfer_config and kv_offload_gib cannot be combined: an engine has one "
                                 "KV connector")
            if is_fp8_kv_cache(self.kv_cache_dtype):
                raise ValueError("kv_transfer_config works with kv_cache_dtype auto only: FP8 blocks mean "
                                 "nothing without their engine's scales")
            if self.tensor_parallel_size > 1:
                raise ValueError("kv_transfer_config works with tensor_parallel_size 1 only")
        if self.kv_offload_gib:
            check_kv_offload_gib(self.kv_offload_gib, self.enable_prefix_caching)
            if self.tensor_parallel_size > 1:
                raise ValueError("kv_offload_gib works with tensor_parallel_size 1 only: the host tier "
                                 "copies rank 0's KV pool")


# vLLM's tokenizer_mode values minillm takes: both read tokenizer.json with the tokenizers library.
TOKENIZER_MODES = ("auto", "hf")


def check_tokenizer_fields(config: EngineConfig) -> None:
    """ValueError naming tokenizer, tokenizer_revision or tokenizer_mode when one is of the wrong kind,
    blank, or a mode minillm has no counterpart of; a path-like tokenizer is kept as its string."""
    tokenizer = config.tokenizer
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        raise ValueError(f"tokenizer must be a directory with tokenizer.json or a hub id, got {short_repr(tokenizer)}")
    if tokenizer is not None:
        object.__setattr__(config, "tokenizer", os.fspath(tokenizer))
        if not config.tokenizer.strip():
            raise ValueError("tokenizer is empty: give a directory with tokenizer.json or a hub id (or None: "
                             "the model's own)")
    revision = config.tokenizer_revision
    if revision is not None and (not isinstance(revision, str) or not revision.strip()):
        raise ValueError(f"tokenizer_revision must be a branch, tag or commit of a hub tokenizer, got "
                         f"{short_repr(revision)}")
    if config.tokenizer_mode not in TOKENIZER_MODES:
        raise ValueError(f"tokenizer_mode {short_repr(config.tokenizer_mode)} is not supported: minillm reads "
                         f"tokenizer.json with the fast tokenizers library ('auto' or 'hf'); vLLM's slow, "
                         f"mistral and custom tokenizers have no counterpart here")


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
SCHEDULING_POLICIES = ("fcfs", "priority")
# vLLM's ModelDType also takes these names.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
# Bounds past which a value only allocates memory for nothing (vLLM's CUDA blocks go to 128 tokens;
# the sampler keeps per-row buffers of max_num_seqs rows).
MAX_BLOCK_SIZE = 1024
MAX_NUM_SEQS = 65536
# BLAS threads (--threads, OPENBLAS_NUM_THREADS, OMP_NUM_THREADS): OpenBLAS takes its count as a C int and
# caps it at the CPUs it was built for, far below this.
MAX_BLAS_THREADS = 4096
# EngineConfig's fields by the kind of value they take (None passes where the field's default is None).
_INT_FIELDS = ("block_size", "num_kv_blocks", "kv_cache_memory_bytes", "max_num_seqs", "max_num_batched_tokens",
               "max_model_len", "seed", "max_logprobs", "tensor_parallel_size")
_FLOAT_FIELDS = ("gpu_memory_utilization", "max_step_ms", "max_step_factor", "kv_offload_gib")
_BOOL_FIELDS = ("enable_prefix_caching", "enforce_eager", "async_scheduling", "calculate_kv_scales",
                "grammar_process", "enable_chunked_prefill")


def _is_finite(value: int | float) -> bool:
    """math.isfinite without its OverflowError on an integer past a float's range (every integer is finite)."""
    return isinstance(value, numbers.Integral) or math.isfinite(value)


def check_field_types(config: EngineConfig) -> None:
    """ValueError naming the first field whose value is of the wrong kind (a string for a number, a
    bool for a count), before any range check compares it. None in a field whose default is not
    None takes the default (vLLM's engine arguments read None as "the default")."""
    if not isinstance(config.model, (str, os.PathLike)):
        raise ValueError(f"model must be a model directory or hub id, got {short_repr(config.model)}")
    for f in dataclasses.fields(config):
        if getattr(config, f.name) is None and f.default is not None and f.default is not dataclasses.MISSING:
            object.__setattr__(config, f.name, f.default)
    for name in _INT_FIELDS:
        value = getattr(config, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise ValueError(f"{name} must be an integer, got {short_repr(value)}")
        if value is not None and type(value) is not int:   # a NumPy integer: random.Random(seed) refused one
            object.__setattr__(config, name, int(value))
    value = config.gpu_memory_utilization
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"gpu_memory_utilization must be a number, got {short_repr(value)}")
    for name in _FLOAT_FIELDS:        # NumPy floats as Python's, which the range checks below take
        value = getattr(config, name)
        if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
            object.__setattr__(config, name, float(value))
    numpy = sys.modules.get("numpy")            # a NumPy bool needs NumPy loaded: never imported here
    for name in _BOOL_FIELDS:
        value = getattr(config, name)
        if numpy is not None and isinstance(value, numpy.bool_):     # NumPy's True and False, as Python's
            object.__setattr__(config, name, bool(value))
        elif value is not None and not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {short_repr(value)}")


def check_unchunked_prefill(config: EngineConfig, max_model_len: int | None) -> None:
    """With enable_chunked_prefill False a prompt runs whole in one step: ValueError when the step's
    token budget is under max_model_len (as vLLM refuses it: a longer prompt could never run), or
    when a step-time budget, which sizes prompt chunks, is set."""
    if config.has_step_budget:
        name = "max_step_ms" if config.max_step_ms is not None else "max_step_factor"
        raise ValueError(f"{name} sizes prompt chunks, which enable_chunked_prefill False leaves none of; "
                         f"leave one of them out")
    if max_model_len is not None and config.max_num_batched_tokens < max_model_len:
        raise ValueError(f"max_num_batched_tokens {config.max_num_batched_tokens} is smaller than max_model_len "
                         f"{max_model_len}: with enable_chunked_prefill False a prompt runs whole in one step, "
                         f"so a longer one could never run; raise max_num_batched_tokens or lower max_model_len")


# vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN, and minillm's name of it: 1 (or true) allows a max_model_len
# past the model's length (model_length), with a warning.
LONG_MAX_MODEL_LEN_VARIABLES = ("MINILLM_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_ALLOW_LONG_MAX_MODEL_LEN")
# Rotary scalings whose table past max_position_embeddings is not the one built up to it.
_ROPE_TYPES_BOUND_TO_LENGTH = ("dynamic", "longrope")


def long_max_model_len_variable() -> str | None:
    """The variable that allows a max_model_len past the model's length (read as vLLM reads its own:
    1 or true), or None."""
    return next((name for name in LONG_MAX_MODEL_LEN_VARIABLES
                 if os.environ.get(name, "0").strip().lower() in ("1", "true")), None)


def model_length(model: ModelConfig) -> tuple[int, str]:
    """The longest context the model's config.json allows, as vLLM derives it, and the fields it comes
    from: max_position_embeddings, stretched by a linear rope_scaling's factor; a yarn scaling's
    original_max_position_embeddings times its factor. Their tables hold at every position; dynamic
    and longrope compute none past max_position_embeddings here, and llama3's factor is in it already."""
    scaling = model.rope_scaling or {}
    kind = scaling.get("rope_type")
    if kind == "linear":
        factor = scaling["factor"]
        length = int(model.max_position_embeddings * factor)
        return length, f"length {length} (max_position_embeddings {model.max_position_embeddings} x its linear " \
                       f"rope_scaling factor {factor:g})"
    if kind == "yarn":
        original, factor = scaling["original_max_position_embeddings"], scaling["factor"]
        length = int(original * factor)
        return length, f"length {length} (its yarn rope_scaling original_max_position_embeddings {original:g} x " \
                       f"factor {factor:g})"
    return model.max_position_embeddings, f"max_position_embeddings {model.max_position_embeddings}"


def check_max_model_len_in_model(max_model_len: int, model: ModelConfig) -> str | None:
    """None when max_model_len is within the model's length (model_length); past it, the warning
    to log where MINILLM_ALLOW_LONG_MAX_MODEL_LEN (or vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN) allows
    it, else a ValueError naming the variables."""
    model_max, source = model_length(model)
    if max_model_len <= model_max:
        return None
    said = f"max_model_len {max_model_len} exceeds the model's {source}"
    rope_type = (model.rope_scaling or {}).get("rope_type")
    if rope_type in _ROPE_TYPES_BOUND_TO_LENGTH:
        raise ValueError(f"{said}, which its rope_scaling ({rope_type}) computes no positions past")
    variable = long_max_model_len_variable()
    if variable is None:
        raise ValueError(f"{said}; to allow it anyway, set MINILLM_ALLOW_LONG_MAX_MODEL_LEN=1 (or vLLM's "
                         f"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1): the model was not trained on positions past "
                         f"{model_max}, and its output there may be garbage")
    return (f"{said}, allowed by {variable}: the model was not trained on positions past {model_max}, and "
            f"its output there may be garbage")


def first_served_name(names) -> str | None:
    """The name an engine goes by, of a served_model_name as vLLM takes it: a name or a list of
    names (the first; an empty list: none); a ValueError naming served_model_name for anything else,
    and for an empty or blank name, which ServerOptions refuses too."""
    if names is None:
        return names
    listed = [names] if isinstance(names, str) else names
    if not isinstance(listed, (list, tuple)) or not all(isinstance(name, str) for name in listed):
        raise ValueError(f"served_model_name must be a name or a list of names, got {short_repr(names)}")
    if not all(name.strip() for name in listed):
        raise ValueError(f"served_model_name must be a name or a list of names, none empty, got {short_repr(names)}")
    return listed[0] if listed else None


def check_kv_cache_dtype(name) -> None:
    """kv_cache_dtype is one of KV_CACHE_DTYPES; E5M2 is named and refused (E4M3 only)."""
    if name == "fp8_e5m2":
        raise ValueError("kv_cache_dtype 'fp8_e5m2' is not supported: the FP8 KV cache stores E4M3 "
                         "(use 'fp8' or 'fp8_e4m3')")
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be 'auto', 'fp8' or 'fp8_e4m3', got {short_repr(name)}")


def is_fp8_kv_cache(name: str) -> bool:
    """True when kv_cache_dtype asks for FP8 E4M3 storage."""
    return name in ("fp8", "fp8_e4m3")


# vLLM's human_readable_int: lower-case suffixes are powers of ten (1k = 1000, decimals allowed),
# upper-case ones powers of two (1K = 1024, whole numbers only); the IEC forms (Ki, MiB, ...) are taken too.
_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)(?:([kmgt])|([KMGT])|([KMGT])iB?)?")
SIZE_FORMS = "a number of bytes, with k/m/g/t for powers of ten (1.5g) or K/M/G/T, Ki/Mi/Gi/Ti or KiB/MiB/GiB/TiB " \
             "for powers of two (4G, 512MiB)"


def parse_memory_bytes(text: str) -> int:
    """A byte count as vLLM's --kv-cache-memory-bytes reads one ("4G", "512M", "1.5g", "4096"),
    or the IEC spelling ("512MiB"); a ValueError naming the forms for anything else."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"must be {SIZE_FORMS}; got {short_repr(text)}")
    number, decimal, binary, iec = match.groups()
    if decimal is not None:
        return int(float(number) * _DECIMAL_SUFFIXES[decimal])
    scale = _BINARY_SUFFIXES.get(binary or iec, 1)
    if "." not in number:
        return int(number) * scale
    if iec is None:       # bytes, or vLLM's upper-case suffixes: whole numbers only, as vLLM takes them
        raise ValueError(f"must be {SIZE_FORMS}; got {short_repr(text)}")
    return int(float(number) * scale)


# vLLM's human-readable counts: k, m, g, t in powers of ten (decimals allowed), K, M, G, T in powers of two.
_COUNT = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT])?")
_COUNT_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
MAX_MODEL_LEN_FORMS = "a token count (2048, 1k = 1000, 1K = 1024, 25.6k), or auto (or -1) for the model's length"


def parse_max_model_len(value: str | int) -> int | None:
    """max_model_len as vLLM reads --max-model-len: a count with an optional k/m/g/t (powers of ten)
    or K/M/G/T (powers of two, whole numbers only) suffix; "auto" or -1 is None, the model's length
    fitted to the KV pool. ValueError naming max_model_len for anything else."""
    text = str(value).strip()
    if text == "-1" or text.lower() == "auto":
        return None
    match = _COUNT.fullmatch(text)
    if match is None or ("." in match[1] and (match[2] is None or match[2].isupper())):
        raise ValueError(f"max_model_len must be {MAX_MODEL_LEN_FORMS}, got {short_repr(value)}")
    return int(float(match[1]) * _COUNT_SUFFIXES[match[2]]) if match[2] else int(match[1])


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_kv_offload_gib(gib: float, enable_prefix_caching: bool) -> None:
    """The host tier's size is a finite, positive amount the machine has free; it extends the
    prefix cache, so that must be on."""
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not _is_finite(gib) or gib < 0:
        raise ValueError(f"kv_offload_gib must be a finite number >= 0, got {short_repr(gib)}")
    if not enable_prefix_caching:
        raise ValueError("kv_offload_gib needs enable_prefix_caching: the host tier keeps prefix-cache blocks")
    available = available_host_bytes()
    if available is not None and gib * 2**30 > available:
        raise ValueError(f"kv_offload_gib {short_repr(gib)} exceeds the machine's available memory "
                         f"({available / 2**30:.1f} GiB); lower kv_offload_gib")
