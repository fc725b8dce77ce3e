"""The interactive chat loop: conversation state, prompt building, streaming and the /commands."""
from __future__ import annotations

import itertools
import math
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Protocol, TextIO

from minillm.chat_terminal import (StreamingKeys, TypeAhead, interrupted_line, is_terminal, read_with_type_ahead,
                                   terminal_safe)
from minillm.exit_signals import unwinding_on_sigterm
from minillm.sampling_params import SamplingParams

PROMPT = ">>> "
QUIT_HINT = "Ctrl-D or /exit quits"
CONTINUATION_PROMPT = "... "
TRIPLE_QUOTE = '"""'
NO_ARGUMENT_COMMANDS = ("/exit", "/quit", "/help", "/reset", "/stats")
# Ollama's names of the same commands (`ollama run`): /bye, /clear, /? and /set parameter KEY VALUE.
OLLAMA_COMMANDS = {"/bye": "/exit", "/clear": "/reset", "/?": "/help"}
OLLAMA_PARAMETERS = {"num_predict": "max_tokens"}     # the rest share the names
SHOW_TOPICS = ("info", "parameters", "system", "template")     # Ollama's /show, less license and modelfile
# Ollama's commands that have nothing to act on here, and why.
OLLAMA_ONLY = {
    "/load": "minillm chat talks to the one model it started with; /bye, then `minillm chat MODEL` for another",
    "/save": "minillm chat saves no session or model; /system and /set last as long as the chat",
}

HELP_TEXT = f"""\
commands:
  /help                 this list
  /reset                forget the conversation (the system message and settings stay)
  /system TEXT          set the system message (/system alone clears it)
  /set KEY VALUE        change sampling: temperature, top_p, top_k, max_tokens, seed
                        (/set alone shows the current values; /set seed none unseeds)
  /stats                speed, time to first token and KV usage of the last reply
  /show WHAT            info (the model and its context), parameters (as /set), system, template
  /exit                 quit (Ctrl-D too)
  Ollama's /bye, /clear, /?, /set system TEXT and /set parameter KEY VALUE
                        (num_predict: max_tokens) work too
input:
  a line ending in \\ continues on the next line; \"\"\" opens and closes a multi-line block
  (a message even when it starts with a slash; after /system, the system message)
  Ctrl-C stops the reply being written; at the prompt it clears the line ({QUIT_HINT})
  what you type while a reply is written is kept for the next prompt"""


# ---------------------------------------------------------------------------------------------
# Conversation state and prompt building
# ---------------------------------------------------------------------------------------------

@dataclass
class ChatSettings:
    """Sampling settings the user changes with /set; each reply gets fresh SamplingParams."""

    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = -1
    max_tokens: int = 256
    seed: int | None = None

    def with_value(self, key: str, text: str) -> ChatSettings:
        """A copy with KEY parsed from TEXT; ValueError names the key when it is invalid."""
        parsers: dict[str, Callable[[str], object]] = {
            "temperature": float, "top_p": float, "top_k": int, "max_tokens": int,
            # -1 is no seed, as SamplingParams (and vLLM) read it: shown as such
            "seed": lambda s: None if s.lower() in ("none", "off", "random") or s.strip() == "-1" else int(s),
        }
        check_setting(key)
        try:
            value = parsers[key](text)
        except ValueError:
            raise ValueError(f"{key} needs {'a number' if key in ('temperature', 'top_p') else 'an integer'}, "
                             f"got {text!r}") from None
        if isinstance(value, float):
            value += 0.0        # -0 is 0 (greedy), not shown as -0.0
        updated = replace(self, **{key: value})
        updated.sampling_params()   # validates the new value with the engine's own rules
        return updated

    def sampling_params(self, max_tokens: int | None = None, **fixed) -> SamplingParams:
        """SamplingParams for one reply (max_tokens may be lowered to fit the context); FIXED: other
        fields, such as the model's defaults that /set does not change."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_tokens=max_tokens or self.max_tokens, seed=self.seed, **fixed)

    def describe(self) -> str:
        """One line with every setting."""
        return (f"temperature={self.temperature} top_p={self.top_p} top_k={self.top_k} "
                f"max_tokens={self.max_tokens} seed={self.seed}")


_SETTINGS = tuple(ChatSettings.__dataclass_fields__)


def check_setting(key: str) -> None:
    """ValueError naming KEY when /set has no such setting."""
    if key not in _SETTINGS:
        raise ValueError(f"unknown setting {key!r}; one of: {', '.join(_SETTINGS)}")


@dataclass
class Conversation:
    """The system message and the alternating user/assistant turns so far."""

    system: str | None = None
    turns: list[dict] = field(default_factory=list)   # {"role": "user"|"assistant", "content"}

    def messages(self) -> list[dict]:
        """The chat-template message list: the system message first, when there is one."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [dict(t) for t in self.turns]

    def drop_oldest_exchange(self) -> bool:
        """Forget the oldest user turn and its reply; False when only the newest turn is left."""
        if len(self.turns) <= 1:
            return False
        del self.turns[0]
        while len(self.turns) > 1 and self.turns[0]["role"] != "user":
            del self.turns[0]
        return True


def conversation_text(conversation: Conversation) -> str:
    """Plain-text rendering for models without a chat template: each reply continues its turn."""
    paragraphs = [conversation.system] if conversation.system else []
    for turn in conversation.turns:
        if turn["role"] == "assistant" and paragraphs:
            paragraphs[-1] += turn["content"]
        else:
            paragraphs.append(turn["content"])
    return "\n".join(paragraphs)


def conversation_prompt_ids(tokenizer, conversation: Conversation, chat_template: str | None = None) -> list[int]:
    """The prompt token ids of the conversation, ending where the assistant's reply begins.

    chat_template (a template's source) replaces the model's own; with neither, plain text.
    """
    if chat_template or tokenizer.has_chat_template:
        return list(tokenizer.apply_chat_template(conversation.messages(), add_generation_prompt=True,
                                                  tokenize=True, chat_template=chat_template))
    return tokenizer.encode(conversation_text(conversation), add_special_tokens=True)


# ---------------------------------------------------------------------------------------------
# Backends: an in-process engine, or a running server (minillm.chat_client.HttpChatBackend)
# ---------------------------------------------------------------------------------------------

@dataclass
class ReplyStats:
    """What was measured for one reply."""

    prompt_tokens: int | None       # None: a server's count that never came
    output_tokens: int
    ttft_s: float | None
    decode_s: float | None          # first token to last token
    total_s: float                  # request sent to reply finished
    finish_reason: str | None
    source: str                     # "engine" | "client"
    cached_tokens: int | None = None
    kv_blocks: int | None = None
    kv_pool_blocks: int | None = None
    block_size: int | None = None
    max_tokens: int | None = None   # the reply's limit (lower than asked when the context was short)
    context_len: int | None = None  # the model's context, when known

    @property
    def tokens_per_s(self) -> float | None:
        """Decode speed: tokens after the first over the time they took."""
        if self.decode_s and self.output_tokens > 1:
            return (self.output_tokens - 1) / self.decode_s
        return self.output_tokens / self.total_s if self.total_s > 0 else None

    def describe(self) -> str:
        """A few human-readable lines."""
        rate = self.tokens_per_s
        ttft = "n/a" if self.ttft_s is None else f"{self.ttft_s * 1e3:.1f} ms"
        lines = [
            f"last reply ({'measured by the client' if self.source == 'client' else 'engine'}): "
            f"{self.output_tokens} tokens in {self.total_s:.2f} s, "
            f"{'n/a' if rate is None else f'{rate:.1f}'} tok/s, time to first token {ttft}, "
            f"finish reason {self.finish_reason}",
        ]
        prompt = f"prompt: {self.prompt_tokens} tokens"
        if self.prompt_tokens is None:
            prompt = ("prompt: not counted (" + ("the reply was stopped before the server counted it)"
                                                 if self.finish_reason == "abort" else "the server sent no count)"))
        if self.cached_tokens is not None:
            prompt += f" ({self.cached_tokens} served from the prefix cache)"
        lines.append(prompt)
        if self.kv_blocks is not None and self.kv_pool_blocks:
            share = 100.0 * self.kv_blocks / self.kv_pool_blocks
            lines.append(f"KV cache: {self.kv_blocks} blocks of {self.block_size} tokens "
                         f"({share:.1f}% of the {self.kv_pool_blocks}-block pool)")
        return "\n".join(lines)


def reply_room(max_tokens: int, context_len: int, num_alone_tokens: int) -> int:
    """The room the oldest exchanges are dropped to give a reply: max_tokens where the newest message
    alone (NUM_ALONE_TOKENS with the system message) leaves it, else half the context (a room no
    prompt leaves would cost every exchange at every message; llama.cpp's context shift keeps half
    the context too); the reply may still run on into the rest of it."""
    if max_tokens <= context_len - num_alone_tokens:
        return max_tokens
    return min(max_tokens, max(context_len // 2, 1))


class ContextTooShort(ValueError):
    """The prompt leaves no room for a reply in the model's context."""


class ChatBackend(Protocol):
    """Where replies come from."""

    name: str
    has_chat_template: bool
    last_stats: ReplyStats | None

    def stream_reply(self, conversation: Conversation, settings: ChatSettings,
                     should_stop: Callable[[], bool]) -> Iterator[str]:
        """Yield text deltas of the assistant's reply until it ends or should_stop() is true."""
        ...


class EngineChatBackend:
    """Replies from an in-process LLMEngine, driven step by step."""

    def __init__(self, engine, name: str, chat_template: str | None = None) -> None:
        self.engine = engine
        self.name = name
        self.tokenizer = engine.tokenizer
        self.chat_template = chat_template        # replaces the model's own when given
        self.has_chat_template = bool(chat_template or self.tokenizer.has_chat_template)
        self.context_len = engine.max_model_len
        self.last_stats: ReplyStats | None = None
        self.last_prompt_ids: list[int] = []
        self.notices: list[str] = []    # things the chat loop should tell the user
        self._request_ids = itertools.count()
        # Ctrl-C stops a reply at the next step, never inside one: a KeyboardInterrupt there left the
        # engine's state half updated, and the aborted request never finished (the chat hung draining it).
        self.stops_between_steps = True
        self._kv_pool_blocks = engine.stats(cells=1).kv_num_blocks
        # The model's generation_config defaults that /set does not change (min_p, repetition_penalty):
        # every reply samples with them, as generate, LLM.chat and the server (chat --url) do.
        self.model_defaults = {k: v for k, v in engine.sampling_defaults.items() if k not in _SETTINGS}

    def fit_prompt(self, conversation: Conversation, settings: ChatSettings) -> tuple[list[int], int]:
        """Prompt ids and max_tokens that fit max_model_len, dropping the oldest exchanges first."""
        max_len = self.engine.max_model_len
        wanted = settings.max_tokens
        # Exchanges are dropped from a copy: a message too long even alone leaves the history as it was.
        trial = Conversation(conversation.system, list(conversation.turns))
        ids = conversation_prompt_ids(self.tokenizer, trial, self.chat_template)
        if max_len - len(ids) < wanted and len(trial.turns) > 1:
            # A message too long even alone is found with one more encoding, not one per exchange dropped.
            alone = conversation_prompt_ids(self.tokenizer, Conversation(trial.system, trial.turns[-1:]),
                                            self.chat_template)
            if max_len - len(alone) < 1:
                raise ContextTooShort(f"message too long: the prompt is {len(alone)} tokens and the context "
                                      f"holds {max_len}")
            wanted = reply_room(settings.max_tokens, max_len, len(alone))
        dropped = 0
        while max_len - len(ids) < wanted and trial.drop_oldest_exchange():
            ids = conversation_prompt_ids(self.tokenizer, trial, self.chat_template)
            dropped += 1
        if not ids:
            raise ValueError("the chat template rendered an empty prompt")
        room = max_len - len(ids)
        if room < 1:
            raise ContextTooShort(f"message too long: the prompt is {len(ids)} tokens and the context "
                                  f"holds {max_len}")
        if dropped:
            conversation.turns[:] = trial.turns
            self.notices.append(f"(dropped the {dropped} oldest exchange(s) to fit the "
                                f"{max_len}-token context)")
        return ids, min(settings.max_tokens, room)

    def template_text(self) -> str | None:
        """The chat template every message renders with (None: plain text)."""
        if self.chat_template or not self.tokenizer.has_chat_template:
            return self.chat_template
        return self.tokenizer.template_source()

    def check_chat_template(self) -> None:
        """ValueError naming the file and line when the model's chat template, the one every message
        renders with, does not compile (a model without one chats in plain text; --chat-template replaces it)."""
        if not self.chat_template and self.tokenizer.has_chat_template:
            self.tokenizer.template_source()

    def stream_reply(self, conversation: Conversation, settings: ChatSettings,
                     should_stop: Callable[[], bool]) -> Iterator[str]:
        """Add the request now (so bad input fails here); the iterator steps the engine."""
        turns, num_notices = list(conversation.turns), len(self.notices)
        prompt_ids, max_tokens = self.fit_prompt(conversation, settings)
        request_id = f"chat-{next(self._request_ids)}"
        started = time.time()
        try:
            params = settings.sampling_params(max_tokens, **self.model_defaults)
            self.engine.add_request(request_id, prompt_ids, params, arrival_time=started)
        except ValueError:
            # The message was refused: the exchanges dropped to make room for it stay.
            conversation.turns[:] = turns
            del self.notices[num_notices:]
            raise
        self.last_prompt_ids = prompt_ids
        return self._stream(request_id, prompt_ids, started, should_stop, max_tokens)

    def _stream(self, request_id: str, prompt_ids: list[int], started: float,
                should_stop: Callable[[], bool], max_tokens: int) -> Iterator[str]:
        """Step the engine and yield the new text of each step; abort once should_stop()."""
        shown, last, is_aborted = "", None, False
        try:
            while last is None or not last.finished:
                if should_stop() and not is_aborted:
                    self.engine.abort_request(request_id)
                    is_aborted = True
                mine = [o for o in self.engine.step() if o.request_id == request_id]
                if mine:
                    last = mine[-1]
                    text = last.outputs[0].text
                    if not is_aborted and len(text) > len(shown) and text.startswith(shown):
                        yield text[len(shown):]
                        shown = text
                elif not self.engine.has_unfinished_requests():
                    break
        finally:
            if last is None or not last.finished:
                self._abort_and_drain(request_id)
            self.last_stats = self._reply_stats(last, prompt_ids, started, max_tokens)

    def _abort_and_drain(self, request_id: str) -> None:
        """Abort a request whose stream was closed early and step until the engine lets it go."""
        self.engine.abort_request(request_id)
        while self.engine.has_unfinished_requests():
            if any(o.request_id == request_id and o.finished for o in self.engine.step()):
                break

    def _reply_stats(self, out, prompt_ids: list[int], started: float, max_tokens: int) -> ReplyStats:
        """ReplyStats from the request's last output and metrics."""
        block_size = self.engine.config.block_size
        num_out = len(out.outputs[0].token_ids) if out is not None else 0
        metrics = out.metrics if out is not None else None
        first = metrics.first_token_time if metrics else None
        lastt = metrics.last_token_time if metrics else None
        return ReplyStats(
            prompt_tokens=len(prompt_ids), output_tokens=num_out,
            ttft_s=metrics.ttft if metrics else None,
            decode_s=(lastt - first) if first and lastt else None,
            total_s=time.time() - started,
            finish_reason=out.outputs[0].finish_reason if out is not None else "abort",
            source="engine",
            cached_tokens=metrics.num_cached_tokens if metrics else None,
            kv_blocks=math.ceil((len(prompt_ids) + num_out) / block_size),
            kv_pool_blocks=self._kv_pool_blocks, block_size=block_size,
            max_tokens=max_tokens, context_len=self.engine.max_model_len)


# ---------------------------------------------------------------------------------------------
# Input and interrupts
# ---------------------------------------------------------------------------------------------

def valid_text(text: str) -> str:
    """Text any tokenizer takes: bytes of the terminal that are not UTF-8 (which Python's stdin
    hands on as lone surrogates) become U+FFFD, as a decoder with errors="replace" would show them."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:       # a surrogate that stands for no byte
        raw = text.encode("utf-8", "replace")
    return raw.decode("utf-8", "replace")


class EndOfInputInMessage(EOFError):
    """Input ended inside a multi-line message (an open triple quote, a trailing backslash)."""

    def __init__(self, text: str, is_quoted: bool = False, is_command: bool = False):
        super().__init__("input ended inside a multi-line message")
        self.text = text                 # what was typed of the message
        self.is_quoted = is_quoted       # inside triple quotes: a message even when it starts with a slash
        self.is_command = is_command     # inside a /command's triple-quoted argument, which is not run


@dataclass(frozen=True)
class UserInput:
    """One input: its text, and whether it came in triple quotes (then it is never a /command)."""

    text: str
    is_quoted: bool = False


def read_message(read_line: Callable[[str], str]) -> str:
    """The text of one user input (see read_input)."""
    return read_input(read_line).text


def read_input(read_line: Callable[[str], str]) -> UserInput:
    """One user input: a trailing backslash continues the line; triple quotes span lines (and make
    the text a message whatever it starts with, as in Ollama's chat; a /command's argument they
    open, as Ollama's /set system, runs on to their close). EndOfInputInMessage carries the message
    so far when input ends inside one."""
    read_line = _without_carriage_return(read_line)
    line = read_line(PROMPT)
    stripped = line.strip()
    if stripped.startswith(TRIPLE_QUOTE):
        body = stripped[len(TRIPLE_QUOTE):]
        if body.endswith(TRIPLE_QUOTE):
            return UserInput(body[:-len(TRIPLE_QUOTE)], is_quoted=True)
        lines = [body] if body else []
        while True:
            line = _continuation(read_line, lines, is_quoted=True)
            if line.rstrip().endswith(TRIPLE_QUOTE):
                lines.append(line.rstrip()[:-len(TRIPLE_QUOTE)])
                return UserInput("\n".join(lines).strip("\n"), is_quoted=True)
            lines.append(line)
    if stripped.startswith("/") and stripped.count(TRIPLE_QUOTE) % 2:
        return UserInput(_command_block(read_line, stripped))
    lines = []
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = _continuation(read_line, lines)
    lines.append(line)
    return UserInput("\n".join(lines))


def _command_block(read_line: Callable[[str], str], first: str) -> str:
    """A /command whose argument opens a triple-quoted block (Ollama's /set system with a system
    message of several lines), read on to the line that closes it; EndOfInputInMessage (the command
    unrun) when input ends first."""
    lines = [first]
    while not (len(lines) > 1 and lines[-1].rstrip().endswith(TRIPLE_QUOTE)):
        try:
            lines.append(read_line(CONTINUATION_PROMPT))
        except EOFError:
            raise EndOfInputInMessage("", is_command=True) from None
    return "\n".join(lines).strip()


def _without_carriage_return(read_line: Callable[[str], str]) -> Callable[[str], str]:
    """READ_LINE whose lines lose the "\r" of a CRLF line end (a script saved on Windows): left on,
    it went to the model, and a backslash before it continued no line."""
    return lambda prompt: read_line(prompt).removesuffix("\r")


def _continuation(read_line: Callable[[str], str], lines: list[str], is_quoted: bool = False) -> str:
    """The next line of a multi-line message; at end of input, EndOfInputInMessage with lines so far."""
    try:
        return read_line(CONTINUATION_PROMPT)
    except EOFError:
        raise EndOfInputInMessage("\n".join(lines).strip("\n"), is_quoted) from None


class StopFlag:
    """Set by the first Ctrl-C while a reply streams; a second Ctrl-C raises KeyboardInterrupt
    (the first too when at_once: a backend that may be stopped anywhere, as one waiting on a server).
    Once the stream is over (is_live false) a Ctrl-C does nothing: one pressed again as the reply
    winds up must not end the chat, nor mark a whole reply interrupted (ends_chat: it raises, as
    for piped input, where Ctrl-C ends the chat). is_shielded: no press raises while the stream
    runs (a backend whose state an exception inside one of its steps would leave half updated)."""

    def __init__(self, at_once: bool = False, ends_chat: bool = False, is_shielded: bool = False) -> None:
        self.is_set = False
        self.at_once = at_once
        self.ends_chat = ends_chat
        self.is_shielded = is_shielded
        self.is_live = True

    def __call__(self) -> bool:
        return self.is_set

    def on_sigint(self, signum, frame) -> None:
        if not self.is_live:
            if self.ends_chat:
                raise KeyboardInterrupt
            return
        was_set, self.is_set = self.is_set, True
        if (was_set or self.at_once) and not self.is_shielded:
            raise KeyboardInterrupt


@contextmanager
def sigint_sets(flag: StopFlag):
    """Route SIGINT to the flag so a reply stops between engine steps, never inside one."""
    previous = signal.signal(signal.SIGINT, flag.on_sigint)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------

def reply_mark(stats: ReplyStats | None, settings: ChatSettings, interrupted: bool, is_one_shot: bool = False) -> str:
    """What follows a reply on its last line: why it stopped, when that was not its own choice
    (is_one_shot: a reply to --quick, which has no /commands to point at)."""
    if interrupted:
        return " [interrupted]"
    if stats is None or stats.finish_reason != "length":
        return ""
    if stats.max_tokens is not None and stats.max_tokens < settings.max_tokens:
        return f" [the {stats.context_len}-token context is full{'' if is_one_shot else ': /reset starts over'}]"
    longer = "--max-tokens N" if is_one_shot else "/set max_tokens N"
    return f" [max_tokens {settings.max_tokens} reached: {longer} for longer replies]"


class ChatSession:
    """The read-eval-print loop over a backend."""

    def __init__(self, backend: ChatBackend, settings: ChatSettings | None = None,
                 system: str | None = None, out: TextIO | None = None, log: TextIO | None = None) -> None:
        self.backend = backend
        self.settings = settings or ChatSettings()
        self.conversation = Conversation(system=system)
        self.out = out or sys.stdout
        self.log = log       # errors and notices, when not on out (reply_once keeps them off the reply)
        self.is_running = True
        self.type_ahead = TypeAhead()
        self.is_terminal = False     # run() reads the terminal itself: keys typed during replies are kept
        self.is_piped = False        # run() reads stdin itself, and it is a pipe or a file
        self.num_failed_replies = 0  # messages answered with an error (a script's chat then exits 1)

    def say(self, text: str) -> None:
        """Print a line to the user."""
        print(_for_stream(self.out, text), file=self.out, flush=True)

    def note(self, text: str) -> None:
        """Print an error or a notice (on log, else on out)."""
        stream = self.log or self.out
        print(_for_stream(stream, text), file=stream, flush=True)

    def reply_once(self, text: str) -> int:
        """vLLM's chat --quick: TEXT sent as the one message (a leading slash too), its reply printed
        alone; the exit status: 1 when it failed (the error on log). Ctrl-C ends it, as in a script."""
        self.is_piped = True
        self.send(valid_text(text), is_one_shot=True)
        return 1 if self.num_failed_replies else 0

    def greet(self) -> None:
        """The banner, and the one notice about plain-text mode."""
        self.say(f"minillm chat with {self.backend.name}. /help lists commands; {QUIT_HINT}.")
        if not self.backend.has_chat_template:
            self.say("note: this model has no chat template, so the conversation runs as plain "
                     "text continuation (minillm chat --chat-template FILE gives it one).")

    def run(self, read_line: Callable[[str], str] | None = None) -> int:
        """Loop until /exit or end of input (the terminal, or read_line when given); the exit status."""
        self.is_terminal = read_line is None
        # Messages piped in (`minillm chat < script`): Ctrl-C ends the chat, as it ends any command
        # that reads a pipe; there is no line of a terminal to clear.
        self.is_piped = read_line is None and not is_terminal(sys.stdin)
        if read_line is None:
            def read_line(prompt: str) -> str:
                return read_with_type_ahead(prompt, self.type_ahead, self.out)
        # Ctrl-C at the prompt clears the line even when the chat was started with SIGINT ignored
        # (a background job of a script): Python then leaves it ignored.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler) if self.is_terminal else None
        errors = _stdin_errors("surrogateescape") if self.is_terminal else None
        try:
            # SIGTERM puts the terminal's modes back (the line editor's, a reply's no-echo) before the
            # chat ends by the signal: by default it ended the chat with echo left off.
            with unwinding_on_sigterm() if self.is_terminal else nullcontext():
                return self._loop(read_line)
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
            if errors is not None:
                _stdin_errors(errors)

    def _loop(self, read_line: Callable[[str], str]) -> int:
        self.greet()
        while self.is_running:
            try:
                entry = read_input(read_line)
            except EndOfInputInMessage as exc:
                # A script or a paste that never closed its message: send what came, and say so.
                if exc.is_command:
                    self.say("(input ended inside a command's triple-quoted text: the command was not run)")
                elif exc.text.strip():
                    self.say("(input ended inside a multi-line message: sending what came)")
                    self.handle(exc.text, is_quoted=exc.is_quoted)
                self.say("")
                break
            except EOFError:
                self.say("")
                break
            except KeyboardInterrupt:
                if self.is_piped:
                    self.say("")        # the prompt's line ends before the error's
                    raise
                # The line is dropped; on an empty one, say how to leave instead.
                line = interrupted_line() if self.is_terminal else None
                self.say("" if line else f"\n({QUIT_HINT})")
                continue
            try:
                self.handle(entry.text, is_quoted=entry.is_quoted)
            except KeyboardInterrupt:
                if self.is_piped:
                    raise
                self.say(f"\n({QUIT_HINT})")     # a Ctrl-C between a reply and the prompt, as one at the prompt
        # Piped input is a script: a reply that failed makes its exit status 1 (as `ollama run`).
        scripted = not (self.is_terminal and is_terminal(sys.stdin))
        return 1 if scripted and self.num_failed_replies else 0

    def handle(self, text: str, is_quoted: bool = False) -> None:
        """Run a /command or send a message (is_quoted: always a message)."""
        text = valid_text(text)
        if not text.strip():
            return
        if text.startswith("/") and not is_quoted:
            self.command(text.strip())
        else:
            self.send(text)

    def command(self, text: str) -> None:
        """Dispatch one /command."""
        typed, arg = _split_word(text)
        name = OLLAMA_COMMANDS.get(typed, typed)
        typed_key = None       # Ollama's /set parameter KEY, as typed: what its usage and errors name
        if name == "/set":
            key, value = _split_word(arg)
            if key == "system":
                name, arg = "/system", value
            elif key == "parameter":
                key, value = _split_word(value)
                arg = f"{OLLAMA_PARAMETERS.get(key, key)} {value}".strip()
                typed_key = f"parameter {key}" if key else None
        if name in NO_ARGUMENT_COMMANDS and arg:
            self.say(f"usage: {typed} (it takes no arguments, got {arg!r})")
        elif name in ("/exit", "/quit"):
            self.is_running = False
        elif name == "/help":
            self.say(HELP_TEXT)
        elif name == "/reset":
            self.conversation.turns.clear()
            self.say("(conversation cleared)")
        elif name == "/system":
            arg = _unquoted(arg)
            self.conversation.system = arg or None
            self.say(f"(system message {'set' if arg else 'cleared'})")
        elif name == "/set":
            self.set_value(arg, typed_key)
        elif name == "/stats":
            stats = self.backend.last_stats
            self.say(stats.describe() if stats else "(no reply yet)")
        elif name == "/show":
            self.show(arg)
        elif name in OLLAMA_ONLY:
            self.say(f"{name}: {OLLAMA_ONLY[name]}")
        else:
            self.say(f"unknown command {_shown(name)} (try /help)")

    def show(self, arg: str) -> None:
        """Ollama's /show TOPIC: what the chat runs with."""
        if arg not in SHOW_TOPICS:
            got = f" (got {arg!r})" if arg else ""
            self.say(f"usage: /show {' | '.join(SHOW_TOPICS)}{got}")
        elif arg == "info":
            context = getattr(self.backend, "context_len", None)
            self.say("\n".join([f"model: {self.backend.name}",
                                f"context: {'not listed by the server' if context is None else f'{context} tokens'}",
                                f"chat template: {'yes' if self.backend.has_chat_template else 'none (plain text)'}"]))
        elif arg == "parameters":
            self.say(self.settings.describe())
        elif arg == "system":
            self.say(self.conversation.system or "(no system message)")
        else:
            template = getattr(self.backend, "template_text", lambda: None)()
            self.say(template if template is not None else
                     "(none: the conversation runs as plain text)" if not self.backend.has_chat_template else
                     "(the server's own: it renders the messages, and /v1/models does not list it)")

    def set_value(self, arg: str, typed_key: str | None = None) -> None:
        """/set KEY VALUE, or /set alone to show the settings; typed_key: how the user named KEY
        (Ollama's `parameter num_predict` for max_tokens), which its usage and errors name."""
        key, value = _split_word(arg)
        if not key:
            self.say(self.settings.describe())
            return
        typed_key = typed_key or key
        try:
            check_setting(key)      # `/set verbose` (Ollama's) is no setting, not a setting missing its value
            if not value:
                self.say(f"usage: /set {typed_key} VALUE")
                return
            self.settings = self.settings.with_value(key, value)
        except ValueError as exc:
            self.say(f"error: {_renamed(str(exc), key, typed_key.split()[-1])}")
            return
        self.say(f"({key} = {getattr(self.settings, key)})")

    def send(self, text: str, is_one_shot: bool = False) -> None:
        """Stream the assistant's reply to TEXT and keep both turns (is_one_shot: reply_once's); a message
        that failed, or was interrupted before any text, leaves the conversation as it was."""
        turns = list(self.conversation.turns)
        self.conversation.turns.append({"role": "user", "content": text})
        flag = StopFlag(at_once=getattr(self.backend, "stops_anywhere", False), ends_chat=self.is_piped,
                        is_shielded=getattr(self.backend, "stops_between_steps", False))
        with sigint_sets(flag):     # to the end of the message's bookkeeping, not just its stream
            self._send(text, turns, flag, is_one_shot)

    def _send(self, text: str, turns: list[dict], flag: StopFlag, is_one_shot: bool) -> None:
        """send, with SIGINT routed to FLAG."""
        reply = ""
        keys = StreamingKeys(self.type_ahead) if self.is_terminal else None
        try:
            try:
                with keys or nullcontext():
                    stream = self.backend.stream_reply(self.conversation, self.settings, flag)
                    self.print_notices()
                    try:
                        for delta in stream:
                            reply += delta
                            self.out.write(_for_stream(self.out, delta))
                            self.out.flush()
                            if keys is not None:
                                keys.poll()
                    finally:
                        stream.close()
            finally:
                flag.is_live = False
        except KeyboardInterrupt:
            flag.is_set = True
        except (ValueError, RuntimeError, OSError) as exc:
            if reply and not reply.endswith("\n"):
                self.say("")            # the error starts a line of its own, not the reply's last one
            self.print_notices()
            self.restore(turns)
            hint = (" (the system message counts too: /system alone clears it)"
                    if isinstance(exc, ContextTooShort) and self.conversation.system and not is_one_shot else "")
            self.note(f"error: {exc}{hint}")
            self.num_failed_replies += 1
            return
        mark = reply_mark(self.backend.last_stats, self.settings, flag.is_set, is_one_shot)
        if is_one_shot:             # the reply alone on out; why it stopped short on log
            self.say("")
            if mark:
                self.note(mark.strip())
        else:
            self.say(mark)
        if flag.is_set and not reply:
            # The message goes too (`ollama run` keeps it): two user turns in a row fail templates that
            # need the roles to alternate, and every message after them would.
            self.restore(turns)
        if flag.is_set and self.is_piped:
            raise KeyboardInterrupt     # the reply ends marked, and the chat with it
        if reply or not flag.is_set:
            self.conversation.turns.append({"role": "assistant", "content": reply})

    def restore(self, turns: list[dict]) -> None:
        """Put the conversation back to TURNS, its turns before a message that got no reply, with the
        oldest exchanges the backend dropped to fit that message."""
        was_trimmed = len(self.conversation.turns) <= len(turns)
        self.conversation.turns[:] = turns
        if was_trimmed:
            self.note("(the exchanges dropped to fit that message are kept)")

    def print_notices(self) -> None:
        """Pass on what the backend wants the user to know (trimmed history, fallbacks)."""
        notices = getattr(self.backend, "notices", [])
        for notice in notices:
            self.note(notice)
        notices.clear()


def _stdin_errors(errors: str) -> str | None:
    """Set how sys.stdin decodes bytes that are not text; what it was (None: stdin has no such setting).
    The chat reads with surrogateescape, for valid_text to make bad bytes U+FFFD: under a UTF-8 locale
    Python's stdin is strict, and one such byte in a piped script ended the chat at that line."""
    stdin = sys.stdin
    was = getattr(stdin, "errors", None)
    if not isinstance(was, str) or not hasattr(stdin, "reconfigure"):
        return None
    try:
        stdin.reconfigure(errors=errors)
    except (ValueError, OSError):     # closed, or a stream that cannot change it
        return None
    return was


def _for_stream(stream: TextIO, text: str) -> str:
    """TEXT as it is written to STREAM: control characters escaped on a terminal; a file or a pipe gets it as it is."""
    return terminal_safe(text) if is_terminal(stream) else text


def _split_word(text: str) -> tuple[str, str]:
    """The first word of text and the rest, stripped; any whitespace (a tab too) separates them."""
    parts = text.split(maxsplit=1)
    return (parts[0] if parts else ""), (parts[1].strip() if len(parts) > 1 else "")


def _renamed(message: str, key: str, name: str) -> str:
    """An error about setting KEY naming it NAME, as the user typed it, where it opens with KEY (as
    with_value's and SamplingParams' errors do)."""
    return name + message[len(key):] if name != key and message.startswith(f"{key} ") else message


def _unquoted(text: str) -> str:
    """TEXT without the triple quotes around it, as Ollama's /set system takes them off."""
    if len(text) >= 2 * len(TRIPLE_QUOTE) and text.startswith(TRIPLE_QUOTE) and text.endswith(TRIPLE_QUOTE):
        return text[len(TRIPLE_QUOTE):-len(TRIPLE_QUOTE)].strip()
    return text


def _shown(text: str) -> str:
    """Text typed by the user as it may be echoed: quoted with escapes when it holds control
    characters (an escape sequence would act on the terminal)."""
    return text if text.isprintable() else repr(text)
