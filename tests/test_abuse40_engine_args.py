"""EngineArgs.add_cli_args as vLLM's (serve's engine flags, from their one table), and vLLM's names that
LLM() takes, taken by EngineArgs as LLM takes them."""
from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from minillm import LLM, EngineArgs, LLMEngine, SamplingParams
from minillm.cli import DEFAULT_CHAT_MODEL, ENGINE_OPTIONS, NOT_ENGINE_FIELDS, SERVE_ENGINE_OPTIONS, option_flags, \
    serve_parameters
from minillm.config import EngineConfig
from minillm.engine_args import VLLM_ONLY_DEFAULTS
from minillm.llm import VLLM_FIXED_ARGS, VLLM_RENAMED_ARGS
from minillm.structured_outputs_config import StructuredOutputsConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def parser() -> argparse.ArgumentParser:
    return EngineArgs.add_cli_args(argparse.ArgumentParser(prog="engine"))


# ---- add_cli_args ---------------------------------------------------------------------------------------------

def test_add_cli_args_defaults_are_engine_args_defaults():
    # The flags come from the CLI's table and the dataclass from EngineConfig: nothing given, they agree.
    assert EngineArgs.from_cli_args(parser().parse_args([])) == EngineArgs(model=DEFAULT_CHAT_MODEL)


def test_add_cli_args_round_trips_vllms_flags():
    args = parser().parse_args([
        "--model", "m", "--max-model-len", "1k", "--dtype", "half", "--num-gpu-blocks-override", "8",
        "--served-model-name", "a", "b", "--seed", "3", "--trust-remote-code", "--no-enable-prefix-caching",
        "--structured-outputs-config", '{"backend": "guidance"}', "-tp", "1", "--kv-cache-memory-bytes", "1G",
        "--kv-transfer-config", '{"kv_connector": "PDConnector", "kv_role": "kv_producer"}'])
    assert EngineArgs.from_cli_args(args) == EngineArgs(
        model="m", max_model_len=1000, dtype="half", num_kv_blocks=8, served_model_name=["a", "b"], seed=3,
        trust_remote_code=True, enable_prefix_caching=False, structured_outputs_config={"backend": "guidance"},
        tensor_parallel_size=1, kv_cache_memory_bytes=1 << 30,
        kv_transfer_config='{"kv_connector": "PDConnector", "kv_role": "kv_producer"}')
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert (config.max_model_len, config.dtype, config.num_kv_blocks, config.served_model_name, config.seed) == \
        (1000, "float16", 8, "a", 3)
    assert config.structured_outputs_config == StructuredOutputsConfig(backend="guidance")


def test_add_cli_args_has_every_engine_flag_of_serve():
    # One table: each flag serve sets the engine with is the parser's, with the same field as its dest.
    actions = {flag: action.dest for action in parser()._actions for flag in action.option_strings}
    for name, (annotation, _) in ENGINE_OPTIONS.items():
        if name not in NOT_ENGINE_FIELDS:
            info = annotation.__metadata__[0]
            flags = [f for d in (info.default, *info.param_decls) if isinstance(d, str) for f in d.split("/") if f]
            assert all(actions.get(flag) == name for flag in flags if not flag.startswith("--no-")), name
    serve = {p.name: p for p in serve_parameters()}
    for name in SERVE_ENGINE_OPTIONS:
        assert all(actions.get(flag) == name for flag in option_flags(serve[name])), name
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(actions.values()) - {"help"} <= fields


@pytest.mark.parametrize("argv,flag", [
    (["--max-model-len", "lots"], "--max-model-len"), (["--dtype", "fp64"], "--dtype"),
    (["--structured-outputs-config", "[1]"], "--structured-outputs-config"), (["--seed", "x"], "--seed"),
    (["--kv-cache-memory-bytes", "much"], "--kv-cache-memory-bytes"),
], ids=["max-model-len", "dtype", "structured-outputs-config", "seed", "kv-cache-memory-bytes"])
def test_add_cli_args_refuses_a_bad_value_naming_its_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(argv)
    assert exc.value.code == 2 and flag in capsys.readouterr().err


def test_add_cli_args_leaves_a_parsers_own_arguments():
    own = argparse.ArgumentParser()
    own.add_argument("--model", default="mine")
    own.add_argument("--port", type=int, default=8000)
    args = EngineArgs.add_cli_args(own).parse_args(["--port", "1", "--max-num-seqs", "4"])
    assert (args.model, args.port) == ("mine", 1)
    assert EngineArgs.from_cli_args(args) == EngineArgs(model="mine", max_num_seqs=4)


# ---- vLLM's names that LLM() takes ----------------------------------------------------------------------------

def test_engine_args_has_a_field_at_vllms_default_for_each_vllm_name_llm_takes():
    assert set(VLLM_ONLY_DEFAULTS) == set(VLLM_FIXED_ARGS) | set(VLLM_RENAMED_ARGS) | {"compilation_config"}
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    assert {name: defaults[name] for name in VLLM_ONLY_DEFAULTS} == VLLM_ONLY_DEFAULTS
    for name, (is_honoured, _) in VLLM_FIXED_ARGS.items():
        assert is_honoured(VLLM_ONLY_DEFAULTS[name]), name
    config = EngineArgs(model="m").create_engine_config()
    assert config == EngineConfig(model="m", structured_outputs_config=StructuredOutputsConfig())


@pytest.mark.parametrize("given", [
    {"quantization": "awq"}, {"pipeline_parallel_size": 2}, {"swap_space": -1}, {"enable_lora": True},
    {"compilation_config": 3}, {"num_gpu_blocks_override": 8, "num_kv_blocks": 4},
], ids=["quantization", "pipeline", "swap-space", "lora", "compilation", "renamed-twice"])
def test_engine_args_refuses_what_llm_refuses_in_the_same_words(stories_path, given):
    with pytest.raises(ValueError) as offline:
        LLM(str(stories_path), device="cpu", **given)
    with pytest.raises(ValueError) as args:
        EngineArgs(model=str(stories_path), device="cpu", **given).create_engine_config()
    assert str(args.value) == str(offline.value) and next(iter(given)) in str(args.value)


def test_engine_args_reads_vllms_names_as_llm_does():
    args = EngineArgs(model="m", trust_remote_code=True, num_gpu_blocks_override=8, swap_space=0,
                      compilation_config={"cudagraph_mode": "NONE"}, hf_overrides={})
    config = args.create_engine_config()
    assert config.num_kv_blocks == 8 and config.enforce_eager is True
    parsed = parser().parse_args(["--model", "m", "--trust-remote-code"])
    assert EngineArgs.from_cli_args(parsed).trust_remote_code is True


def test_engine_from_cli_args_runs_as_llm_does(stories_path):
    argv = ["--model", str(stories_path), "--device", "cpu", "--max-model-len", "64", "--num-gpu-blocks-override",
            "16", "--trust-remote-code", "--structured-outputs-config", json.dumps({"backend": "guidance"})]
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(parser().parse_args(argv)), log=lambda line: None)
    try:
        engine.add_request("r", "Once upon a time", GREEDY)
        done = []
        while engine.has_unfinished_requests():
            done += [out for out in engine.step() if out.finished]
        assert engine.config.num_kv_blocks == 16
    finally:
        engine.shutdown()
    with LLM(str(stories_path), device="cpu", max_model_len=64, num_gpu_blocks_override=16) as llm:
        expected = llm.generate(["Once upon a time"], GREEDY)[0].outputs[0].token_ids
    assert list(done[0].outputs[0].token_ids) == list(expected)
