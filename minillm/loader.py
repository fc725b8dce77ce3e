"""Model directories: read config.json into a ModelConfig and safetensors weights into NumPy."""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minillm.config import ModelConfig
from minillm.sampling_params import short_repr
# Finding a model (a local directory, or a hub id in the store) lives in model_store.
from minillm.model_store import broken_link, index_weight_map, list_local_models, read_json_object, resolve_model_path  # noqa: F401
from minillm.model_store import weights_index

logger = logging.getLogger("minillm")

# config.json "architectures" -> (its model_type, the decoder family minillm runs it as). A config
# that lists no architectures is read by its model_type, as transformers' Auto classes pick the class.
_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "llama"),
    "MistralForCausalLM": ("mistral", "llama"),
    "Qwen2ForCausalLM": ("qwen2", "qwen2"),
    "Qwen3ForCausalLM": ("qwen3", "qwen3"),
}
SUPPORTED_ARCHITECTURES = {arch: family for arch, (_, family) in _ARCHITECTURES.items()}
MODEL_TYPE_ARCHITECTURES = {model_type: arch for arch, (model_type, _) in _ARCHITECTURES.items()}


# ---- config.json -> ModelConfig ------------------------------------------------------------------


def _read_config(path: Path) -> dict:
    return read_json_object(Path(path) / "config.json")


def config_architecture(cfg: dict) -> str:
    """The supported architecture a config names ("architectures", else its "model_type"), or a
    ValueError naming what it names and the supported ones."""
    names = cfg.get("architectures") or []
    names = names if isinstance(names, list) else [names]    # one name, written without its list
    for name in names:
        if isinstance(name, str) and name in SUPPORTED_ARCHITECTURES:
            return name
    model_type = cfg.get("model_type")
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if names:
        raise ValueError(f"unsupported architecture {', '.join(map(str, names))}; supported: {supported}")
    if isinstance(model_type, str) and model_type in MODEL_TYPE_ARCHITECTURES:
        return MODEL_TYPE_ARCHITECTURES[model_type]
    if model_type is not None:
        raise ValueError(f"unsupported model_type {short_repr(model_type)} (config.json lists no architectures); "
                         f"supported: {supported} (model_type {', '.join(MODEL_TYPE_ARCHITECTURES)})")
    raise ValueError(f'config.json names no architecture (neither "architectures" nor "model_type"); '
                     f"supported: {supported}")


def _require(cfg: dict, key: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json field {key!r} must be a positive integer, got {value!r}")
    return value


def _optional(cfg: dict, key: str, default: int) -> int:
    """A positive integer field that may be absent or null (then default)."""
    return default if cfg.get(key) is None else _require(cfg, key)


def _positive_number(cfg: dict, key: str, default: float, where: str = "") -> float:
    """A finite positive number field that may be absent or null (then default); where: the
    field's parent in the error (e.g. "rope_scaling.")."""
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"config.json field {where + key!r} must be a positive number, got {short_repr(value)}")
    return float(value)


# config.json fields transformers' config classes default differently from Llama's when the file
# leaves them out (an explicit null keeps minillm's fallback).
_ARCHITECTURE_DEFAULTS = {
    "MistralForCausalLM": {"max_position_embeddings": 131072, "num_key_value_heads": 8, "sliding_window": 4096},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 32},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128},
}
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def _rope(cfg: dict, head_dim: int, max_positions: int) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) as transformers reads them: a non-empty "rope_scaling" replaces
    "rope_parameters" (transformers 5's name) whole, and a rope_theta inside it wins over the top-level one."""
    for key in ("rope_parameters", "rope_scaling"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise ValueError(f"config.json field {key!r} must be an object, got {short_repr(cfg[key])}")
    where = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    params = dict(cfg.get(where) or {})
    theta = (_positive_number(params, "rope_theta", 10000.0, where=where + ".") if "rope_theta" in params
             else _positive_number(cfg, "rope_theta", 10000.0))
    kind = _rope_type(params)
    if kind == "default":          # transformers' default rotary reads neither a factor nor partial_rotary_factor
        return theta, None
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and (isinstance(partial, bool) or not isinstance(partial, (int, float))
                                or int(head_dim * partial) != head_dim):
        # transformers builds rotary tables of int(head_dim * factor) columns and fails on the full heads
        raise ValueError(f"config.json partial_rotary_factor {short_repr(partial)} is not supported with "
                         f"rope_scaling type {short_repr(kind)} (the whole head of {head_dim} is rotated)")
    scaling = {k: v for k, v in params.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
    scaling["rope_type"] = kind
    if kind in ("llama3", "yarn", "longrope") and cfg.get("original_max_position_embeddings") is not None:
        # transformers' standardize_rope_params: a config's own original_max_position_embeddings
        # (Phi-3's spelling) wins over the one in the rope parameters
        scaling["original_max_position_embeddings"] = _positive_number(cfg, "original_max_position_embeddings", 0.0)
    return theta, _check_rope_scaling(scaling, head_dim, max_positions)


def _rope_type(params: dict):
    """The rope type of rope parameters as vLLM's patch_legacy_rope_type reads them: rope_type, else the
    legacy "type"; a ValueError when the two disagree; legacy "su" is longrope and "mrope" (text
    positions) the default rotary."""
    kind, legacy = params.get("rope_type"), params.get("type")
    if "rope_type" in params and "type" in params and kind != legacy \
            and (legacy, kind) not in (("su", "longrope"), ("mrope", "default")):
        raise ValueError(f"config.json rope_scaling has conflicting rope_type {short_repr(kind)} (modern field) "
                         f"and type {short_repr(legacy)} (legacy field); give only one of them")
    kind = kind if "rope_type" in params else legacy if "type" in params else "default"
    if kind == "su":
        logger.warning("config.json rope_scaling type 'su' is read as 'longrope', its current name")
        return "longrope"
    if kind == "mrope":
        if "mrope_section" not in params:
            raise ValueError("config.json rope_scaling type 'mrope' needs an 'mrope_section'")
        logger.warning("config.json rope_scaling type 'mrope' is read as 'default' (text positions)")
        return "default"
    return kind


def _check_rope_scaling(scaling: dict, head_dim: int, max_positions: int) -> dict:
    """The scaling with the defaults transformers fills in (original_max_position_embeddings: the
    model's max_position_embeddings; a yarn or longrope factor of null: their ratio), or a
    ValueError naming the field that is missing, out of range or not reproduced exactly."""
    kind = scaling["rope_type"]
    if kind not in ROPE_TYPES:
        raise ValueError(f"config.json rope_scaling type {short_repr(kind)} is not supported "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    required = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
                "longrope": ("short_factor", "long_factor")}[kind]
    missing = [key for key in required if key not in scaling]
    if missing:
        raise ValueError(f"config.json rope_scaling ({kind}) needs a {missing[0]!r}")
    out = dict(scaling)
    if kind in ("llama3", "yarn", "longrope"):
        out["original_max_position_embeddings"] = _positive_number(
            scaling, "original_max_position_embeddings", max_positions, where="rope_scaling.")
        if kind != "llama3" and out.get("factor") is None:
            out["factor"] = max_positions / out["original_max_position_embeddings"]
    for key in ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "mscale", "mscale_all_dim"):
        if out.get(key) is not None:
            out[key] = _positive_number(out, key, 1.0, where="rope_scaling.")
    for key in ("beta_fast", "beta_slow"):
        if out.get(key):           # transformers reads 0 or null as the default (32, 1)
            out[key] = _positive_number(out, key, 1.0, where="rope_scaling.")
    if kind == "llama3" and out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ValueError("config.json rope_scaling.high_freq_factor must be greater than low_freq_factor")
    if kind == "longrope":
        _check_longrope(out, head_dim, max_positions)
    return out


def _check_longrope(scaling: dict, head_dim: int, max_positions: int) -> None:
    """longrope's factor lists, and a context that never leaves the short factors: past
    original_max_position_embeddings transformers switches every position to the long factors
    for that forward pass only, which no position-indexed table reproduces."""
    for key in ("short_factor", "long_factor"):
        value = scaling[key]
        if not (isinstance(value, list) and len(value) == head_dim // 2 and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < float("inf") for x in value)):
            raise ValueError(f"config.json rope_scaling.{key} must be a list of {head_dim // 2} positive "
                             f"numbers, got {short_repr(value)}")
    original = scaling["original_max_position_embeddings"]
    if original < max_positions:
        raise ValueError(f"config.json rope_scaling (longrope) with original_max_position_embeddings "
                         f"{original:g} < max_position_embeddings {max_positions} is not supported (the long "
                         f"factors transformers switches to past {original:g} positions are not implemented)")


def _check_supported_features(arch: str, cfg: dict) -> None:
    """Reject config options the decoder does not implement, naming the field; options the
    architecture's transformers class ignores (Mistral's attention_bias) are ignored here too."""
    quantization = cfg.get("quantization_config")
    if quantization is not None:         # vLLM runs these with its quantized kernels; there are none here
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        what = f"quant_method {short_repr(method)}" if method is not None else short_repr(quantization)
        raise ValueError(f"config.json quantization_config ({what}) is not supported: minillm runs "
                         f"unquantized float32, float16 or bfloat16 weights")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):      # transformers' ACT2FN maps both names to SiLU
        raise ValueError(f"config.json hidden_act {short_repr(act)} is not supported (only 'silu', also named 'swish')")
    if arch == "LlamaForCausalLM" and cfg.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=true is not supported (its MLP projections have biases)")
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and cfg.get("attention_bias"):
        raise ValueError(f"config.json attention_bias=true is not supported for {arch} (its o_proj has a bias)")


def _sliding_window(arch: str, cfg: dict, num_layers: int) -> int | None:
    """The attention window transformers gives some layer of this config, or None when every layer
    is full-context (Mistral: sliding_window; Qwen2 and Qwen3: only with use_sliding_window, on the
    layers layer_types names, else on those from max_window_layers on)."""
    if arch == "LlamaForCausalLM":
        return None
    window = cfg.get("sliding_window")
    if arch != "MistralForCausalLM":
        window = window if cfg.get("use_sliding_window") else None
        types = cfg.get("layer_types")
        if types is None:
            first = cfg.get("max_window_layers", 28)
            if isinstance(first, bool) or not isinstance(first, int) or first < 0:
                raise ValueError(f"config.json field 'max_window_layers' must be a non-negative integer, "
                                 f"got {short_repr(first)}")
            if first >= num_layers:
                return None
        else:
            if not (isinstance(types, list) and len(types) == num_layers
                    and all(t in ("full_attention", "sliding_attention") for t in types)):
                raise ValueError(f"config.json field 'layer_types' must list 'full_attention' or "
                                 f"'sliding_attention' for each of the {num_layers} layers, got {short_repr(types)}")
            if "sliding_attention" not in types:
                return None
            if window is None:      # transformers fails building such a model's cache
                raise ValueError("config.json layer_types names sliding_attention layers but the config has "
                                 "no window (use_sliding_window false or sliding_window null)")
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"config.json field 'sliding_window' must be a positive integer or null, got {short_repr(window)}")
    return window


_FLOAT_DTYPES = ("float32", "float16", "bfloat16")     # what --dtype auto takes from config.json


def _checkpoint_dtype(path: Path, cfg: dict) -> str:
    """The dtype the weights were saved in: config.json's (torch_)dtype, else the first tensor's."""
    key = "dtype" if cfg.get("dtype") is not None else "torch_dtype"     # transformers 5 reads dtype first
    name = cfg.get(key)
    if name is not None and not isinstance(name, str):
        raise ValueError(f"config.json field {key!r} must be a dtype name such as 'bfloat16', got {short_repr(name)}")
    if name:
        name = name.replace("torch.", "")
        if name not in _FLOAT_DTYPES:
            logger.warning("config.json %s %r is no float dtype minillm computes in; --dtype auto computes in "
                           "bfloat16 on a GPU (float32 on the CPU)", key, name)
        return name
    try:
        entry = next(iter(checkpoint_tensors(path).values()))
    except (ValueError, StopIteration):
        return "float32"
    return {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(entry.dtype, "float32")


def _token_ids(cfg: dict, key: str) -> tuple[int, ...]:
    """A token id field (absent, null, an id or a list of ids) as a tuple of ids."""
    value = cfg.get(key)
    ids = [] if value is None else [value] if not isinstance(value, list) else value
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise ValueError(f"config.json field {key!r} must be a token id or a list of them, got {value!r}")
    return tuple(ids)


def load_model_config(path: str | Path) -> ModelConfig:
    """Read config.json into a ModelConfig (ValueError naming the field or architecture on bad input)."""
    path = Path(path)
    cfg = _read_config(path)
    arch = config_architecture(cfg)
    cfg = {**_ARCHITECTURE_DEFAULTS.get(arch, {}), **cfg}
    num_heads = _require(cfg, "num_attention_heads")
    hidden = _require(cfg, "hidden_size")
    num_kv_heads = _optional(cfg, "num_key_value_heads", num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"config.json num_attention_heads {num_heads} is not a multiple of "
                         f"num_key_value_heads {num_kv_heads}")
    if arch == "LlamaForCausalLM" and hidden % num_heads:     # transformers' LlamaConfig refuses it, head_dim or not
        raise ValueError(f"config.json hidden_size {hidden} is not a multiple of num_attention_heads {num_heads}")
    head_dim = _optional(cfg, "head_dim", hidden // num_heads)
    if head_dim % 2:          # rotary turns pairs of a head's values; transformers refuses such a config too
        derived = " (hidden_size / num_attention_heads)" if cfg.get("head_dim") is None else ""
        raise ValueError(f"config.json head_dim {head_dim}{derived} is odd: rotary embeddings need an even head_dim")
    num_layers = _require(cfg, "num_hidden_layers")
    max_positions = _optional(cfg, "max_position_embeddings", 2048)
    _check_supported_features(arch, cfg)
    window = _sliding_window(arch, cfg, num_layers)
    theta, scaling = _rope(cfg, head_dim, max_positions)
    bos = cfg.get("bos_token_id")
    if bos is not None and (isinstance(bos, bool) or not isinstance(bos, int)):
        raise ValueError(f"config.json field 'bos_token_id' must be a token id or null, got {short_repr(bos)}")
    tied = cfg.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):     # transformers' config classes refuse "false" and null alike
        raise ValueError(f"config.json field 'tie_word_embeddings' must be true or false, got {short_repr(tied)}")
    return ModelConfig(
        architecture=SUPPORTED_ARCHITECTURES[arch],
        vocab_size=_require(cfg, "vocab_size"), hidden_size=hidden,
        intermediate_size=_require(cfg, "intermediate_size"), num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=int(num_kv_heads), head_dim=int(head_dim),
        rms_norm_eps=_positive_number(cfg, "rms_norm_eps", 1e-6), rope_theta=theta,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied,
        attention_bias=arch == "Qwen2ForCausalLM", qk_norm=arch == "Qwen3ForCausalLM",
        rope_scaling=scaling, torch_dtype=_checkpoint_dtype(path, cfg),
        bos_token_id=bos, eos_token_id=_token_ids(cfg, "eos_token_id"),
        sliding_window=window if window is not None and window < max_positions else None)


# ---- safetensors -> numpy ------------------------------------------------------------------------


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder reads, by Hugging Face name, with its shape (no lm_head when tied)."""
    d, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d)}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
            p + "mlp.gate_proj.weight": (i, d), p + "mlp.up_proj.weight": (i, d),
            p + "mlp.down_proj.weight": (d, i)})
        if config.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if config.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (config.head_dim,),
                           p + "self_attn.k_norm.weight": (config.head_dim,)})
    shapes["model.norm.weight"] = (d,)
    if not config.tie_word_embeddings:   # tied: the output head is the embedding
        shapes["lm_head.weight"] = (v, d)
    return shapes


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie in a safetensors file."""

    file: Path
    dtype: str                # safetensors code: "F32", "F16", "BF16", ...
    shape: tuple[int, ...]
    start: int                # absolute byte offsets in the file
    end: int


# bf16 kept as raw bits; F64 (transformers loads it, vLLM casts it) is cast to the dtype asked like the rest
_NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


def read_safetensors_header(file: Path) -> dict[str, TensorEntry]:
    """Parse a safetensors header: an 8-byte little-endian length, then JSON name -> dtype/shape/offsets."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        if size < 8 or header_len > size - 8:
            raise ValueError(f"{file} is not a safetensors file (header length {header_len}, file size {size})")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as exc:     # not JSON, or not UTF-8
            raise ValueError(f"{file} is not a safetensors file (its header is not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file} is not a safetensors file (its header is not a JSON object)")
    base = 8 + header_len
    entries = {name: _tensor_entry(file, name, info, base) for name, info in header.items() if name != "__metadata__"}
    _check_tiling(file, entries, base, size)
    return entries


def _check_tiling(file: Path, entries: dict[str, TensorEntry], base: int, size: int) -> None:
    """The safetensors library's rule: the tensors tile the data after the header, in order, without
    gaps or overlaps, and end inside the file; a ValueError naming the tensor (and the one it
    overlaps) otherwise."""
    def offsets(entry: TensorEntry) -> str:
        return f"[{entry.start - base}, {entry.end - base}]"

    previous, data_end = None, base
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].start, item[1].end)):
        if entry.end > size:
            raise ValueError(f"{file} is not a safetensors file (tensor {name} has data_offsets {offsets(entry)}, "
                             f"past the end of its data ({size - base} bytes; a truncated download?))")
        if entry.start < data_end:
            raise ValueError(f"{file} is not a safetensors file (tensor {name}'s data_offsets overlap another "
                             f"tensor: {name} at {offsets(entry)}, {previous[0]} at {offsets(previous[1])})")
        if entry.start > data_end:
            raise ValueError(f"{file} is not a safetensors file (tensor {name}'s data_offsets leave a gap before "
                             f"it: they start at {entry.start - base}, {entry.start - data_end} bytes after "
                             f"{previous[0] if previous else 'the header'} ends)")
        previous, data_end = (name, entry), entry.end


def _tensor_entry(file: Path, name: str, info, base: int) -> TensorEntry:
    """The TensorEntry of one header item: a dtype name, a shape of non-negative integers and two
    ordered non-negative integer data_offsets, as the safetensors library requires."""
    def is_count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    offsets = info.get("data_offsets") if isinstance(info, dict) else None
    shape = info.get("shape") if isinstance(info, dict) else None
    if not (isinstance(info, dict) and isinstance(info.get("dtype"), str)
            and isinstance(shape, list) and all(map(is_count, shape))
            and isinstance(offsets, list) and len(offsets) == 2 and all(map(is_count, offsets))):
        raise ValueError(f"{file} is not a safetensors file (its header has no dtype, shape and "
                         f"data_offsets for {name!r})")
    if offsets[0] > offsets[1]:
        raise ValueError(f"{file} is not a safetensors file (tensor {name} has data_offsets {offsets}: "
                         f"its end comes before its start)")
    return TensorEntry(file, info["dtype"], tuple(shape), base + offsets[0], base + offsets[1])


def checkpoint_tensors(path: str | Path, log_conflicts: bool = False) -> dict[str, TensorEntry]:
    """Every tensor of a checkpoint, single-file or sharded (model.safetensors.index.json); with
    log_conflicts, a warning for a tensor in two shards and for one the index places in another."""
    path = Path(path)
    index = weights_index(path)
    weight_map = index_weight_map(index) if index is not None else None
    if weight_map is not None:
        files = sorted(path / f for f in set(weight_map.values()))
        named = f" named in {index.name}"
    else:
        # transformers reads model.safetensors alone, past an index, consolidated.safetensors (Mistral's
        # own format) or an adapter beside it; without it, every file is a shard, as vLLM reads them
        single = path / "model.safetensors"
        files = [single] if single.exists() or single.is_symlink() else sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(_no_safetensors(path))
        named = ""
    unread = next((f for f in files if not f.is_file()), None)
    if unread is not None:
        raise ValueError(_why_unreadable(unread, named))
    tensors: dict[str, TensorEntry] = {}
    repeated: list[tuple[str, Path, Path]] = []      # (tensor, the file it was in first, the file it is used from)
    for file in files:
        for name, entry in read_safetensors_header(file).items():
            if name in tensors:
                repeated.append((name, tensors[name].file, file))
            tensors[name] = entry                      # the later shard's copy, as transformers and vLLM take it
    if repeated and log_conflicts:
        name, first, used = repeated[0]
        logger.warning("tensor %s%s is in both %s and %s; the copy in %s is used", name, _more(repeated),
                       first.name, used.name, used.name)
    if weight_map is not None and log_conflicts:
        _check_weight_map(index, weight_map, tensors)
    return tensors


def _no_safetensors(path: Path) -> str:
    """Why a model directory without safetensors has no weights minillm reads, naming the PyTorch
    pickle weights it holds instead."""
    pickles = sorted(f.name for pattern in ("*.bin", "*.pt", "*.pth") for f in path.glob(pattern))
    if not pickles:
        return f"model directory {path} has no *.safetensors weights"
    return (f"model directory {path} has PyTorch weights ({pickles[0]}{_more(pickles)}) but no *.safetensors "
            f"weights, the only ones minillm reads: convert them (transformers' "
            f"AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir) writes safetensors)")


def _more(items: list) -> str:
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""


def _check_weight_map(index: Path, weight_map: dict[str, str], tensors: dict[str, TensorEntry]) -> None:
    """Log the tensors the index places in a shard they are not in (they load from where they are,
    as transformers reads every tensor of every shard the index names)."""
    misplaced = [(name, file) for name, file in weight_map.items()
                 if name in tensors and tensors[name].file != index.parent / file]
    if misplaced:
        name, file = misplaced[0]
        logger.warning("%s names %s for tensor %s%s, but it is in %s; loaded from there", index.name, file, name,
                       _more(misplaced), tensors[name].file.name)


def _why_unreadable(file: Path, named: str) -> str:
    """Why a weights file (NAMED: where it is named, or "") cannot be read: a folder of that name,
    a link to a blob never fetched (a hub cache), or nothing there at all."""
    if file.is_dir():
        return f"{file}{named} is a directory, not safetensors weights"
    if file.is_symlink():
        return f"{file}{named} cannot be read{broken_link(file, ': ')}"
    if file.exists():
        return f"{file}{named} cannot be read: it is no regular file"
    return f"shard {file.name}{named} is missing from {file.parent}"


def _read_tensor(name: str, entry: TensorEntry) -> np.ndarray:
    """The tensor's bytes as numpy (bf16 as uint16 bits), mapped from the file, not copied yet."""
    np_dtype = _NUMPY_DTYPES.get(entry.dtype)
    if np_dtype is None:
        raise ValueError(f"tensor {name} in {entry.file.name} has dtype {entry.dtype}; "
                         f"supported: {', '.join(_NUMPY_DTYPES)}")
    count = int(np.prod(entry.shape, dtype=np.int64))
    if count * np.dtype(np_dtype).itemsize != entry.end - entry.start:
        raise ValueError(f"tensor {name} in {entry.file.name}: {entry.end - entry.start} bytes "
                         f"do not hold shape {entry.shape} of {entry.dtype}")
    if count == 0:
        return np.zeros(entry.shape, np_dtype)
    raw = np.memmap(entry.file, dtype=np.uint8, mode="r", offset=entry.start, shape=(entry.end - entry.start,))
    return raw.view(np_dtype).reshape(entry.shape)


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32, exactly: bf16 is the high half of an fp32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), rounded to nearest even; NaN stays a quiet NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) >> 16
    nan = ((bits >> 16) | np.uint32(0x0040))
    return np.where(np.isnan(x), nan, rounded).astype(np.uint16)


def _convert(raw: np.ndarray, src: str, dtype: str) -> np.ndarray:
    """A tensor read from the file -> an owned array of the requested dtype."""
    if dtype == "bfloat16":
        if src == "BF16":
            return np.array(raw, dtype=np.uint16)
        return float32_to_bf16_bits(raw.astype(np.float32))
    target = {"float32": np.float32, "float16": np.float16}[dtype]
    if src == "BF16":
        return bf16_bits_to_float32(raw).astype(target, copy=False)
    return np.array(raw, dtype=target)


def load_weights(path: str | Path, config: ModelConfig, dtype: str) -> dict[str, np.ndarray]:
    """Read the checkpoint into numpy arrays of dtype ("bfloat16": uint16 bf16 bits), checking names and shapes."""
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
    saved = checkpoint_tensors(path, log_conflicts=True)
    tensors = _with_model_prefix(saved)
    was_prefixed = tensors is not saved
    if config.tie_word_embeddings:
        tensors = _tied_tensors(tensors)
    weights: dict[str, np.ndarray] = {}
    _check_layer_count(path, config, tensors)
    shapes = expected_weight_shapes(config)
    _check_layout(path, tensors, shapes, was_prefixed)
    for name, shape in shapes.items():
        weights[name] = _load_tensor(path, tensors, name, shape, dtype)
    if "lm_head.weight" in tensors and "lm_head.weight" not in weights:
        head_shape = (config.vocab_size, config.hidden_size)
        weights["lm_head.weight"] = _load_tensor(path, tensors, "lm_head.weight", head_shape, dtype)
    _check_unread(path, config, tensors, weights)
    return weights


# Buffers older exports saved beside the weights, recomputed from the config (vLLM skips them too).
_ROTARY_CACHES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _check_unread(path: Path, config: ModelConfig, tensors: dict[str, TensorEntry], read: dict) -> None:
    """A ValueError naming a checkpoint tensor the model has no place for (vLLM refuses them: the
    checkpoint is not the model config.json describes); a bias is logged and passed over, as
    transformers and vLLM pass over it."""
    unread = sorted(n for n in tensors if n not in read and not n.endswith(_ROTARY_CACHES))
    if not unread:
        return
    arch = config_architecture(_read_config(path))
    biases = [n for n in unread if n.endswith(".bias")]
    if biases:
        logger.warning("checkpoint tensor %s%s is not read: %s with this config.json has no bias there", biases[0],
                       _more(biases), arch)
    others = [n for n in unread if not n.endswith(".bias")]
    if not others:
        return
    name = others[0]
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    hint = (f" (config.json's num_hidden_layers {config.num_layers}, the checkpoint has layer {layer[1]})"
            if layer and int(layer[1]) >= config.num_layers else "")
    raise ValueError(f"checkpoint in {path} has tensor {name}{_more(others)} in {tensors[name].file.name}, which "
                     f"{arch} has no place for{hint}: is config.json this checkpoint's?")


def _check_layout(path: Path, tensors: dict[str, TensorEntry], shapes: dict[str, tuple[int, ...]],
                  was_prefixed: bool) -> None:
    """A ValueError naming a tensor the model reads that the checkpoint lacks and one it holds in its place
    that the model has no place for: its tensors are named in another layout (Mistral's own
    consolidated.safetensors, a multimodal model's language_model. prefix). A missing tensor alone
    is _load_tensor's to name. was_prefixed: the names had "model." put before them (_with_model_prefix)."""
    missing = [name for name in shapes if name not in tensors]
    others = sorted(name for name in tensors if name not in shapes and name != "lm_head.weight"
                    and not name.endswith(_ROTARY_CACHES) and not name.endswith(".bias"))
    if not (missing and others):
        return
    arch = config_architecture(_read_config(path))
    shown = others[0].removeprefix("model.") if was_prefixed else others[0]      # as the file names it
    raise ValueError(f"checkpoint in {path} is missing tensor {missing[0]}{_more(missing)} and holds tensors "
                     f"{arch} has no place for, such as {shown} in {tensors[others[0]].file.name}: its tensors "
                     f"are not named as Hugging Face's {arch} names them (another format, such as Mistral's own "
                     f"consolidated.safetensors?)")


def _with_model_prefix(tensors: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """A checkpoint saved from the base model ("embed_tokens.weight", "layers.0. ...") under the
    names of the causal LM's, as transformers adds its base_model_prefix "model." when no tensor has it."""
    if any(name.startswith("model.") for name in tensors):
        return tensors
    return {name if name.startswith("lm_head.") else "model." + name: entry for name, entry in tensors.items()}


def _tied_tensors(tensors: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """A tied checkpoint's tensors as transformers 5 ties them: the embedding from lm_head.weight
    when only that is saved; both kept when both are saved with different values (it does not tie
    them then); the head dropped when it equals the embedding."""
    embed, head = tensors.get("model.embed_tokens.weight"), tensors.get("lm_head.weight")
    if head is None:
        return tensors
    if embed is None:
        return {**tensors, "model.embed_tokens.weight": head}
    same = (embed.dtype == head.dtype and embed.shape == head.shape and embed.dtype in _NUMPY_DTYPES
            and np.array_equal(_read_tensor("model.embed_tokens.weight", embed), _read_tensor("lm_head.weight", head)))
    return {name: entry for name, entry in tensors.items() if name != "lm_head.weight"} if same else tensors


def _check_layer_count(path: Path, config: ModelConfig, tensors: dict[str, TensorEntry]) -> None:
    """A ValueError when config.json names more layers than the checkpoint holds (before the names of
    every layer it names are listed: a num_hidden_layers of 10**9 listed them for minutes)."""
    held = {int(m[1]) for m in map(re.compile(r"model\.layers\.(\d+)\.").match, tensors) if m}
    if held and max(held) + 1 < config.num_layers:
        missing = f"model.layers.{max(held) + 1}.input_layernorm.weight"
        raise ValueError(f"checkpoint in {path} is missing tensor {missing} (config.json's num_hidden_layers "
                         f"{config.num_layers}, the checkpoint has layers up to {max(held)})")


def _placed_by_index(path: Path, name: str) -> str:
    """Where the weights index places a tensor no shard holds (a shard of another version of the
    checkpoint, or cut short), in words for an error; "" when no index names it."""
    index = weights_index(path)
    if index is None:
        return ""
    weight_map = index_weight_map(index)
    shard = weight_map.get(name, weight_map.get(name.removeprefix("model.")))
    return "" if shard is None else f" ({index.name} places it in {shard}, which does not hold it)"


def _load_tensor(path, tensors: dict[str, TensorEntry], name: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """One named tensor of the checkpoint, its shape checked against config.json's."""
    entry = tensors.get(name)
    if entry is None:
        # transformers' config classes read an absent tie_word_embeddings as false: a tied checkpoint
        # saved without the field loads as one whose head is missing (transformers fills it at random)
        why = (" (config.json's tie_word_embeddings is false or absent, which reads as false: a model whose output "
               "head is its embedding says true)") if name == "lm_head.weight" else _placed_by_index(Path(path), name)
        raise ValueError(f"checkpoint in {path} is missing tensor {name}{why}")
    if entry.shape != shape:
        raise ValueError(f"tensor {name} in {entry.file.name} has shape {list(entry.shape)}, expected "
                         f"{list(shape)} from config.json")
    return _convert(_read_tensor(name, entry), entry.dtype, dtype)
