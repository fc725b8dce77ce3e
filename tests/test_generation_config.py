"""The model's generation_config.json sampling defaults (vLLM's --generation-config auto): what a
request that leaves temperature, top_p, top_k, min_p, repetition_penalty or max_tokens unset gets,
in LLM.generate / chat without sampling_params and on the server; "vllm" ignores the file."""
from __future__ import annotations

import contextlib
import json

import httpx
import pytest

from minillm import LLM, SamplingParams
from minillm.generation_config import sampling_defaults

from test_server_helpers import chat_model_dir, running_server

# Greedy and short, as a model's file might ask (top_k 1 makes any temperature greedy).
GREEDY_FIVE = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.7, "top_k": 1,
               "max_new_tokens": 5}


def test_the_file_is_read_by_sampling_params_names_and_bad_values_are_left_out():
    assert sampling_defaults({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 64,
                              "bos_token_id": 1}) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 64}
    assert sampling_defaults({"top_k": 0, "min_p": 0.05, "repetition_penalty": 1.1}) == \
        {"top_k": -1, "min_p": 0.05, "repetition_penalty": 1.1}                     # transformers' top_k 0: off
    bad = {"temperature": "hot", "top_p": 1.5, "top_k": 2.5, "max_new_tokens": 0, "min_p": float("nan"),
           "repetition_penalty": True}
    assert sampling_defaults(bad) == {}


@pytest.fixture(scope="module")
def greedy_model(stories_path, tmp_path_factory):
    """stories260K with a chat template and a generation_config.json that asks for GREEDY_FIVE."""
    path = chat_model_dir(stories_path, tmp_path_factory.mktemp("greedy-five"))
    (path / "generation_config.json").write_text(json.dumps(GREEDY_FIVE))
    return path


def test_llm_without_sampling_params_samples_as_the_model_asks(greedy_model):
    llm = LLM(str(greedy_model), device="cpu")
    assert llm.get_default_sampling_params().max_tokens == 5
    outs = llm.generate(["Tom"] * 3)
    assert all(len(o.outputs[0].token_ids) == 5 for o in outs)
    assert len({o.outputs[0].text for o in outs}) == 1                      # top_k 1: greedy
    greedy = llm.generate("Tom", SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].text
    assert outs[0].outputs[0].text == greedy
    explicit = llm.generate(["Tom"], SamplingParams(max_tokens=7))[0].outputs[0]
    assert len(explicit.token_ids) == 7              # an explicit SamplingParams is taken as it is
    ignored = LLM(str(greedy_model), device="cpu", generation_config="vllm")
    assert ignored.get_default_sampling_params() == SamplingParams()


def test_the_server_fills_what_a_request_leaves_unset(greedy_model):
    with contextlib.ExitStack() as stack:
        url, _ = stack.enter_context(running_server(greedy_model))
        chat = {"model": "stories", "messages": [{"role": "user", "content": "Tom"}]}
        answers = [httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).json() for _ in range(3)]
        assert all(a["usage"]["completion_tokens"] == 5 for a in answers)      # max_new_tokens
        assert len({a["choices"][0]["message"]["content"] for a in answers}) == 1
        # A field the request sets is its own: max_tokens 8 and top_k off at temperature 1 are taken.
        own = httpx.post(f"{url}/v1/chat/completions", json={**chat, "max_tokens": 8, "top_k": -1, "seed": 1},
                         timeout=60).json()
        assert own["usage"]["completion_tokens"] == 8
        # Completions keep OpenAI's max_tokens 16 when it is left out, sampling greedily as the model asks.
        done = [httpx.post(f"{url}/v1/completions", json={"model": "stories", "prompt": "Tom"}, timeout=60).json()
                for _ in range(2)]
        assert done[0]["choices"][0]["text"] == done[1]["choices"][0]["text"]
        assert done[0]["usage"]["completion_tokens"] == 16


def _cli(*args: str, stdin: str | None = None):
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, "-m", "minillm.cli", *args], cwd=repo, input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_generate_cli_takes_the_model_defaults_for_the_flags_it_is_not_given(greedy_model):
    from minillm import LLM
    greedy = LLM(str(greedy_model), device="cpu").generate(
        "Tom", SamplingParams(temperature=0, max_tokens=7))[0].outputs[0].token_ids
    unset = _cli("generate", str(greedy_model), "--device", "cpu", "-p", "Tom", "--json")
    assert unset.returncode == 0, unset.stderr
    record = json.loads(unset.stdout)
    assert record["outputs"][0]["token_ids"] == list(greedy[:5])          # max_new_tokens 5, top_k 1
    given = _cli("generate", str(greedy_model), "--device", "cpu", "-p", "Tom", "--json", "--max-tokens", "7",
                 "--top-k", "-1", "--temperature", "0")
    assert json.loads(given.stdout)["outputs"][0]["token_ids"] == list(greedy)   # flags win over the file
    bad = _cli("generate", str(greedy_model), "--device", "cpu", "-p", "Tom", "--top-p", "2")
    assert bad.returncode != 0 and "top_p" in bad.stderr and "Traceback" not in bad.stderr


def test_chat_cli_starts_from_the_model_defaults_unless_given(greedy_model):
    shown = _cli("chat", str(greedy_model), "--device", "cpu", stdin="/set\n/exit\n")
    assert shown.returncode == 0, shown.stderr
    assert "temperature=0.7 top_p=0.9 top_k=1 " in shown.stdout       # the file's temperature and top_k
    given = _cli("chat", str(greedy_model), "--device", "cpu", "--top-k", "5", "--temperature", "0.2",
                 stdin="/set\n/exit\n")
    assert "temperature=0.2 top_p=0.9 top_k=5 " in given.stdout


@pytest.mark.parametrize("generation_config, override, line", [
    ("auto", None, "minillm: sampling defaults from the model's generation_config.json (generation_config "
                   "'vllm' ignores them): temperature=0.7, top_k=1, max_tokens=5"),
    ("auto", {"temperature": 0.2}, "minillm: sampling defaults from the model's generation_config.json with "
                                   "override_generation_config over it: temperature=0.2, top_k=1, max_tokens=5"),
    ("vllm", {"temperature": 0.2}, "minillm: sampling defaults from override_generation_config: temperature=0.2"),
    ("vllm", None, None),
])
def test_the_start_up_line_names_where_the_defaults_came_from(greedy_model, generation_config, override, line):
    from minillm.config import EngineConfig
    from minillm.engine import LLMEngine
    lines: list[str] = []
    config = EngineConfig(model=str(greedy_model), device="cpu", num_kv_blocks=16, generation_config=generation_config,
                          override_generation_config=override)
    LLMEngine(config, log=lines.append)
    said = [x for x in lines if "sampling defaults" in x]
    assert said == ([line] if line else [])
