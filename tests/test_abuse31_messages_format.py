"""Anthropic's structured-outputs beta field on /v1/messages: output_format, as output_config.format."""
from __future__ import annotations

import json

from test_abuse30_server import MODEL, NAME_SCHEMA
from test_server_helpers import chat_template_server, story_streams  # noqa: F401 (the server and healthy fixtures)


def _body(**fields) -> dict:
    return {"model": MODEL, "max_tokens": 40, "temperature": 0, "messages": [{"role": "user", "content": "Name?"}],
            **fields}


def test_output_format_holds_the_reply_to_its_schema_as_output_config_format_does(http, healthy_stream):
    # The beta's output_format was logged as an unknown field and ignored: a 200 with free text.
    fmt = {"type": "json_schema", "schema": NAME_SCHEMA}
    beta = http.post("/v1/messages", json=_body(output_format=fmt)).json()
    ga = http.post("/v1/messages", json=_body(output_config={"format": fmt})).json()
    [block] = beta["content"]
    assert block["type"] == "text" and set(json.loads(block["text"])) == {"name"}, beta
    assert beta["content"] == ga["content"] and beta["stop_reason"] == "end_turn"


def test_output_format_errors_name_it(http, healthy_stream):
    def error(**fields) -> dict:
        response = http.post("/v1/messages", json=_body(max_tokens=4, **fields))
        assert response.status_code == 400, response.text
        return response.json()["error"]

    assert error(output_format={"type": "xml", "schema": {}})["param"] == "output_format.type"
    assert error(output_format={"type": "json_schema"})["param"] == "output_format.schema"
    bad_schema = error(output_format={"type": "json_schema", "schema": {"type": "bogus"}})
    assert bad_schema["param"] == "output_format.schema", bad_schema
    fmt = {"type": "json_schema", "schema": NAME_SCHEMA}
    assert error(output_format=fmt, output_config={"format": fmt})["param"] == "output_format"
    # the next request's errors name its own field again
    assert error(output_config={"format": {"type": "json_schema", "schema": {"type": "bogus"}}})["param"] \
        == "output_config.format.schema"
