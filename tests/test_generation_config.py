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
    assert bad.returncode == 2 and "'--top-p'" in bad.stderr and "Traceback" not in bad.stderr


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


# ---- a generation_config folder's eos_token_id (vLLM's update_from_generation_config) -------------

def test_a_folders_eos_token_id_is_read_as_a_list_and_auto_and_vllm_read_none(tmp_path):
    from minillm.generation_config import folder_eos_token_ids
    file = tmp_path / "generation_config.json"
    for value, ids in ((1, [1]), ([128001, 128008, 128009], [128001, 128008, 128009]), (None, [])):
        file.write_text(json.dumps({"temperature": 0.6} if value is None else {"eos_token_id": value}))
        assert folder_eos_token_ids(str(tmp_path)) == ids
    assert folder_eos_token_ids("auto") == folder_eos_token_ids("vllm") == []
    file.write_text(json.dumps({"eos_token_id": [2, 1.5]}))
    with pytest.raises(ValueError, match=r"generation_config.json field 'eos_token_id' must be a token id or a list"):
        folder_eos_token_ids(tmp_path)


@pytest.fixture(scope="module")
def model_and_folders(stories_path, tmp_path_factory):
    """stories260K (symlinked; its own generation_config.json names EOS 2 only) and generation_config
    folders whose eos_token_id adds token 1, on which stories260K's stories end: as an int, and as a
    list beside the primary EOS and an id past the 512-token vocabulary."""
    root = tmp_path_factory.mktemp("eos-folders")
    model = root / "model"
    model.mkdir()
    for f in stories_path.iterdir():
        (model / f.name).symlink_to(f)
    folders = {}
    for name, eos in (("int", 1), ("list", [2, 1, 128009])):
        folders[name] = root / name
        folders[name].mkdir()
        (folders[name] / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "eos_token_id": eos}))
    return model, folders


def _story(llm, **params):
    return llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=450, **params))[0].outputs[0]


@pytest.mark.parametrize("form", ["int", "list"])
def test_a_folders_eos_ids_stop_every_request_that_does_not_ignore_eos(model_and_folders, form, caplog):
    model, folders = model_and_folders
    plain = _story(LLM(str(model), device="cpu", num_kv_blocks=64))
    assert 1 in plain.token_ids                                     # the model's own EOS (2) does not stop there
    with caplog.at_level("WARNING", logger="minillm"):
        llm = LLM(str(model), device="cpu", num_kv_blocks=64, generation_config=str(folders[form]))
    assert ("128009" in caplog.text) == (form == "list")            # past the vocabulary: left out, said so
    assert llm.get_tokenizer().eos_token_id == 2 and llm.llm_engine.eos_token_ids == [2]   # the primary EOS as it was
    params = SamplingParams(temperature=0, max_tokens=450, stop_token_ids=[300])
    [out] = llm.generate("Once upon a time", params)
    stopped = out.outputs[0]
    first = plain.token_ids.index(1)
    assert stopped.token_ids == plain.token_ids[:first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == 1     # a stop token id, as vLLM's
    assert params.stop_token_ids == [300]                                 # the caller's params left as given
    assert llm.get_default_sampling_params().stop_token_ids == []
    # Without sampling_params, the folder's defaults (temperature 0) and its EOS ids both apply.
    assert llm.generate("Once upon a time")[0].outputs[0].token_ids == plain.token_ids[:min(first + 1, 16)]
    held = _story(llm, min_tokens=first + 5)                          # min_tokens holds them back, as EOS
    assert 1 not in held.token_ids[:first + 4] and len(held.token_ids) >= first + 5
    ignored = _story(llm, ignore_eos=True)
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 450
    assert ignored.token_ids[:len(plain.token_ids)] == plain.token_ids


def test_the_engine_itself_stops_on_a_folders_eos_ids(model_and_folders):
    # The folder's ids join the engine's stop ids, so every path that adds requests to it (LLM, the
    # chat, the server's engine core) stops on them, not LLM.generate alone.
    from minillm.config import EngineConfig
    from minillm.engine import LLMEngine
    model, folders = model_and_folders
    plain = LLMEngine(EngineConfig(model=str(model), device="cpu", num_kv_blocks=64))
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", num_kv_blocks=64,
                                    generation_config=str(folders["list"])))
    assert 1 not in plain.extra_eos_token_ids and engine.extra_eos_token_ids == plain.extra_eos_token_ids + [1]
    for eng in (plain, engine):
        eng.add_request("r", "Once upon a time", SamplingParams(temperature=0, max_tokens=450))
        while eng.has_unfinished_requests():
            outputs = eng.step()
    [out] = outputs
    assert out.outputs[0].token_ids[-1] == 1 and out.outputs[0].stop_reason == 1


def test_auto_and_vllm_take_eos_ids_from_the_models_own_file_only(model_and_folders, eos_model_path):
    # vLLM reads the model's generation_config.json for EOS under both "auto" and "vllm" ("vllm" leaves
    # out only its sampling defaults); a folder is read only when given.
    model, _ = model_and_folders
    for generation_config in ("auto", "vllm"):
        own = _story(LLM(str(eos_model_path), device="cpu", num_kv_blocks=64, generation_config=generation_config))
        assert (own.finish_reason, own.stop_reason, own.token_ids[-1]) == ("stop", 1, 1), generation_config
        plain = _story(LLM(str(model), device="cpu", num_kv_blocks=64, generation_config=generation_config))
        assert 1 in plain.token_ids[:-1], generation_config


def test_generate_cli_stops_on_a_folders_eos_ids(model_and_folders):
    model, folders = model_and_folders
    common = ("generate", str(model), "--device", "cpu", "-p", "Once upon a time", "--max-tokens", "450",
              "--json", "--temperature", "0")
    plain, stopped = _cli(*common), _cli(*common, "--generation-config", str(folders["list"]))
    assert plain.returncode == stopped.returncode == 0, stopped.stderr
    plain_ids = json.loads(plain.stdout)["outputs"][0]["token_ids"]
    record = json.loads(stopped.stdout)["outputs"][0]
    assert record["token_ids"] == plain_ids[:plain_ids.index(1) + 1] and record["finish_reason"] == "stop"
