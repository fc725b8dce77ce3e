"""EngineArgs: vLLM's engine arguments, a mutable dataclass with one field per EngineConfig field."""
from __future__ import annotations

import argparse
import dataclasses

from minillm.config import EngineConfig
from minillm.structured_outputs_config import offline_config


class _EngineArgsMethods:
    """vLLM's EngineArgs methods, over the fields make_dataclass gives EngineArgs below."""

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace):
        """The EngineArgs of an argparse namespace: each field the namespace has an attribute of (vLLM's)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})

    def create_engine_config(self, usage_context=None) -> EngineConfig:
        """The validated, frozen EngineConfig of these arguments (vLLM returns its VllmConfig; minillm's
        whole configuration is this one), structured_outputs_config None taken as vLLM's defaults, as
        LLM takes it. usage_context labels vLLM's usage statistics: minillm keeps none, so any value is taken."""
        args = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        args["structured_outputs_config"] = offline_config(args["structured_outputs_config"])
        return EngineConfig(**args)


def _field(f: dataclasses.Field) -> tuple:
    """An EngineConfig field as make_dataclass takes it, with its default (model has none)."""
    if f.default is not dataclasses.MISSING:
        return f.name, f.type, dataclasses.field(default=f.default)
    if f.default_factory is not dataclasses.MISSING:
        return f.name, f.type, dataclasses.field(default_factory=f.default_factory)
    return f.name, f.type


# Made from EngineConfig's fields, so that the two never disagree: EngineArgs(model=..., max_model_len=...)
# takes the same names and defaults, is a TypeError for any other name (as a dataclass is), and is
# checked when create_engine_config() builds the EngineConfig.
EngineArgs = dataclasses.make_dataclass(
    "EngineArgs", [_field(f) for f in dataclasses.fields(EngineConfig)], bases=(_EngineArgsMethods,),
    namespace={"__doc__": "vLLM's EngineArgs: the arguments of LLMEngine.from_engine_args, EngineConfig's "
                          "fields by their names (mutable; checked by create_engine_config)."})
EngineArgs.__module__ = __name__            # pickled and shown as minillm.engine_args.EngineArgs
