"""vLLM's API and command-line shapes taken as vLLM takes them, and options refused in one line where
they would fail later or never end: served names, the monitor without a terminal, the bench
commands' bounds, add_request's prompt forms, LLM.chat's content format, served_model_name."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_cli import REPO, STORIES, minillm, needs_stories, run_main


# ---- serve --served-model-name ------------------------------------------------------------------------

@pytest.fixture
def started(monkeypatch):
    """serve's run_server stubbed: what it was started with ({"config", "options"}) once main() returns."""
    seen: dict = {}

    def fake_run_server(config, host="127.0.0.1", port=8000, options=None, monitor=False, core_hook=None):
        seen.update(config=config, options=options)
        return 0

    monkeypatch.setattr("minillm.server.app.run_server", fake_run_server)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)      # a key in the environment is a key of the server
    return seen


@needs_stories
def test_a_served_name_that_starts_with_an_unknown_tilde_user_is_a_name(capsys, started, monkeypatch, tmp_path):
    # With MODEL left out, each name was tried as a model directory through Path.expanduser, which
    # raised RuntimeError "Could not determine home directory." for ~nouser: serve failed on a name.
    monkeypatch.setenv("MINILLM_MODEL", str(STORIES))
    status, _, err = run_main(capsys, "serve", "--device", "cpu", "--served-model-name", "~nouser-22", "x" * 300)
    assert (status, err) == (0, "")
    assert started["options"].served_model_name == ("~nouser-22", "x" * 300)
    # The case the check is for still holds: a model directory (here under ~) written after the option.
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    started.clear()
    status, _, err = run_main(capsys, "serve", "--device", "cpu", "--served-model-name", "~/model")
    assert status == 1 and not started
    assert err.strip().startswith("minillm: error: --served-model-name took ~/model as a name")


# ---- monitor without a terminal ---------------------------------------------------------------------

def test_the_monitor_piped_to_a_file_is_one_line_and_ends(tmp_path):
    # Textual drew frame after frame into the file and never ended (the demo loops).
    out = tmp_path / "out.txt"
    with out.open("w") as f:
        result = subprocess.run([sys.executable, "-m", "minillm.cli", "monitor", "--demo"], stdout=f,
                                stderr=subprocess.PIPE, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 1 and out.read_text() == ""
    assert result.stderr.splitlines() == [
        "minillm: error: the monitor draws its dashboard in a terminal, but stdout is not one (a file or a pipe "
        "would get frames without end); run it in a terminal"]


def test_the_monitor_needs_a_terminal_on_stdout_and_stderr_and_runs_with_both(capsys, monkeypatch, tmp_path):
    runs: list[dict] = []

    def fake_run_monitor(url, api_key=None, source=None, recorder=None, interval_s=None):
        runs.append({"url": url, "source": source, "recorder": recorder})

    monkeypatch.setattr("minillm.tui.app.run_monitor", fake_run_monitor)
    status, out, err = run_main(capsys, "monitor", "http://127.0.0.1:9")     # no server: nothing connects
    assert (status, out) == (1, "") and not runs
    assert err.strip().endswith("run it in a terminal, or read one snapshot of the stats as JSON from "
                                "http://127.0.0.1:9/v1/stats")
    # A --record file is neither truncated nor left behind by the refusal.
    kept, fresh = tmp_path / "kept.jsonl", tmp_path / "fresh.jsonl"
    kept.write_text("earlier recording\n")
    for path in (kept, fresh):
        status, _, err = run_main(capsys, "monitor", "--demo", "--record", str(path))
        assert status == 1 and "stdout is not one" in err
    assert kept.read_text() == "earlier recording\n" and not fresh.exists()
    # The dashboard is drawn on stderr: a terminal on stdout alone is not enough.
    monkeypatch.setattr("minillm.chat_terminal.is_terminal", lambda stream: stream is sys.stdout)
    status, _, err = run_main(capsys, "monitor", "--demo")
    assert status == 1 and "but stderr is not one" in err and not runs
    status, _, err = run_main(capsys, "serve", str(STORIES), "--monitor")
    assert status == 1 and err.startswith("minillm: error: --monitor draws the dashboard in this terminal, "
                                          "but stderr is not a terminal")
    monkeypatch.setattr("minillm.chat_terminal.is_terminal", lambda stream: True)
    assert run_main(capsys, "monitor", "--demo", "--record", str(fresh))[:2] == (0, "")
    [run] = runs
    assert run["source"] is not None and run["recorder"].path == fresh
    run["recorder"].close()


# ---- bench options past their bounds ------------------------------------------------------------------

@needs_stories
def test_bench_throughput_refuses_a_huge_workload_in_one_line_naming_the_option():
    # --num-seqs 10**9 drew a billion prompts before anything ran, and never got to run.
    result = minillm("bench", "throughput", "--model", str(STORIES), "--device", "cpu", "--num-seqs", str(10**9))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == ["minillm bench throughput: error: --num-seqs must be in [1, 65536], got "
                                          "1000000000 (try 'minillm bench throughput --help')"]


@pytest.mark.parametrize("module, args, message", [
    ("throughput", ["--max-input-len", str(10**12)], "--max-input-len must be in [1, 1048576], got 1000000000000"),
    ("throughput", ["--max-num-seqs", str(10**9)], "--max-num-seqs must be in [1, 65536], got 1000000000"),
    ("throughput", ["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be in [1, 1048576], got 0"),
    ("throughput", ["--peer-num-seqs", str(10**9)], "--peer-num-seqs must be in [1, 65536], got 1000000000"),
    ("throughput", ["--temperature", "nan"], "--temperature: temperature must be a finite number, got nan"),
    ("serving", ["--num-prompts", str(10**9)], "--num-prompts must be in [1, 65536], got 1000000000"),
    ("serving", ["--num-prompts", "60000", "--input-len", "1000"],
     "--num-prompts 60000 x --input-len 1000 = 60000000 prompt tokens are past the 33554432 a workload may hold"),
    ("serving", ["--num-client-processes", str(10**6)], "--num-client-processes must be in [1, 256], got 1000000"),
    ("serving", ["--timeout", "1e308"], "--timeout must be at most 86400 seconds, got 1e+308"),
    ("serving", ["--mixed-users", "2", "--duration", "inf"], "--duration must be at most 86400 seconds, got inf"),
    ("pd_disagg", ["--users", "0"], "--users must be in [1, 65536], got 0"),
    ("pd_disagg", ["--prefill-blocks", str(10**12)], "--prefill-blocks must be in [1, 1048576], got 1000000000000"),
    ("pd_disagg", ["--long-every", "inf"], "--long-every must be at most 86400 seconds, got inf"),
])
def test_bench_options_past_their_bounds_are_usage_errors_naming_them(module, args, message):
    import importlib

    from minillm.benchmarks.cli_args import BenchUsageError
    with pytest.raises(BenchUsageError) as info:
        importlib.import_module(f"minillm.benchmarks.{module}").parse_args(args)
    assert info.value.message.startswith(message), info.value.message
    assert info.value.prog == f"minillm bench {module}"     # the command the error's --help hint names


@needs_stories
def test_bench_throughput_checks_the_workload_against_the_model_before_drawing_it():
    from minillm.benchmarks import throughput
    from minillm.benchmarks.cli_args import BenchError, BenchUsageError
    model = ["--model", str(STORIES), "--device", "cpu"]
    with pytest.raises(BenchUsageError, match=r"^--num-seqs 65536 x --max-input-len 1000 = 65536000 prompt tokens"):
        throughput.resolve_defaults(throughput.parse_args([*model, "--num-seqs", "65536", "--max-input-len", "1000"]))
    with pytest.raises(BenchUsageError, match=r"^--peer-num-seqs 17 is more than the workload's 16 requests"):
        throughput.resolve_defaults(throughput.parse_args([*model, "--peer", "hf", "--peer-num-seqs", "17"]))
    with pytest.raises(BenchError, match=r"^--max-model-len 1000 is past the model's max_position_embeddings 512"):
        throughput.resolve_defaults(throughput.parse_args([*model, "--max-model-len", "1000"]))
    args = throughput.parse_args([*model, "--num-seqs", "3", "--max-model-len", "512"])
    throughput.resolve_defaults(args)
    assert (args.num_seqs, args.max_input_len, args.max_model_len) == (3, 128, 512)


# ---- LLMEngine.add_request's prompt forms -------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(stories_path):
    from minillm import LLM
    return LLM(str(stories_path), device="cpu")


def run_to_end(engine) -> dict:
    """Step the engine until it has nothing left; each finished request's output by id."""
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {out.request_id: out for out in engine.step() if out.finished}
    return finished


def test_add_request_takes_vllms_text_and_tokens_prompt_dicts(llm):
    # A dict was "prompt must be a non-empty string or a non-empty list of token ids".
    from minillm import SamplingParams, TextPrompt, TokensPrompt
    engine, greedy = llm.llm_engine, SamplingParams(temperature=0, max_tokens=6)
    ids = engine.tokenizer.encode("Once upon", add_special_tokens=True)
    prompts = {"str": "Once upon", "text": TextPrompt(prompt="Once upon"), "ids": TokensPrompt(prompt_token_ids=ids),
               "ids+text": {"prompt_token_ids": ids, "prompt": "Once upon"}}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, greedy, output_kind="final")
    outs = run_to_end(engine)
    assert {rid: out.prompt for rid, out in outs.items()} == {
        "str": "Once upon", "text": "Once upon", "ids": None, "ids+text": "Once upon"}
    assert all(out.prompt_token_ids == ids for out in outs.values())
    assert len({tuple(out.outputs[0].token_ids) for out in outs.values()}) == 1
    [generated] = llm.generate(prompts["ids+text"], greedy)
    assert (generated.prompt, generated.outputs[0].token_ids) == ("Once upon", outs["str"].outputs[0].token_ids)


@pytest.mark.parametrize("prompt, message", [
    ({}, "a prompt dict needs 'prompt' (a string) or 'prompt_token_ids' (a list of ids)"),
    ({"prompt": 5}, "a prompt dict's 'prompt' must be a string, got 5"),
    ({"prompt_token_ids": [1, 403], "prompt": ["Once"]}, "a prompt dict's 'prompt' must be a string, got ['Once']"),
    ({"prompt_token_ids": "1 403"}, "prompt_token_ids must be a list of token ids, got '1 403'"),
    ({"prompt_token_ids": []}, "prompt_token_ids must not be empty"),
    ({"prompt_token_ids": [1, 10**9]}, "prompt token ids must be integers in [0, 512), got 1000000000"),
    ({"prompt": "Once", "multi_modal_data": {"image": "cat.png"}},
     "prompt dict has unsupported key(s) ['multi_modal_data']"),
    ({"prompt": "Once", 7: 1}, "prompt dict has unsupported key(s) [7]"),
])
def test_add_request_refuses_a_malformed_prompt_dict_naming_the_key(llm, prompt, message):
    from minillm import SamplingParams
    engine = llm.llm_engine
    with pytest.raises(ValueError) as info:
        engine.add_request("bad", prompt, SamplingParams(max_tokens=2))
    assert str(info.value).startswith(message), str(info.value)
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError) as info:           # LLM.generate reads prompts the same way
        llm.generate(["Once", prompt], SamplingParams(max_tokens=2))
    assert str(info.value).startswith(f"prompt 2 of 2: {message}") and not engine.has_unfinished_requests()


# ---- LLM.chat's chat_template_content_format -----------------------------------------------------------

# A template that loops over a message's content (vLLM's "auto" gives it parts), and one that does not.
PARTS_TEMPLATE = ("{% for m in messages %}{% if m.content is string %}S:{{ m.content }}|{% else %}"
                  "{% for p in m.content %}P:{{ p.text }};{% endfor %}{% endif %}{% endfor %}")
STRING_TEMPLATE = ("{% for m in messages %}{% if m.content is string %}S:{{ m.content }}|{% else %}"
                   "L:{{ m.content | length }}|{% endif %}{% endfor %}")
PARTS_MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Tom"}, {"type": "text", "text": "had a ball."}]},
                  {"role": "user", "content": "Lily"}]


@pytest.mark.parametrize("template, content_format, prompt", [
    (PARTS_TEMPLATE, "auto", "P:Tom;P:had a ball.;P:Lily;"),
    (PARTS_TEMPLATE, "string", "S:Tom\nhad a ball.|S:Lily|"),
    (PARTS_TEMPLATE, "openai", "P:Tom;P:had a ball.;P:Lily;"),
    (STRING_TEMPLATE, "auto", "S:Tom\nhad a ball.|S:Lily|"),
    (STRING_TEMPLATE, "openai", "L:2|L:1|"),
])
def test_chat_template_content_format_shapes_content_as_vllm_does(llm, template, content_format, prompt):
    # LLM.chat had no such argument (a TypeError): content was always shaped as "auto" shapes it.
    from minillm import SamplingParams
    [out] = llm.chat(PARTS_MESSAGES, SamplingParams(max_tokens=1), chat_template=template,
                     chat_template_content_format=content_format)
    assert out.prompt == prompt


@pytest.mark.parametrize("value", ["OpenAI", "text", None, 5, ["auto"]])
def test_an_unknown_chat_template_content_format_is_a_value_error_naming_it(llm, value):
    with pytest.raises(ValueError) as info:
        llm.chat(PARTS_MESSAGES, chat_template=PARTS_TEMPLATE, chat_template_content_format=value)
    assert str(info.value) == f"chat_template_content_format must be 'auto', 'string' or 'openai', got {value!r}"
    assert not llm.llm_engine.has_unfinished_requests()


# ---- LLM(served_model_name=...) ------------------------------------------------------------------------

@pytest.mark.parametrize("names", [5, True, b"stories", {"stories"}, ["stories", 5], [None]])
def test_a_served_model_name_that_is_no_name_is_a_value_error_naming_it(stories_path, names):
    # LLM(served_model_name=5) loaded the model and went by 5 in its stats.
    from minillm import LLM
    with pytest.raises(ValueError) as info:
        LLM(str(stories_path), device="cpu", served_model_name=names)
    assert str(info.value) == f"served_model_name must be a name or a list of names, got {names!r}"


def test_served_model_name_takes_a_name_or_a_list_of_names_as_vllm_does(stories_path):
    from minillm import LLM
    from minillm.config import EngineConfig
    assert EngineConfig(model=str(stories_path), served_model_name="stories").served_model_name == "stories"
    assert EngineConfig(model=str(stories_path), served_model_name=[]).served_model_name is None   # the model's
    llm = LLM(str(stories_path), device="cpu", served_model_name=["stories", "alias"])
    assert llm.llm_engine.stats().model == "stories"          # the first name, as vLLM's engine goes by
    llm.shutdown()
