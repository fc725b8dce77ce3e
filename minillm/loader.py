"""Model directories: read config.json into a ModelConfig and safetensors weights into NumPy."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minillm.config import ModelConfig
from minillm.sampling_params import short_repr
# Finding a model (a local directory, or a hub id in the store) lives in model_store.
from minillm.model_store import broken_link, index_weight_files, list_local_models, read_json_object, resolve_model_path  # noqa: F401

# config.json "architectures" -> the decoder family minillm runs it as.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


# ---- config.json -> ModelConfig ------------------------------------------------------------------


def _read_config(path: Path) -> dict:
    return read_json_object(Path(path) / "config.json")


def _architecture(cfg: dict) -> str:
    """The decoder family of a config, or a ValueError naming the architecture and the supported ones."""
    names = cfg.get("architectures") or []
    names = names if isinstance(names, list) else [names]    # one name, written without its list
    for name in names:
        if isinstance(name, str) and name in SUPPORTED_ARCHITECTURES:
            return name
    shown = ", ".join(map(str, names)) if names else f"none (model_type {cfg.get('model_type')!r})"
    raise ValueError(f"unsupported architecture {shown}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


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


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling); transformers 5 writes both under "rope_parameters"."""
    for key in ("rope_parameters", "rope_scaling"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise ValueError(f"config.json field {key!r} must be an object, got {short_repr(cfg[key])}")
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling")
    scaling = dict(scaling) if scaling else {k: v for k, v in params.items() if k != "rope_theta"}
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    else:
        _check_rope_scaling(scaling)
    theta = _positive_number(cfg if "rope_theta" in cfg else params, "rope_theta", 10000.0)
    return theta, scaling


def _check_rope_scaling(scaling: dict) -> None:
    """The fields the rotary tables read, named in the error when missing or out of range."""
    kind = scaling.get("rope_type")
    if kind not in ("linear", "llama3"):
        raise ValueError(f"config.json rope_scaling type {short_repr(kind)} is not supported "
                         "(supported: default, linear, llama3)")
    if "factor" not in scaling:
        raise ValueError(f"config.json rope_scaling ({kind}) needs a 'factor'")
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if key in scaling:
            _positive_number(scaling, key, 1.0, where="rope_scaling.")
    if kind == "llama3" and float(scaling.get("high_freq_factor", 4.0)) <= float(scaling.get("low_freq_factor", 1.0)):
        raise ValueError("config.json rope_scaling.high_freq_factor must be greater than low_freq_factor")


def _check_supported_features(arch: str, cfg: dict) -> None:
    """Reject config options the decoder does not implement, naming the field."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act {act!r} is not supported (only 'silu')")
    if cfg.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=true is not supported")
    if arch != "Qwen2ForCausalLM" and cfg.get("attention_bias"):
        raise ValueError(f"config.json attention_bias=true is not supported for {arch} (its o_proj has a bias)")
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window", arch == "MistralForCausalLM")
    if uses_window and window is not None and window < cfg.get("max_position_embeddings", 0):
        raise ValueError(f"config.json sliding_window={window} is not supported (attention is full-context)")


def _checkpoint_dtype(path: Path, cfg: dict) -> str:
    """The dtype the weights were saved in: config.json's (torch_)dtype, else the first tensor's."""
    name = cfg.get("torch_dtype") or cfg.get("dtype")
    if isinstance(name, str):
        return name.replace("torch.", "")
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
    arch = _architecture(cfg)
    _check_supported_features(arch, cfg)
    num_heads = _require(cfg, "num_attention_heads")
    hidden = _require(cfg, "hidden_size")
    num_kv_heads = _optional(cfg, "num_key_value_heads", num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"config.json num_attention_heads {num_heads} is not a multiple of "
                         f"num_key_value_heads {num_kv_heads}")
    head_dim = _optional(cfg, "head_dim", hidden // num_heads)
    theta, scaling = _rope(cfg)
    bos = cfg.get("bos_token_id")
    return ModelConfig(
        architecture=SUPPORTED_ARCHITECTURES[arch],
        vocab_size=_require(cfg, "vocab_size"), hidden_size=hidden,
        intermediate_size=_require(cfg, "intermediate_size"), num_layers=_require(cfg, "num_hidden_layers"),
        num_heads=num_heads, num_kv_heads=int(num_kv_heads), head_dim=int(head_dim),
        rms_norm_eps=_positive_number(cfg, "rms_norm_eps", 1e-6), rope_theta=theta,
        max_position_embeddings=_optional(cfg, "max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "Qwen2ForCausalLM", qk_norm=arch == "Qwen3ForCausalLM",
        rope_scaling=scaling, torch_dtype=_checkpoint_dtype(path, cfg),
        bos_token_id=bos if isinstance(bos, int) else None, eos_token_id=_token_ids(cfg, "eos_token_id"))


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


_NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}   # bf16 kept as raw bits


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
    data_end = base
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].start, item[1].end)):
        if entry.end > size:
            raise ValueError(f"{file}: tensor {name} lies outside the file (truncated download?)")
        if entry.start != data_end:
            # The safetensors library's rule: tensors tile the data, in order, without gaps or overlaps.
            raise ValueError(f"{file} is not a safetensors file (tensor {name}'s data_offsets "
                             f"{'overlap another tensor' if entry.start < data_end else 'leave a gap before it'})")
        data_end = entry.end
    return entries


def _tensor_entry(file: Path, name: str, info, base: int) -> TensorEntry:
    """The TensorEntry of one header item: a dtype name, a shape of non-negative integers and two
    ordered non-negative integer data_offsets, as the safetensors library requires."""
    def is_count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    offsets = info.get("data_offsets") if isinstance(info, dict) else None
    shape = info.get("shape") if isinstance(info, dict) else None
    if not (isinstance(info, dict) and isinstance(info.get("dtype"), str)
            and isinstance(shape, list) and all(map(is_count, shape))
            and isinstance(offsets, list) and len(offsets) == 2 and all(map(is_count, offsets))
            and offsets[0] <= offsets[1]):
        raise ValueError(f"{file} is not a safetensors file (its header has no dtype, shape and "
                         f"data_offsets for {name!r})")
    return TensorEntry(file, info["dtype"], tuple(shape), base + offsets[0], base + offsets[1])


def checkpoint_tensors(path: str | Path) -> dict[str, TensorEntry]:
    """Every tensor of a checkpoint, single-file or sharded (model.safetensors.index.json)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(path / f for f in index_weight_files(index))
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"shard {missing[0].name} named in {index.name} is missing from {path}")
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"model directory {path} has no *.safetensors weights")
        unread = next((f for f in files if not f.is_file()), None)
        if unread is not None:      # a folder of that name, or a link to a blob not fetched (a hub cache)
            if unread.is_dir():
                raise ValueError(f"{unread} is a directory, not safetensors weights")
            raise ValueError(f"{unread} cannot be read{broken_link(unread, ': ') or ': it is no regular file'}")
    tensors: dict[str, TensorEntry] = {}
    for file in files:
        tensors.update(read_safetensors_header(file))
    return tensors


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
    tensors = checkpoint_tensors(path)
    weights: dict[str, np.ndarray] = {}
    for name, shape in expected_weight_shapes(config).items():
        entry = tensors.get(name)
        if entry is None:
            raise ValueError(f"checkpoint in {path} is missing tensor {name}")
        if entry.shape != shape:
            raise ValueError(f"tensor {name} has shape {list(entry.shape)}, expected {list(shape)} "
                             f"from config.json")
        weights[name] = _convert(_read_tensor(name, entry), entry.dtype, dtype)
    return weights
