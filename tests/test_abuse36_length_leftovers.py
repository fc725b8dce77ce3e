"""Length boundaries left after test_abuse36_length_bounds, as vLLM users drive them: an empty text prompt
at the engine, --no-enable-chunked-prefill, min_tokens over max_completion_tokens, CLI errors naming flags,
and MINILLM_ALLOW_LONG_MAX_MODEL_LEN (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import test_abuse22_api_cli
from test_abuse29b_cli import one_line
from test_cli import STORIES, needs_stories, run_main
from test_server_helpers import openai_error
from test_server_helpers import chat_template_server, story_streams  # noqa: F401 (the server and healthy fixtures)

from minillm import LLM, SamplingParams
from minillm.block_manager import BlockManager
from minillm.cli import in_flag_words
from minillm.config import ModelConfig
from minillm.scheduler import Scheduler, StepOutput
from minillm.sequence import Sequence

started = test_abuse22_api_cli.started      # a fixture
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
WORDS = " ".join(["a"] * 99)      # 100 tokens of stories260K (BOS and one a word)
LONG_VARIABLES = ("MINILLM_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_ALLOW_LONG_MAX_MODEL_LEN")


def run_engine(engine, request_id: str, prompt, params, **kwargs):
    """add_request, then step until that request finishes: its last RequestOutput."""
    engine.add_request(request_id, prompt, params, **kwargs)
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out


# ---- 1. an empty text prompt at the engine ----------------------------------------------------------------------

def test_the_engine_runs_an_empty_text_prompt_on_bos_alone(llm):
    # LLMEngine.add_request refused "" ("prompt must not be empty") where LLM.generate and vLLM's engine
    # run it on the tokenizer's BOS alone.
    [want] = llm.generate([""], GREEDY, use_tqdm=False)
    out = run_engine(llm.llm_engine, "empty", "", GREEDY)
    assert (out.prompt, out.prompt_token_ids) == ("", want.prompt_token_ids) == ("", [1])
    assert out.outputs[0].token_ids == want.outputs[0].token_ids and len(want.outputs[0].token_ids) == 4


def test_an_empty_text_without_bos_is_still_refused(llm):
    # No special tokens: no tokens at all, which vLLM refuses too ("The decoder prompt cannot be empty").
    with pytest.raises(ValueError, match="prompt must not be empty: an empty text has no tokens without a BOS"):
        llm.llm_engine.add_request("none", "", GREEDY, tokenization_kwargs={"add_special_tokens": False})
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.generate([""], GREEDY, use_tqdm=False, tokenization_kwargs={"add_special_tokens": False})
    assert not llm.llm_engine.has_unfinished_requests()


# ---- 2. --no-enable-chunked-prefill -----------------------------------------------------------------------------

def _sequence(rid: str, first: int, prompt_len: int) -> Sequence:
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    return Sequence(rid, 0, list(range(first, first + prompt_len)), params, 0.0, np.random.default_rng(0), 3)


def _counts(enable_chunked_prefill: bool) -> list[list[int]]:
    """Each step's token counts for two 10-token prompts under a 16-token budget."""
    sched = Scheduler(BlockManager(64, 4, True), 8, 16, 16, [0], enable_chunked_prefill=enable_chunked_prefill)
    sched.add(_sequence("a", 1, 10))
    sched.add(_sequence("b", 20, 10))
    steps = []
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update_from_output(out, StepOutput({s.seq_id: [7] for s in out.sampling_seqs}))
        steps.append(out.num_new_tokens)
    return steps


def test_without_chunked_prefill_a_prompt_is_scheduled_whole():
    assert _counts(True)[:2] == [[10, 6], [1, 4]]          # b's prompt in two chunks
    assert _counts(False)[:2] == [[10], [1, 10]]           # b waits for a step with room for all of it


def test_generate_without_chunked_prefill_matches_with_it(capsys):
    args = ("generate", str(STORIES), "--device", "cpu", "--max-model-len", "128", "--max-num-batched-tokens", "128",
            "-p", WORDS, "-p", WORDS + " a", "--max-tokens", "3", "--ignore-eos", "--json")
    status, chunked, err = run_main(capsys, *args)
    assert status == 0, err
    status, whole, err = run_main(capsys, *args, "--no-enable-chunked-prefill")
    assert status == 0, err
    records = [json.loads(line) for line in whole.splitlines()]
    assert [len(r["prompt_token_ids"]) for r in records] == [100, 101]
    assert whole == chunked


@needs_stories
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_no_chunked_prefill_under_max_model_len_is_refused_naming_the_flags(capsys, started, command):
    extra = ("-p", "x") if command == "generate" else ()
    status, _, err = run_main(capsys, command, str(STORIES), "--device", "cpu", "--no-enable-chunked-prefill",
                              "--max-num-batched-tokens", "64", "--max-model-len", "128", *extra)
    assert status == 2 and not started
    assert f"minillm {command}: error: Invalid value for '--max-num-batched-tokens': 64 is smaller than " \
           "--max-model-len 128: with --no-enable-chunked-prefill a prompt runs whole in one step" in one_line(err)


@needs_stories
def test_serve_takes_no_chunked_prefill_where_the_budget_holds_the_context(capsys, started):
    status, _, err = run_main(capsys, "serve", str(STORIES), "--device", "cpu", "--no-enable-chunked-prefill")
    assert (status, err) == (0, "")
    assert started["config"].enable_chunked_prefill is False


def test_the_python_api_names_the_fields(stories_path):
    with pytest.raises(ValueError, match="max_num_batched_tokens 64 is smaller than max_model_len 128: with "
                                         "enable_chunked_prefill False"):
        LLM(str(stories_path), device="cpu", enable_chunked_prefill=False, max_num_batched_tokens=64,
            max_model_len=128)
    with pytest.raises(ValueError, match="max_step_ms sizes prompt chunks, which enable_chunked_prefill False"):
        LLM(str(stories_path), device="cpu", enable_chunked_prefill=False, max_step_ms=20)
    # the model's length (512), fitted to the pool, is over the budget: known once the engine sized it
    with pytest.raises(ValueError, match="max_num_batched_tokens 256 is smaller than max_model_len 512"):
        LLM(str(stories_path), device="cpu", enable_chunked_prefill=False, max_num_batched_tokens=256)


# ---- 3. min_tokens over max_completion_tokens -------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "Tell me a story."}]


def test_min_tokens_over_max_completion_tokens_names_the_field_sent(http, healthy_stream):
    # It said "min_tokens must not exceed max_tokens (3)", a field the client did not send.
    body = {"model": "stories", "messages": MESSAGES, "max_completion_tokens": 3, "min_tokens": 5}
    error = openai_error(http.post("/v1/chat/completions", json=body), 400, "min_tokens")
    assert "max_completion_tokens (3)" in error["message"] and "max_tokens" not in \
        error["message"].replace("max_completion_tokens", ""), error
    body = {"model": "stories", "messages": MESSAGES, "max_tokens": 3, "min_tokens": 5}
    error = openai_error(http.post("/v1/chat/completions", json=body), 400, "min_tokens")
    assert "max_tokens (3)" in error["message"], error


# ---- 4. CLI errors name the flags -------------------------------------------------------------------------------

@needs_stories
@pytest.mark.parametrize("pool_flag", ["--num-kv-blocks", "--num-gpu-blocks-override"])
def test_a_pool_too_small_for_max_model_len_names_the_flags(capsys, pool_flag):
    status, _, err = run_main(capsys, "generate", str(STORIES), "--device", "cpu", "--max-model-len", "100",
                              pool_flag, "3", "-p", "x")
    assert status == 2
    assert one_line(err).startswith("minillm generate: error: Invalid value for '--max-model-len': 100 needs 7 KV "
                                    "blocks but the pool has 3; lower --max-model-len or raise --num-kv-blocks ")


@needs_stories
def test_chat_names_the_flags_of_an_engine_refusal(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("hi\n"))
    status, _, err = run_main(capsys, "chat", str(STORIES), "--device", "cpu", "--max-model-len", "100",
                              "--num-kv-blocks", "3")
    assert status == 2 and "lower --max-model-len or raise --num-kv-blocks" in one_line(err), err


def test_the_python_api_keeps_the_keyword_names(stories_path):
    with pytest.raises(ValueError, match="lower max_model_len or raise num_kv_blocks$"):
        LLM(str(stories_path), device="cpu", max_model_len=100, num_kv_blocks=3)


def test_other_config_errors_name_their_flags(capsys):
    status, _, err = run_main(capsys, "generate", "m", "-p", "x", "--kv-offload-gib", "0.001",
                              "--no-enable-prefix-caching")
    assert status == 2
    assert "'--kv-offload-gib': needs --enable-prefix-caching: the host tier" in one_line(err), err


def test_flag_words_leave_quoted_keys_and_file_names():
    engine = {"max_model_len": ("--max-model-len", None),
              "enable_chunked_prefill": ("--enable-chunked-prefill", "--no-enable-chunked-prefill")}
    assert in_flag_words("has unknown field 'max_model_len'", "speculative_config", "--speculative-config",
                         engine) == "has unknown field 'max_model_len'"
    assert in_flag_words("under max_model_len 9 with enable_chunked_prefill False", "x", "--x", engine) == \
        "under --max-model-len 9 with --no-enable-chunked-prefill"


# ---- 5. MINILLM_ALLOW_LONG_MAX_MODEL_LEN ------------------------------------------------------------------------

def test_a_max_model_len_past_the_model_names_the_variable(stories_path, monkeypatch):
    for name in LONG_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="max_model_len 700 exceeds the model's max_position_embeddings 512; to "
                                         "allow it anyway, set MINILLM_ALLOW_LONG_MAX_MODEL_LEN=1"):
        LLM(str(stories_path), device="cpu", max_model_len=700)


@pytest.mark.parametrize("name, value", [("MINILLM_ALLOW_LONG_MAX_MODEL_LEN", "1"),
                                         ("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "true")])
def test_the_variable_allows_it_with_a_warning(stories_path, monkeypatch, capsys, name, value):
    for other in LONG_VARIABLES:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, value)
    with LLM(str(stories_path), device="cpu", max_model_len=700) as llm:
        assert f"max_position_embeddings 512, allowed by {name}" in capsys.readouterr().err
        prompt = [1] + [261] * 599          # 600 tokens: positions past the model's 512
        [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                             use_tqdm=False)
        assert len(out.prompt_token_ids) == 600 and len(out.outputs[0].token_ids) == 3
        assert llm.llm_engine.max_model_len == 700


@pytest.mark.parametrize("value", ["0", "", "no"])
def test_other_values_of_the_variable_allow_nothing(stories_path, monkeypatch, value):
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    monkeypatch.setenv("MINILLM_ALLOW_LONG_MAX_MODEL_LEN", value)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 512"):
        LLM(str(stories_path), device="cpu", max_model_len=513)


def test_a_rope_scaling_bound_to_the_length_is_refused_anyway(monkeypatch):
    from minillm.config import check_max_model_len_in_model
    monkeypatch.setenv("MINILLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    shape = dict(architecture="llama", vocab_size=32, hidden_size=8, intermediate_size=16, num_layers=1,
                 num_heads=2, num_kv_heads=2, head_dim=4, rms_norm_eps=1e-5, rope_theta=1e4,
                 max_position_embeddings=64, tie_word_embeddings=True)
    assert check_max_model_len_in_model(128, ModelConfig(**shape)).startswith("max_model_len 128 exceeds")
    dynamic = ModelConfig(**shape, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=r"its rope_scaling \(dynamic\) computes no positions past"):
        check_max_model_len_in_model(128, dynamic)
    assert check_max_model_len_in_model(64, dynamic) is None
