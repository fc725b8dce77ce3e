"""vLLM's server-wide --stream-interval N: streams of every endpoint send a chunk once a completion has N
new tokens (its first and last at once); a request's own stream_interval may raise it, never lower it
(vLLM clamps it to the engine's); it reaches every API server of --api-server-count; a value below 1
is a one-line usage error naming the flag. And the streams it shapes, abused: their concatenation is
the answer the same request gets unstreamed."""
from __future__ import annotations

import json
import os
import re
import socket
import sys

import httpx
import pytest
from test_abuse29_cli import one_line
from test_abuse28_cli import started  # noqa: F401 - serve's run_server stubbed, as a fixture
from core_hooks import install
from test_cli import STORIES, needs_stories, run_main
from test_server_failure import _serve
from test_server_helpers import STEP_PACE_S, call_utility, chat_model_dir, running_server, sse_events, wait_for

from minillm.outputs import CompletionOutput, RequestOutput
from minillm.server.app import ServerOptions
from minillm.server.serving import due_output

SERVER_INTERVAL = 3
MESSAGES = [{"role": "user", "content": "Once upon"}]


@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    """(url, engine): stories260K with a chat template and --stream-interval 3, on the CPU."""
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    options = ServerOptions(stream_interval=SERVER_INTERVAL)
    # a token budget of 48 splits a long prompt's prefills, so that n > 1 completions start steps apart
    with running_server(model, options=options, max_model_len=256, max_num_batched_tokens=48,
                        core_hook=install) as running:
        yield running


def stream_chunks(url: str, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a stream (up to [DONE], which must end it)."""
    with httpx.stream("POST", f"{url}{path}", json={"model": "stories", **body, "stream": True},
                      timeout=60) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return sse_events(lines)


def token_counts(chunks: list[dict], index: int = 0) -> list[int]:
    """A choice's token counts, chunk by chunk (the chunks that carry tokens)."""
    return [len(c["token_ids"]) for chunk in chunks for c in chunk["choices"]
            if c["index"] == index and c.get("token_ids")]


def assert_held_to(counts: list[int], interval: int, total: int) -> None:
    """Every chunk between a choice's first and last carries at least interval tokens (a loaded server may
    send fewer, larger chunks, even one: a stream's outputs coalesce while its reader is behind)."""
    assert sum(counts) == total, counts
    assert all(n >= interval for n in counts[1:-1]), counts
    assert len(counts) <= 2 + (total - 2) // interval, counts


# ---- the flag ----------------------------------------------------------------------------------------------

@needs_stories
@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_a_stream_interval_below_one_is_a_one_line_usage_error_naming_the_flag(capsys, started, value):  # noqa: F811
    status, out, err = run_main(capsys, "serve", str(STORIES), "--device", "cpu", "--port", "0",
                                "--stream-interval", value)
    assert (status, out, started) == (2, "", {})
    assert "'--stream-interval'" in one_line(err)


@needs_stories
def test_stream_interval_reaches_the_server_options(capsys, started):  # noqa: F811
    status, _, err = run_main(capsys, "serve", str(STORIES), "--device", "cpu", "--port", "0",
                              "--stream-interval", "4")
    assert status == 0, err
    assert started["options"].stream_interval == 4


def test_serve_help_shows_stream_interval(capsys):
    status, out, _ = run_main(capsys, "serve", "--help")
    assert status == 0 and "--stream-interval" in out and "buffer size" in " ".join(out.split())


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_server_options_refuse_a_stream_interval_below_one_naming_it(value):
    with pytest.raises(ValueError, match="^stream_interval must be an integer >= 1"):
        ServerOptions(stream_interval=value)


# ---- what it does, and how a request's field meets it -------------------------------------------------------

@pytest.mark.parametrize("request_interval, held", [(None, SERVER_INTERVAL), (1, SERVER_INTERVAL), (5, 5)],
                         ids=["server's", "lower-clamped-up", "higher-raises"])
def test_text_completion_streams_hold_the_larger_of_the_two_intervals(server, request_interval, held):
    url = server[0]
    body = {"prompt": "Once upon a time", "max_tokens": 13, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    if request_interval is not None:
        body["stream_interval"] = request_interval
    whole = httpx.post(f"{url}/v1/completions", json={"model": "stories", **body}, timeout=60).json()["choices"][0]
    chunks = stream_chunks(url, "/v1/completions", body)
    assert_held_to(token_counts(chunks), held, 13)
    assert "".join(c["text"] for chunk in chunks for c in chunk["choices"]) == whole["text"]


def test_chat_streams_hold_the_servers_interval(server):
    url = server[0]
    body = {"messages": MESSAGES, "max_tokens": 11, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    whole = httpx.post(f"{url}/v1/chat/completions", json={"model": "stories", **body}, timeout=60).json()
    chunks = stream_chunks(url, "/v1/chat/completions", body)
    assert_held_to(token_counts(chunks), SERVER_INTERVAL, 11)
    assert "".join(c["delta"].get("content") or "" for chunk in chunks for c in chunk["choices"]) == \
        whole["choices"][0]["message"]["content"]


def test_each_of_n_completions_is_held_to_the_interval_on_its_own(server):
    # vLLM holds each child request of n > 1 on its own. A completion that started a step later
    # (its prompt's prefill split by the token budget) made the others go out with it: choices 0
    # and 1 came in chunks of [1, 1, 3, 3, ...] tokens, the second sent with choice 2's first.
    url, engine = server
    body = {"prompt": "Once upon a time there was a little girl named Lily who liked to play in the park with "
                      "her dog", "max_tokens": 16, "n": 3, "temperature": 1, "seed": 3, "ignore_eos": True,
            "return_token_ids": True}
    call_utility(engine, "pace_steps", STEP_PACE_S)    # a reader that keeps up gets every step's output
    try:
        chunks = stream_chunks(url, "/v1/completions", body)
    finally:
        call_utility(engine, "pace_steps", 0)
    for index in range(3):
        assert_held_to(token_counts(chunks, index), SERVER_INTERVAL, 16)


def test_a_completion_that_starts_a_step_later_does_not_carry_the_others_out():
    # The same case, step by step (no server, no reader that may fall behind): completions 0 and 1
    # take a token a step from step 1, completion 2 from step 2; each is held to the interval alone.
    sent: dict[int, CompletionOutput] = {}
    counts: dict[int, list[int]] = {0: [], 1: [], 2: []}
    last = {0: 0, 1: 0, 2: 0}
    for step in range(1, 18):
        comps = [CompletionOutput(index=i, text="", token_ids=list(range(min(16, max(0, step - (i == 2))))),
                                  finish_reason="length" if step - (i == 2) >= 16 else None) for i in range(3)]
        out = due_output(RequestOutput("r", None, [1], None, comps, finished=all(c.finish_reason for c in comps)),
                         sent, SERVER_INTERVAL)
        for c in (out.outputs if out is not None else []):
            if len(c.token_ids) > last[c.index]:
                counts[c.index].append(len(c.token_ids) - last[c.index])
                last[c.index] = len(c.token_ids)
    for index in range(3):
        assert_held_to(counts[index], SERVER_INTERVAL, 16)


# ---- several API servers --------------------------------------------------------------------------------------

def serving_pid(client: socket.socket, pids: list[int]) -> int | None:
    """Which of pids holds the server end of a connected client socket (read from /proc); None while none does."""
    local_port, peer_port = client.getsockname()[1], client.getpeername()[1]
    for pid in pids:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                inodes.add(os.readlink(f"/proc/{pid}/fd/{fd}").removeprefix("socket:[").removesuffix("]"))
            except OSError:
                continue
        with open(f"/proc/{pid}/net/tcp") as table:
            for fields in (line.split() for line in list(table)[1:]):
                ports = int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16)
                if ports == (peer_port, local_port) and fields[9] in inodes:
                    return pid
    return None


def raw_stream(client: socket.socket, body: dict) -> list[dict]:
    """A streamed completion over an open connection (closed after it): its chunks."""
    data = json.dumps({"model": "stories", **body, "stream": True}).encode()
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
    received = b""
    while chunk := client.recv(65536):
        received += chunk
    client.close()
    head, _, rest = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), received
    lines = [line.split(b"\r\n")[-1].decode() for line in rest.split(b"\n") if b"data:" in line]
    return sse_events(line[line.index("data:"):] for line in lines)


def test_every_api_server_streams_with_the_servers_interval(stories_path, tmp_path):
    # The kernel spreads connections over the API servers (SO_REUSEPORT): connect until each has one.
    command = [sys.executable, "-m", "minillm.cli", "serve", str(stories_path), "--api-server-count", "2",
               "--stream-interval", "4"]
    with _serve(tmp_path, command) as (proc, url, log):
        pids = [int(pid) for pid in re.findall(r"API server \d+ in process (\d+)", log.read_text())]
        host, port = url.removeprefix("http://").rsplit(":", 1)
        body = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        served = {}
        for _ in range(64):
            client = socket.create_connection((host, int(port)), timeout=60)
            pid = wait_for(lambda: serving_pid(client, pids), timeout=30)
            if pid in served:
                client.close()
                continue
            served[pid] = token_counts(raw_stream(client, body))
            if len(served) == len(pids):
                break
        assert sorted(served) == sorted(pids), served
        for counts in served.values():
            assert_held_to(counts, 4, 10)
