"""Beam search as vLLM's LLM.beam_search runs it, over the engine's own one-token requests.

Each step asks every live beam for one token with its 2 * beam_width likeliest alternatives (its
log-probabilities, as vLLM follows transformers), so a step is one batch of requests whose prompts
share their beam's prefix (the prefix cache serves it). Of all the candidates of a prompt, one that
ends on EOS is set aside as completed and the beam_width best others go on; at the end the
beam_width best of the completed and the live ones are the output, scored by
get_beam_search_score.

search_steps is the search itself, as a generator of each step's prompts; run_steps drives it over
LLM.generate, run_steps_async over a server's engine (each step's requests beside the others it
serves), as vLLM's offline and online searches run the same steps.

Under an output constraint (params.structured_outputs, as vLLM's offline search applies it per beam)
a beam's step carries the constraint with the beam's own tokens as the output's start
(step_params: num_output_prefix_tokens), so the engine's matcher takes them first and the step's
candidates come from the masked distribution: a token the grammar refuses has log-probability -inf
and is no candidate. A beam whose sentence is complete is offered EOS alone, and ends on it ("stop").
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, field

from minillm.outputs import CompletionOutput, Logprob, RequestOutput
from minillm.sampling_params import SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: the prompt's tokens and its own, and their log-probabilities (vLLM's fields)."""

    tokens: list[int]                       # the prompt's, then the generated ones
    logprobs: list[dict[int, Logprob]]      # per generated token: its step's candidates {token id: Logprob}
    lora_request: None = None               # vLLM's; minillm loads no adapters
    cum_logprob: float = 0.0                # the generated tokens' log-probabilities, summed
    text: str | None = None                 # the whole sequence decoded, set on the best beams at the end
    finish_reason: str | None = None        # "stop" (it ended on EOS) or "length", set on the output's beams
    stop_reason: int | str | None = None    # None: EOS, as a CompletionOutput ended by it


@dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first: beam_width of them, or fewer where fewer were found."""

    sequences: list[BeamSearchSequence]


@dataclass
class BeamSearchInstance:
    """One prompt's search: the beams still growing and those that ended on EOS."""

    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)
    cache_salt: str | None = None           # the prompt's, on each step's requests

    @classmethod
    def from_prompt(cls, prompt_tokens: list[int], cache_salt: str | None = None) -> "BeamSearchInstance":
        """A search that starts from the prompt alone."""
        return cls([BeamSearchSequence(tokens=list(prompt_tokens), logprobs=[])], cache_salt=cache_salt)


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | None,
                          length_penalty: float = 1.0) -> float:
    """cumulative_logprob / len ** length_penalty, len counting the prompt and not a final EOS (vLLM's
    score, after transformers'). A beam of no counted token (a prompt of EOS alone, searched for no
    token) counts as one token long, where vLLM's score divides by zero."""
    seq_len = len(tokens)
    if tokens[-1] == eos_token_id:
        seq_len -= 1
    return cumulative_logprob / (max(seq_len, 1) ** length_penalty)


def sort_beams_key(eos_token_id: int | None, length_penalty: float) -> Callable[[BeamSearchSequence], float]:
    """A beam's score as a sort key (vLLM's create_sort_beams_key_function)."""
    return lambda beam: get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id, length_penalty)


def search_steps(instances: list[BeamSearchInstance], params, eos_token_id: int | None,
                 max_model_len: int) -> Generator[list[dict], list[RequestOutput], None]:
    """Grow the beams of instances for params.max_tokens steps (or until none is left): yields each
    step's token prompts, one a live beam, and takes their outputs, in order, by send(). A prompt's
    beams, all of one length, stop growing where they fill max_model_len."""
    key = sort_beams_key(eos_token_id, params.length_penalty)
    is_constrained = params.structured_outputs is not None
    for _ in range(params.max_tokens):
        growing = [inst for inst in instances if inst.beams and len(inst.beams[0].tokens) < max_model_len]
        if not growing:
            return
        beams = [(inst, beam) for inst in growing for beam in inst.beams]
        outputs = yield [_beam_prompt(beam, inst.cache_salt) for inst, beam in beams]
        candidates: dict[int, list[BeamSearchSequence]] = {id(inst): [] for inst in growing}
        for (inst, beam), out in zip(beams, outputs):
            for new in _extensions(beam, out, is_constrained):
                if new.tokens[-1] == eos_token_id and (not params.ignore_eos or is_constrained):
                    new.finish_reason = "stop"
                    inst.completed.append(new)
                else:
                    candidates[id(inst)].append(new)
        for inst in growing:
            inst.beams = sorted(candidates[id(inst)], key=key, reverse=True)[:params.beam_width]


def run_steps(instances: list[BeamSearchInstance], step: Callable[[list[dict], int], list[RequestOutput]],
              params, eos_token_id: int | None, max_model_len: int, on_step: Callable[[], None] | None = None) -> None:
    """search_steps, each step's prompts run by step(prompts, the tokens each beam has of its own) (their
    outputs in order); on_step after each step."""
    steps = search_steps(instances, params, eos_token_id, max_model_len)
    prompts = next(steps, None)
    num_generated = 0
    while prompts is not None:
        prompts = _next_prompts(steps, step(prompts, num_generated))
        num_generated += 1
        if on_step is not None:
            on_step()


async def run_steps_async(instances: list[BeamSearchInstance],
                          step: Callable[[list[dict], int], Awaitable[list[RequestOutput]]], params,
                          eos_token_id: int | None, max_model_len: int) -> None:
    """search_steps, each step's prompts run by awaiting step(prompts, the tokens each beam has of its own)
    (their outputs in order)."""
    steps = search_steps(instances, params, eos_token_id, max_model_len)
    prompts = next(steps, None)
    num_generated = 0
    while prompts is not None:
        prompts = _next_prompts(steps, await step(prompts, num_generated))
        num_generated += 1


def step_params(base: SamplingParams, params, num_generated: int) -> SamplingParams:
    """A step's SamplingParams: base, or under params.structured_outputs base with the constraint, whose
    output starts with the beam's num_generated tokens (every live beam of a step has as many)."""
    if params.structured_outputs is None:
        return base
    constraint = dataclasses.replace(params.structured_outputs, num_output_prefix_tokens=num_generated)
    return dataclasses.replace(base, structured_outputs=constraint)


def _next_prompts(steps: Generator[list[dict], list[RequestOutput], None], outputs: list[RequestOutput]
                  ) -> list[dict] | None:
    """The next step's prompts once steps has taken this step's outputs; None when the search is over."""
    try:
        return steps.send(outputs)
    except StopIteration:
        return None


def _beam_prompt(beam: BeamSearchSequence, cache_salt: str | None) -> dict:
    """The token prompt that asks for a beam's next token."""
    prompt = {"prompt_token_ids": beam.tokens}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt


def _extensions(beam: BeamSearchSequence, out: RequestOutput, is_constrained: bool = False) -> list[BeamSearchSequence]:
    """beam with each candidate token of its step's output appended (the step's logprobs dict: the
    sampled token and the likeliest ones; under a constraint those its grammar allows, the others -inf)."""
    completion = out.outputs[0]
    if not completion.logprobs:
        return []
    candidates = completion.logprobs[0]
    # float(): a server's outputs carry plain floats, LLM.generate's vLLM's Logprob objects
    return [BeamSearchSequence(tokens=beam.tokens + [token_id], logprobs=beam.logprobs + [candidates],
                               cum_logprob=beam.cum_logprob + float(logprob))
            for token_id, logprob in candidates.items() if not (is_constrained and math.isinf(float(logprob)))]


def best_beams(instance: BeamSearchInstance, params, eos_token_id: int | None,
               decode: Callable[[list[int]], str]) -> BeamSearchOutput:
    """The beam_width best of an instance's completed and live beams, each with its text (the whole
    sequence decoded, prompt and special tokens too, as vLLM's) and finish reason."""
    best = _best(instance, params, eos_token_id)
    for beam in best:
        beam.text = decode(beam.tokens)
    return BeamSearchOutput(sequences=best)


def beam_completions(instance: BeamSearchInstance, params, eos_token_id: int | None, num_prompt_tokens: int,
                     decode: Callable[[list[int]], str]) -> list[CompletionOutput]:
    """The beam_width best beams as a request's completions, best first, as vLLM's server answers a
    beam search: each the tokens after the prompt, a final EOS left out of them unless
    params.include_stop_str_in_output (and out of the text either way), finish_reason "stop"
    (stop_reason the EOS id) or "length". The text is what the tokens add to the prompt's decoded
    text (a SentencePiece word's leading space kept, which decoding them alone would drop)."""
    completions = []
    for i, beam in enumerate(_best(instance, params, eos_token_id)):
        prompt, token_ids = beam.tokens[:num_prompt_tokens], beam.tokens[num_prompt_tokens:]
        is_eos_end = beam.finish_reason == "stop"
        shown = token_ids[:-1] if is_eos_end else token_ids
        completions.append(CompletionOutput(
            index=i, text=_text_after(prompt, shown, decode),
            token_ids=token_ids if params.include_stop_str_in_output else shown,
            cumulative_logprob=beam.cum_logprob, logprobs=beam.logprobs, finish_reason=beam.finish_reason,
            stop_reason=eos_token_id if is_eos_end else None))
    return completions


def _text_after(prompt: list[int], token_ids: list[int], decode: Callable[[list[int]], str]) -> str:
    """The text token_ids add after prompt, decoded in its context."""
    head, whole = decode(prompt), decode(prompt + token_ids)
    return whole[len(head):] if whole.startswith(head) else decode(token_ids)


def _best(instance: BeamSearchInstance, params, eos_token_id: int | None) -> list[BeamSearchSequence]:
    """The beam_width best of an instance's completed and live beams, best first, each with its finish reason."""
    key = sort_beams_key(eos_token_id, params.length_penalty)
    best = sorted(itertools.chain(instance.completed, instance.beams), key=key, reverse=True)[:params.beam_width]
    for beam in best:
        if beam.finish_reason is None:
            beam.finish_reason = "length"
    return best
