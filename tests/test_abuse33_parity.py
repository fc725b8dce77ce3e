"""One request through the offline API (LLM.generate, LLMEngine.add_request, AsyncLLM) and through
/v1/completions behaves the same way: the same inputs are taken or refused on both sides, as vLLM
takes or refuses them."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from test_abuse25_serving import async_llm, config, thread_engine  # noqa: F401 - the engines, as fixtures
from test_server_helpers import openai_error, running_server

from minillm import SamplingParams

GREEDY = dict(temperature=0, max_tokens=2)


@pytest.fixture(scope="module")
def url(stories_path):
    """A stories260K server on the CPU with the context of the `llm` fixture (128 tokens)."""
    with running_server(stories_path, max_model_len=128) as running:
        yield running[0]


def complete(url: str, **fields) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "stories", **fields}, timeout=60)


# ---- truncate_prompt_tokens past the context ----------------------------------------------------------

def test_generate_refuses_truncate_prompt_tokens_past_the_context_by_name(llm):
    # The server refuses it (400 naming truncate_prompt_tokens), as vLLM's LLM.generate refuses it
    # (TokenizeParams: "cannot be greater than max_model_len"); the offline API took it.
    limit = llm.llm_engine.max_model_len
    with pytest.raises(ValueError, match=rf"^truncate_prompt_tokens must be at most max_model_len \({limit}\), "
                                         rf"or -1, got {limit + 1}$"):
        llm.generate("Once upon", SamplingParams(truncate_prompt_tokens=limit + 1, **GREEDY), use_tqdm=False)
    with pytest.raises(ValueError, match="^truncate_prompt_tokens must be at most max_model_len"):
        llm.llm_engine.add_request("past", "Once upon", SamplingParams(truncate_prompt_tokens=10**30, **GREEDY))
    assert not llm.llm_engine.has_unfinished_requests()
    [out] = llm.generate("Once upon", SamplingParams(truncate_prompt_tokens=limit, **GREEDY), use_tqdm=False)
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("engine_name", ["async_llm", "thread_engine"])
def test_async_engines_refuse_truncate_prompt_tokens_past_the_context_by_name(request, engine_name):
    engine = request.getfixturevalue(engine_name)
    limit = engine.max_model_len

    async def scenario():
        for keep in (limit + 1, 2**64, 10**30):
            with pytest.raises(ValueError, match=rf"^truncate_prompt_tokens must be at most max_model_len "
                                                 rf"\({limit}\), or -1, got"):
                await engine.add_request(f"{engine_name}-{keep}", "Once", SamplingParams(truncate_prompt_tokens=keep))
        stream = await engine.add_request(f"{engine_name}-ok", "Once",
                                          SamplingParams(truncate_prompt_tokens=limit, **GREEDY))
        return [out async for out, _ in stream][-1].outputs[0].finish_reason
    assert asyncio.run(scenario()) == "length"


# ---- truncate_prompt_tokens -1 -----------------------------------------------------------------------

def test_generate_says_what_truncate_prompt_tokens_minus_one_kept(llm):
    # Offline, -1 keeps max_model_len tokens (vLLM's LLM keeps them too, and its engine then refuses a
    # prompt that fills the context), where the server keeps max_model_len - max_tokens. The error only
    # said "prompt has 128 tokens, which leaves no room", of a prompt the caller had asked to be cut.
    limit = llm.llm_engine.max_model_len
    ids = [1] + [3 + (7 * i) % 400 for i in range(limit + 20)]
    with pytest.raises(ValueError, match=rf"^prompt has {limit} tokens, which leaves no room under max_model_len "
                                         rf"{limit}: truncate_prompt_tokens -1 keeps max_model_len tokens .*"
                                         rf"truncate_prompt_tokens=max_model_len - max_tokens"):
        llm.generate([ids], SamplingParams(truncate_prompt_tokens=-1, **GREEDY), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    [out] = llm.generate([ids], SamplingParams(truncate_prompt_tokens=limit - 2, **GREEDY), use_tqdm=False)
    assert out.prompt_token_ids == ids[-(limit - 2):] and len(out.outputs[0].token_ids) == 2


# ---- an empty string in a batch of prompts ------------------------------------------------------------

def test_a_batch_may_hold_an_empty_string_as_generate_takes_it(url, llm):
    # vLLM refuses a prompt that is "" (its validator), not "" in a list: that one is BOS alone, as
    # LLM.generate takes it. The server refused any empty string of a batch ("prompt must not be empty").
    prompts = ["Once upon", ""]
    want = [out.outputs[0].text for out in llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)]
    reply = complete(url, prompt=prompts, **GREEDY)
    assert reply.status_code == 200, reply.text
    assert [c["text"] for c in sorted(reply.json()["choices"], key=lambda c: c["index"])] == want
    assert reply.json()["usage"]["prompt_tokens"] == 3 + 1


@pytest.mark.parametrize("fields", [dict(prompt=""), dict(prompt=[]), dict(prompt=[[]]), dict(prompt=["a", []]),
                                    dict(prompt=["a", ""], add_special_tokens=False)],
                         ids=["empty-string", "empty-list", "empty-ids", "empty-ids-in-batch", "no-tokens"])
def test_prompts_of_no_tokens_are_still_refused(url, fields):
    openai_error(complete(url, **fields, **GREEDY), 400, "prompt")
