"""The prompt types under vLLM's module name (`from vllm.inputs import TokensPrompt` reads
`from minillm.inputs import TokensPrompt`); minillm.prompts defines them."""
from minillm.prompts import PromptType, TextPrompt, TokensPrompt

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
