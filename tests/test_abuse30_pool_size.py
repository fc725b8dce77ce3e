"""A KV pool too small for what was asked names the setting that sized it: a budget that holds no
block is refused (it was rounded up to one block), and a max_model_len past the pool asks for more of
the budget that was given, not for num_kv_blocks."""
from __future__ import annotations

import re

import pytest
from test_cli import STORIES, run_main

BLOCK_BYTES = 1280 * 16      # stories260K: 1280 bytes of KV a token, blocks of 16


def test_a_budget_under_one_block_is_refused_naming_it(stories_path):
    from minillm.llm import LLM
    with pytest.raises(ValueError, match=f"kv_cache_memory_bytes {BLOCK_BYTES - 1} holds no KV block: "
                                         f"a block of 16 tokens takes {BLOCK_BYTES} bytes"):
        LLM(str(stories_path), device="cpu", kv_cache_memory_bytes=BLOCK_BYTES - 1)


def test_exactly_one_block_is_a_pool_of_one(stories_path):
    from minillm.llm import LLM
    llm = LLM(str(stories_path), device="cpu", kv_cache_memory_bytes=BLOCK_BYTES)
    assert llm.llm_engine.stats(cells=1).kv_num_blocks == 1
    llm.llm_engine.shutdown()


def test_max_model_len_past_the_budget_asks_for_more_of_the_budget(capsys):
    status, out, err = run_main(capsys, "generate", str(STORIES), "--device", "cpu", "-p", "x",
                                "--kv-cache-memory-bytes", "64K", "--max-model-len", "512")
    assert (status, out) == (2, ""), err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert "512 needs 32 KV blocks but the pool has 3; lower --max-model-len or raise " in line
    assert line.split(" or raise ", 1)[1].startswith(("kv_cache_memory_bytes", "--kv-cache-memory-bytes"))
    assert "num_kv_blocks" not in line and "num-kv-blocks" not in line


def test_max_model_len_past_num_kv_blocks_still_names_num_kv_blocks(stories_path):
    from minillm.llm import LLM
    with pytest.raises(ValueError, match="pool has 3; lower max_model_len or raise num_kv_blocks$"):
        LLM(str(stories_path), device="cpu", num_kv_blocks=3, max_model_len=512)


def test_bench_throughput_takes_kv_cache_memory_bytes(capsys):
    # bench parsed its own options without this one: "unrecognized arguments: --kv-cache-memory-bytes".
    status, out, err = run_main(capsys, "bench", "throughput", "--model", str(STORIES), "--device", "cpu",
                                "--num-seqs", "4", "--max-input-len", "16", "--max-output-len", "16",
                                "--max-model-len", "48", "--kv-cache-memory-bytes", "64K", "--no-ceiling")
    assert status == 0, err
    # 64 KiB hold 3 blocks of 16 tokens: four requests of up to 32 tokens cannot all stay resident.
    assert re.search(r"[1-9]\d* preemptions?\b", out), out


@pytest.mark.parametrize("value", ["lots", "0", "1.5G"])
def test_bench_refuses_a_bad_kv_cache_memory_bytes_naming_it(capsys, value):
    status, out, err = run_main(capsys, "bench", "throughput", "--model", str(STORIES), "--device", "cpu",
                                "--kv-cache-memory-bytes", value)
    assert (status, out) == (2, "")
    assert "argument --kv-cache-memory-bytes:" in err and "Traceback" not in err
