"""bad_words: tokenized as vLLM tokenizes them, and the token that would complete one banned after
the generated tokens (never the prompt's) that start it."""
from __future__ import annotations

import numpy as np
import pytest

from minillm.bad_words import (MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS, bad_word_entries, bad_word_ids,
                               banned_next_tokens)
from minillm.sampling_params import SamplingParams
from minillm.sequence import Sequence

VOCAB = 64


class TableTokenizer:
    """A tokenizer that looks each text up in a table (what a test needs of one)."""

    def __init__(self, table: dict[str, list[int]]):
        self.table = table

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return list(self.table[text])

    def __len__(self) -> int:
        return VOCAB


# "ab" and " ab" spell the word with another first token in as many tokens; " dog" is one token
# where "dog" is two; " eel" starts as "eel" does.
TOKENIZER = TableTokenizer({"ab": [7, 8], " ab": [9, 8], "dog": [10, 11], " dog": [12], "eel": [13],
                            " eel": [13, 14], "c": [5], " c": [6], "": [], " ": [], "big": [70], " big": [71]})


def params_with(words: list[str], tokenizer=TOKENIZER, **kw) -> SamplingParams:
    params = SamplingParams(bad_words=words, **kw)
    params.update_from_tokenizer(tokenizer, VOCAB)
    return params


def test_a_word_is_tokenized_bare_and_after_a_space_where_that_spells_it_otherwise():
    assert bad_word_ids(("ab",), TOKENIZER, VOCAB).sequences == ((7, 8), (9, 8))
    assert bad_word_ids(("dog",), TOKENIZER, VOCAB).sequences == ((10, 11),)       # another length
    assert bad_word_ids(("eel",), TOKENIZER, VOCAB).sequences == ((13,),)          # the same first token
    assert bad_word_ids(("  ab",), TOKENIZER, VOCAB).sequences == ((7, 8), (9, 8))   # leading spaces go
    ids = params_with(["c", "dog"]).bad_words_token_ids
    assert ids == ((5,), (6,), (10, 11))
    assert params_with(["c", "dog"])._bad_word_ids.max_prefix_len == 1
    assert params_with(["c"])._bad_word_ids.max_prefix_len == 0 and not params_with(["c"]).needs_output_tokens
    assert params_with(["dog"]).needs_output_tokens                # its ban reads the token before
    assert SamplingParams(bad_words=[]).bad_words_token_ids is None


@pytest.mark.parametrize("words, says", [
    ([""], "bad_words cannot contain an empty string"),
    ([" "], "bad_words entries must tokenize to at least one token"),
    (["big"], "bad_words tokenize to ids outside the vocabulary [0, 64): [70, 71]"),
    (["\ud800"], "bad_words is not valid Unicode"),
])
def test_a_word_that_cannot_be_banned_is_a_value_error_naming_bad_words(words, says):
    with pytest.raises(ValueError, match=r"^bad_words") as info:
        params_with(words)
    assert says in str(info.value)


def test_bad_words_are_bounded_in_words_sequences_and_tokens():
    with pytest.raises(ValueError, match=r"^bad_words may hold at most 128 words, got 129"):
        SamplingParams(bad_words=["ab"] * 129)
    for bad in ("ab", 5, None):
        with pytest.raises(ValueError, match=r"^bad_words must be a list of strings"):
            SamplingParams(bad_words=bad if bad == "ab" else ["ab", bad])
    many = TableTokenizer({**{f"w{i}": [i % VOCAB] for i in range(100)}, **{f" w{i}": [(i + 1) % VOCAB]
                                                                          for i in range(100)}})
    with pytest.raises(ValueError, match=rf"^bad_words make 200 token sequences, more than {MAX_BAD_WORD_SEQUENCES}"):
        params_with([f"w{i}" for i in range(100)], many)
    long = TableTokenizer({"w": [1] * (MAX_BAD_WORD_TOKENS + 1), " w": [1] * (MAX_BAD_WORD_TOKENS + 1)})
    with pytest.raises(ValueError, match=rf"^bad_words make {MAX_BAD_WORD_TOKENS + 1} tokens, more than"):
        params_with(["w"], long)


def test_the_last_token_of_a_word_is_banned_only_after_its_first_tokens():
    ids = bad_word_ids(("ab", "c", "dog"), TOKENIZER, VOCAB)
    assert banned_next_tokens(ids, []) == [5, 6]                   # one-token words: always
    assert banned_next_tokens(ids, [3, 7]) == [8, 5, 6]
    assert banned_next_tokens(ids, [9]) == [8, 5, 6]               # the spaced form's start
    assert banned_next_tokens(ids, [7, 3]) == [5, 6]
    assert banned_next_tokens(ids, [1, 10]) == [5, 6, 11]


def test_only_generated_tokens_start_a_word():
    params = params_with(["ab"])
    seq = Sequence("r", 0, [1, 7], params, 0.0, np.random.default_rng(0), 100)   # the prompt ends with "a"
    seq.num_output_placeholders = 1
    assert bad_word_entries([seq], [0]) == ([], [])
    seq.token_ids += [2, 7]
    assert bad_word_entries([seq, seq], [1]) == ([1], [8])
