"""bad_words (vLLM's): words a completion must not contain, banned token by token.

Each word becomes token-id sequences once, where the request is added: the word as given (less
leading spaces) and, when a space before it gives another first token in as many tokens, that
form too (tokenizers that mark a word's start spell the word differently inside the text). At
each step a row bans the last token of every sequence whose other tokens end its output so far;
a one-token sequence is banned always. Only generated tokens count, never the prompt's. The
bans join min_tokens' in the sampler's ban entries, so a request without bad words costs nothing.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

from minillm.sampling_params import short_repr
from minillm.tokenizer import check_unicode

# Every step scans each sequence of each row that has them, on the host.
MAX_BAD_WORD_SEQUENCES = 128
MAX_BAD_WORD_TOKENS = 1024


class BadWordIds(NamedTuple):
    """A request's bad words as the sampler reads them."""

    sequences: tuple[tuple[int, ...], ...]   # token ids of each form of each word
    max_prefix_len: int                      # the most earlier tokens a ban looks at (0: none)


@functools.lru_cache(maxsize=256)
def bad_word_ids(words: tuple[str, ...], tokenizer, vocab_size: int) -> BadWordIds:
    """words tokenized as vLLM tokenizes them (remembered: the API server and the engine ask alike);
    ValueError naming bad_words for a word of no tokens, ids outside [0, vocab_size), or too many."""
    sequences = []
    for word in words:
        check_unicode(word, "bad_words")
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"bad_words entries must tokenize to at least one token, got {short_repr(word)}")
        sequences.append(tuple(plain))
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(tuple(spaced))
    _check_sizes(sequences, vocab_size)
    return BadWordIds(tuple(sequences), max(len(s) for s in sequences) - 1 if sequences else 0)


def _check_sizes(sequences: list[tuple[int, ...]], vocab_size: int) -> None:
    """ValueError naming bad_words for ids outside the vocabulary or more sequences or tokens than a step scans."""
    outside = sorted({t for s in sequences for t in s if not 0 <= t < vocab_size})
    if outside:
        raise ValueError(f"bad_words tokenize to ids outside the vocabulary [0, {vocab_size}): {short_repr(outside)}")
    if len(sequences) > MAX_BAD_WORD_SEQUENCES:
        raise ValueError(f"bad_words make {len(sequences)} token sequences, more than {MAX_BAD_WORD_SEQUENCES}")
    num_tokens = sum(len(s) for s in sequences)
    if num_tokens > MAX_BAD_WORD_TOKENS:
        raise ValueError(f"bad_words make {num_tokens} tokens, more than {MAX_BAD_WORD_TOKENS}")


def banned_next_tokens(ids: BadWordIds, outputs: list[int]) -> list[int]:
    """The tokens that would complete a bad word after outputs (the generated ids so far)."""
    tail = tuple(outputs[-ids.max_prefix_len:]) if ids.max_prefix_len else ()   # all outputs, when fewer
    banned = []
    for seq in ids.sequences:
        k = len(seq) - 1
        if k == 0 or (k <= len(tail) and tail[len(tail) - k:] == seq[:-1]):
            banned.append(seq[-1])
    return banned


def bad_word_entries(seqs, rows) -> tuple[list[int], list[int]]:
    """(rows, tokens) to set to -inf for the rows' bad words. seqs: one per row (a Sequence or a
    view with params and output_tail). Each row copies only the outputs a ban looks at."""
    out_rows, tokens = [], []
    for b in rows:
        s = seqs[b]
        ids = s.params._bad_word_ids
        banned = banned_next_tokens(ids, s.output_tail(ids.max_prefix_len) if ids.max_prefix_len else ())
        out_rows.extend([b] * len(banned))
        tokens.extend(banned)
    return out_rows, tokens
