"""What the engine hands back to callers: one RequestOutput per request per step."""
from __future__ import annotations

from dataclasses import dataclass, field


class Logprob(float):
    """A token's log-probability: a float, which also answers vLLM's Logprob fields (.logprob,
    .rank: 1 for the likeliest token, a sampled or prompt token's place in the whole vocabulary,
    .decoded_token: the token's text alone)."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> "Logprob":
        self = super().__new__(cls, logprob)
        self.rank = rank
        self.decoded_token = decoded_token
        return self

    def __reduce__(self):
        return (Logprob, (float(self), self.rank, self.decoded_token))

    def __repr__(self) -> str:
        """As vLLM's Logprob prints, so a printed output shows each token's rank and text."""
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"

    __str__ = float.__repr__        # str(), f-strings and JSON give the number, as a float's

    @property
    def logprob(self) -> float:
        """The value itself, as vLLM's Logprob.logprob."""
        return float(self)


@dataclass
class CompletionOutput:
    """One of a request's n completions, cumulative so far (fields in the order of vLLM's, which has
    routed_experts between logprobs and finish_reason)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # logprobs[i]: {token_id: Logprob} for generated token i (the sampled one and the top-k)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "error" | "repetition" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    # vLLM's: the LoRA adapter that made it; minillm loads none
    lora_request = None

    def finished(self) -> bool:
        """True once a finish reason is set (a method, as vLLM's CompletionOutput.finished() is)."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0           # prompt tokens served from the prefix cache (its first scheduled completion's)

    @property
    def time_in_queue(self) -> float | None:
        """Seconds from arrival to first being scheduled (vLLM's RequestMetrics.time_in_queue)."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token in seconds."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one request after a step: its prompt and its completions so far (the arguments
    in the order of vLLM's, then minillm's kv_transfer_params and kv_transfer_stats)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # With SamplingParams.prompt_logprobs: per prompt token {token id: logprob} (the token itself
    # and its top alternatives), None for the first; the entries computed so far while it runs.
    # The engine's are floats; LLM.generate returns vLLM's Logprob objects, as for the outputs.
    prompt_logprobs: list[dict[int, float] | dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default=None)  # type: ignore[assignment]
    # vLLM's, for the models and adapters minillm does not run: no LoRA adapter, no encoder prompt
    lora_request: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    # Prompt tokens served from the prefix cache (vLLM's RequestOutput.num_cached_tokens). With n > 1
    # vLLM's output is one child's and carries that child's count: a final output the last to finish
    # (it completes the parent), an earlier one the first scheduled (output_processor.py: reported_num_cached_tokens).
    num_cached_tokens: int | None = None
    # Prefill/decode disaggregation (vLLM's kv_transfer_params): what a prefill engine hands a
    # decode engine, in the response; kv_transfer_stats: what loading the prompt took on a decode engine.
    kv_transfer_params: dict | None = None
    kv_transfer_stats: dict | None = None

    def add(self, next_output: "RequestOutput", aggregate: bool) -> None:
        """Merge a later output of this request into this one, as vLLM's RequestOutput.add: with
        aggregate (DELTA outputs) a completion's new text, token ids and log-probabilities are
        appended to those of the completion of its index, without it the completion is replaced;
        a completion of an index not held yet is appended."""
        self.finished |= next_output.finished
        for new in next_output.outputs:
            for i, held in enumerate(self.outputs):
                if held.index == new.index:
                    if aggregate:
                        _append_delta(held, new)
                    else:
                        self.outputs[i] = new
                    break
            else:
                self.outputs.append(new)
        if self.prompt_logprobs is None:       # a DELTA request reports them once, whole
            self.prompt_logprobs = next_output.prompt_logprobs
        if next_output.num_cached_tokens is not None:
            self.num_cached_tokens = next_output.num_cached_tokens
        self.metrics = next_output.metrics or self.metrics
        self.kv_transfer_params = next_output.kv_transfer_params or self.kv_transfer_params


def _append_delta(held: CompletionOutput, new: CompletionOutput) -> None:
    """A completion's next DELTA output added to what held has (the finish reason once it comes)."""
    held.text += new.text
    if not isinstance(held.token_ids, list):
        held.token_ids = list(held.token_ids)
    held.token_ids.extend(new.token_ids)
    if new.logprobs:
        if held.logprobs is None:
            held.logprobs = []
        held.logprobs.extend(new.logprobs)
    held.cumulative_logprob = new.cumulative_logprob
    held.finish_reason = new.finish_reason
    held.stop_reason = new.stop_reason


def reported_prompt_logprobs(req) -> list | None:
    """The prompt log-probabilities a request's output carries: all computed so far, or for a delta
    request (req.is_delta) all of them once the whole prompt has them, and None in its other outputs."""
    if req.prompt_logprobs is None:
        return None
    if not req.is_delta:
        return list(req.prompt_logprobs)
    if req.is_prompt_logprobs_sent or len(req.prompt_logprobs) < len(req.prompt_token_ids):
        return None
    req.is_prompt_logprobs_sent = True
    return list(req.prompt_logprobs)
