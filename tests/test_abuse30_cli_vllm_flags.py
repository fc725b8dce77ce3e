"""vLLM flags that `minillm serve` has no counterpart for say why; vLLM's --model is taken."""
from __future__ import annotations

import pytest
from test_abuse29b_cli import one_line
import test_abuse30_cli
from test_cli import STORIES, needs_stories, run_main

serve, started = test_abuse30_cli.serve, test_abuse30_cli.started      # started: a fixture


@needs_stories
@pytest.mark.parametrize("flag, why", [
    (("--quantization", "awq"), "unquantized"),
    (("--quantization=fp8",), "unquantized"),
    (("--pipeline-parallel-size", "2"), "--tensor-parallel-size"),
    (("--disable-frontend-multiprocessing",), "--engine-core thread"),
    (("--max-log-len", "100"), "no prompt text"),
    (("--enable-lora",), "LoRA"),
    (("-pp", "2"), "--tensor-parallel-size"),       # read as -p twice: "No such option: -p"
    (("-dp", "2"), "one engine"),
])
def test_a_vllm_flag_without_a_counterpart_says_why(capsys, started, flag, why):
    status, err = serve(capsys, *flag)
    line = one_line(err)
    name = flag[0].split("=")[0]
    assert status == 2 and line.startswith(f"minillm serve: error: No such option: {name}: "), line
    assert why in line, line


def test_a_reason_names_only_options_of_the_command_that_prints_it(capsys):
    status, _, err = run_main(capsys, "generate", "m", "-p", "x", "--disable-frontend-multiprocessing")
    assert status == 2 and one_line(err).startswith("minillm generate: error: No such option: "
                                                    "--disable-frontend-multiprocessing (try ")
    status, _, err = run_main(capsys, "generate", "m", "-p", "x", "--pipeline-parallel-size", "2")
    assert status == 2 and "by --tensor-parallel-size only" in one_line(err)


@needs_stories
def test_model_is_also_taken_as_vllms_model_option(capsys, started):
    """`vllm serve --model M` (and the older api_server's command line) named no option of minillm's."""
    status, _, err = run_main(capsys, "serve", "--model", str(STORIES), "--device", "cpu")
    assert status == 0, err
    assert started["config"].model == str(STORIES)
    assert started["options"].served_model_name == (str(STORIES),)
    status, _, err = run_main(capsys, "serve", "other", "--model", str(STORIES), "--device", "cpu")
    line = one_line(err)
    assert status == 2 and "MODEL other and --model" in line, line


@pytest.mark.parametrize("flag, value, choices", [
    ("--tool-call-parser", "mistral", "'hermes', 'llama3_json'"),
    ("--dtype", "bf16", "'auto', 'float32', 'float16', 'bfloat16', 'half', 'float'"),
])
def test_a_vllm_choice_minillm_lacks_is_named_with_the_choices_it_has(capsys, flag, value, choices):
    """The line read "Invalid value for '--dtype': Value error, 'bf16' is not one of ...", pydantic's words."""
    status, _, err = run_main(capsys, "serve", "m", flag, value)
    assert status == 2
    assert one_line(err) == (f"minillm serve: error: Invalid value for '{flag}': '{value}' is not one of {choices}. "
                             "(try 'minillm serve --help')")
