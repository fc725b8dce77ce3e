"""A ValueError about an option, said in the command line's words: the option's Python name becomes its
flag, but not where the name is part of a file name (generation_config.json)."""
from __future__ import annotations

from test_cli import minillm

from minillm.cli import in_flag_words


def test_a_file_named_after_the_option_keeps_its_name():
    text = in_flag_words("folder /tmp/x holds no generation_config.json", "generation_config", "--generation-config")
    assert text == "folder /tmp/x holds no generation_config.json"
    # the name itself, at the end of a sentence too, is still the flag
    assert in_flag_words("give generation_config.", "generation_config", "--generation-config") == \
        "give --generation-config."


def test_generate_names_the_missing_file(tmp_path):
    # It said "folder ... holds no --generation-config.json", a file no one would look for.
    result = minillm("generate", "model-not-read", "-p", "x", "--generation-config", str(tmp_path))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines() == [
        f"minillm generate: error: Invalid value for '--generation-config': folder {tmp_path} holds no "
        f"generation_config.json (try 'minillm generate --help')"]
