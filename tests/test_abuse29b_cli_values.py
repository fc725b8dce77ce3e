"""Values a command line gets wrong, named as usage errors or with what to give instead: the router's
timeouts, generate's prompts given two ways or none, and a model given as its web address."""
from __future__ import annotations

import pytest
from test_abuse29b_cli import one_line
from test_cli import STORIES, run_main

ROUTER = ("router", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9", "--port", "0")


@pytest.mark.parametrize("flag, value", [("--connect-timeout", "0"), ("--connect-timeout", "nan"),
                                         ("--timeout", "-1")])
def test_a_router_timeout_that_is_no_timeout_is_a_usage_error_naming_the_flag(capsys, flag, value):
    # "minillm: error: the connect timeout must be a positive number of seconds", status 1, named no flag.
    status, out, err = run_main(capsys, *ROUTER, flag, value)
    assert (status, out) == (2, "")
    assert f"Invalid value for '{flag}': must be a positive number of seconds, got " in one_line(err)


def test_prompt_and_prompts_file_together_or_neither_are_usage_errors(capsys, tmp_path):
    # Both were status 1, where every other pair of options that cannot be combined, and a missing
    # option, are usage errors (status 2).
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once\n")
    status, _, err = run_main(capsys, "generate", str(STORIES), "-p", "x", "--prompts-file", str(prompts))
    assert status == 2
    assert one_line(err) == ("minillm generate: error: --prompt and --prompts-file cannot be combined: give the "
                             "prompts one way (try 'minillm generate --help')")
    status, _, err = run_main(capsys, "generate", str(STORIES))
    assert status == 2
    assert one_line(err) == ("minillm generate: error: give at least one --prompt TEXT or a --prompts-file FILE "
                             "(try 'minillm generate --help')")


@pytest.mark.parametrize("model", ["https://huggingface.co/Qwen/Qwen3-0.6B", "hf.co/Qwen/Qwen3-0.6B",
                                   "http://www.huggingface.co/Qwen/Qwen3-0.6B/tree/main/"])
@pytest.mark.parametrize("command", [("generate", "-p", "x"), ("pull",), ("serve",)])
def test_a_model_given_as_its_web_address_names_its_repo_id(capsys, monkeypatch, tmp_path, model, command):
    # It was "no such directory: https://huggingface.co/Qwen/Qwen3-0.6B", pull's with "pull takes a
    # Hugging Face repo id such as Qwen/Qwen3-0.6B" after it: the id the user had given, as a URL.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    status, _, err = run_main(capsys, command[0], model, *command[1:], "--download-dir", str(tmp_path))
    assert status == 1
    assert one_line(err) == (f"minillm: error: {model} is a web address; give the model's Hugging Face repo id: "
                             "Qwen/Qwen3-0.6B")


def test_a_local_directory_that_reads_as_a_web_address_is_still_a_directory(capsys, monkeypatch, tmp_path):
    (tmp_path / "hf.co" / "Qwen").mkdir(parents=True)
    (tmp_path / "hf.co" / "Qwen" / "Qwen3-0.6B").symlink_to(STORIES)
    monkeypatch.chdir(tmp_path)
    status, out, err = run_main(capsys, "pull", "hf.co/Qwen/Qwen3-0.6B")
    assert status == 1 and "is a local directory: there is nothing to pull" in one_line(err)


def test_minillm_model_given_as_a_web_address_names_its_repo_id(capsys, monkeypatch, tmp_path):
    # It was "could not fetch the default model https://... (CliError: ...); pass a local model directory".
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MINILLM_MODEL", "https://huggingface.co/Qwen/Qwen3-0.6B")
    status, _, err = run_main(capsys, "serve", "--download-dir", str(tmp_path))
    assert status == 1
    assert one_line(err) == ("minillm: error: https://huggingface.co/Qwen/Qwen3-0.6B is a web address; give the "
                             "model's Hugging Face repo id: Qwen/Qwen3-0.6B")


@pytest.mark.parametrize("value", ["", " "])
@pytest.mark.parametrize("command", [("list",), ("pull", "Qwen/Qwen3-0.6B"), ("generate", "Qwen/Qwen3-0.6B", "-p", "x"),
                                     ("serve", "Qwen/Qwen3-0.6B")])
def test_an_empty_download_dir_is_named_not_read_as_the_cache_or_a_folder_called_space(capsys, monkeypatch,
                                                                                       tmp_path, command, value):
    # An unset variable in `--download-dir "$DIR"` listed and pulled into the Hugging Face cache; " "
    # was a folder of that name in the working directory.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    status, out, err = run_main(capsys, *command, "--download-dir", value)
    assert (status, out) == (2, "")
    assert "Invalid value for '--download-dir': is empty; give a directory, or leave it out (the Hugging Face " \
           "cache)" in one_line(err)
    assert list(tmp_path.iterdir()) == []


def test_pull_under_hf_hub_offline_says_the_variable_forbids_fetching(capsys, monkeypatch, tmp_path):
    # The reason was huggingface_hub's sentence cut at 200 characters ("... pass 'local_file..."),
    # about an argument of its own that the user never gave.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    status, _, err = run_main(capsys, "pull", "Qwen/Qwen3-0.6B", "--download-dir", str(tmp_path))
    assert status == 1
    assert one_line(err).endswith("HF_HUB_OFFLINE is set, so nothing is fetched, and the store holds no snapshot "
                                  "of it)")
