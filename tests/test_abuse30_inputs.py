"""vLLM's `from vllm.inputs import TokensPrompt, TextPrompt` has its counterpart in minillm.inputs."""
from __future__ import annotations

from minillm import LLM, SamplingParams
from minillm.inputs import TextPrompt, TokensPrompt


def test_prompts_from_minillm_inputs_generate_as_plain_ones(stories_path):
    ids = [1, 403, 407, 261, 378]
    with LLM(str(stories_path), device="cpu") as llm:
        params = SamplingParams(temperature=0, max_tokens=8)
        typed = llm.generate([TokensPrompt(prompt_token_ids=ids), TextPrompt(prompt="Once upon a time")], params)
        plain = llm.generate([{"prompt_token_ids": ids}, "Once upon a time"], params)
    assert [o.outputs[0].token_ids for o in typed] == [o.outputs[0].token_ids for o in plain]
    assert typed[0].prompt_token_ids == ids
