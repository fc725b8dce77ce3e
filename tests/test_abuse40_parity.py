"""Where minillm followed an older vLLM or answered otherwise than vLLM: LLM(task=None) (vLLM's task is
deprecated, default None) and LLM(convert=...); a beam search for max_tokens 0 (vLLM's runs no step and
answers each prompt's one beam, the prompt alone: offline, and on the server's completions and chat);
and the router's own /health, which now keeps the router's view of each server (a down server whose
/health answers 200 is up again; an up one that refuses the connection is down for its backoff)."""
from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from test_abuse40_router import Server, router_client  # noqa: E402
from test_server_helpers import chat_model_dir, running_server  # noqa: E402

from minillm import LLM  # noqa: E402
from minillm.engine_args import EngineArgs  # noqa: E402
from minillm.llm import engine_config  # noqa: E402
from minillm.router import RouterConfig  # noqa: E402
from minillm.sampling_params import BeamSearchParams  # noqa: E402

MODEL = "stories"
BEAM = {"use_beam_search": True}


# ---- LLM(task=None): vLLM's current default -------------------------------------------------------------

@pytest.mark.parametrize("args", [dict(task=None), dict(task="auto"), dict(runner="auto", convert="auto"),
                                  dict(convert="none"), dict(task=None, runner="generate")])
def test_vllms_defaults_of_task_runner_and_convert_are_taken(stories_path, args):
    # task=None was "ValueError: task=None is not supported"; convert was an unexpected keyword (TypeError).
    assert engine_config(stories_path, args).model == stories_path


@pytest.mark.parametrize("args, field", [(dict(task="embed"), "task"), (dict(runner=None), "runner"),
                                         (dict(runner="pooling"), "runner"), (dict(convert="embed"), "convert")])
def test_what_vllm_or_minillm_cannot_run_is_a_value_error_naming_the_field(stories_path, args, field):
    with pytest.raises(ValueError, match=f"^{field}="):
        engine_config(stories_path, args)


def test_engine_args_default_task_is_vllms_none_and_builds(stories_path):
    args = EngineArgs(model=str(stories_path), device="cpu")
    assert args.task is None and args.convert == "auto"
    assert args.create_engine_config().model == str(stories_path)


def test_llm_with_task_none_generates(stories_path):
    with LLM(str(stories_path), task=None, device="cpu", max_model_len=64) as llm:
        [out] = llm.generate("Once", use_tqdm=False)
    assert out.outputs[0].token_ids


# ---- beam search for max_tokens 0 -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def offline(stories_path):
    with LLM(str(stories_path), device="cpu", max_model_len=64) as llm:
        yield llm


def test_offline_beam_search_for_no_token_is_the_prompts_one_beam(offline):
    # BeamSearchParams(max_tokens=0) was "ValueError: max_tokens must be an integer >= 1".
    tokenizer = offline.get_tokenizer()
    prompt_ids = tokenizer.encode("Once upon a time")
    outputs = offline.beam_search(["Once upon a time", {"prompt_token_ids": [tokenizer.eos_token_id]}],
                                  BeamSearchParams(beam_width=3, max_tokens=0))
    [beam] = outputs[0].sequences
    assert beam.tokens == prompt_ids and beam.logprobs == [] and beam.cum_logprob == 0.0
    assert beam.text == tokenizer.decode(prompt_ids) and beam.finish_reason == "length"
    [eos_alone] = outputs[1].sequences       # a prompt of EOS alone: its score divided by no token's length
    assert eos_alone.tokens == [tokenizer.eos_token_id] and eos_alone.logprobs == []


def test_beam_search_params_still_refuse_a_negative_max_tokens():
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 0"):
        BeamSearchParams(beam_width=2, max_tokens=-1)


@pytest.fixture(scope="module")
def client(stories_path, tmp_path_factory):
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("parity40_model"))
    with running_server(model, engine_core="thread", max_model_len=64) as (base, _):
        with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60) as c:
            yield c


def test_server_completions_beam_search_for_no_token_is_one_empty_choice_a_prompt(client):
    # It was a 400 naming max_tokens.
    got = client.completions.create(model=MODEL, prompt=["Once", "The dog"], n=3, max_tokens=0, temperature=0,
                                    extra_body={**BEAM, "return_token_ids": True})
    assert [(c.index, c.text, c.finish_reason, c.token_ids) for c in got.choices] == [
        (0, "", "length", []), (3, "", "length", [])]
    assert got.usage.completion_tokens == 0
    echoed = client.completions.create(model=MODEL, prompt="Once", n=2, max_tokens=0, echo=True, extra_body=BEAM)
    assert [(c.text, c.finish_reason) for c in echoed.choices] == [("Once", "length")]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_server_chat_beam_search_for_no_token_is_one_empty_choice(client, field):
    # Each was a 400 naming the field: SamplingParams take at least one token.
    got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                         temperature=0, extra_body={**BEAM, field: 0})
    assert [(c.index, c.message.content, c.finish_reason) for c in got.choices] == [(0, "", "length")]
    assert got.usage.completion_tokens == 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                                 stream=True, extra_body={**BEAM, field: 0}))
    finishes = [(c.index, c.finish_reason) for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert finishes == [(0, "length")]


def test_without_beam_search_max_tokens_0_is_still_a_400(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    assert raised.value.body["param"] == "max_tokens"


# ---- the router's /health and its view of each server ------------------------------------------------------

@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def servers():
    """Make Servers (test_abuse40_router's), listening or not; close them all after."""
    made = []

    def make(listening: bool = True) -> Server:
        made.append(Server())
        return made[-1].listen() if listening else made[-1]

    yield make
    for server in made:
        server.close()


@pytest.mark.anyio
async def test_router_health_brings_a_down_server_whose_health_answers_200_up(servers):
    live, revived = servers(), servers(listening=False)
    config = RouterConfig((live.url,), (revived.url, live.url), backoff_s=60, max_backoff_s=60)
    async with router_client(config) as (router, client):
        for _ in range(2):                  # one of the two tries the down server first: refused
            assert (await client.post("/v1/completions", json={"prompt": "Once"})).status_code == 200
        health = router.server_health[revived.url]
        assert not health.is_up and health.down_for_s() > 50
        revived.listen()
        answer = await client.get("/health")
        assert answer.status_code == 200
        decode = {entry["url"]: entry for entry in answer.json()["decode"]}
        assert decode[revived.url]["ok"] is True
        # It answered 200, so it is up: the router sends it requests again, not 60 s later. (It was
        # reported ok while every request passed it over for the rest of its backoff.)
        assert health.is_up
        for _ in range(2):
            assert (await client.post("/v1/completions", json={"prompt": "Once"})).status_code == 200
        assert ("POST", "/v1/completions") in revived.paths


@pytest.mark.anyio
async def test_router_health_puts_an_up_server_that_refuses_the_connection_down(servers):
    live, dead = servers(), servers(listening=False)
    config = RouterConfig((live.url,), (dead.url, live.url), backoff_s=60, max_backoff_s=60)
    async with router_client(config) as (router, client):
        health = router.server_health[dead.url]
        assert health.is_up                  # nothing has been sent to it yet
        answer = await client.get("/health")
        assert answer.status_code == 200     # the other decode server is up
        decode = {entry["url"]: entry for entry in answer.json()["decode"]}
        assert decode[dead.url] == {"url": dead.url, "ok": False, "error": "ConnectError"}
        # Down, as a request that found it so would have left it: no request pays its connect failure.
        assert not health.is_up and health.reason == "/health: ConnectError" and health.down_for_s() > 50
        for _ in range(3):
            assert (await client.post("/v1/completions", json={"prompt": "Once"})).status_code == 200
        assert not [url for url in router.sent if url.startswith(dead.url + "/v1/")]


@pytest.mark.anyio
async def test_router_health_probes_do_not_lengthen_a_down_servers_backoff(servers):
    live, dead = servers(), servers(listening=False)
    config = RouterConfig((live.url,), (dead.url, live.url), backoff_s=60, max_backoff_s=600)
    async with router_client(config) as (router, client):
        for _ in range(2):
            assert (await client.post("/v1/completions", json={"prompt": "Once"})).status_code == 200
        health = router.server_health[dead.url]
        down_until, num_down = health.down_until, health.num_down
        for _ in range(3):                   # a load balancer probing: the backoff is the requests' to set
            assert (await client.get("/health")).status_code == 200
        assert (health.down_until, health.num_down) == (down_until, num_down)
