"""LLM: the offline batch API, vLLM-compatible."""
from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence as Seq

from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.outputs import RequestOutput
from minillm.sampling_params import SamplingParams

# What LLM.generate takes as one prompt (vLLM's TextPrompt and TokensPrompt are the two dicts).
PromptType = str | list[int] | dict


class LLM:
    """Generate for many prompts at once through the engine's continuous batching."""

    def __init__(self, model: str, **engine_args):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    @property
    def llm_engine(self) -> LLMEngine:
        """The LLMEngine underneath (vLLM's name for it)."""
        return self.engine

    def get_tokenizer(self):
        """The model's tokenizer."""
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        A prompt is a string, a list of token ids, {"prompt": text} or {"prompt_token_ids": ids}.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        unpacked = [_unpack_prompt(prompt) for prompt in prompts]
        texts, prompts = [text for text, _ in unpacked], [prompt for _, prompt in unpacked]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, Seq) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p, output_kind="final")
                ids.append(rid)
        except ValueError:
            for rid in ids:
                self.engine.abort_request(rid)
            self._drain()
            raise
        finished: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(ids)) if use_tqdm else None
        while len(finished) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        outputs = [finished[rid] for rid in ids]
        for out, text in zip(outputs, texts):
            if out.prompt is None and text is not None:   # ids were given with their text
                out.prompt = text
        return outputs

    def chat(self, messages: list[dict] | Seq[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = False, chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a batch of them, rendered with the chat template.

        chat_template replaces the model's own (a model without one needs it); each output's
        prompt is the rendered conversation.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(list(conversation), add_generation_prompt=add_generation_prompt,
                                                 chat_template=chat_template, **(chat_template_kwargs or {}))
            # The template writes BOS itself where the model wants it.
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def shutdown(self) -> None:
        """Release the engine's device memory (KV pool, graphs, weights); the LLM is unusable after."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()


def _unpack_prompt(prompt) -> tuple[str | None, str | list[int]]:
    """(text or None, what the engine takes) for a str, a list of ids, or a prompt dict as vLLM has them."""
    if not isinstance(prompt, dict):
        return (prompt if isinstance(prompt, str) else None), prompt
    unknown = set(prompt) - {"prompt", "prompt_token_ids"}
    if unknown:
        raise ValueError(f"prompt dict has unsupported key(s) {sorted(unknown)}; "
                         f"give 'prompt' (text) or 'prompt_token_ids'")
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids must be a list of token ids, got {type(ids).__name__}")
        return prompt.get("prompt"), list(ids)
    if "prompt" in prompt and isinstance(prompt["prompt"], str):
        return prompt["prompt"], prompt["prompt"]
    raise ValueError("a prompt dict needs 'prompt' (a string) or 'prompt_token_ids' (a list of ids)")


def _progress_bar(total: int):
    """A tqdm bar on stderr (tqdm comes with huggingface-hub)."""
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="generate", unit="req", file=sys.stderr)
