"""A model directory with a SentencePiece tokenizer.model and no tokenizer.json (Llama 2 era
exports): the error says which file is there and how to make the one minillm reads."""
from __future__ import annotations

import pytest
from test_abuse30_models import stories_copy
from test_chat import needs_stories

from minillm.tokenizer import Tokenizer


@needs_stories
def test_a_tokenizer_model_without_tokenizer_json_says_how_to_convert_it(tmp_path):
    path = stories_copy(tmp_path, "llama 2 ü")
    (path / "tokenizer.json").unlink()
    (path / "tokenizer.model").write_bytes(b"\n\x05\n\x01a\x15\x00\x00\x00\x00")
    with pytest.raises(ValueError) as raised:
        Tokenizer.from_pretrained(path)
    message = str(raised.value)
    assert "has tokenizer.model (a SentencePiece tokenizer) but no tokenizer.json" in message
    assert "AutoTokenizer.from_pretrained" in message and repr(str(path)) in message


@needs_stories
def test_a_directory_with_no_tokenizer_at_all_says_so(tmp_path):
    path = stories_copy(tmp_path)
    (path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        Tokenizer.from_pretrained(path)
