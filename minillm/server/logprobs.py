"""Log-probabilities in OpenAI's two shapes (legacy completions, chat's content), and vLLM's prompt_logprobs."""
from __future__ import annotations

from typing import Any, NamedTuple

from minillm.output_processor import prompt_logprobs_context, ranked_logprobs
from minillm.tokenizer import MAX_LOGPROB_CONTEXT_TOKENS, IncrementalDetokenizer


def token_id_placeholder(token_id: int) -> str:
    """How a token is named under vLLM's return_tokens_as_token_ids."""
    return f"token_id:{token_id}"


class LogprobRow(NamedTuple):
    """One token's log-probability row, as both OpenAI shapes are built from it."""

    token: str                                  # its text, or token_id_placeholder under as_token_ids
    logprob: float | None                       # None for a prompt's first token
    top: list[tuple[str, float]] | None         # the likeliest alternatives (named as token is)
    offset: int                                 # where its text starts in the choice's text
    text: str                                   # its text (what chat's bytes hold, as in vLLM)


class TokenTexts:
    """Token id -> its name in logprobs, as vLLM's server names it (Logprob.decoded_token, which LLM.generate
    gives too): decoded alone, SentencePiece's leading space kept; a token that ends inside a character read
    after the tokens before it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def named(self, token_id: int, context: list[int]) -> str:
        """token_id's name, CONTEXT the sequence's tokens before it: the character it completes, or ""
        while one is unfinished (tokenizer.logprob_token_text)."""
        return self.tokenizer.logprob_token_text(token_id, context)


class LogprobCursor:
    """Walks one completion's tokens, producing their strings and text offsets incrementally."""

    def __init__(self, texts: TokenTexts, prompt_token_ids: list[int], text_base: int,
                 skip_special_tokens: bool, as_token_ids: bool = False,
                 spaces_between_special_tokens: bool = True, context_floor: int = 0) -> None:
        self.texts = texts
        # a token is named after those of token_ids before it from this index on (a prompt's first has no entry)
        self.context_floor = context_floor
        self.as_token_ids = as_token_ids    # vLLM's return_tokens_as_token_ids: tokens named "token_id:<id>"
        # offsets index the completion's text, which spaces_between_special_tokens shapes too
        self.detok = IncrementalDetokenizer(texts.tokenizer, skip_special_tokens=skip_special_tokens,
                                            prompt_token_ids=prompt_token_ids,
                                            spaces_between_special_tokens=spaces_between_special_tokens)
        self.text_base = text_base       # characters before the completion (the echoed prompt)
        self.num_done = 0

    def advance(self, token_ids: list[int], logprobs: list[dict[int, float] | None], num_top: int
                ) -> list[LogprobRow]:
        """A row for each new token (a prompt's first has no logprob and no alternatives)."""
        rows = []
        end = min(len(token_ids), len(logprobs))
        for i in range(self.num_done, end):
            token_id, candidates = token_ids[i], logprobs[i]
            offset = self.text_base + len(self.detok.text)
            self.detok.add(token_id)
            context = token_ids[max(self.context_floor, i - MAX_LOGPROB_CONTEXT_TOKENS):i]
            text = self.texts.named(token_id, context)
            token = token_id_placeholder(token_id) if self.as_token_ids else text
            if candidates is None:
                rows.append(LogprobRow(token, None, None, offset, text))
            else:
                top = sorted(candidates.items(), key=lambda kv: -kv[1])[:num_top]
                top_rows = [(self._name(tid, token_id, token, context), _finite(lp)) for tid, lp in top]
                rows.append(LogprobRow(token, _finite(candidates.get(token_id)), top_rows, offset, text))
        self.num_done = max(self.num_done, end)
        return rows

    def _name(self, token_id: int, chosen_id: int, chosen: str, context: list[int]) -> str:
        """How an alternative to the chosen token is named (in the chosen token's context)."""
        if token_id == chosen_id:
            return chosen
        return token_id_placeholder(token_id) if self.as_token_ids else self.texts.named(token_id, context)


def prompt_logprob_rows(texts: TokenTexts, prompt_token_ids: list[int], entries: list, num_top: int,
                        skip_special_tokens: bool, as_token_ids: bool = False) -> list[LogprobRow]:
    """LogprobCursor.advance's rows for a prompt's own tokens (prompt_logprobs entries: None first)."""
    cursor = LogprobCursor(texts, [], 0, skip_special_tokens, as_token_ids, context_floor=1)
    return cursor.advance(prompt_token_ids, entries, num_top)


def prompt_logprobs_json(entries: list, prompt_token_ids: list[int], num_top: int, tokenizer: Any) -> list:
    """vLLM's prompt_logprobs as JSON data: None, then {token id: {logprob, rank, decoded_token}} per token."""
    # The prompt token first, then its num_top likeliest alternatives, ranked as LLM.generate ranks them.
    out: list = []
    for i, entry in enumerate(entries):
        if entry is None:
            out.append(None)
            continue
        ranked = ranked_logprobs(entry, num_top, tokenizer, context=prompt_logprobs_context(prompt_token_ids, i))
        token = prompt_token_ids[i]
        order = [token] + [tid for tid in ranked if tid != token] if token in ranked else list(ranked)
        out.append({tid: {"logprob": _finite(ranked[tid]), "rank": ranked[tid].rank,
                          "decoded_token": ranked[tid].decoded_token} for tid in order})
    return out


def _finite(logprob: float | None) -> float | None:
    # JSON has no -inf; a token masked out by top-k/top-p reads as a very unlikely one.
    return None if logprob is None else max(float(logprob), -9999.0)


def completion_logprobs(rows: list[LogprobRow]) -> dict:
    """The legacy completions logprobs object for some tokens. Each top_logprobs entry holds the
    chosen token as well as the most likely ones, so up to logprobs + 1 entries (OpenAI's
    documented shape, and vLLM's)."""
    return {
        "tokens": [r[0] for r in rows],
        "token_logprobs": [r[1] for r in rows],
        "top_logprobs": [None if r[2] is None else _with_chosen(r[2], r[0], r[1]) for r in rows],
        "text_offset": [r[3] for r in rows],
    }


def _with_chosen(top: list[tuple[str, float]], text: str, logprob: float | None) -> dict[str, float]:
    """The top alternatives as a dict, the chosen token's text added where it is not among them."""
    # Tokens can read alike (a byte-fallback "n" and the token "n"): a text keeps its likeliest token's
    # logprob (top is ranked), not the last one's.
    out: dict[str, float] = {}
    for name, top_logprob in top:
        out.setdefault(name, top_logprob)
    if text not in out and logprob is not None:
        out[text] = logprob
    return out


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(rows: list[LogprobRow]) -> dict:
    """The chat logprobs object ({"content": [...]}) for some tokens."""
    # As in vLLM, a token's bytes are its text's and an alternative's those of its name ("token_id:<id>"
    # under return_tokens_as_token_ids).
    return {"content": [
        {"token": row.token, "logprob": row.logprob, "bytes": _utf8(row.text),
         "top_logprobs": [{"token": t, "logprob": v, "bytes": _utf8(t)} for t, v in row.top]}
        for row in rows
    ]}
