"""EngineArgs: vLLM's engine arguments, a mutable dataclass with one field per EngineConfig field and one
per vLLM argument that LLM() takes under vLLM's name only (VLLM_ONLY_DEFAULTS)."""
from __future__ import annotations

import argparse
import dataclasses

from typing import Any

from minillm.config import EngineConfig

# vLLM's engine arguments that LLM() takes though minillm has no setting of their own (llm.VLLM_FIXED_ARGS,
# taken at what minillm does), or has one under another name (llm.VLLM_RENAMED_ARGS: num_gpu_blocks_override
# is num_kv_blocks), and compilation_config: their EngineArgs fields, at vLLM's defaults, are checked as
# LLM() checks them.
VLLM_ONLY_DEFAULTS: dict[str, Any] = {
    "trust_remote_code": False, "code_revision": None, "logprobs_mode": "raw_logprobs", "skip_tokenizer_init": False,
    "quantization": None, "pipeline_parallel_size": 1, "data_parallel_size": 1, "cpu_offload_gb": 0,
    "swap_space": 4, "hf_overrides": None, "task": None, "runner": "auto", "convert": "auto", "model_impl": "auto",
    "config_format": "auto", "mm_processor_kwargs": None, "limit_mm_per_prompt": None, "allowed_media_domains": None,
    "allowed_local_media_path": "", "override_pooler_config": None, "pooler_config": None, "logits_processors": None,
    "enable_lora": False, "enable_sleep_mode": False, "max_seq_len_to_capture": 8192,
    "disable_custom_all_reduce": False, "disable_async_output_proc": False, "hf_token": None,
    "distributed_executor_backend": None, "max_num_partial_prefills": 1, "max_long_partial_prefills": 1,
    "long_prefill_token_threshold": 0, "enable_prompt_embeds": False, "cuda_graph_sizes": None,
    "max_cudagraph_capture_size": None, "num_gpu_blocks_override": None, "compilation_config": None,
}


class _EngineArgsMethods:
    """vLLM's EngineArgs methods, over the fields make_dataclass gives EngineArgs below."""

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace):
        """The EngineArgs of an argparse namespace: each field the namespace has an attribute of (vLLM's)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """parser with the engine's arguments added under vLLM's flag names (vLLM's): --model and the
        flags `minillm serve` sets the engine with, from the same table, so that
        from_cli_args(parser.parse_args(...)) gives these arguments; a FlexibleArgumentParser
        (minillm.argparse_utils, vLLM's) takes their names with underscores too. Returns parser."""
        from minillm.cli import add_engine_args_cli
        add_engine_args_cli(parser)
        return parser

    def create_engine_config(self, usage_context=None) -> EngineConfig:
        """The validated, frozen EngineConfig of these arguments (vLLM returns its VllmConfig; minillm's
        whole configuration is this one), built as LLM builds it: structured_outputs_config None taken as
        vLLM's defaults, and vLLM's names of VLLM_ONLY_DEFAULTS checked against what minillm does (a
        ValueError naming the field) or read under minillm's name. usage_context labels vLLM's usage
        statistics: minillm keeps none, so any value is taken."""
        from minillm.llm import engine_config
        return engine_config(self.model, {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                                          if f.name != "model"})


def _field(f: dataclasses.Field) -> tuple:
    """An EngineConfig field as make_dataclass takes it, with its default (model has none)."""
    if f.default is not dataclasses.MISSING:
        return f.name, f.type, dataclasses.field(default=f.default)
    if f.default_factory is not dataclasses.MISSING:
        return f.name, f.type, dataclasses.field(default_factory=f.default_factory)
    return f.name, f.type


# Made from EngineConfig's fields, so that the two never disagree: EngineArgs(model=..., max_model_len=...)
# takes the same names and defaults (and vLLM's of VLLM_ONLY_DEFAULTS), is a TypeError for any other name
# (as a dataclass is), and is checked when create_engine_config() builds the EngineConfig.
EngineArgs = dataclasses.make_dataclass(
    "EngineArgs", [_field(f) for f in dataclasses.fields(EngineConfig)]
    + [(name, Any, dataclasses.field(default=default)) for name, default in VLLM_ONLY_DEFAULTS.items()],
    bases=(_EngineArgsMethods,),
    namespace={"__doc__": "vLLM's EngineArgs: the arguments of LLMEngine.from_engine_args, EngineConfig's "
                          "fields and VLLM_ONLY_DEFAULTS' by their names (mutable; checked by "
                          "create_engine_config)."})
EngineArgs.__module__ = __name__            # pickled and shown as minillm.engine_args.EngineArgs
