"""chat --url against a server that wants a key, given none: the error says how to give one (it said
the server refused the key, though none was sent)."""
from __future__ import annotations

import httpx
import pytest

from minillm.chat_client import _raise_for_status

BODY = b'{"error": {"message": "Invalid or missing API key", "code": "invalid_api_key"}}'


@pytest.mark.parametrize("headers, said", [
    ({}, "the server asks for an API key (401): pass --api-key KEY or set $OPENAI_API_KEY"),
    ({"Authorization": "Bearer wrong"}, "the server refused the API key (401): Invalid or missing API key"),
])
def test_a_401_says_whether_a_key_was_sent(headers, said):
    request = httpx.Request("POST", "http://127.0.0.1:1/v1/chat/completions", headers=headers)
    with pytest.raises(RuntimeError) as info:
        _raise_for_status(httpx.Response(401, content=BODY, request=request), BODY)
    assert str(info.value) == said
