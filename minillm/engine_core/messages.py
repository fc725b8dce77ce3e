"""What the API server and the engine core say to each other: msgspec structs framed as msgpack.

Down (API server -> core): small commands, one message each. Up (core -> API server): one
StepOutputs per engine step with every request that moved (new token ids, not text), plus replies
to adds, stats and utility calls, and EngineDead before the core exits on a failure it cannot
contain. With several API servers (--api-server-count) each command names the server that sent
it (client_index), and the core sends each server only its own requests' outputs and replies. Structs are array-like (positional), so a step of 256 requests encodes in tens of
microseconds.
"""
from __future__ import annotations

from typing import Any, Union

import msgspec

from minillm.outputs import Logprob
from minillm.stats import EngineStats

# ---- down: API server -> engine core ---------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    """Queue a request; the core answers with an AddResults entry (accepted, or the ValueError's text)."""

    request_id: str
    prompt_token_ids: Any               # list[int] as the caller gave it; the engine validates it
    params: dict[str, Any]              # SamplingParams' constructor fields
    arrival_time: float
    client_index: int = 0               # the API server that sent it: its outputs go there
    # The prompt's prefix-cache keys (block_manager.prompt_block_keys), hashed by the API server so
    # the core's thread does not; None: the core hashes the prompt itself.
    prompt_block_keys: list[bytes] | None = None
    cache_salt: str | None = None       # vLLM's: shares prefix-cache blocks only with the same salt
    priority: int = 0                   # vLLM's: under the priority policy a lower value is served first


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    """Stop these requests now and free their blocks (unknown ids, and with several API servers
    another server's requests, are ignored)."""

    request_ids: list[str]
    client_index: int = 0               # the API server that sent it: only its own requests are aborted


class StopSequences(msgspec.Struct, tag=True, array_like=True):
    """The API server's detokenizer found stop strings: (request_id, sequence index, stop string)
    (with several API servers, only the sending server's requests are stopped)."""

    stops: list[tuple[str, int, str]]
    client_index: int = 0


class FinishedCounts(msgspec.Struct, tag=True, array_like=True):
    """Requests an API server has seen end since its last report, by final reason (a stop string it
    found is "stop" even where the core had meanwhile reached max_tokens): the core adds them up,
    so every server's stats show the whole engine's. num_dropped_tokens: tokens the core generated
    for sequences the server had already ended with a stop string (before the core heard of the
    stop), which no response holds: the core takes them out of its generation_tokens_total."""

    counts: dict[str, int]
    client_index: int = 0
    num_dropped_tokens: int = 0


class GetStats(msgspec.Struct, tag=True, array_like=True):
    """Ask for a full-resolution EngineStats snapshot, or with summary its counters and gauges alone
    (one snapshot answers a batch of these: a full one if any asks for it)."""

    call_id: int
    client_index: int = 0
    summary: bool = False


class UtilityCall(msgspec.Struct, tag=True, array_like=True):
    """Call a method of the core's LLMEngine between two steps; the result comes back in UtilityReply."""

    call_id: int
    method: str
    args: list[Any]
    client_index: int = 0


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Abort everything, release the device and exit."""


DownMessage = Union[AddRequest, AbortRequests, StopSequences, FinishedCounts, GetStats, UtilityCall, Shutdown]

# ---- up: engine core -> API server -----------------------------------------------------------


class SeqOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence's news in one step: the token ids it gained, and how it ended if it did."""

    index: int
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None   # one row per new token when logprobs were asked
    finish_reason: str | None = None                     # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    grammar_terminated: bool | None = None               # constrained: its matcher took an EOS (not text)
    kv_transfer_params: dict[str, Any] | None = None     # a KV transfer's word on it, sent once each
    kv_transfer_stats: dict[str, Any] | None = None      # (RequestOutput's fields of these names)
    num_cached_tokens: int | None = None                 # its prefix-cache count, in its first report with news


class RequestStepOutput(msgspec.Struct, array_like=True):
    """One request's news in one step, with the times the server's latency metrics read."""

    request_id: str
    seqs: list[SeqOutput]
    finished: bool                      # every sequence ended: the core has retired the request
    num_cached_tokens: int
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    # prompt_logprobs entries since the request's last report (the first report starts with None),
    # and the rank of each entry's own prompt token (prompt_token_ranks): the entries carry floats
    new_prompt_logprobs: list[dict[int, float] | None] | None = None
    new_prompt_logprob_ranks: list[int | None] | None = None


class FailedRequests(msgspec.Struct, array_like=True):
    """A contained step failure (StepError): the core aborted these requests and serves on."""

    request_ids: list[str]
    error_type: str
    error: str


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    """Everything one engine step produced, in one message."""

    num_steps: int                      # the engine's step counter (EngineStats.num_steps) after the step
    time: float                         # time.time() when the step's outputs were taken
    outputs: list[RequestStepOutput]
    failed: list[FailedRequests] = []


class AddResults(msgspec.Struct, tag=True, array_like=True):
    """Answers to the adds of one command batch: (request_id, None when accepted, else the error)."""

    results: list[tuple[str, str | None]]


class StatsReply(msgspec.Struct, tag=True, array_like=True):
    """One snapshot for every GetStats of a command batch (or why none could be built).

    reported: the finish counts of the receiving API server's own FinishedCounts that the snapshot's
    num_requests_finished holds. That server puts its own whole count in their place: it covers every
    request of its the core finished before the snapshot, reports still on their way included, so a
    snapshot that runs no request counts them all (another API server's requests count once its
    report has reached the core)."""

    call_ids: list[int]
    stats: EngineStats | None
    error: str | None = None
    reported: dict[str, int] = {}


class UtilityReply(msgspec.Struct, tag=True, array_like=True):
    """The result of a UtilityCall, or the exception it raised as "Type: message"."""

    call_id: int
    result: Any = None
    error: str | None = None


class Ready(msgspec.Struct, tag=True, array_like=True):
    """The core has loaded the model and sized the KV pool; what the API server needs to serve."""

    pid: int
    max_model_len: int
    vocab_size: int
    stats: EngineStats
    prefix_block_size: int = 0          # the block size prompts are keyed by; 0: no prefix caching


class StartupFailed(msgspec.Struct, tag=True, array_like=True):
    """Building the engine raised; the core exits after sending this."""

    error_type: str
    error: str


class EngineDead(msgspec.Struct, tag=True, array_like=True):
    """The loop hit a failure it cannot contain; the core exits (status 1) after sending this."""

    error_type: str
    error: str


UpMessage = Union[StepOutputs, AddResults, StatsReply, UtilityReply, Ready, StartupFailed, EngineDead]


def down_decoder() -> msgspec.msgpack.Decoder:
    """A decoder of commands (the core's side)."""
    return msgspec.msgpack.Decoder(DownMessage)


def up_decoder() -> msgspec.msgpack.Decoder:
    """A decoder of the core's messages (the API server's side)."""
    return msgspec.msgpack.Decoder(UpMessage)


def encoder() -> msgspec.msgpack.Encoder:
    """An encoder for either direction."""
    return msgspec.msgpack.Encoder(enc_hook=_plain_float)


def prompt_token_ranks(entries: list, prompt_token_ids: list[int], first: int) -> list[int | None]:
    """The rank of each entry's own prompt token (entries[j] scores prompt token first + j), or None."""
    return [None if entry is None else getattr(entry.get(prompt_token_ids[first + j]), "rank", None)
            for j, entry in enumerate(entries)]


def with_prompt_token_ranks(entries: list, ranks: list[int | None] | None, prompt_token_ids: list[int],
                            first: int) -> list:
    """prompt_token_ranks' inverse: each prompt token's value a Logprob with its rank again (in place)."""
    for j, (entry, rank) in enumerate(zip(entries, ranks or ())):
        token = prompt_token_ids[first + j]
        if entry is not None and rank is not None and token in entry:
            entry[token] = Logprob(entry[token], rank)
    return entries


def _plain_float(value: Any) -> float:
    """A float subclass (a Logprob) travels as its value; the ranks a server shows travel beside it."""
    if isinstance(value, float):
        return float(value)
    raise TypeError(f"Encoding objects of type {type(value).__name__} is unsupported")
