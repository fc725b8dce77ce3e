"""The engine ids of /v1/responses and /v1/messages start with the id their reply carries (resp-<client
id>, resp_<hex>, msg_<hex>), as those of chat completions do: an operator finds them in /v1/stats."""
from __future__ import annotations

import re

import pytest
from test_abuse34_request_ids import GATE, HEX8, Post, engine_ids, gated, rows_matching, server  # noqa: F401 (fixtures)
from test_server_helpers import wait_for


RESPONSES = {"model": "stories", "input": "Hi", "max_output_tokens": 4}
MESSAGES = {"model": "stories", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.mark.parametrize("path, body, headers, stem", [
    ("/v1/responses", {**RESPONSES, "request_id": "body-3"}, {}, "resp-body-3"),
    ("/v1/responses", RESPONSES, {"X-Request-Id": "hdr-3"}, "resp-hdr-3"),
    ("/v1/responses", RESPONSES, {}, "resp_[0-9a-f]{32}"),
    ("/v1/messages", MESSAGES, {}, "msg_[0-9a-f]{32}"),
], ids=["responses-body", "responses-header", "responses-fresh", "messages"])
def test_the_engine_id_starts_with_the_reply_id(server, gated, path, body, headers, stem):
    # They ran as chatcmpl-<fresh hex>, an id the client never sees.
    post = Post(f"{server[0]}{path}", body, headers)
    post.start()
    ids = wait_for(lambda: rows_matching(server[0], rf"{stem}-{HEX8}", 1), timeout=60)
    assert ids, engine_ids(server[0])
    GATE.is_open.set()
    post.join(120)
    assert post.response.status_code == 200, post.response.text
    assert ids[0].startswith(post.response.json()["id"] + "-")
    assert re.fullmatch(rf"{re.escape(post.response.json()['id'])}-{HEX8}", ids[0])
