"""`minillm generate --logprobs` names the tokens of a character split over byte tokens as vLLM (and LLM.generate's
decoded_token) does; `minillm bench latency` runs vLLM's `vllm bench latency` on a fixed batch."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from test_abuse29b_cli import one_line
from test_cli import STORIES, needs_stories, run_main

from minillm.benchmarks import latency

EMOJI = "😀"          # four byte-fallback tokens in stories260K's vocabulary: <0xF0> <0x9F> <0x98> <0x80>
CHOICE = f"a {EMOJI} 日本"
# as the server names them (tests/test_abuse37_text.py): the byte tokens as vLLM's Logprob.decoded_token does,
# "" while a character is unfinished and the whole character on the token that ends it
CHOICE_TOKENS = ["a", " ", "", "", "", EMOJI, " ", "", "", "日", "", "", "本"]
BYTE_TOKENS = [2, 3, 4, 5, 7, 8, 9, 10, 11, 12]     # CHOICE_TOKENS' indices of byte tokens


def byte_tokens(names: list) -> list:
    """The names at the byte tokens of CHOICE's tokens."""
    return [names[i] for i in BYTE_TOKENS]
GENERATE = ("generate", str(STORIES), "--device", "cpu", "--max-model-len", "128", "--temperature", "0",
            "--max-tokens", "16", "--logprobs", "1")


@needs_stories
def test_generate_json_logprob_tokens_of_split_characters_as_llm_generate(capsys, llm):
    from minillm import SamplingParams, StructuredOutputsParams
    status, out, err = run_main(capsys, *GENERATE, "-p", "Once upon a time", "--choice", CHOICE, "--json")
    assert status == 0, err
    logprobs = json.loads(out)["outputs"][0]["logprobs"]
    # each byte token read "\ufffd", so the tokens did not spell the text
    assert [t["token"] for t in logprobs] == CHOICE_TOKENS
    assert [t["top_logprobs"][0]["token"] for t in logprobs] == CHOICE_TOKENS
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=1,
                            structured_outputs=StructuredOutputsParams(choice=[CHOICE]))
    completion = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0]
    decoded = [lp[tid].decoded_token for tid, lp in zip(completion.token_ids, completion.logprobs)]
    assert byte_tokens(decoded) == byte_tokens(CHOICE_TOKENS)


@needs_stories
def test_generate_prompt_logprob_tokens_of_split_characters_as_llm_generate(capsys, llm):
    from minillm import SamplingParams
    status, out, err = run_main(capsys, *GENERATE, "-p", CHOICE, "--max-tokens", "1", "--prompt-logprobs", "1",
                                "--json")
    assert status == 0, err
    record = json.loads(out)
    named = [None if e is None else e["token"] for e in record["prompt_logprobs"]]
    prompt = llm.generate([CHOICE], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    expected = [None if e is None else e[tid].decoded_token
                for tid, e in zip(prompt.prompt_token_ids, prompt.prompt_logprobs)]
    assert named == [None, " a", *CHOICE_TOKENS[1:]]      # after BOS, SentencePiece's "▁a"
    assert byte_tokens(named[1:]) == byte_tokens(expected[1:])


@needs_stories
def test_generate_plain_logprob_lines_name_split_characters_as_vllm(capsys):
    status, out, err = run_main(capsys, *GENERATE, "-p", "Once upon a time", "--choice", CHOICE)
    assert status == 0, err
    lines = out.splitlines()[2:]
    assert "\ufffd" not in out
    assert [line.split("   top:")[0].rsplit(None, 1)[0].strip() for line in lines] == [repr(t) for t in CHOICE_TOKENS]


# ---- minillm bench latency ---------------------------------------------------------------------------------

LATENCY = ("bench", "latency", "--model", str(STORIES), "--device", "cpu", "--input-len", "3", "--output-len", "2",
           "--batch-size", "2", "--num-iters-warmup", "1", "--num-iters", "4")
VLLM_LINES = [r"Avg latency: \S+ seconds", r"Std latency: \S+ seconds",
              *(rf"{p}% percentile latency: \S+ seconds" for p in (10, 25, 50, 75, 90, 99))]


@pytest.fixture
def batches(monkeypatch):
    """Every batch LLM.generate ran: (prompts, params, outputs)."""
    from minillm import LLM
    seen, generate = [], LLM.generate

    def recording(self, prompts, params=None, *args, **kwargs):
        outs = generate(self, prompts, params, *args, **kwargs)
        seen.append((prompts, params, outs))
        return outs

    monkeypatch.setattr(LLM, "generate", recording)
    return seen


@needs_stories
def test_bench_latency_times_each_batch_after_the_warmup_and_prints_vllms_lines(capsys, tmp_path, batches):
    out_file = tmp_path / "latency.json"
    status, out, err = run_main(capsys, *LATENCY, "--n", "2", "--output-json", str(out_file))
    assert status == 0, err
    lines = out.splitlines()
    start = lines.index("Warming up...") + 1
    assert all(re.fullmatch(pattern, line) for pattern, line in zip(VLLM_LINES, lines[start:])), lines
    figures = json.loads(out_file.read_text())
    assert set(figures) == {"avg_latency", "std_latency", "latencies", "percentiles"}    # vLLM's keys, on the CPU
    assert len(figures["latencies"]) == 4 and list(figures["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert figures["avg_latency"] == pytest.approx(np.mean(figures["latencies"]))
    assert figures["percentiles"]["50"] == pytest.approx(np.median(figures["latencies"]))
    assert f"Avg latency: {figures['avg_latency']} seconds" in lines
    assert len(batches) == 1 + 4            # the warm-up, then the timed iterations: one fixed batch each
    first = batches[0][0]
    for prompts, params, outs in batches:
        assert prompts == first and len(prompts) == 2 and all(len(p) == 3 for p in prompts)
        assert (params.n, params.ignore_eos, params.max_tokens) == (2, True, 2)
        assert [len(c.token_ids) for o in outs for c in o.outputs] == [2] * 4


@needs_stories
def test_bench_latency_profile_profiles_one_batch_on_the_cpu_and_times_none(capsys, batches):
    status, out, err = run_main(capsys, *LATENCY, "--profile")
    assert status == 0, err
    assert "Profiling with cProfile" in out and "ops/numpy.py" in out
    assert "Avg latency" not in out
    assert len(batches) == 1 + 1


def test_bench_latency_turns_prefix_caching_off_as_vllm_does():
    engine = latency.engine_arguments(latency.parse_args(list(LATENCY[2:])))
    assert engine["enable_prefix_caching"] is False and engine["seed"] == 0
    engine = latency.engine_arguments(latency.parse_args([*LATENCY[2:], "--enable-prefix-caching", "--seed", "5",
                                                          "--block-size", "8"]))
    assert (engine["enable_prefix_caching"], engine["seed"], engine["block_size"]) == (True, 5, 8)


@needs_stories
@pytest.mark.parametrize("flags, named", [
    (("--batch-size", "0"), "--batch-size must be in [1, "),
    (("--n", "0"), "--n must be in [1, "),
    (("--num-iters", "0"), "--num-iters must be in [1, "),
    (("--num-iters-warmup", "-1"), "--num-iters-warmup must be in [0, "),
    (("--input-len", "x"), "argument --input-len: invalid int value: 'x'"),
    (("--use-beam-search", "--n", "11"), "--n with --use-beam-search: beam_width must be an integer in [1, 10]"),
    (("--profile", "--output-json", "out.json"), "--profile runs one profiled batch"),
    (("--block-size", "3"), "--block-size must be a power of two"),
    (("--input-len", "500", "--output-len", "100"), "--input-len 500 + --output-len 100 = 600 tokens do not fit in "
                                                    "the model's max_position_embeddings 512"),
    (("--max-model-len", "4"), "--input-len 3 + --output-len 2 = 5 tokens do not fit in --max-model-len 4"),
    (("--output-json", "/nonexistent-dir/out.json"), "--output-json /nonexistent-dir/out.json: no such directory"),
])
def test_bench_latency_bad_values_are_one_line_naming_the_flag(capsys, flags, named):
    status, out, err = run_main(capsys, *LATENCY, *flags)
    assert status in (1, 2) and "Avg latency" not in out
    assert named in one_line(err)


@needs_stories
def test_bench_latency_batch_past_the_engines_kv_pool_is_one_line_naming_the_flags(capsys):
    status, out, err = run_main(capsys, *LATENCY, "--input-len", "30", "--output-len", "30", "--num-kv-blocks", "1")
    assert status == 1 and "Traceback" not in err
    # the engine's notice of the max_model_len its pool holds comes first
    assert err.strip().splitlines()[-1].endswith("--input-len 30 + --output-len 30 = 60 tokens do not fit in the engine's "
                                  "max_model_len 16; lower them, or give the KV pool more (--num-kv-blocks, "
                                  "--kv-cache-memory-bytes)")


def test_bench_lists_latency(capsys):
    status, out, _ = run_main(capsys, "bench", "--help")
    assert status == 0 and re.search(r"\blatency\s+Latency of one fixed batch", out)
    status, out, _ = run_main(capsys, "bench", "latency", "--help")
    assert status == 0 and out.startswith("Usage: minillm bench latency [OPTIONS]")
    assert all(flag in out for flag in ("--input-len", "--output-len", "--batch-size", "--n ", "--num-iters-warmup",
                                        "--num-iters ", "--profile", "--output-json", "--max-num-seqs"))
