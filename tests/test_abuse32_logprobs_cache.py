"""The token-text cache behind the server's logprobs holds a bounded number of entries (it grew to
200,000 pairs, about 50 MB per API server) and gives the same texts as decoding afresh."""
from __future__ import annotations

from minillm.server.logprobs import TokenTexts


class CountingTokenizer:
    """Decodes ids as '<id>' pieces, a space before the first, counting calls."""

    def __init__(self) -> None:
        self.num_calls = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.num_calls += 1
        return " " + "".join(f"<{i}>" for i in ids)


def test_cache_is_bounded_and_texts_unchanged():
    tok = CountingTokenizer()
    texts = TokenTexts(tok)
    for prev in range(20_000):
        assert texts.text(prev, prev + 1) == f"<{prev + 1}>"
    assert texts.text(None, 7) == " <7>"
    assert len(texts._cache) <= 8192                  # a few thousand entries, not 200,000


def test_recent_pairs_are_served_from_the_cache():
    tok = CountingTokenizer()
    texts = TokenTexts(tok)
    for prev in range(2 * TokenTexts.MAX_ENTRIES):
        texts.text(prev, 5)
    texts.text(0, 5)                                  # evicted long ago: decoded again
    texts.text(2 * TokenTexts.MAX_ENTRIES - 1, 5)     # the newest: no decode
    before = tok.num_calls
    for _ in range(3):
        assert texts.text(2 * TokenTexts.MAX_ENTRIES - 1, 5) == "<5>"
        assert texts.text(0, 5) == "<5>"
    assert tok.num_calls == before
