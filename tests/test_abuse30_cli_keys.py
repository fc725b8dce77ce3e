"""`minillm serve`'s API keys as `vllm serve` takes them: --api-key KEY..., else $VLLM_API_KEY (one key)."""
from __future__ import annotations

import test_abuse30_cli
from test_cli import STORIES, needs_stories, run_main

serve, started = test_abuse30_cli.serve, test_abuse30_cli.started      # started: a fixture


@needs_stories
def test_the_api_key_is_read_from_vllm_api_key_as_vllm_reads_it(capsys, started, monkeypatch):
    """A vLLM deployment that keeps its key in VLLM_API_KEY served every request without one."""
    monkeypatch.setenv("VLLM_API_KEY", "sk-env")
    assert serve(capsys)[0] == 0
    assert started["options"].api_key == "sk-env"
    assert serve(capsys, "--api-key", "sk-flag")[0] == 0
    assert started["options"].api_key == "sk-flag"          # the flag over the variable, as in vLLM
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert serve(capsys)[0] == 0
    assert started["options"].api_key is None                 # empty is unset, as in vLLM


@needs_stories
def test_several_api_keys_after_one_flag_are_taken_as_vllm_takes_them(capsys, started):
    """vLLM's --api-key takes several keys (any of them is accepted); the second was read as an
    extra argument ("Got unexpected extra argument(s) (b)") without a word about the key."""
    status, err = serve(capsys, "--api-key", "a", "b")
    assert status == 0 and started["options"].api_keys == ("a", "b"), err
    assert serve(capsys, "--api-key", "a")[0] == 0 and started["options"].api_key == "a"
    status, _, err = run_main(capsys, "serve", "--device", "cpu", "--api-key", "a", str(STORIES))
    assert status == 0 and started["options"].api_key == "a", err       # the key, then MODEL
