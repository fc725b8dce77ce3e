"""`--reasoning-parser`: a thinking model's reasoning apart from its answer, as vLLM returns it.

    deepseek_r1   <think> reasoning </think> answer; the template may open <think> in the prompt, so
                  only </think> need appear; without it the whole output is reasoning (cut short)
    qwen3         the same, and with chat_template_kwargs {"enable_thinking": false} (the template
                  then closes the thinking block in the prompt) the whole output is the answer

Either way a prompt that closed the thinking block itself (it ends in </think>: Qwen3's template with
enable_thinking false, DeepSeek-V3.1's with thinking false, any template whose generation prompt ends in
<think></think>) leaves the whole output the answer; a finished block of an earlier turn does not.

A chat completion's message then carries `reasoning` (and `reasoning_content`, its older name in
vLLM) beside `content`; a stream's deltas carry the one or the other. The split is made on the
text, so a tag spread over several tokens (or streamed across chunks) is found all the same: a
stream holds back the end of a delta that could be the start of a tag until the next delta says.

Whole and streamed replies split alike, as vLLM streams them token by token: everything before the
first </think> is reasoning, less its <think> tags (text before a <think> is reasoning too: vLLM's
non-streamed path drops it, its stream keeps it), and what follows is the content as written. A
whole reply's reasoning is "" (not null) where it is empty, its content null, as vLLM returns them;
a stream sends no empty delta. qwen3 with thinking off, and a prompt that closed the thinking block,
leave every output whole as the content, whole or streamed (as vLLM's stream does; its non-streamed
path has in some versions still split at a </think> the model writes).

Under a constraint (response_format, structured_outputs, a forced tool call) the engine leaves the
reasoning free and holds only what follows </think> to the grammar (vLLM's structured outputs with a
reasoning parser; --structured-outputs-config enable_in_reasoning holds every token instead): the tags
must then be added tokens of the tokenizer, whose ids the engine watches for. After a prompt that
closed the thinking block the grammar holds the output from its first token, tags or no tags.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

REASONING_PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of text that is a proper start of tag (held back in a stream)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass(frozen=True)
class ReasoningParser:
    """One parser and what a request's chat_template_kwargs and prompt say of thinking."""

    name: str
    thinking: bool = True        # False (qwen3's enable_thinking false, a prompt that closed the block): no reasoning

    def __post_init__(self) -> None:
        if self.name not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, got {self.name!r}")

    @classmethod
    def for_request(cls, name: str, template_kwargs: dict | None, reasoning_ended: bool = False) -> ReasoningParser:
        """The parser as a request's chat_template_kwargs set it (qwen3's enable_thinking) and its
        prompt left it (reasoning_ended: the prompt closed the thinking block, see reasoning_ended_in_prompt)."""
        thinking = not reasoning_ended
        if name == "qwen3" and isinstance(template_kwargs, dict) and thinking:
            thinking = template_kwargs.get("enable_thinking", True) is not False
        return cls(name, thinking)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output: reasoning "" where empty (None with thinking off),
        content None where empty (without </think> the output was cut short while thinking)."""
        if not self.thinking:
            return None, text
        reasoning, _, content = text.partition(END)
        return reasoning.replace(START, ""), content or None

    def stream(self) -> ReasoningStream:
        """A choice's state while it streams."""
        return ReasoningStream(self.thinking)

    def count_reasoning_tokens(self, token_ids: Sequence[int], tags: ThinkingTagIds) -> int:
        """How many of an output's tokens are its reasoning (vLLM's count_reasoning_tokens, reported as
        reasoning_tokens): those before the first </think>, less the <think> tags among them (all of
        them without </think>, cut short while thinking); 0 with thinking off."""
        if not self.thinking:
            return 0
        end = find_subsequence(token_ids, tags.end)
        reasoning = token_ids[:end] if end >= 0 else token_ids
        return len(reasoning) - len(tags.start) * count_subsequence(reasoning, tags.start)

    def count_reasoning_tokens_in_text(self, token_ids: Sequence[int], decode: Callable[[list[int]], str]) -> int:
        """count_reasoning_tokens where the tags are no single tokens (their encodings need not be the
        pieces the model wrote them in): the tokens whose decoded text ends before the first </think>,
        less those that end inside a <think> before it."""
        if not self.thinking:
            return 0
        ids = list(token_ids)
        text = decode(ids)
        end = text.find(END)
        reasoning = text if end < 0 else text[:end]
        count = len(ids) if end < 0 else num_tokens_within(ids, decode, end)
        at = reasoning.find(START)
        while at >= 0:
            count -= num_tokens_within(ids, decode, at + len(START)) - num_tokens_within(ids, decode, at)
            at = reasoning.find(START, at + len(START))
        return count


def reasoning_ended_in_prompt(prompt: str, continues_message: bool = False) -> bool:
    """Whether the prompt closed the thinking block for the reply: it ends in </think> (and whitespace),
    or, where the reply continues the prompt's final message, has a </think> after its last <think>.
    vLLM's is_reasoning_end takes any </think> after the last <think>, which reads an agent loop's
    history (Qwen3's template keeps the last turns' <think>...</think> and opens no new block) as a
    closed prompt and the new turn's reasoning as its answer; a template that closes the block for the
    reply (Qwen3's enable_thinking false, DeepSeek-V3.1's thinking false) puts the </think> last. Read
    as text, so tags spelled in several tokens are found all the same."""
    if continues_message:
        return prompt.find(END, max(prompt.rfind(START), 0)) >= 0
    tail = prompt.rstrip()
    return tail.endswith(END) and tail.rfind(START) < len(tail) - len(END)


def num_tokens_within(token_ids: list[int], decode: Callable[[list[int]], str], num_chars: int) -> int:
    """How many leading tokens decode to at most num_chars characters (a binary search over prefixes)."""
    low, high = 0, len(token_ids)
    while low < high:
        mid = (low + high + 1) // 2
        if len(decode(token_ids[:mid])) <= num_chars:
            low = mid
        else:
            high = mid - 1
    return low


def thinking_token_ids(tokenizer) -> tuple[int, int] | None:
    """(start, end) ids of <think> and </think> as added tokens of the tokenizer (vLLM's parsers look them
    up in the vocabulary); None when either is not one token there."""
    ids = {text: i for i, text in tokenizer.added_token_contents.items()}
    if START not in ids or END not in ids:
        return None
    return ids[START], ids[END]


@dataclass(frozen=True)
class ThinkingTagIds:
    """<think> and </think> as the token ids an output holds them by."""

    start: tuple[int, ...]
    end: tuple[int, ...]


@functools.lru_cache(maxsize=8)
def thinking_tag_ids(tokenizer) -> ThinkingTagIds | None:
    """The tags' ids where both are added tokens of the tokenizer; None where they are not (their
    encodings, "▁<", "/", "th", ..., need not be the tokens an output spells them with)."""
    single = thinking_token_ids(tokenizer)
    return None if single is None else ThinkingTagIds((single[0],), (single[1],))


def count_reasoning_tokens(parser: ReasoningParser, token_ids: Sequence[int], tokenizer) -> int:
    """An output's reasoning tokens (vLLM's reasoning_tokens): by the tags' ids where they are single
    tokens, else by the decoded text."""
    tags = thinking_tag_ids(tokenizer)
    if tags is not None:
        return parser.count_reasoning_tokens(token_ids, tags)
    return parser.count_reasoning_tokens_in_text(token_ids, functools.partial(tokenizer.decode, skip_special_tokens=True))


def find_subsequence(token_ids: Sequence[int], sub: Sequence[int], begin: int = 0) -> int:
    """Where sub first occurs in token_ids from begin on; -1 where it does not (or is empty)."""
    n = len(sub)
    for i in range(begin, len(token_ids) - n + 1 if n else begin):
        if token_ids[i] == sub[0] and tuple(token_ids[i:i + n]) == tuple(sub):
            return i
    return -1


def count_subsequence(token_ids: Sequence[int], sub: Sequence[int]) -> int:
    """How many times sub occurs in token_ids, without overlap."""
    count, at = 0, find_subsequence(token_ids, sub)
    while at >= 0:
        count, at = count + 1, find_subsequence(token_ids, sub, at + len(sub))
    return count


class ReasoningStream:
    """Splits one choice's streamed text into reasoning and content deltas."""

    def __init__(self, thinking: bool) -> None:
        self.in_reasoning = thinking
        self._held = ""                # the end of the text so far that may begin a tag

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) that delta adds; text that may begin a tag waits for the next."""
        if not self.in_reasoning:
            return "", delta
        text = self._held + delta
        reasoning, tag, content = text.partition(END)
        if tag:
            self.in_reasoning, self._held = False, ""
            return reasoning.replace(START, ""), content
        keep = max(partial_tag_len(text, END), partial_tag_len(text, START))
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep].replace(START, ""), ""

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output has ended: reasoning it was."""
        held, self._held = self._held, ""
        return (held, "") if self.in_reasoning else ("", held)
