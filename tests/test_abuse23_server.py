"""`minillm serve` under odd but legal requests, malformed HTTP, and signals, held to vLLM's server.

A real server on loopback with a chat template and max_model_len 256; each test that talks to it
runs with a healthy greedy stream in flight, and every such stream must end with the text of the
same request made alone.
"""
from __future__ import annotations

import json
import random
import signal
import socket
import sys
import threading

import httpx
import pytest
from test_abuse20_deploy import SLOW_LOAD_SERVE, Serve, Stream, serve_command
from test_abuse20_deploy import serve  # noqa: F401 (the fixture that starts `minillm serve` processes)
from test_server_helpers import CHAT_TEMPLATE, choice_texts, openai_error, sse_events
from test_server_helpers import chat_template_server, story_streams  # noqa: F401 (the server and healthy fixtures)

from minillm.server import json_body, serving_chat, serving_completion, serving_messages, serving_responses
from minillm.server import serving_tokenization
from minillm.server.app import ServerOptions, ServerThread, create_app
from minillm.server.protocol import DetokenizeRequest
from minillm.server.json_body import LARGE_BODY_BYTES
from minillm.server.serving_tokenization import decode_in_pieces

MODEL = "stories"
MAX_MODEL_LEN = 256          # the chat_template_server's


def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, **fields}


# ---- echo without generation of a prompt that fills the context -------------------------------

def _full_context_prompt(http) -> tuple[list[int], dict]:
    """A prompt of MAX_MODEL_LEN tokens whose last token is the greedy choice after the others, and
    what a one-token completion with echo says of it: its text, the last token's logprob and top."""
    head = [1] + [300, 301, 302] * ((MAX_MODEL_LEN - 2) // 3) + [300] * ((MAX_MODEL_LEN - 2) % 3)
    assert len(head) == MAX_MODEL_LEN - 1
    reply = http.post("/v1/completions", json=_completion(prompt=head, max_tokens=1, logprobs=2, echo=True,
                                                          return_token_ids=True))
    assert reply.status_code == 200, reply.text
    [choice] = reply.json()["choices"]
    return head + choice["token_ids"], {"text": choice["text"], "token_logprob": choice["logprobs"]["token_logprobs"][-1],
                                        "top": choice["logprobs"]["top_logprobs"][-1]}


def _same_logprobs(a: dict, b: dict) -> bool:
    """Two legacy logprobs objects alike: the same tokens and offsets, the numbers within float noise
    (a batch of other shape sums in another order)."""
    assert (a["tokens"], a["text_offset"]) == (b["tokens"], b["text_offset"])
    assert [x is None for x in a["token_logprobs"]] == [x is None for x in b["token_logprobs"]]
    for x, y in zip(a["token_logprobs"][1:], b["token_logprobs"][1:]):
        assert x == pytest.approx(y, abs=1e-4)
    for x, y in zip(a["top_logprobs"][1:], b["top_logprobs"][1:]):
        assert x == pytest.approx(y, abs=1e-4)
    return True


def test_echo_of_a_prompt_as_long_as_the_context_with_max_tokens_0_is_served_as_in_vllm(http, healthy_stream):
    # vLLM takes echo with max_tokens 0 for a prompt of max_model_len tokens (it fits, and nothing is
    # generated); it was a 400 here, the engine keeping room for a token a prompt.
    prompt, last = _full_context_prompt(http)
    text = last["text"]
    body = _completion(prompt=prompt, max_tokens=0, echo=True)
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    [choice] = reply.json()["choices"]
    assert (choice["text"], choice["finish_reason"], choice["logprobs"]) == (text, "length", None)
    assert reply.json()["usage"] == {"prompt_tokens": MAX_MODEL_LEN, "completion_tokens": 0,
                                     "total_tokens": MAX_MODEL_LEN, "prompt_tokens_details": None,
                                     "completion_tokens_details": None}
    # Scored: each prompt token, its last one as the model scores it after the others.
    reply = http.post("/v1/completions", json={**body, "logprobs": 2, "n": 2})
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1] and _same_logprobs(choices[0]["logprobs"], choices[1]["logprobs"])
    logprobs = choices[0]["logprobs"]
    assert len(logprobs["tokens"]) == MAX_MODEL_LEN and logprobs["token_logprobs"][0] is None
    assert logprobs["token_logprobs"][-1] == pytest.approx(last["token_logprob"], abs=1e-4)
    assert logprobs["top_logprobs"][-1] == pytest.approx(last["top"], abs=1e-4)
    # The same in a stream, and vLLM's prompt_logprobs and token ids.
    reply = http.post("/v1/completions", json={**body, "logprobs": 2, "stream": True})
    [chunk] = sse_events(reply.text.splitlines())
    assert chunk["choices"][0]["text"] == text and _same_logprobs(chunk["choices"][0]["logprobs"], logprobs)
    reply = http.post("/v1/completions", json={**body, "prompt_logprobs": 1, "return_token_ids": True})
    [choice] = reply.json()["choices"]
    assert choice["prompt_token_ids"] == prompt and choice["token_ids"] == []
    assert len(choice["prompt_logprobs"]) == MAX_MODEL_LEN
    assert choice["prompt_logprobs"][-1][str(prompt[-1])]["logprob"] == pytest.approx(last["token_logprob"], abs=1e-4)
    # One token more does not fit; nor does a completion after a full context.
    openai_error(http.post("/v1/completions", json={**body, "prompt": prompt + [300]}), 400, "prompt")
    openai_error(http.post("/v1/completions", json={**body, "max_tokens": 1}), 400, "prompt")
    openai_error(http.post("/v1/completions", json={**body, "echo": False}), 400, "max_tokens")


# ---- bytes that are not HTTP --------------------------------------------------------------------

@pytest.fixture(scope="module", params=["httptools", "h11"])
def any_protocol_url(request, server):
    """(protocol, url): the module's server (httptools) and a second one over the same engine
    speaking through h11."""
    if request.param == "httptools":
        yield request.param, server[0]
        return
    app = create_app(server[1], ServerOptions(served_model_name=MODEL, chat_template=CHAT_TEMPLATE))
    with ServerThread(app, http="h11") as h11_server:
        yield request.param, h11_server.url


def _exchange(url: str, data: bytes) -> bytes:
    """Send data on a fresh connection and read until the server closes it."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def _responses(raw: bytes) -> list[tuple[int, dict, bytes]]:
    """(status, headers, body) of each HTTP/1.1 response in raw, bodies by Content-Length or chunked."""
    out = []
    while raw:
        head, _, raw = raw.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        if "content-length" in headers:
            size = int(headers["content-length"])
            body, raw = raw[:size], raw[size:]
        else:                                    # chunked
            body = b""
            while True:
                size_line, _, raw = raw.partition(b"\r\n")
                size = int(size_line, 16)
                body, raw = body + raw[:size], raw[size + 2:]
                if size == 0:
                    break
        out.append((int(status_line.split()[1]), headers, body))
    return out


def _invalid_http_error(response: tuple[int, dict, bytes]) -> dict:
    status, headers, body = response
    assert status == 400 and headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] is None
    assert error["code"] == "invalid_http_request" and error["type"] == "invalid_request_error"
    assert error["message"].startswith("Invalid HTTP request")
    return error


MALFORMED = {
    "request line": b"GARBAGE\r\n\r\n",
    "header without a colon": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
    "chunk size": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\nabc\r\n",
    "content length": b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{"a":1}',
    "http version": b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n",
    "headers too large": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n",
}


@pytest.mark.parametrize("kind", MALFORMED)
def test_bytes_that_are_not_http_get_a_json_400(any_protocol_url, healthy_stream, kind):
    # uvicorn answers them itself, in plain text ("Invalid HTTP request received."): an OpenAI client
    # reading the error's JSON got none.
    protocol, url = any_protocol_url
    if kind == "http version" and protocol == "h11":
        pytest.skip("h11 takes any HTTP/1.x-looking version")
    [response] = _responses(_exchange(url, MALFORMED[kind]))
    _invalid_http_error(response)


def test_a_400_for_bad_bytes_follows_the_responses_due_before_it(any_protocol_url, healthy_stream):
    # Requests pipelined before the bad bytes get their answers first, whole; uvicorn (httptools)
    # wrote its 400 over them and closed, so the request before it had no answer at all.
    _, url = any_protocol_url
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    models = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    first, second, third = _responses(_exchange(url, health + models + b"GARBAGE\r\n\r\n"))
    assert first[0] == 200 and json.loads(first[2]) == {"status": "ok"}
    assert second[0] == 200 and json.loads(second[2])["data"][0]["id"] == MODEL
    _invalid_http_error(third)
    body = json.dumps(_completion(max_tokens=5, stream=True)).encode()
    stream = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    events, error = _responses(_exchange(url, stream + b"GET / HTTP/1.1\r\nBad Header\r\n\r\n"))
    assert events[0] == 200 and events[2].rstrip().endswith(b"data: [DONE]")
    want = httpx.post(f"{url}/v1/completions", json=_completion(max_tokens=5)).json()["choices"][0]["text"]
    assert choice_texts(sse_events(events[2].decode().splitlines())) == {0: want}
    _invalid_http_error(error)


# ---- start-up and signals ------------------------------------------------------------------------

# SLOW_LOAD_SERVE that also names the port it holds while the model loads: started on port 0, as a
# port picked by binding 0 and closing could be any connection's local port before the server binds it.
PORT_SHOWN_SLOW_SERVE = SLOW_LOAD_SERVE.replace("\nif __name__", """
import minillm.server.app
real_hold_port = minillm.server.app.hold_port

def shown_hold_port(host, port):
    sock = real_hold_port(host, port)
    print(f"minillm-test: holding port {sock.getsockname()[1]}", file=sys.stderr, flush=True)
    return sock

minillm.server.app.hold_port = shown_hold_port
\nif __name__""", 1)


def _slow_serve(serve, tmp_path, model, *args: str, script_text: str = SLOW_LOAD_SERVE):
    """A `minillm serve` whose model load waits for the file `go` (test_abuse20_deploy's script); it
    and `go`, once the load has begun."""
    script, go = tmp_path / "slow_serve.py", tmp_path / "go"
    script.write_text(script_text)
    server = serve([sys.executable, str(script), str(go), *serve_command(model, *args)[3:]])
    server.wait_line(r"minillm-test: loading in process \d+")
    return server, go


def test_the_port_is_held_while_the_model_loads_as_vllm_holds_it(serve, tmp_path, stories_path):
    # The port was checked, closed again and bound only once the model had loaded: a second server
    # started meanwhile passed the check, loaded its model too, and one of them failed at the end.
    first, go = _slow_serve(serve, tmp_path, stories_path, script_text=PORT_SHOWN_SLOW_SERVE)
    port = int(first.wait_line(r"minillm-test: holding port (\d+)").group(1))
    with pytest.raises(ConnectionRefusedError):        # bound, not listening yet: as vLLM's
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
    (tmp_path / "second").mkdir()
    second = Serve(serve_command(stories_path, "--port", str(port)), tmp_path / "second")
    try:
        assert second.proc.wait(timeout=60) == 1
    finally:
        second.stop()
    assert f"cannot listen on 127.0.0.1:{port}" in second.text() and "loading" not in second.text(), second.text()
    go.touch()
    url = first.wait_line(r"Uvicorn running on (http://\S+)").group(1)
    assert url == f"http://127.0.0.1:{port}" and httpx.get(f"{url}/health", timeout=10).status_code == 200
    first.proc.send_signal(signal.SIGTERM)
    assert first.proc.wait(timeout=60) == 0, first.text()


def test_a_second_ctrl_c_while_the_model_loads_exits_quietly_with_130(serve, tmp_path, stories_path):
    # The second came while the process stopped (the interpreter's teardown among it): it died by
    # SIGINT (status -2). Whenever the second lands, the exit is the first's.
    server, go = _slow_serve(serve, tmp_path, stories_path)
    server.proc.send_signal(signal.SIGINT)
    server.proc.send_signal(signal.SIGINT)
    status = server.proc.wait(timeout=60)
    go.touch()
    assert status == 130 and server.text().splitlines()[-1] == "minillm: interrupted", server.text()
    assert "Traceback" not in server.text()


def test_a_second_ctrl_c_while_serving_stops_quietly_with_0(serve, stories_path):
    # uvicorn raised the signal again once per Ctrl-C after its shutdown, and the forced exit left
    # the app's shutdown cancelled: the second came out as a traceback of the lifespan task.
    server = serve(serve_command(stories_path))
    url = server.wait_line(r"Uvicorn running on (http://\S+)").group(1)
    stream = Stream(url)
    assert stream.first.wait(60), server.text()
    server.proc.send_signal(signal.SIGINT)
    server.wait_line(r"Shutting down")
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(timeout=60) == 0, server.text()
    assert "Traceback" not in server.text() and "ERROR" not in server.text(), server.text()
    stream.join(30)      # ended, whole or with the engine's shutdown error, never cut
    assert not stream.is_alive() and stream.lines[-2:] == ["data: [DONE]", ""], stream.lines[-3:]
    assert server.leftovers() == []


# ---- tokenization off the event loop -------------------------------------------------------------

class Held:
    """Wraps a callable so that its calls whose first argument is large wait for release() (and
    say so through `entered`): what runs on the event loop then stalls every other request."""

    def __init__(self, fn, is_large) -> None:
        self.fn, self.is_large = fn, is_large
        self.entered, self.released = threading.Event(), threading.Event()

    def __call__(self, *args, **kwargs):
        if args and self.is_large(args[0]):
            self.entered.set()
            assert self.released.wait(60), "never released"
        return self.fn(*args, **kwargs)


def _served_while_held(http, held: Held, post, what: str):
    """Start post() (a large request) on a thread; once it is held inside `held`, /health and a
    completion must answer; then release it and return its response."""
    result = {}
    request = threading.Thread(target=lambda: result.update(response=post()))
    request.start()
    try:
        assert held.entered.wait(60), what
        assert http.get("/health", timeout=10).status_code == 200
        assert http.post("/v1/completions", json=_completion(), timeout=10).status_code == 200
    finally:
        held.released.set()
        request.join(120)
    return result["response"]


def _is_long(value) -> bool:
    return len(value) > 10_000 if isinstance(value, (list, str)) else False


def _many_ids(body) -> bool:
    return isinstance(body, dict) and _is_long(body.get("tokens")) or _is_long(body)


IDS = [1] + [300, 301, 302] * 40_000
HELD = {   # what a large request spends its time in, and the request
    "detokenize: validating the ids": (DetokenizeRequest, "model_validate", _many_ids, "/detokenize", {"tokens": IDS}),
    "detokenize: decoding": (None, "decode", _is_long, "/detokenize", {"tokens": IDS}),
    "detokenize: writing the JSON": (serving_tokenization, "json_dumps", lambda obj: _is_long(obj.get("prompt")),
                                     "/detokenize", {"tokens": IDS}),
    "tokenize: encoding": (None, "encode_batch", lambda texts: _is_long(texts[0]), "/tokenize",
                           {"prompt": "Once upon a time " * 40_000}),
    "tokenize: writing the JSON": (serving_tokenization, "json_dumps", lambda obj: _is_long(obj.get("tokens")),
                                   "/tokenize", {"prompt": "Once upon a time " * 40_000, "return_token_strs": True}),
}


@pytest.mark.parametrize("stage", HELD)
def test_a_large_tokenization_request_leaves_the_event_loop_serving(server, http, healthy_stream, monkeypatch, stage):
    # /detokenize validated its ids on the event loop and the tokenizer decoded two million of them
    # holding the GIL (about a second, every stream and /health stalled meanwhile); /tokenize wrote
    # its response's JSON there. Each stage is held here until /health and a completion have answered.
    owner, name, is_large, path, body = HELD[stage]
    owner = server[1].tokenizer if owner is None else owner
    held = Held(getattr(owner, name), is_large)
    monkeypatch.setattr(owner, name, held)
    response = _served_while_held(http, held, lambda: httpx.post(f"{server[0]}{path}", json=body, timeout=120),
                                  "the request never reached the held stage")
    assert response.status_code == 200 and response.headers["content-type"] == "application/json", response.text[:300]
    if path == "/detokenize":
        assert response.json() == {"prompt": server[1].tokenizer.decode(IDS, skip_special_tokens=False)}
    else:
        reply = response.json()
        assert reply["count"] == len(reply["tokens"]) == len(reply["token_strs"] or reply["tokens"]) > 10_000


def test_decoding_in_pieces_is_one_decode(server, monkeypatch):
    # Pieces are decoded after a few ids of context; random ids, byte tokens among them (characters
    # cut across pieces), give the text of one decode.
    tok = server[1].tokenizer
    monkeypatch.setattr(serving_tokenization, "DECODE_PIECE_IDS", 40)
    rng = random.Random(23)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) if rng.random() < 0.5 else rng.randrange(3, 259)
               for _ in range(rng.randint(1, 300))]
        for skip in (False, True):
            assert decode_in_pieces(tok, ids, skip) == tok.decode(ids, skip_special_tokens=skip)


def test_detokenize_hands_the_tokenizer_a_piece_at_a_time(server, http, monkeypatch):
    # The tokenizer holds the GIL through one decode, so off the event loop a decode of millions of
    # ids still stalled it; in pieces the loop gets the GIL between them.
    tok = server[1].tokenizer
    sizes = []
    decode = tok.decode

    def recorded(ids, **kwargs):
        sizes.append(len(ids))
        return decode(ids, **kwargs)

    monkeypatch.setattr(tok, "decode", recorded)
    reply = http.post("/detokenize", json={"tokens": IDS})
    monkeypatch.undo()
    assert reply.status_code == 200 and reply.json()["prompt"] == tok.decode(IDS, skip_special_tokens=False)
    limit = serving_tokenization.DECODE_PIECE_IDS + serving_tokenization.PIECE_CONTEXT_IDS
    assert max(sizes) <= limit and sum(sizes) >= len(IDS)


# ---- JSON bodies off the event loop ----------------------------------------------------------------

CONVERSATION = {"model": MODEL, "messages": [{"role": "user", "content": "Tom had a red ball."}], "max_tokens": 4,
                "temperature": 0}
LARGE_BODIES = {   # a request, and where its reply's text is
    "/v1/completions": (_completion(), lambda reply: reply["choices"][0]["text"]),
    "/v1/chat/completions": (CONVERSATION, lambda reply: reply["choices"][0]["message"]["content"]),
    "/v1/messages": (CONVERSATION, lambda reply: reply["content"][0]["text"]),
}


def _padded(body: dict) -> bytes:
    """body as JSON past LARGE_BODY_BYTES: the same request, padded with JSON whitespace."""
    return json.dumps(body).encode() + b" " * (LARGE_BODY_BYTES + 1)


@pytest.mark.parametrize("path", LARGE_BODIES)
def test_a_large_body_is_parsed_while_the_event_loop_serves(server, http, healthy_stream, monkeypatch, path):
    # FastAPI parsed every body on the event loop (10-12 ms per MB of token ids or messages, during
    # which no stream and no /health was served). The parse of a large body is held here until
    # /health and a completion have answered.
    body, reply_text = LARGE_BODIES[path]
    alone = http.post(path, json=body)
    assert alone.status_code == 200, alone.text
    held = Held(json_body.loads_yielding, lambda content: len(content) > LARGE_BODY_BYTES)
    monkeypatch.setattr(json_body, "loads_yielding", held)
    response = _served_while_held(http, held, lambda: httpx.post(
        f"{server[0]}{path}", content=_padded(body), headers={"content-type": "application/json"}, timeout=120),
        "the large body was never parsed on a thread")
    assert response.status_code == 200, response.text[:300]
    assert reply_text(response.json()) == reply_text(alone.json())


MANY_MESSAGES = [{"role": "user", "content": "hi"}] * 12_000
WALKED = {   # what of a large request walks every message or token id, what is held there, and the request
    "chat: its unknown fields": (serving_chat, "unknown_fields", lambda req: _is_long(req.messages),
                                 "/v1/chat/completions", {**CONVERSATION, "messages": MANY_MESSAGES}),
    "responses: its chat request": (serving_responses, "chat_body", lambda req: _is_long(req.input), "/v1/responses",
                                    {"model": MODEL, "input": MANY_MESSAGES, "max_output_tokens": 4}),
    "messages: its chat request": (serving_messages, "chat_body", lambda req: _is_long(req.messages), "/v1/messages",
                                   {**CONVERSATION, "messages": MANY_MESSAGES}),
    "completions: its token ids": (serving_completion, "truncate_prompt", _is_long, "/v1/completions",
                                   _completion(prompt=IDS, truncate_prompt_tokens=8)),
}


def _reply(response: httpx.Response) -> tuple[int, object]:
    """A reply's status and what it says: its error, or its completion's text."""
    body = response.json()
    return response.status_code, body.get("error") or body["choices"][0]["text"]


@pytest.mark.parametrize("stage", WALKED)
def test_a_large_request_is_walked_while_the_event_loop_serves(server, http, healthy_stream, monkeypatch, stage):
    # A chat request's unknown fields were looked for in each of its messages on the event loop (110 ms
    # of a 10 MB body), a Responses or Messages request became a chat request and was validated there
    # (1.5-2.5 s), and a completion's token ids were copied there (5-25 ms). Each is held here until
    # /health and a completion have answered.
    owner, name, is_large, path, body = WALKED[stage]
    assert len(json.dumps(body)) > LARGE_BODY_BYTES
    alone = http.post(path, json=body)
    held = Held(getattr(owner, name), is_large)
    monkeypatch.setattr(owner, name, held)
    response = _served_while_held(http, held, lambda: httpx.post(f"{server[0]}{path}", json=body, timeout=120),
                                  "the request never reached the held stage")
    assert _reply(response) == _reply(alone), alone.text[:300]


UNPARSED = {   # bodies the JSON parser refuses, as the start of a large body
    "bad syntax": b'{"model": "stories",' + b" " * LARGE_BODY_BYTES + b"}",
    "not UTF-8": b'{"model": "caf\xe9", "pad": "' + b"x" * LARGE_BODY_BYTES + b'"}',
    "a number too long": b'{"max_tokens": ' + b"9" * 5000 + b', "pad": "' + b"x" * LARGE_BODY_BYTES + b'"}',
    "nested too deeply": b'{"x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    "not an object": b"[" + b" " * LARGE_BODY_BYTES + b"1]",
}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages"])
@pytest.mark.parametrize("case", UNPARSED)
def test_a_large_body_that_does_not_parse_gets_the_error_it_got_on_the_event_loop(http, monkeypatch, path, case):
    content = UNPARSED[case]
    assert len(content) > LARGE_BODY_BYTES

    def post():
        return http.post(path, content=content, headers={"content-type": "application/json"})

    on_thread = post()
    monkeypatch.setattr(json_body, "LARGE_BODY_BYTES", len(content))     # parsed on the event loop
    on_loop = post()
    assert on_thread.status_code == on_loop.status_code == 400
    assert on_thread.json() == on_loop.json()
    error = on_thread.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
