"""vLLM scripts and command lines against minillm's LLM, LLMEngine, SamplingParams and CLI, on inputs
earlier rounds did not try: what vLLM accepts works the same here, bad input is a ValueError (or a
usage error, status 2) naming what was wrong, and no request corrupts another."""
import json

import pytest

from minillm import LLM, SamplingParams
from test_cli import minillm

GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def llm(stories_path):
    """One stories260K LLM on the CPU for the module."""
    with LLM(str(stories_path), device="cpu", max_model_len=128) as model:
        yield model


# ---- vLLM's names of engine settings -----------------------------------------------------------

def test_num_gpu_blocks_override_sizes_the_pool_as_vllms_does(stories_path):
    """vLLM's num_gpu_blocks_override (the way a script asks for a tiny KV pool) was a TypeError."""
    with LLM(str(stories_path), device="cpu", block_size=4, num_gpu_blocks_override=40) as model:
        assert model.llm_engine.stats().kv_num_blocks == 40
        assert model.generate("Once", GREEDY)[0].outputs[0].text == " upon a time, there was"
    with pytest.raises(ValueError, match="num_gpu_blocks_override=40 and num_kv_blocks=30 are the same setting"):
        LLM(str(stories_path), device="cpu", num_gpu_blocks_override=40, num_kv_blocks=30)


def test_num_gpu_blocks_override_flag_sizes_the_pool_and_errors_name_the_flag_typed(stories_path):
    """--num-gpu-blocks-override is vLLM's flag for --num-kv-blocks; a bad --num-kv-blocks still names itself."""
    result = minillm("generate", str(stories_path), "--device", "cpu", "--num-gpu-blocks-override", "3",
                     "-p", "Once", "--temperature", "0", "--max-tokens", "3")
    assert result.returncode == 0, result.stderr
    assert "KV pool float32 3 blocks" in result.stderr and result.stdout == "Once upon a time\n"
    bad = minillm("generate", str(stories_path), "--device", "cpu", "--num-kv-blocks", "0", "-p", "Once")
    assert bad.returncode == 2 and "Invalid value for '--num-kv-blocks': must be >= 1" in bad.stderr, bad.stderr


# ---- the CLI's prompts file -------------------------------------------------------------------

def test_a_prompts_file_line_holding_a_form_feed_or_unicode_separator_is_one_prompt(stories_path, tmp_path):
    """One prompt a line: str.splitlines also broke lines at a form feed, U+2028 and NEL, so a file of
    three lines ran six prompts, each a fragment of one."""
    path = tmp_path / "prompts.txt"
    path.write_bytes("Once upon\x0ca time\nLily had\u2028a ball\r\nThe cat\x85 sat\rTom\n\n".encode())
    result = minillm("generate", str(stories_path), "--device", "cpu", "--prompts-file", str(path),
                     "--temperature", "0", "--max-tokens", "1", "--json")
    assert result.returncode == 0, result.stderr
    prompts = [json.loads(line)["prompt"] for line in result.stdout.split("\n") if line]
    assert prompts == ["Once upon\x0ca time", "Lily had\u2028a ball", "The cat\x85 sat", "Tom"]


@pytest.mark.parametrize("pair", ["x=1", "300", "=1"])
def test_a_malformed_logit_bias_pair_is_a_usage_error_as_a_bias_out_of_range_is(stories_path, pair):
    """--logit-bias 5=101 was status 2 naming the flag, --logit-bias x=1 status 1."""
    result = minillm("generate", str(stories_path), "--device", "cpu", "-p", "Once", "--logit-bias", pair)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (f"minillm generate: error: --logit-bias: expected ID=BIAS (a token id and a "
                                     f"number), got {pair!r} (try 'minillm generate --help')")
