"""Parallel sampling (n > 1) where minillm differed from vLLM: which child's prefix-cache count a
request's output carries, and the order of a chat stream's opening chunks."""
from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from test_server_helpers import CHAT_TEMPLATE, running_server, sse_events

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.engine_core import messages as m
from minillm.engine_core.core import SAMPLING_FIELDS, EngineCore
from minillm.engine_core.output_processor import OutputProcessor
from minillm.sampling_params import RequestOutputKind
from minillm.server.app import ServerOptions

BLOCK = 16          # the engines' block size (EngineConfig's default)
RID = "parent"


@pytest.fixture(scope="module")
def golden(stories_path):
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


# ---- num_cached_tokens of an n > 1 request's outputs ---------------------------------------------------
# vLLM runs n children. Each has its own count (the first admitted none on a first run, its siblings
# the blocks it fills in the same step); ParentRequest.get_outputs makes the final output on the last
# child's output to finish, and that child's RequestState builds it: its count is the one reported
# (output_processor.py: _new_request_output). A stream reads its first output's (first_iteration).


class EngineDriver:
    """An LLMEngine that makes its own RequestOutputs."""

    def __init__(self, stories_path):
        self.engine = LLMEngine(EngineConfig(model=str(stories_path), device="cpu", max_model_len=64),
                                log=lambda _: None)

    def add(self, prompt, params):
        self.engine.add_request(RID, prompt, params)

    def step(self):
        return self.engine.step()


class CoreDriver:
    """An engine core sending token ids, and an API server's OutputProcessor making the RequestOutputs."""

    def __init__(self, stories_path):
        self.core = EngineCore(EngineConfig(model=str(stories_path), device="cpu", max_model_len=64),
                               log=lambda _: None)
        self.engine = self.core.engine
        self.processor = OutputProcessor(self.engine.tokenizer)

    def add(self, prompt, params):
        self.processor.add(RID, None, prompt, params, time.time(), handle=RID)
        fields = {name: getattr(params, name) for name in SAMPLING_FIELDS}
        assert self.core.add_request(m.AddRequest(RID, prompt, fields, time.time())) is None

    def step(self):
        return [out for _, out in self.processor.process(self.core.step(), time.time()).outputs]


def run_stopping_early(driver, prompt, params, stopped_first: tuple[int, ...]):
    """Run RID, ending the completions stopped_first (by a stop string) once every one has a token, the
    rest at max_tokens; (its outputs, each completion's own prefix-cache count)."""
    driver.add(prompt, params)
    outputs, seqs = [], driver.engine.requests[RID].seqs
    while not all(seq.output_token_ids for seq in seqs):
        outputs += driver.step()
    for index in stopped_first:
        driver.engine.stop_sequence(RID, index, "<early>")
    while not outputs or not outputs[-1].finished:
        outputs += driver.step()
    return outputs, [seq.num_cached_tokens for seq in seqs]


@pytest.mark.parametrize("kind", [RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE],
                         ids=["final_only", "cumulative"])
@pytest.mark.parametrize("driver", [EngineDriver, CoreDriver], ids=["engine", "engine_core"])
@pytest.mark.parametrize("stopped_first, last", [((), 2), ((1, 2), 0), ((0, 2), 1)],
                         ids=["together", "first_last", "second_last"])
def test_the_final_output_carries_the_count_of_the_last_completion_to_finish(
        stories_path, golden, driver, kind, stopped_first, last):
    # It carried the first admitted completion's: 0 on a first run, where its siblings had a block
    # from the prefix cache. Completions that finish in one step finish in index order (vLLM's
    # children's outputs come in the order they were scheduled), so of those the last is the highest.
    params = SamplingParams(temperature=0, n=3, max_tokens=6, ignore_eos=True, output_kind=kind)
    outputs, counts = run_stopping_early(driver(stories_path), golden[:30], params, stopped_first)
    assert counts == [0, BLOCK, BLOCK]
    final = outputs[-1]
    assert final.finished and len(final.outputs) == 3
    assert final.num_cached_tokens == counts[last]
    assert [c.finish_reason == "stop" for c in final.outputs] == [i in stopped_first for i in range(3)]
    assert final.metrics.num_cached_tokens == 0          # the first admitted's, which a stream reports
    # vLLM's first output (and every one while the children run) is the first admitted child's
    assert all(out.num_cached_tokens == 0 for out in outputs[:-1])
    assert len(outputs) == 1 if kind is RequestOutputKind.FINAL_ONLY else len(outputs) > 2


def test_llm_generate_reports_the_count_of_the_last_completion_to_finish(stories_path, golden):
    with LLM(str(stories_path), device="cpu", max_model_len=64) as llm:
        params = SamplingParams(temperature=0.8, seed=5, n=3, max_tokens=4, ignore_eos=True)
        [first] = llm.generate({"prompt_token_ids": golden[:30]}, params, use_tqdm=False)
        [alone] = llm.generate({"prompt_token_ids": golden[1:31]}, SamplingParams(max_tokens=2), use_tqdm=False)
    assert first.num_cached_tokens == BLOCK and first.metrics.num_cached_tokens == 0
    assert alone.num_cached_tokens == 0 == alone.metrics.num_cached_tokens


# ---- the server ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def url(stories_path):
    options = ServerOptions(chat_template=CHAT_TEMPLATE, enable_prompt_tokens_details=True)
    with running_server(stories_path, options=options, max_model_len=256) as (base_url, _):
        yield base_url


def _body(path: str, text: str, **fields) -> dict:
    body = {"model": "stories", "max_tokens": 4, "ignore_eos": True, "temperature": 1.0, **fields}
    if path == "/v1/completions":
        return {**body, "prompt": text}
    return {**body, "messages": [{"role": "user", "content": text}]}


def _events(base_url: str, path: str, body: dict) -> list[dict]:
    response = httpx.post(f"{base_url}{path}", json={**body, "stream": True}, timeout=60)
    assert response.status_code == 200, response.text[:500]
    return sse_events(response.text.splitlines())


def _fresh_text() -> str:
    """A prompt no earlier request shares a block with (its first tokens are new)."""
    return f"{uuid.uuid4().hex} Once upon a time, there was a little girl named Lily. She loved to play."


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_usage_counts_cached_tokens_of_n_completions_as_vllm_does(url, path):
    # A whole reply's usage is the final output's: the last completion's to finish, which on a first run
    # was served the first completion's blocks. It said 0. A stream's is its first output's: the first's, 0.
    usage = httpx.post(f"{url}{path}", json=_body(path, _fresh_text(), n=3), timeout=60).json()["usage"]
    assert usage["prompt_tokens"] > 2 * BLOCK
    assert usage["prompt_tokens_details"] == {"cached_tokens": (usage["prompt_tokens"] - 1) // BLOCK * BLOCK}
    streamed = _events(url, path, _body(path, _fresh_text(), n=3, stream_options={"include_usage": True}))
    assert streamed[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    # n = 1: its one completion's, whole or streamed
    text = _fresh_text()
    assert httpx.post(f"{url}{path}", json=_body(path, text), timeout=60).json()["usage"][
        "prompt_tokens_details"] == {"cached_tokens": 0}
    again = _events(url, path, _body(path, text, stream_options={"include_usage": True}))[-1]["usage"]
    assert again["prompt_tokens_details"] == {"cached_tokens": (again["prompt_tokens"] - 1) // BLOCK * BLOCK}


# ---- a chat stream's opening chunks --------------------------------------------------------------------
# vLLM's chat_completion_stream_generator, on its first output, sends one chunk per choice index with
# the role (content "", logprobs and finish_reason null; prompt_token_ids and prompt_text set, null
# unless asked), then one per index with the echoed last message where echo repeats one, then content.


def _role_choice(index: int) -> dict:
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


@pytest.mark.parametrize("asked", [False, True], ids=["plain", "prompt_fields"])
def test_a_chat_stream_opens_with_every_choices_role_before_any_content(url, asked):
    # Each choice's role chunk came just before its first content: role 0, content 0, role 1, ...
    fields = {"return_token_ids": True, "return_prompt_text": True} if asked else {}
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = _events(url, "/v1/chat/completions",
                     _body("/v1/chat/completions", "Tom had a ball.", n=3, stream_options=options, **fields))
    openers, rest = events[:3], events[3:]
    assert [e["choices"] for e in openers] == [[_role_choice(i)] for i in range(3)]
    whole = httpx.post(f"{url}/v1/chat/completions", json=_body(
        "/v1/chat/completions", "Tom had a ball.", max_tokens=1, return_token_ids=True, return_prompt_text=True),
        timeout=60).json()
    for event in openers:
        assert event["prompt_token_ids"] == (whole["prompt_token_ids"] if asked else None)
        assert event["prompt_text"] == (whole["prompt_text"] if asked else None)
        assert event["usage"]["completion_tokens"] == 0
    assert all("role" not in c["delta"] and "prompt_text" not in e for e in rest for c in e["choices"])
    assert {c["index"] for e in rest for c in e["choices"]} == {0, 1, 2}


def test_an_echoed_message_follows_every_choices_role(url):
    # The echo rode in the role chunk's content, each choice's just before its content.
    messages = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "Once upon a"}]
    body = {"model": "stories", "messages": messages, "n": 2, "max_tokens": 3, "echo": True,
            "add_generation_prompt": False, "continue_final_message": True}
    events = _events(url, "/v1/chat/completions", body)
    assert [e["choices"] for e in events[:2]] == [[_role_choice(i)] for i in range(2)]
    assert [e["choices"] for e in events[2:4]] == [
        [{"index": i, "delta": {"content": "Once upon a"}, "logprobs": None, "finish_reason": None}] for i in range(2)]
    assert all("prompt_token_ids" not in e for e in events[2:])
    whole = httpx.post(f"{url}/v1/chat/completions", json={**body, "temperature": 0, "n": 1}, timeout=60).json()
    streamed = _events(url, "/v1/chat/completions", {**body, "temperature": 0, "n": 1})
    text = "".join(c["delta"].get("content") or "" for e in streamed for c in e["choices"])
    assert text == whole["choices"][0]["message"]["content"]
