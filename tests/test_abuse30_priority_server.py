"""vLLM's "priority" request field through the server, sent by the openai SDK as extra_body.

Under --scheduling-policy priority the engine serves requests by it (lower first), whichever
engine core runs it; under fcfs (the default) a non-zero priority is a 400 naming priority, as
vLLM answers. The order is read from the engine's running queue by a core hook, which also holds
the engine's steps until every request of a test waits: the test depends on no timing."""
import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from test_server_helpers import CHAT_TEMPLATE, call_utility, running_server

from minillm.server.app import ServerOptions

MODEL = "stories"
PRIORITIES = [3, -1, 2, 0]


def hold_and_record(engine) -> None:
    """core_hook: hold_steps_until_waiting(n) keeps the engine from stepping until n requests
    wait; admission_order() lists the prompts in the order their requests first ran."""
    real_step = engine.step
    state = {"hold": 0, "order": []}

    def step():
        if len(engine.scheduler.waiting) < state["hold"]:
            time.sleep(0.002)
            return []
        state["hold"] = 0
        outputs = real_step()
        for seq in engine.scheduler.running:
            if list(seq.prompt_token_ids) not in state["order"]:
                state["order"].append(list(seq.prompt_token_ids))
        return outputs

    def hold_steps_until_waiting(n):
        state["hold"], state["order"] = n, []

    def admission_order():
        return state["order"]

    engine.step = step
    engine.hold_steps_until_waiting = hold_steps_until_waiting
    engine.admission_order = admission_order


@pytest.fixture(scope="module")
def golden(stories_path):
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def fcfs_server(stories_path):
    with running_server(stories_path, max_model_len=128,
                        options=ServerOptions(chat_template=CHAT_TEMPLATE)) as (url, _):
        yield url


@pytest.fixture(scope="module")
def priority_server(stories_path):
    with running_server(stories_path, max_model_len=128, scheduling_policy="priority",
                        options=ServerOptions(chat_template=CHAT_TEMPLATE)) as (url, _):
        yield url


@pytest.mark.parametrize("engine_core", ["thread", "process"])
def test_requests_are_served_by_priority_and_answer_as_alone(stories_path, golden, engine_core):
    prompts = [golden[i:i + 6] for i in range(len(PRIORITIES))]
    with running_server(stories_path, max_model_len=128, scheduling_policy="priority", max_num_seqs=1,
                        engine_core=engine_core, core_hook=hold_and_record) as (url, engine):
        api = client(url)

        def complete(prompt, priority):
            return api.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                          extra_body={"priority": priority, "ignore_eos": True}).choices[0].text

        call_utility(engine, "hold_steps_until_waiting", len(prompts))
        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(complete, prompts, PRIORITIES))
        order = call_utility(engine, "admission_order")
        assert order == [prompts[i] for i in sorted(range(len(prompts)), key=PRIORITIES.__getitem__)]
        assert texts == [complete(prompt, 0) for prompt in prompts]     # each alone, one after the other


@pytest.mark.parametrize("priority", [5, -2])
def test_fcfs_refuses_a_non_zero_priority_naming_it(fcfs_server, priority):
    api = client(fcfs_server)
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    extra_body={"priority": priority})
    assert info.value.param == "priority" and "scheduling_policy 'fcfs'" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model=MODEL, prompt="Once", max_tokens=2, extra_body={"priority": priority})
    assert info.value.param == "priority"
    with pytest.raises(openai.BadRequestError) as info:
        api.responses.create(model=MODEL, input="Once", max_output_tokens=2, extra_body={"priority": priority})
    assert info.value.param == "priority"
    # 0 and null ask for nothing
    for value in (0, None):
        api.completions.create(model=MODEL, prompt="Once", max_tokens=2, extra_body={"priority": value})


def test_each_api_takes_a_priority_under_the_priority_policy(priority_server):
    api = client(priority_server)
    chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Once"}], max_tokens=3,
                                       temperature=0, extra_body={"priority": -7})
    assert chat.choices[0].finish_reason in ("stop", "length")
    completion = api.completions.create(model=MODEL, prompt="Once", max_tokens=3, temperature=0,
                                        extra_body={"priority": 9})
    assert completion.choices[0].text == api.completions.create(model=MODEL, prompt="Once", max_tokens=3,
                                                                temperature=0).choices[0].text
    response = api.responses.create(model=MODEL, input="Once", max_output_tokens=3, temperature=0,
                                    extra_body={"priority": 2})
    assert response.status in ("completed", "incomplete") and response.output
    stream = api.completions.create(model=MODEL, prompt="Once", max_tokens=3, temperature=0, stream=True,
                                    extra_body={"priority": 1})
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == completion.choices[0].text


@pytest.mark.parametrize("value", ["high", "1.5", 1.5, [1], 2 ** 63, -2 ** 63 - 1])
def test_a_bad_priority_is_a_400_naming_it(priority_server, value):
    api = client(priority_server)
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    extra_body={"priority": value})
    assert info.value.param == "priority", info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model=MODEL, prompt="Once", max_tokens=2, extra_body={"priority": value})
    assert info.value.param == "priority", info.value.message
