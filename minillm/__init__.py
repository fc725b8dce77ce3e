"""minillm: a small, fast LLM inference engine with a paged KV cache and continuous batching."""
from pathlib import Path as _Path

__all__ = ["CompletionOutput", "EngineArgs", "LLM", "LLMEngine", "PromptType", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams", "TextPrompt", "TokensPrompt"]
__version__ = "0.1.0"

# In a checkout, tui/ and benchmarks/ sit beside this package; an install puts them inside it as
# minillm.tui and minillm.benchmarks (package-dir in pyproject.toml). Searching the checkout root
# for subpackages gives the same names in both, so a checkout never imports an installed copy.
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "tui" / "__init__.py").is_file():
    __path__.append(str(_checkout))


def __getattr__(name: str):
    # Everything lazily: `import minillm` runs before the console script's Ctrl-C guard
    # (minillm/entry.py) is in place, and a library user pays only for what it uses.
    if name == "SamplingParams":
        from minillm.sampling_params import SamplingParams
        return SamplingParams
    if name == "LLM":
        from minillm.llm import LLM
        return LLM
    if name == "EngineArgs":
        from minillm.engine_args import EngineArgs
        return EngineArgs
    if name == "LLMEngine":
        from minillm.engine import LLMEngine
        return LLMEngine
    if name in ("PromptType", "TextPrompt", "TokensPrompt"):
        from minillm import prompts
        return getattr(prompts, name)
    if name in ("RequestOutput", "CompletionOutput"):
        from minillm import outputs
        return getattr(outputs, name)
    if name == "StructuredOutputsParams":
        from minillm.structured_output import StructuredOutputsParams
        return StructuredOutputsParams
    raise AttributeError(f"module 'minillm' has no attribute {name!r}")
