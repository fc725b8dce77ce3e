"""allowed_token_ids (vLLM's): a row samples only from these tokens.

The sampler keeps a row's allowed logits, fills the row with -inf and writes them back, before
every other rule (vLLM masks them first too): three indexing operations over entries packed with
the other per-row inputs, the same on NumPy and CuPy arrays, with no kernel of its own. A request
without the option adds no entry. EOS ends a sequence only when sampled, so a set without it runs
to max_tokens.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from minillm.sampling_params import FLOAT32_MAX, short_repr


def allowed_entries(seqs, rows) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(rows [A], tokens [A]) int32 with one entry per allowed token of the rows, and the rows once
    each (the rows to mask). seqs: one per row (a Sequence or a view with params)."""
    ids = [seqs[b].params._allowed_entries for b in rows]          # each [n_b] int32, distinct
    out_rows = np.repeat(np.asarray(rows, np.int32), [len(a) for a in ids])
    return out_rows, np.concatenate(ids), list(rows)


def keep_only_allowed(logits, rows, tokens, masked_rows) -> None:
    """logits: [B, V] float32, in place: -inf across masked_rows [R] except at (rows [A], tokens [A])."""
    kept = logits[rows, tokens]                   # [A]
    logits[masked_rows] = -np.inf                 # [R, V]
    logits[rows, tokens] = kept


# ---- rules that leave a row nothing to sample ---------------------------------------------------
# A row whose every logit is -inf samples id 0, on the GPU as on the CPU. The bans that can do that
# are known on the host: logit_bias's of -inf, bad words' and min_tokens' (EOS and stop tokens), over
# allowed_token_ids or the whole vocabulary. A request whose first token has nothing left is refused where it enters
# (first_token_error); one whose bans could cover every candidate later has each token it gets
# checked (masked_out_error): a token its own rules forbid is the sign of such a row.


def min_tokens_bans(params, eos_token_ids) -> set[int]:
    """What min_tokens bans until it is reached: stop tokens and EOS (under ignore_eos too)."""
    # The sampler's ban entries (sampling_metadata.banned_entries) and the checks below read this one set.
    return set(params.stop_token_ids) | set(eos_token_ids) if params.min_tokens > 0 else set()


def logit_bias_bans(params) -> frozenset[int]:
    """What logit_bias bans at every step: the tokens whose bias is -inf as float32 (_float32_bits)."""
    bias = params.logit_bias
    return frozenset(t for t, v in bias.items() if v < -FLOAT32_MAX) if bias else frozenset()


def _covers(bans: set[int], allowed: np.ndarray | None, vocab_size: int) -> bool:
    """bans hold every token a row may sample: each of allowed ([A] int32), or else of the vocabulary."""
    if allowed is None:
        return len({t for t in bans if 0 <= t < vocab_size}) >= vocab_size
    return len(bans) >= len(allowed) and bool(np.isin(allowed, np.fromiter(bans, np.int64, len(bans))).all())


def _banning_rules(params, words: set[int], stops: set[int], biased=frozenset()) -> tuple[str, str]:
    """(first field, description) of the rules whose bans fall on tokens the row may sample."""
    allowed = params._allowed_entries
    kept = set(allowed.tolist()) if allowed is not None else None
    rules = []
    if biased and (kept is None or not biased.isdisjoint(kept)):
        rules.append(("logit_bias", "logit_bias values of -inf"))
    if words and (kept is None or not words.isdisjoint(kept)):
        rules.append(("bad_words", "bad_words"))
    if stops and (kept is None or not stops.isdisjoint(kept)):
        rules.append(("min_tokens", f"min_tokens={params.min_tokens} (which bans EOS and stop_token_ids until then)"))
    return rules[0][0], " and ".join(text for _, text in rules)


def first_token_error(params, eos_token_ids, vocab_size: int) -> str | None:
    """Why params' bans leave the first output token nothing to sample; None when they do not."""
    ids = params._bad_word_ids
    words = {s[0] for s in ids.sequences if len(s) == 1} if ids is not None else set()
    # A grammar whose only sentence is empty lifts min_tokens' ban of EOS: EOS counts only without one.
    stops = min_tokens_bans(params, eos_token_ids if params.structured_outputs is None else ())
    biased = logit_bias_bans(params)
    allowed = params._allowed_entries
    if not _covers(words | stops | biased, allowed, vocab_size):
        return None
    name, rules = _banning_rules(params, words, stops, biased)
    if allowed is None:
        return f"{name} must leave a token the first output token may take, but {rules} ban every token"
    return (f"allowed_token_ids must hold a token the first output token may take, but {rules} "
            f"ban all of them, got {short_repr(params.allowed_token_ids)}")


class MaskedRowCheck(NamedTuple):
    """What masked_out_error needs besides a request's params (SamplingParams._masked_row_check)."""

    eos_token_ids: tuple[int, ...]
    vocab_size: int
    biased: frozenset[int]          # logit_bias_bans: the same at every step


def masked_row_check(params, eos_token_ids, vocab_size: int) -> MaskedRowCheck | None:
    """A MaskedRowCheck when params' bans may cover every token a row may sample after some output."""
    # Under a constraint the grammar refuses the id 0 of such a row (StructuredOutputRequest.rejection).
    ids = params._bad_word_ids
    if params.structured_outputs is not None or (ids is None and params.min_tokens == 0):
        return None
    # logit_bias alone bans the same tokens at every step: first_token_error has ruled it out.
    last = {s[-1] for s in ids.sequences} if ids is not None else set()
    biased = logit_bias_bans(params)
    if not _covers(last | min_tokens_bans(params, eos_token_ids) | biased, params._allowed_entries, vocab_size):
        return None
    return MaskedRowCheck(tuple(eos_token_ids), vocab_size, biased)


def masked_out_error(params, outputs: list[int], token: int) -> str | None:
    """The error ending a request whose token after outputs is one its own bans forbid; else None."""
    # The sampler takes such a token (id 0) only from a row with every logit -inf.
    eos_token_ids, vocab_size, biased = params._masked_row_check
    stops = min_tokens_bans(params, eos_token_ids) if len(outputs) < params.min_tokens else set()
    words = set()
    if params._bad_word_ids is not None:
        from minillm.bad_words import banned_next_tokens      # loaded: it made params' bad word ids
        words = set(banned_next_tokens(params._bad_word_ids, outputs))
    allowed = params._allowed_entries
    if token not in stops and token not in words and token not in biased and (
            allowed is None or (k := int(np.searchsorted(allowed, token))) < len(allowed) and allowed[k] == token):
        return None
    where = f"after {len(outputs)} output token{'' if len(outputs) == 1 else 's'}" if outputs \
        else "for the first output token"
    left = "no allowed token" if allowed is not None else "no token"
    if not _covers(words | stops | biased, allowed, vocab_size):
        return f"{'allowed_token_ids' if allowed is not None else 'sampling'}: {left} is left to sample {where}: " \
               "their logits are all -inf or NaN; the output stops there"
    name, rules = _banning_rules(params, words, stops, biased)
    return f"{'allowed_token_ids' if allowed is not None else name}: {left} is left to sample {where}: " \
           f"{rules} ban all of them; the output stops there"
