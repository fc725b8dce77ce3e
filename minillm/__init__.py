"""minillm: a small, fast LLM inference engine with a paged KV cache and continuous batching."""
from minillm.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Import the engine lazily so `import minillm` stays light.
    if name == "LLM":
        from minillm.llm import LLM
        return LLM
    if name == "LLMEngine":
        from minillm.engine import LLMEngine
        return LLMEngine
    if name == "StructuredOutputsParams":
        from minillm.structured_output import StructuredOutputsParams
        return StructuredOutputsParams
    raise AttributeError(f"module 'minillm' has no attribute {name!r}")
