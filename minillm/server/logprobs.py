"""Log-probabilities in OpenAI's two shapes: legacy completions and chat's content list."""
from __future__ import annotations

from typing import Any

from minillm.tokenizer import IncrementalDetokenizer


class TokenTexts:
    """Token id -> its text as it reads after a neighbour (keeps sentencepiece's leading space)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[tuple[int, int], str] = {}

    def text(self, prev_id: int | None, token_id: int) -> str:
        """The text token_id adds after prev_id (decoded in that context, specials kept)."""
        key = (-1 if prev_id is None else prev_id, token_id)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        decode = self.tokenizer.decode
        if prev_id is None:
            text = decode([token_id], skip_special_tokens=False)
        else:
            head = decode([prev_id], skip_special_tokens=False)
            both = decode([prev_id, token_id], skip_special_tokens=False)
            text = both[len(head):] if both.startswith(head) else decode([token_id], skip_special_tokens=False)
        if len(self._cache) < 200_000:
            self._cache[key] = text
        return text


class LogprobCursor:
    """Walks one completion's tokens, producing their strings and text offsets incrementally."""

    def __init__(self, texts: TokenTexts, prompt_token_ids: list[int], text_base: int,
                 skip_special_tokens: bool) -> None:
        self.texts = texts
        self.prev_id: int | None = prompt_token_ids[-1] if prompt_token_ids else None
        self.detok = IncrementalDetokenizer(texts.tokenizer, skip_special_tokens=skip_special_tokens,
                                            prompt_token_ids=prompt_token_ids)
        self.text_base = text_base       # characters before the completion (the echoed prompt)
        self.num_done = 0

    def advance(self, token_ids: list[int], logprobs: list[dict[int, float] | None], num_top: int
                ) -> list[tuple[str, float | None, list[tuple[str, float]] | None, int]]:
        """(token text, its logprob, top alternatives, text offset) for each new token; a token
        without log-probabilities (a prompt's first) gets None for both."""
        rows = []
        end = min(len(token_ids), len(logprobs))
        for i in range(self.num_done, end):
            token_id, candidates = token_ids[i], logprobs[i]
            offset = self.text_base + len(self.detok.text)
            self.detok.add(token_id)
            text = self.texts.text(self.prev_id, token_id)
            if candidates is None:
                rows.append((text, None, None, offset))
            else:
                top = sorted(candidates.items(), key=lambda kv: -kv[1])[:num_top]
                top_rows = [(text if tid == token_id else self.texts.text(self.prev_id, tid), _finite(lp))
                            for tid, lp in top]
                rows.append((text, _finite(candidates.get(token_id)), top_rows, offset))
            self.prev_id = token_id
        self.num_done = max(self.num_done, end)
        return rows


def prompt_logprob_rows(texts: TokenTexts, prompt_token_ids: list[int], entries: list, num_top: int,
                        skip_special_tokens: bool) -> list[tuple[str, float | None, list | None, int]]:
    """LogprobCursor.advance's rows for a prompt's own tokens (prompt_logprobs entries: None first)."""
    return LogprobCursor(texts, [], 0, skip_special_tokens).advance(prompt_token_ids, entries, num_top)


def _finite(logprob: float | None) -> float | None:
    # JSON has no -inf; a token masked out by top-k/top-p reads as a very unlikely one.
    return None if logprob is None else max(float(logprob), -9999.0)


def completion_logprobs(rows: list[tuple[str, float | None, list[tuple[str, float]], int]]) -> dict:
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
    out = dict(top)
    if text not in out and logprob is not None:
        out[text] = logprob
    return out


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(rows: list[tuple[str, float | None, list[tuple[str, float]], int]]) -> dict:
    """The chat logprobs object ({"content": [...]}) for some tokens."""
    return {"content": [
        {"token": text, "logprob": lp, "bytes": _utf8(text),
         "top_logprobs": [{"token": t, "logprob": v, "bytes": _utf8(t)} for t, v in top]}
        for text, lp, top, _ in rows
    ]}
