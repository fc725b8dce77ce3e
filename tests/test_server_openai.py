"""The server driven by the official openai client: completions and chat, streamed and not."""
from __future__ import annotations

import asyncio
import json
import os
import re
import socket

import pytest

openai = pytest.importorskip("openai")

from test_server_helpers import chat_model_dir, running_server  # noqa: E402

from minillm.server.app import port_socket  # noqa: E402
from minillm.tokenizer import Tokenizer  # noqa: E402

PROMPT = "Once upon a time"
MODEL = "stories"


@pytest.fixture(scope="module")
def model_dir(stories_path, tmp_path_factory):
    return chat_model_dir(stories_path, tmp_path_factory.mktemp("chat-model"))


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(model_dir, served_model_name=MODEL) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def golden(stories_path):
    return json.loads((stories_path / "reference.json").read_text())


def test_models_lists_the_served_name(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion_greedy_matches_reference_and_usage_counts(client, tok, golden):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(tok.encode(PROMPT)) == len(golden["prompt_ids"])
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert golden["greedy_from_bos_200_text"].startswith(PROMPT + choice.text)
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")


def test_completion_stream_equals_non_stream_with_usage_chunk(client):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_string_and_max_tokens(client, golden):
    full = golden["greedy_from_bos_200_text"][len(PROMPT):]
    stop = "little"                       # "..., there was a little girl"
    assert stop in full[:60]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[:full.index(stop)]
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[:full.index(stop)]
    short = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3


def test_stop_token_ids_and_sampling_knobs(client, golden):
    after_prompt = golden["greedy_from_bos_200_ids"][len(golden["prompt_ids"]):]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                    extra_body={"stop_token_ids": [after_prompt[1]]})
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and out.usage.completion_tokens == 2
    assert choice.model_extra["stop_reason"] == after_prompt[1]
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    # Each of these leaves only the argmax token, so sampling at temperature 1 must reproduce greedy.
    for knob in ({"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-6}):
        sampled = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=3,
                                            extra_body=knob).choices[0].text
        assert sampled == greedy, knob
    penalised = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                          presence_penalty=2.0, frequency_penalty=2.0,
                                          extra_body={"repetition_penalty": 2.0}).choices[0].text
    assert penalised != greedy


def test_logit_bias_through_the_openai_client(client, golden):
    after_prompt = golden["greedy_from_bos_200_ids"][len(golden["prompt_ids"]):]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0)
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                       logit_bias={str(after_prompt[0]): -100})
    assert banned.choices[0].text != plain.choices[0].text           # greedy's token is out of reach
    # +100 on one token: sampling at temperature 1 takes it whatever the seed, in both endpoints
    sample = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=1.0)
    forced = [client.completions.create(**sample, seed=seed, logit_bias={"300": 100}).choices[0].text
              for seed in (5, 6)]
    free = [client.completions.create(**sample, seed=seed).choices[0].text for seed in (5, 6)]
    assert forced[0] == forced[1] and forced != free
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=1.0, seed=7, logit_bias={"300": 100})
    assert chat.choices[0].message.content.strip() == forced[0].strip()


def test_n_and_seeded_sampling(client):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=1.0, n=2, seed=1234)
    first = client.completions.create(**args)
    again = client.completions.create(**args)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens == sum(
        len(c.logprobs.tokens) for c in client.completions.create(logprobs=0, **args).choices)
    other = client.completions.create(**{**args, "seed": 99})
    assert [c.text for c in other.choices] != [c.text for c in first.choices]


def test_stream_with_n_2_carries_both_choices(client):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, n=2, seed=5)
    whole = client.completions.create(**args)
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in client.completions.create(stream=True, **args):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
    assert finishes == {c.index: c.finish_reason for c in whole.choices}


def test_batch_prompts_and_token_id_prompts(client, tok, golden):
    ids = golden["prompt_ids"]
    out = client.completions.create(model=MODEL, prompt=[PROMPT, "The dog"], max_tokens=5, temperature=0, n=2,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text != out.choices[2].text
    assert out.usage.prompt_tokens == len(ids) + len(tok.encode("The dog"))
    assert out.usage.completion_tokens == 4 * 5
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == out.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_completion_logprobs_and_echo(client, tok):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                    echo=True, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT)
    # With echo the prompt's tokens come first (OpenAI's legacy shape): the first has no logprob.
    num_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == num_prompt + 8
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # The 3 most likely, and the chosen (here: prompt) token where it is not among them.
    assert all(v <= 0 and 3 <= len(top) <= 4 and top[t] == v
               for t, v, top in zip(lp.tokens[1:num_prompt], lp.token_logprobs[1:num_prompt], lp.top_logprobs[1:]))
    assert "".join(lp.tokens[num_prompt:]) == choice.text[len(PROMPT):]
    assert lp.text_offset[num_prompt] == len(PROMPT) and lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens[num_prompt:], lp.token_logprobs[num_prompt:],
                                   lp.top_logprobs[num_prompt:]):
        assert len(top) <= 4 and logprob <= 0
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5)   # greedy picks the argmax
        assert token in top


def test_chat_completion_and_stream(client, tok):
    messages = [{"role": "user", "content": "Tell me a story."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16,
                                         temperature=0, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert out.usage.prompt_tokens == len(rendered)
    assert out.usage.completion_tokens == 16 and choice.finish_reason == "length"
    assert choice.message.role == "assistant" and choice.message.content
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.prompt_tokens == len(rendered) and chunks[-1].usage.completion_tokens == 16


def test_chat_logprobs_n_and_stop(client):
    messages = [{"role": "user", "content": "Hi"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0.8, n=2,
                                         seed=7, logprobs=True, top_logprobs=2)
    assert len(out.choices) == 2
    for choice in out.choices:
        content = choice.logprobs.content
        assert 1 <= len(content) <= 6
        assert all(len(item.top_logprobs) <= 2 and item.bytes == list(item.token.encode()) for item in content)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0.8, n=2,
                                           seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]
    greedy = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    word = greedy.choices[0].message.content.split()[2]
    stopped = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                             stop=[word])
    assert stopped.choices[0].finish_reason == "stop"
    assert word not in stopped.choices[0].message.content


def _server_end(client_sock: socket.socket) -> socket.socket:
    """The server's end of a connection to a server running in this process (found among our fds)."""
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue                                     # not a socket (or already closed)
        try:
            if sock.family == client_sock.family and sock.getpeername() == client_sock.getsockname():
                return sock
        except OSError:
            pass
        sock.close()
    raise AssertionError("no server end found")


def test_keep_alive_responses_go_out_at_once(server):
    """Connections have TCP_NODELAY: without it Nagle holds each response after the first on a
    keep-alive connection until the client's delayed ACK, about 40 ms a request."""
    host, port = server[0].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        for _ in range(2):
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            response = b""
            while b"\r\n\r\n" not in response:
                response += conn.recv(65536)
            head, body = response.split(b"\r\n\r\n", 1)
            length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
            while len(body) < length:
                body += conn.recv(65536)
            assert head.startswith(b"HTTP/1.1 200") and len(body) == length
        with _server_end(conn) as end:
            assert end.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_several_api_servers_listen_on_a_socket_whose_connections_get_tcp_nodelay():
    """`serve --api-server-count N`: asyncio turns Nagle off on what a socket of port_socket accepts."""
    listening = port_socket("127.0.0.1", 0)

    async def nodelay_of_an_accepted_connection() -> int:
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()

        class Accept(asyncio.Protocol):
            def connection_made(self, transport):
                accepted.set_result(transport.get_extra_info("socket").getsockopt(
                    socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await loop.create_server(Accept, sock=listening)
        async with server:
            _, writer = await asyncio.open_connection(*listening.getsockname())
            try:
                return await asyncio.wait_for(accepted, 30)
            finally:
                writer.close()

    assert asyncio.run(nodelay_of_an_accepted_connection())


def test_completion_top_logprobs_hold_the_chosen_token_too():
    from minillm.server.logprobs import completion_logprobs
    rows = [("a", -0.1, [("a", -0.1), ("b", -2.0)], 0), ("c", -5.0, [("a", -0.2), ("b", -1.9)], 1),
            ("<s>", None, None, 2)]
    lp = completion_logprobs(rows)
    # OpenAI: "the API will always return the logprob of the sampled token, so there may be up to
    # logprobs+1 elements"
    assert lp["top_logprobs"] == [{"a": -0.1, "b": -2.0}, {"a": -0.2, "b": -1.9, "c": -5.0}, None]
