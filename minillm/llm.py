"""LLM: the offline batch API, vLLM-compatible."""
from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence as Seq

from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.outputs import RequestOutput
from minillm.sampling_params import SamplingParams


class LLM:
    """Generate for many prompts at once through the engine's continuous batching."""

    def __init__(self, model: str, **engine_args):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        """The model's tokenizer."""
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Seq[str] | Seq[list[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, Seq) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        ids = []
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
        return [finished[rid] for rid in ids]

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


def _progress_bar(total: int):
    """A tqdm bar on stderr (tqdm comes with huggingface-hub)."""
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="generate", unit="req", file=sys.stderr)
