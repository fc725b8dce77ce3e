"""The OpenAI-compatible API as vLLM's clients meet it, checked against vLLM's request models: a count
of log-probabilities sent as text ("logprobs": "2") is a 400 naming the field, as vLLM's
check_logprobs refuses it (pydantic's lax reading made it the number). Raw HTTP: an HTTP/1.0 client
gets a stream without chunked encoding, its end where the connection closes (the httptools protocol
sent it chunk sizes in the text)."""
from __future__ import annotations

import json
import socket

import pytest
from test_server_helpers import chat_template_server, openai_error  # noqa: F401 (the server fixture)

USER = {"role": "user", "content": "Once upon"}
COMPLETION = {"model": "stories", "prompt": "Once upon", "max_tokens": 2, "temperature": 0}
CHAT = {"model": "stories", "messages": [USER], "max_tokens": 2, "temperature": 0}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {**COMPLETION, "logprobs": "2"}, "logprobs"),
    ("/v1/completions", {**COMPLETION, "prompt_logprobs": "1"}, "prompt_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": "2"}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "prompt_logprobs": "0"}, "prompt_logprobs"),
], ids=["completions_logprobs", "completions_prompt_logprobs", "chat_top_logprobs", "chat_prompt_logprobs"])
def test_a_logprobs_count_sent_as_text_is_a_400_naming_it(http, path, body, param):
    error = openai_error(http.post(path, json=body), 400, param)
    assert "must be an integer" in error["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {**COMPLETION, "logprobs": 2.0, "prompt_logprobs": 1}),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2.0, "prompt_logprobs": 0}),
], ids=["completions", "chat"])
def test_a_logprobs_count_sent_as_a_number_is_taken(http, path, body):
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    tops = logprobs["top_logprobs"] if path == "/v1/completions" else \
        [entry["top_logprobs"] for entry in logprobs["content"]]
    assert [len(top) for top in tops] == [2, 2]


def http_exchange(url: str, request: bytes) -> tuple[list[str], bytes]:
    """Send raw request bytes; read the answer until the server closes: (header lines, body as sent)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return head.decode("latin-1").split("\r\n"), body


def post_request(version: str, body: dict, close: bool = False) -> bytes:
    """The bytes of a POST /v1/completions of body in that HTTP version."""
    data = json.dumps(body).encode()
    connection = b"Connection: close\r\n" if close else b""
    return (b"POST /v1/completions " + version.encode() + b"\r\nHost: x\r\nContent-Type: application/json\r\n"
            + connection + b"Content-Length: %d\r\n\r\n" % len(data) + data)


def header(lines: list[str], name: str) -> str | None:
    """The value of a response header (name in lower case), or None."""
    return next((line.split(":", 1)[1].strip() for line in lines[1:] if line.lower().startswith(name + ":")), None)


def http_post_text(url: str, body: dict) -> str:
    """The first choice's text of a non-streamed HTTP/1.1 completion."""
    lines, raw = http_exchange(url, post_request("HTTP/1.1", body, close=True))
    assert lines[0].endswith("200 OK") and int(header(lines, "content-length")) == len(raw)
    return json.loads(raw)["choices"][0]["text"]


def test_an_http_1_0_stream_is_close_delimited_without_chunk_sizes(server):
    body = {**COMPLETION, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    lines, raw = http_exchange(server[0], post_request("HTTP/1.0", body))
    assert lines[0].endswith("200 OK") and header(lines, "transfer-encoding") is None
    assert header(lines, "connection") == "close"
    text = raw.decode()
    assert text.startswith("data: {") and text.endswith("data: [DONE]\n\n")
    events = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == \
        http_post_text(server[0], {**COMPLETION, "max_tokens": 4})
    assert events[-1]["usage"]["completion_tokens"] == 4


def test_http_1_0_errors_and_answers_keep_their_length_and_http_1_1_streams_stay_chunked(server):
    lines, raw = http_exchange(server[0], post_request("HTTP/1.0", COMPLETION))
    assert lines[0].endswith("200 OK") and int(header(lines, "content-length")) == len(raw)
    lines, raw = http_exchange(server[0], post_request("HTTP/1.0", {**COMPLETION, "logprobs": "2", "stream": True}))
    assert lines[0].endswith("400 Bad Request") and int(header(lines, "content-length")) == len(raw)
    assert json.loads(raw)["error"]["param"] == "logprobs"
    lines, raw = http_exchange(server[0], post_request("HTTP/1.1", {**COMPLETION, "stream": True}, close=True))
    assert header(lines, "transfer-encoding") == "chunked" and raw.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
