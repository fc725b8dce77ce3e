"""The engine core: an LLMEngine that hands out token ids, and the loop that runs it in its own process.

The core does no text work: its LLMEngine is built with TokenOutputs, so each step reports the
token ids every sequence gained (and their log-probabilities), and the API server detokenises and
checks stop strings. Between two steps the loop takes a bounded batch of commands off its socket
(so no flood of them can starve generation), answers the batch's adds in one message and its
stats requests with one snapshot, then steps and sends the step's outputs up in one message.

With several API servers (--api-server-count) the core pulls commands from all of them on one
socket, remembers which server added each request, and pushes each server only its own
requests' outputs and its own replies, on a socket per server. Each server holds the only write end
of a pipe the core watches: once a server's process is gone (a crash, SIGKILL), the core aborts its
requests, which nobody can read any more, and counts them as aborted.

Failures: a StepError (a step failed for some requests only; the engine aborted them and is
intact) is reported in that step's message and the loop goes on. Any other exception is sent up
as EngineDead and the process exits with status 1; the API server sees the exit either way.
"""
from __future__ import annotations

import _thread
import dataclasses
import logging
import multiprocessing.connection
from collections import Counter, defaultdict
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import zmq

from minillm.config import EngineConfig
from minillm.engine import LLMEngine, StepError
from minillm.engine_core import messages as m
from minillm.engine_core.heap import freeze_startup_heap
from minillm.sampling_params import RequestOutputKind, SamplingParams
from minillm.sequence import Sequence

logger = logging.getLogger("minillm.engine_core")

# Command work between two steps: enough to admit a burst of requests at once, bounded so that a
# flood (of stats polls, say) delays generation by a few milliseconds, never by whole seconds.
MAX_COMMANDS_PER_STEP = 64
MAX_COMMAND_SECONDS_PER_STEP = 0.005
LAST_WORD_LINGER_MS = 2000      # how long a failing core waits for its EngineDead to reach the API servers
# Stats are built at full resolution (one cell per block) and downsampled by each caller.
FULL_RESOLUTION = sys.maxsize
# The loop's own methods of LLMEngine: a utility call to one would take a step's outputs from the
# requests' callers, shut the engine down under the loop, or add a request no caller follows.
LOOP_METHODS = frozenset({"step", "shutdown", "add_request", "add_request_with_own_params"})
SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.init)
_SAMPLING_FIELD_SET = frozenset(SAMPLING_FIELDS)


# ---- token outputs ---------------------------------------------------------------------------

@dataclass
class TokenState:
    """What a sequence has reported so far: how many of its tokens, and log-probability rows not sent."""

    want_logprobs: bool
    num_prompt_tokens: int = 0
    num_sent: int = 0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    grammar_terminated: bool | None = None   # None: no grammar; else whether its last token was an accepted EOS
    is_kv_reported: tuple[bool, bool] = (False, False)   # kv_transfer_params, kv_transfer_stats sent
    num_prompt_logprobs_sent: int = 0        # the request's prompt_logprobs entries reported (on its first sequence)


def sampling_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams' constructor arguments from an AddRequest's fields (msgpack carried the
    structured-output constraint and repetition_detection as plain dicts). A new dict: fields is
    left as it is."""
    if fields.keys() <= _SAMPLING_FIELD_SET:     # what an API server sends: one copy in C, no filtering
        out = dict(fields)
    else:
        out = {k: v for k, v in fields.items() if k in _SAMPLING_FIELD_SET}
    constraint = out.get("structured_outputs")
    if isinstance(constraint, dict):   # llguidance is imported only for requests that use it
        from minillm.structured_output import StructuredOutputsParams
        init = {f.name for f in dataclasses.fields(StructuredOutputsParams) if f.init}
        # The API server compile-checked it: checked again here, it would hold the step loop.
        out["structured_outputs"] = StructuredOutputsParams.from_checked(**{k: v for k, v in constraint.items()
                                                                            if k in init})
    detection = out.get("repetition_detection")
    if isinstance(detection, dict):     # likewise RepetitionDetectionParams, checked again as it is made
        from minillm.repetition import FIELDS, RepetitionDetectionParams
        out["repetition_detection"] = RepetitionDetectionParams(**{k: detection[k] for k in FIELDS if k in detection})
    return out


class TokenOutputs:
    """LLMEngine output processing for a core: each report carries the tokens gained since the last
    one (a delta, as vLLM's DELTA output kind), with no text; stop strings are the API server's.

    A report is the wire struct itself (messages.SeqOutput), so a step's outputs go into its
    message without another object per sequence.
    """

    # add_token does nothing with a token that has no log-probability row, of a sequence without a grammar
    # (the engine's per-token report skips the call then).
    reads_every_token = False

    def __init__(self, tokenizer: Any) -> None:
        del tokenizer   # no text here

    def new_state(self, seq: Sequence, incremental: bool) -> TokenState:
        """Fresh state for a sequence."""
        return TokenState(seq.params.logprobs is not None, len(seq.prompt_token_ids))

    def add_token(self, state: TokenState, seq: Sequence, token: int,
                  logprobs: dict[int, float] | None) -> None:
        """Keep the token's log-probability row for the next report; never a stop string."""
        if seq.structured_output is not None:   # read now: the grammar is let go when the sequence ends
            state.grammar_terminated = seq.structured_output.is_terminated
        if state.want_logprobs and logprobs is not None:
            state.logprobs.append(logprobs)

    def prompt_logprobs_entry(self, entry: dict[int, float] | None, params: SamplingParams,
                              token: int, context: list[int] = ()) -> dict[int, float] | None:
        """One prompt position's entry as it travels (the API server ranks and decodes it, after context)."""
        return entry

    def completion_output(self, state: TokenState, seq: Sequence) -> m.SeqOutput:
        """The tokens (and rows) gained since the last report, and the finish if it came."""
        num_sent = state.num_sent
        new = seq.token_ids[state.num_prompt_tokens + num_sent:]
        status = seq.status
        finished = status._finished         # SequenceStatus.is_finished, spelled out: asked of every report
        # an n > 1 request's final output reports the count of its last sequence to finish: each sends its own, once
        cached = seq.num_cached_tokens if num_sent == 0 and (new or finished) and seq.params.n > 1 else None
        state.num_sent = num_sent + len(new)
        rows = None
        if state.want_logprobs:
            rows, state.logprobs = state.logprobs, []
        kv_params = kv_stats = None
        if seq.kv_transfer_params is not None or seq.kv_transfer_stats is not None:
            kv_params, kv_stats = new_kv_reports(state, seq)
        if finished:
            return m.SeqOutput(seq.index, new, rows, status.finish_reason, seq.stop_reason, state.grammar_terminated,
                               kv_params, kv_stats, cached)
        return m.SeqOutput(seq.index, new, rows, None, None, state.grammar_terminated, kv_params, kv_stats, cached)

    def request_output(self, req, finished: bool) -> m.RequestStepOutput:
        """req's message after a step (req: the engine's Request), with the prompt_logprobs entries it
        has not reported yet. A core's requests are all cumulative: every report goes out."""
        metrics, seqs = req.metrics, req.seqs
        outputs = [self.completion_output(req.states[0], seqs[0])] if len(seqs) == 1 else \
            [self.completion_output(st, s) for st, s in zip(req.states, seqs)]
        message = m.RequestStepOutput(req.request_id, outputs,
                                      finished, metrics.num_cached_tokens, metrics.first_scheduled_time,
                                      metrics.first_token_time, metrics.last_token_time)
        entries = req.prompt_logprobs
        if entries is not None and len(entries) > (sent := (state := req.states[0]).num_prompt_logprobs_sent):
            new = entries[sent:]
            message.new_prompt_logprobs = new
            message.new_prompt_logprob_ranks = m.prompt_token_ranks(new, req.prompt_token_ids, sent)
            state.num_prompt_logprobs_sent = len(entries)
        return message


def new_kv_reports(state: TokenState, seq: Sequence) -> tuple[dict | None, dict | None]:
    """A KV transfer's kv_transfer_params and kv_transfer_stats, each the first time it is there."""
    kv = (seq.kv_transfer_params, seq.kv_transfer_stats)
    new = [value if value is not None and not sent else None for value, sent in zip(kv, state.is_kv_reported)]
    state.is_kv_reported = (kv[0] is not None, kv[1] is not None)
    return new[0], new[1]


def error_fields(exc: BaseException) -> tuple[str, str]:
    """(type name, message) of an exception, for a message."""
    return type(exc).__name__, str(exc)


def release_refused_claim(engine: LLMEngine, extra_args: Any) -> None:
    """A refused add gives back the KV lease its params claimed: a decode server's API server
    leaves the release to the engine once the add is on its way (its caller may have left while it
    was in flight, and the refusal then reaches nobody)."""
    connector = getattr(engine, "kv_connector", None)
    if connector is not None and isinstance(extra_args, dict):
        connector.request_refused(extra_args.get("kv_transfer_params"))


# ---- the core --------------------------------------------------------------------------------

class EngineCore:
    """An LLMEngine with token outputs, driven by messages: commands in, one StepOutputs per step out."""

    def __init__(self, config: EngineConfig, log: Callable[[str], None] | None = None) -> None:
        self.engine = LLMEngine(config, log=log, output_processor=TokenOutputs)

    def add_request(self, command: m.AddRequest) -> str | None:
        """Queue a request; None when accepted, else why not (the ValueError's text)."""
        try:
            params = SamplingParams.from_fields(sampling_fields(command.params))    # validated here, once
            # A core reports each step's new tokens whatever the kind (TokenOutputs): the API server
            # makes the caller's kind of output from them, and looks for stop strings in their text
            # as they come (a FINAL_ONLY report would bring them after max_tokens).
            params.output_kind = RequestOutputKind.CUMULATIVE
            self.engine.add_request_with_own_params(command.request_id, command.prompt_token_ids, params,
                                                    command.arrival_time, command.prompt_block_keys,
                                                    command.cache_salt, command.priority)
        except (ValueError, TypeError) as exc:   # a bad field, or one of the wrong type
            self.refuse(command)
            return str(exc)
        return None

    def refuse(self, command: m.AddRequest) -> None:
        """Leave an add out of the engine, giving back the KV lease its params claimed."""
        extra = command.params.get("extra_args") if isinstance(command.params, dict) else None
        release_refused_claim(self.engine, extra)

    def step(self) -> m.StepOutputs:
        """One engine step as a message; a contained failure is reported with the requests it hit."""
        failed = []
        try:
            outputs = self.engine.step()
        except StepError as exc:
            cause = exc.cause if exc.cause is not None else exc
            logger.error("a step failed for %d request(s), which were aborted; serving goes on: %s: %s",
                         len(exc.request_ids), type(cause).__name__, cause)
            failed.append(m.FailedRequests(list(exc.request_ids), *error_fields(cause)))
            outputs = []
        return m.StepOutputs(self.engine.metrics.num_steps, time.time(), outputs, failed)   # TokenOutputs' messages

    def utility(self, call: m.UtilityCall) -> m.UtilityReply:
        """Run a method of the engine (a public one) between steps."""
        if call.method.startswith("_") or call.method in LOOP_METHODS:
            return m.UtilityReply(call.call_id, error=f"AttributeError: no utility {call.method!r}")
        try:
            # Plain data here: a result msgpack cannot carry (a Tokenizer) fails the call, not the loop.
            return m.UtilityReply(call.call_id, msgspec.to_builtins(getattr(self.engine, call.method)(*call.args)))
        except Exception as exc:  # noqa: BLE001 - the caller gets the error, the loop goes on
            return m.UtilityReply(call.call_id, error="%s: %s" % error_fields(exc))


@dataclass
class CoreSpec:
    """Everything the core process starts from (pickled once, when it is spawned)."""

    config: EngineConfig
    input_addresses: list[str]    # commands: each API server's PUSH, our one PULL
    output_addresses: list[str]   # outputs: our PUSH to each API server's PULL, by client index
    parent_pipe: Any              # readable (EOF) once the process that started us is gone
    alive_pipe: Any = None        # a write end only we hold: the API servers see its EOF when we are gone
    core_hook: Callable[[LLMEngine], None] | None = None   # called with the engine before serving (tests)
    # By client index, the read end of a pipe whose write end only that API server holds: EOF once it is gone.
    presence_pipes: list = field(default_factory=list)


class EngineCoreProc:
    """The core's process loop: sockets, the bounded command batches, the steps."""

    def __init__(self, core: EngineCore, spec: CoreSpec, input_sock: zmq.Socket,
                 output_socks: list[zmq.Socket]) -> None:
        self.core, self.engine = core, core.engine
        self.spec = spec
        self.input, self.outputs = input_sock, output_socks
        self.encoder, self.decoder = m.encoder(), m.down_decoder()
        self.poller = zmq.Poller()
        self.poller.register(self.input, zmq.POLLIN)
        self.poller.register(spec.parent_pipe.fileno(), zmq.POLLIN)
        # A tensor-parallel worker that dies while the engine is idle wakes the loop, which then fails
        # (EngineDead) instead of waiting for the next request to find it gone.
        self.worker_sentinels = self.engine.runner.worker_sentinels()
        for fd in self.worker_sentinels:
            self.poller.register(fd, zmq.POLLIN)
        self.presences = {pipe.fileno(): client for client, pipe in enumerate(spec.presence_pipes)}
        for fd in self.presences:
            self.poller.register(fd, zmq.POLLIN)
        self.gone: set[int] = set()             # the API servers whose process has ended
        # Request id -> the API servers whose requests of that id the engine holds, in the order they
        # were added (several API servers only): an aborted request's id is free at once, so another
        # may be added before the engine's last report of the first, which comes out before the
        # new one's. The last is the one an abort or a stop string can still reach.
        self.client_of: dict[str, list[int]] = {}
        self.finished = Counter()               # final reasons the API servers reported
        self.reported: dict[int, Counter] = defaultdict(Counter)   # API server -> its part of `finished`
        self.num_dropped_tokens = 0             # generated past stop strings, in no response (FinishedCounts)
        self.orphaned = False                   # the process that started us went without stopping us

    def send(self, message: Any, client: int = 0) -> None:
        """Send a message to one API server (raises ConnectionError once it is gone); one whose
        process has ended gets nothing."""
        if client in self.gone:
            return
        try:
            self.outputs[client].send(self.encoder.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            raise ConnectionError("the API server is gone") from None

    def broadcast(self, message: Any) -> None:
        """Send a message to every API server."""
        data = self.encoder.encode(message)
        for client, sock in enumerate(self.outputs):
            if client in self.gone:
                continue
            try:
                sock.send(data, zmq.NOBLOCK)
            except zmq.Again:
                raise ConnectionError("an API server is gone") from None

    def send_step(self, step: m.StepOutputs) -> None:
        """A step's outputs: all to the one API server, else each server its own requests'."""
        if len(self.outputs) == 1:
            self.send(step)
            return
        outputs: dict[int, list] = defaultdict(list)
        failed: dict[int, list] = defaultdict(list)
        client_of = self.client_of
        for out in step.outputs:
            clients = client_of.get(out.request_id)
            if clients is None:
                client = 0
            elif out.finished:          # the first's last report: the id's next request is the next's
                client = clients.pop(0)
                if not clients:
                    del client_of[out.request_id]
            else:
                client = clients[0]
            outputs[client].append(out)
        for failure in step.failed:
            by_client: dict[int, list[str]] = defaultdict(list)
            for request_id in failure.request_ids:
                # The newest of the id (the one the step ran). Kept until its finished output (the
                # next step's): that too must reach its API server, whose output processor follows
                # the request until the core's last word.
                by_client[client_of[request_id][-1] if request_id in client_of else 0].append(request_id)
            for client, ids in by_client.items():
                failed[client].append(m.FailedRequests(ids, failure.error_type, failure.error))
        for client in sorted(outputs.keys() | failed.keys()):
            self.send(m.StepOutputs(step.num_steps, step.time, outputs[client], failed[client]), client)

    def run(self) -> None:
        """Take commands and step until told to stop or the API server goes away."""
        while self.run_once():
            pass

    def run_once(self) -> bool:
        """The commands that have arrived, then one step if any request is unfinished (waiting for
        a command while there is none); False once told to stop or the API server has gone."""
        timeout = 0
        if not self.engine.has_unfinished_requests():   # block only when there is nothing to do
            wait = self.engine.service_kv_transfers()    # (a KV producer's leases may want it sooner)
            timeout = None if wait is None else max(1, int(wait * 1000))
        events = dict(self.poller.poll(timeout))
        if self.spec.parent_pipe.fileno() in events:
            self.orphaned = True
            return False    # the API server's process has gone: nobody to serve
        if self.worker_sentinels and any(fd in events for fd in self.worker_sentinels):
            self.engine.runner.check_workers()      # raises, naming the worker that exited
        if self.input in events and not self.run_commands():
            return False
        for fd in [fd for fd in self.presences if fd in events]:   # after the commands it sent before it went
            self.api_server_gone(self.presences[fd], fd)
        if self.engine.has_unfinished_requests():
            self.send_step(self.core.step())
        return True

    def api_server_gone(self, client: int, fd: int) -> None:
        """An API server's process has ended (a crash, a SIGKILL, or its exit): abort its requests, which
        no client can read any more, counting them as aborted (it cannot report them), and send it
        nothing more. The other servers' requests go on."""
        self.poller.unregister(fd)
        del self.presences[fd]
        self.gone.add(client)
        live = self.live_requests_of(client)
        for request_id in live:
            self.engine.abort_request(request_id)
        if live:
            self.finished["abort"] += len(live)
            logger.warning("API server %d is gone; aborted its %d request(s)", client, len(live))
        self.outputs[client].close(linger=0)    # what was queued for it is for nobody

    def live_requests_of(self, client: int) -> list[str]:
        """The ids of the unfinished requests in the engine that API server `client` added."""
        requests = self.engine.requests
        ids = requests if len(self.outputs) == 1 else [rid for rid, clients in self.client_of.items()
                                                       if clients[-1] == client]
        return [rid for rid in ids if rid in requests and not requests[rid].is_finished]

    def run_commands(self) -> bool:
        """Handle a bounded batch of waiting commands; False once told to shut down."""
        adds: dict[int, list[tuple[str, str | None]]] = defaultdict(list)
        stats: dict[int, list[int]] = defaultdict(list)
        full_stats = False         # a GetStats of the batch asks for more than a summary
        started = time.perf_counter()
        running = True
        for count in range(MAX_COMMANDS_PER_STEP):
            if count and time.perf_counter() - started > MAX_COMMAND_SECONDS_PER_STEP:
                break
            try:
                command = self.decoder.decode(self.input.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            except msgspec.DecodeError as exc:    # a field of the wrong type: that command alone is lost
                logger.error("the engine core dropped a command it could not decode: %s", exc)
                continue
            if isinstance(command, m.AddRequest):
                if command.client_index in self.gone:     # sent just before it went: nobody would read it
                    self.core.refuse(command)
                    continue
                error = self.core.add_request(command)
                adds[command.client_index].append((command.request_id, error))
                if error is None and len(self.outputs) > 1:
                    self.client_of.setdefault(command.request_id, []).append(command.client_index)
            elif isinstance(command, m.AbortRequests):
                for request_id in command.request_ids:
                    if self.is_own(request_id, command.client_index):
                        self.engine.abort_request(request_id)
            elif isinstance(command, m.StopSequences):
                for request_id, index, stop_string in command.stops:
                    if self.is_own(request_id, command.client_index):
                        self.engine.stop_sequence(request_id, index, stop_string)
            elif isinstance(command, m.FinishedCounts):
                self.finished.update(command.counts)
                self.num_dropped_tokens += command.num_dropped_tokens
                self.reported[command.client_index].update(command.counts)
            elif isinstance(command, m.GetStats):
                stats[command.client_index].append(command.call_id)   # one snapshot answers the batch's
                full_stats |= not command.summary
            elif isinstance(command, m.UtilityCall):
                self.send(self.core.utility(command), command.client_index)
            elif isinstance(command, m.Shutdown):
                running = False
                break
        for client, results in adds.items():
            self.send(m.AddResults(results), client)
        if stats:
            snapshot, error = self.snapshot(summary=not full_stats)
            for client, call_ids in stats.items():
                self.send(m.StatsReply(call_ids, snapshot, error, dict(self.reported[client])), client)
        return running

    def is_own(self, request_id: str, client: int) -> bool:
        """Whether the engine's request of this id (the id's newest) is this API server's: one server
        must not end another's request that happens to have the same id."""
        if len(self.outputs) == 1:
            return True
        clients = self.client_of.get(request_id)
        return clients is not None and clients[-1] == client

    def snapshot(self, summary: bool = False) -> tuple[Any, str | None]:
        """(a full-resolution snapshot, or a summary, with the API servers' finish counts, None), or
        (None, why not): a stats bug fails the callers, not serving."""
        try:
            stats = self.engine.stats(1, summary=True) if summary else self.engine.stats(FULL_RESOLUTION)
        except Exception as exc:  # noqa: BLE001
            return None, "%s: %s" % error_fields(exc)
        return dataclasses.replace(stats, num_requests_finished=dict(self.finished),
                                   generation_tokens_total=stats.generation_tokens_total - self.num_dropped_tokens), None


def _connect(ctx: zmq.Context, spec: CoreSpec) -> tuple[zmq.Socket, list[zmq.Socket]]:
    """(input, outputs) sockets, connected first thing, so all are up long before Ready is sent."""
    input_sock = ctx.socket(zmq.PULL)
    input_sock.setsockopt(zmq.RCVHWM, 0)
    for address in spec.input_addresses:       # one PULL takes turns between the API servers
        input_sock.connect(address)
    output_socks = []
    for address in spec.output_addresses:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, LAST_WORD_LINGER_MS)
        sock.connect(address)
        output_socks.append(sock)
    return input_sock, output_socks


def remove_socket_dir(addresses: list[str]) -> None:
    """Remove the private directory of these ipc:// sockets (the one CoreProcess made), if it is one."""
    dirs = {os.path.dirname(a.removeprefix("ipc://")) for a in addresses if a.startswith("ipc://")}
    for path in dirs:
        if os.path.basename(path).startswith("minillm-core-"):
            shutil.rmtree(path, ignore_errors=True)


class StarterGone(BaseException):
    """The process that started the core went away, or let it go, before the model had loaded."""


class LoadWatch:
    """Ends the model load once the parent pipe reports the core's starter gone (killed outright, or
    letting the core go): the loop looks at that pipe only once serving, and a core left loading held
    the device for minutes. A thread waits on the pipe and raises StarterGone in the main thread,
    through the SIGTERM handler (which otherwise ignores SIGTERM: Ctrl-C, or a supervisor's SIGTERM,
    may reach the whole process group, and the API server handles it and shuts the core down; a
    handler, not SIG_IGN, so processes the core spawns keep SIGTERM)."""

    def __init__(self, parent_pipe: Any) -> None:
        self._parent_pipe = parent_pipe
        self._lock = threading.Lock()
        self._phase = "loading"                     # then "serving" or "failed", or "leaving" and "left"
        self._loaded_r, self._loaded_w = os.pipe()

    def start(self) -> None:
        """Start watching: from here on StarterGone may be raised in the main thread, at once if the
        starter is already gone (so the caller starts it inside the try that handles it)."""
        signal.signal(signal.SIGTERM, self._on_sigterm)
        threading.Thread(target=self._watch, args=(self._parent_pipe,), name="minillm-core-load-watch",
                         daemon=True).start()

    def _watch(self, parent_pipe: Any) -> None:
        multiprocessing.connection.wait([parent_pipe, self._loaded_r])
        with self._lock:
            if self._phase == "loading":
                self._phase = "leaving"
                _thread.interrupt_main(signal.SIGTERM)
        os.close(self._loaded_r)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self._phase == "leaving":                # never takes the lock: the main thread may hold it
            self._phase = "left"
            raise StarterGone()

    def loaded(self, ok: bool = True) -> bool:
        """Mark the load ended (ok: the model loaded; else it failed, and the failure is to be sent
        without a StarterGone raised into the send); False when the starter went first (StarterGone
        may not have come)."""
        with self._lock:
            if self._phase == "loading":
                self._phase = "serving" if ok else "failed"
            elif self._phase == "leaving":
                self._phase = "left"                # too late to raise: the caller leaves
        os.write(self._loaded_w, b"x")
        os.close(self._loaded_w)
        return self._phase == "serving"


def run_engine_core(spec: CoreSpec) -> None:
    """The core process's entry point: build the engine, say Ready, serve; exit 1 on a fatal failure."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch = LoadWatch(spec.parent_pipe)
    ctx = zmq.Context()
    input_sock, output_socks = _connect(ctx, spec)
    encoder = m.encoder()
    status = 0
    try:
        try:
            watch.start()
            core = EngineCore(spec.config)
            if spec.core_hook is not None:
                spec.core_hook(core.engine)
        except StarterGone:
            remove_socket_dir(spec.input_addresses + spec.output_addresses)
            return
        except Exception as exc:  # noqa: BLE001 - the API servers re-raise it
            watch.loaded(ok=False)      # the starter exits on the failure: its pipe must not interrupt the send
            failed = encoder.encode(m.StartupFailed(*error_fields(exc)))
            for sock in output_socks:
                sock.send(failed)
            status = 1
            return
        if not watch.loaded():
            core.engine.shutdown()
            remove_socket_dir(spec.input_addresses + spec.output_addresses)
            return
        proc = EngineCoreProc(core, spec, input_sock, output_socks)
        engine = core.engine
        blocks = engine.block_manager
        proc.broadcast(m.Ready(os.getpid(), engine.max_model_len, engine.model_config.vocab_size,
                               engine.stats(cells=1), blocks.block_size if blocks.enable_prefix_caching else 0))
        freeze_startup_heap()
        try:
            proc.run()
        except ConnectionError:
            pass        # an API server is gone
        except BaseException as exc:  # noqa: BLE001 - any other failure ends the core, reported first
            traceback.print_exc()
            status = 1
            try:
                proc.broadcast(m.EngineDead(*error_fields(exc)))
            except ConnectionError:
                pass
        finally:
            engine.shutdown()
            if proc.orphaned:      # killed outright, the starter could not remove our socket directory
                remove_socket_dir(spec.input_addresses + spec.output_addresses)
    finally:
        # A failure's last message (EngineDead, StartupFailed) must reach the API servers; after a stop
        # what is still queued is for servers that have left, and waiting on it held the exit 2 s.
        linger = LAST_WORD_LINGER_MS if status else 0
        input_sock.close(linger=0)
        for sock in output_socks:
            sock.close(linger=linger)
        ctx.destroy(linger=linger)
        sys.stderr.flush()
        if status:
            os._exit(status)    # skip interpreter teardown: the API server is waiting on our exit
