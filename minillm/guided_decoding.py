"""vLLM's earlier name for a structured-output constraint: SamplingParams(guided_decoding=
GuidedDecodingParams(json=...)), as vLLM took it before structured_outputs. It is a
StructuredOutputsParams, built by llguidance as every constraint here is."""
from __future__ import annotations

from dataclasses import dataclass

from minillm.sampling_params import short_repr
from minillm.structured_output import StructuredOutputsError, StructuredOutputsParams

# GuidedDecodingParams' options beside the constraint: name -> (whether the value is what minillm
# does, what minillm does). llguidance is vLLM's "guidance" backend.
_FIXED_OPTIONS = {
    "backend": (lambda v: v in (None, "auto", "guidance", "llguidance"),
                "minillm builds every constraint with llguidance (vLLM's 'guidance' backend)"),
    "backend_was_auto": (lambda v: isinstance(v, bool), ""),
    "disable_fallback": (lambda v: isinstance(v, bool), ""),
}


@dataclass
class GuidedDecodingParams(StructuredOutputsParams):
    """StructuredOutputsParams under vLLM's earlier name, taking its options of the backend where the
    value is what minillm does (a StructuredOutputsError naming the option otherwise)."""

    backend: str | None = None
    backend_was_auto: bool = False
    disable_fallback: bool = False

    def __post_init__(self) -> None:
        for name, (is_done, does) in _FIXED_OPTIONS.items():
            value = getattr(self, name)
            if not is_done(value):
                raise StructuredOutputsError(name, f"{short_repr(value)} is not supported: {does}")
        super().__post_init__()
