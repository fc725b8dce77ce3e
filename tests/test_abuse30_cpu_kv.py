"""The CPU KV pool's size: vLLM's --kv-cache-memory-bytes (with its size suffixes) on every command
that loads a model, VLLM_CPU_KVCACHE_SPACE (GiB) under it, vLLM's 4 GiB CPU default under both, and
a bad value refused as a usage error naming the flag."""
from __future__ import annotations

import pytest
from test_abuse29b_cli import one_line
from test_cli import STORIES, run_main

# stories260K: 5 layers x 2 x 4 KV heads x 8 dims x 4 bytes = 1280 bytes a token, 20 KiB a block of 16.
BLOCK_BYTES = 1280 * 16


@pytest.mark.parametrize("text, expected", [
    ("4096", 4096), ("4G", 4 << 30), ("512M", 512 << 20), ("64K", 64 << 10), ("1T", 1 << 40),
    ("1k", 1000), ("1.5g", 1_500_000_000), ("25.6k", 25_600), ("512MiB", 512 << 20), ("2Gi", 2 << 30),
    ("0.5GiB", 1 << 29), (" 8K ", 8 << 10),
])
def test_sizes_read_as_vllm_reads_them(text, expected):
    from minillm.config import parse_memory_bytes
    assert parse_memory_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "4GB", "-1", "1.5G", "1e9", "4 G B", "0x10", "G"])
def test_a_size_that_is_no_size_is_refused_naming_the_forms(text):
    from minillm.config import parse_memory_bytes
    with pytest.raises(ValueError, match="a number of bytes"):
        parse_memory_bytes(text)


@pytest.mark.parametrize("command", [("generate", str(STORIES), "-p", "x"), ("chat", str(STORIES)),
                                     ("serve", str(STORIES))])
@pytest.mark.parametrize("value, message", [
    ("0", "must be >= 1"), ("-5", "a number of bytes"), ("lots", "a number of bytes"), ("1.5G", "a number of bytes"),
    ("1000T", "exceeds the"),
])
def test_a_bad_kv_cache_memory_bytes_is_a_usage_error_naming_the_flag(capsys, command, value, message):
    # There was no such flag: "No such option: --kv-cache-memory-bytes".
    status, out, err = run_main(capsys, *command, "--device", "cpu", "--kv-cache-memory-bytes", value)
    assert (status, out) == (2, "")
    line = one_line(err)
    assert "Invalid value for '--kv-cache-memory-bytes'" in line and message in line


def test_kv_cache_memory_bytes_sizes_the_cpu_pool(capsys):
    status, out, err = run_main(capsys, "generate", str(STORIES), "--device", "cpu", "--temperature", "0",
                                "--max-tokens", "4", "-p", "Once", "--kv-cache-memory-bytes", "64K")
    assert status == 0, err
    # 64 KiB hold 3 blocks of 20 KiB: 48 tokens, so the model's 512 are fitted down to them.
    assert "KV pool float32 3 blocks x 16 = 48 tokens" in err
    assert "minillm: CPU KV budget 64.0 KiB from --kv-cache-memory-bytes" in err
    assert out.startswith("Once")


def test_vllm_cpu_kvcache_space_sizes_the_pool_when_no_flag_does(stories_path, monkeypatch):
    from minillm.llm import LLM
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.0001")        # GiB: 107,374 bytes, 5 blocks
    llm = LLM(str(stories_path), device="cpu")
    assert llm.llm_engine.stats(cells=1).kv_num_blocks == 5
    llm.llm_engine.shutdown()
    # The explicit budget wins over the variable, as a flag wins over the environment.
    llm = LLM(str(stories_path), device="cpu", kv_cache_memory_bytes=2 * BLOCK_BYTES)
    assert llm.llm_engine.stats(cells=1).kv_num_blocks == 2
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("value", ["abc", "-2", "nan", "inf", "100000000"])
def test_a_bad_vllm_cpu_kvcache_space_is_named(stories_path, monkeypatch, value):
    from minillm.device import cpu_kv_budget
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", value)
    with pytest.raises(ValueError, match="^VLLM_CPU_KVCACHE_SPACE"):
        cpu_kv_budget(None)


def test_unset_or_zero_kvcache_space_is_vllms_4_gib_default_within_half_the_memory(monkeypatch):
    # The pool's budget was a fixed 1 GiB, which nothing on the command line could change.
    from minillm.config import available_host_bytes
    from minillm.device import cpu_kv_budget
    expected = min(4 << 30, (available_host_bytes() or 8 << 30) // 2)
    for value in (None, "0", ""):
        if value is None:
            monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
        else:
            monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", value)
        budget = cpu_kv_budget(None)
        assert (budget.num_bytes, budget.source) == (expected, "default")


def test_gpu_memory_utilization_on_the_cpu_is_said_to_be_unused(capsys):
    status, _, err = run_main(capsys, "generate", str(STORIES), "--device", "cpu", "--temperature", "0",
                              "--max-tokens", "2", "-p", "Once", "--gpu-memory-utilization", "0.5")
    assert status == 0, err
    assert "--gpu-memory-utilization is not used on the CPU" in err
