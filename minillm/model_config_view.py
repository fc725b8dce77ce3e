"""LLMEngine.model_config as vLLM scripts read it (llm.llm_engine.model_config.max_model_len): the
model's shape (minillm's ModelConfig, which it is) plus the fields of vLLM's ModelConfig that minillm
knows, all frozen."""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from minillm.config import EngineConfig, ModelConfig
from minillm.model_store import read_json_object


class HFConfigView:
    """The model's config.json read by attribute, as vLLM's model_config.hf_config (a transformers
    PretrainedConfig) is for the keys the file holds; read-only."""

    __slots__ = ("_values",)

    def __init__(self, values: dict) -> None:
        object.__setattr__(self, "_values", MappingProxyType(copy.deepcopy(values)))

    def __getattr__(self, name: str):
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"the model's config.json has no {name!r} (hf_config holds the file's own "
                                 f"keys: {', '.join(sorted(self._values))})") from None

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError("hf_config is read-only: minillm reads the model's config.json as it is "
                             "(edit a copy of the model directory)")

    def __contains__(self, name: str) -> bool:
        return name in self._values

    def to_dict(self) -> dict:
        """A copy of config.json's object (PretrainedConfig.to_dict's name)."""
        return copy.deepcopy(dict(self._values))

    def __repr__(self) -> str:
        return f"HFConfigView({dict(self._values)!r})"


@dataclass(frozen=True, kw_only=True)
class EngineModelConfig(ModelConfig):
    """ModelConfig plus vLLM's ModelConfig fields, with the values the engine runs with:
    max_model_len as fitted to the KV pool, dtype the compute dtype's name ("bfloat16"; vLLM's is a
    torch.dtype)."""

    model: str
    tokenizer: str
    max_model_len: int
    dtype: str
    seed: int
    served_model_name: str
    max_logprobs: int
    revision: str | None
    generation_config: str
    hf_config: HFConfigView
    quantization: None = None
    trust_remote_code: bool = False
    enforce_eager: bool = False

    @property
    def hf_text_config(self) -> HFConfigView:
        """The text model's config: hf_config itself (minillm loads text-only models)."""
        return self.hf_config

    def get_vocab_size(self) -> int:
        """The LM head's vocabulary size (config.json's vocab_size)."""
        return self.vocab_size

    def get_hidden_size(self) -> int:
        """The model's hidden size."""
        return self.hidden_size

    def get_head_size(self) -> int:
        """Each attention head's dimension."""
        return self.head_dim

    def get_total_num_kv_heads(self) -> int:
        """The model's KV heads, over all tensor-parallel ranks."""
        return self.num_kv_heads


def engine_model_config(shape: ModelConfig, config: EngineConfig, model_path: Path, max_model_len: int,
                        dtype: str, served_model_name: str) -> EngineModelConfig:
    """The engine's model_config: its shape from config.json and the values it runs with."""
    hf = read_json_object(Path(model_path) / "config.json", missing_ok=True)
    fields = {f.name: getattr(shape, f.name) for f in dataclasses.fields(ModelConfig)}
    return EngineModelConfig(
        **fields, model=config.model, tokenizer=config.tokenizer or config.model, max_model_len=max_model_len,
        dtype=dtype, seed=config.seed, served_model_name=served_model_name, max_logprobs=config.max_logprobs,
        revision=config.revision, generation_config=config.generation_config, hf_config=HFConfigView(hf),
        enforce_eager=config.enforce_eager)
