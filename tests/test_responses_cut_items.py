"""/v1/responses cut by max_output_tokens: the response is "incomplete", and so is the item that was
cut (OpenAI marks it so; the message item said "completed")."""
from __future__ import annotations

import json

import httpx
import pytest
from test_server_helpers import running_server

from minillm.server.app import ServerOptions

TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def url(stories_path):
    with running_server(stories_path, max_model_len=256, options=ServerOptions(chat_template=TEMPLATE)) as (base, _):
        yield base


def streamed(url: str, body: dict) -> list[dict]:
    """The events of a streamed response."""
    with httpx.stream("POST", f"{url}/v1/responses", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        return [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]


def test_the_cut_message_item_is_incomplete_whole_and_streamed(url):
    body, status = {"input": "Lily", "max_output_tokens": 3, "temperature": 0}, "incomplete"
    whole = httpx.post(f"{url}/v1/responses", json=body, timeout=60).json()
    assert whole["status"] == status
    [item] = whole["output"]
    assert item["type"] == "message" and item["status"] == status
    events = streamed(url, body)
    [done] = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done["status"] == status and done["content"][0]["text"] == item["content"][0]["text"]
    assert events[-1]["type"] == f"response.{status}"
    assert [i["status"] for i in events[-1]["response"]["output"]] == [status]


def test_an_item_that_ended_is_completed(url):
    body = {"input": "Lily", "max_output_tokens": 20, "temperature": 0, "stop": ["Tom"]}    # vLLM's stop
    whole = httpx.post(f"{url}/v1/responses", json=body, timeout=60).json()
    assert whole["status"] == "completed" and [i["status"] for i in whole["output"]] == ["completed"]
    events = streamed(url, body)
    assert [e["item"]["status"] for e in events if e["type"] == "response.output_item.done"] == ["completed"]
    assert events[-1]["type"] == "response.completed"
