"""One rule for each of the two seeds: the engine seed (LLM(seed=...), serve's and every benchmark's --seed)
is vLLM's, an integer in [0, 2**32 - 1]; a request's (SamplingParams.seed, generate's and chat's --seed) a
signed 64-bit integer, -1 none. Engine-args errors echo a client's value shortened; bench pd_disagg on the
CPU refuses sizes its servers cannot hold before starting them; a KV connector needs a role, as vLLM's."""
from __future__ import annotations

import pytest
from test_abuse29b_cli import one_line
from test_cli import STORIES, needs_stories, run_main

from minillm.benchmarks import latency, pd_disagg, serving, throughput
from minillm.benchmarks.cli_args import BenchError, BenchUsageError
from minillm.config import EngineConfig
from minillm.kv_connector.transfer_config import KVTransferConfig
from minillm.sampling_params import SamplingParams

ENGINE_SEED = "must be an integer in [0, 2**32 - 1]"


# ---- seeds ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [-1, -2, 2**32, 2**63, 2**64, 2**1100, 1.0, True, "3"], ids=range(9))
def test_an_engine_seed_outside_vllms_range_is_refused_naming_it(seed):
    # LLM(seed=2**64) was taken (np.random.seed, which vLLM seeds with it, refuses past 2**32 - 1)
    with pytest.raises(ValueError, match=r"seed must be an integer") as info:
        EngineConfig(str(STORIES), seed=seed)
    assert len(str(info.value)) < 120, str(info.value)


def test_the_ends_of_the_engine_seeds_range_are_taken():
    assert EngineConfig(str(STORIES), seed=2**32 - 1).seed == 2**32 - 1
    assert EngineConfig(str(STORIES), seed=0).seed == 0


@pytest.mark.parametrize("seed", ["-1", "4294967296"])
def test_serves_seed_is_the_engine_seed_and_refused_alike(capsys, monkeypatch, seed):
    # --seed 4294967296 started the server; -1 was refused in other words than LLM's
    monkeypatch.setattr("minillm.server.app.run_server", lambda *a, **k: pytest.fail("the server started"))
    status, _, err = run_main(capsys, "serve", str(STORIES), "--device", "cpu", "--seed", seed)
    assert status == 2 and f"'--seed': {ENGINE_SEED}, got {seed}" in one_line(err), err


@pytest.mark.parametrize("module, argv", [
    (throughput, ["--model", str(STORIES), "--device", "cpu"]),
    (latency, ["--model", str(STORIES), "--device", "cpu"]),
    (serving, []),
    (pd_disagg, ["--device", "cpu", "--small"]),
])
@pytest.mark.parametrize("seed", ["-1", "4294967296"])
def test_every_benchmarks_seed_is_the_engine_seed(module, argv, seed):
    # throughput and latency took 2**32 and more; pd_disagg and serving took -1 too
    with pytest.raises(BenchUsageError) as info:
        module.parse_args([*argv, "--seed", seed])
    assert f"--seed {ENGINE_SEED}, got {seed}" in info.value.message, info.value.message


@needs_stories
@pytest.mark.parametrize("seed", ["-2", "-1", "4294967296"])
def test_generates_seed_is_the_request_seed(capsys, seed):
    # the request's seed keeps SamplingParams' range: a negative one, or one past 2**32, is vLLM's too
    status, out, err = run_main(capsys, "generate", str(STORIES), "--device", "cpu", "-p", "Once", "--max-tokens",
                                "2", "--seed", seed)
    assert status == 0 and out.strip(), err
    assert SamplingParams(seed=int(seed)).seed == (None if seed == "-1" else int(seed))


# ---- shortened echoes ------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("gpu_memory_utilization", 2**1100), ("device", "x" * 5000), ("dtype", "y" * 5000),
    ("load_format", "z" * 5000), ("block_size", 2**1100), ("num_kv_blocks", -2**1100), ("max_num_seqs", 2**1100),
    ("max_model_len", -2**1100), ("seed", "s" * 5000), ("kv_offload_gib", 2**1100),
    ("max_step_ms", -2**1100), ("tensor_parallel_size", -2**1100), ("kv_cache_memory_bytes", -2**1100),
    ("max_num_batched_tokens", -2**1100), ("max_logprobs", 2**1100),
], ids=lambda v: v if isinstance(v, str) and len(v) < 40 else "huge")
def test_engine_args_errors_echo_a_huge_value_shortened(field, value):
    # gpu_memory_utilization=2**1100 printed all 332 digits back
    with pytest.raises(ValueError) as info:
        EngineConfig(str(STORIES), **{field: value})
    assert len(str(info.value)) < 400, str(info.value)[:300]


@pytest.mark.parametrize("config", [
    {"kv_role": "kv_" + "x" * 5000}, {"kv_role": "kv_both", "kv_ip": 10**2000},
    {"kv_role": "kv_both", "kv_port": 2**1100}, {"kv_role": "kv_both", "kv_buffer_device": "d" * 5000},
    {"kv_role": "kv_both", "kv_connector": "c" * 5000}, {"kv_role": "kv_both", "kv_lease_s": -2**1100},
    {"kv_role": "kv_both", "engine_id": 2**1100},
])
def test_kv_transfer_config_errors_echo_a_huge_value_shortened(config):
    with pytest.raises(ValueError) as info:
        KVTransferConfig.from_any(config)
    assert len(str(info.value)) < 300, str(info.value)[:300]


@pytest.mark.parametrize("config", [{"num_speculative_tokens": 2**1100}, {"method": "m" * 5000},
                                    {"model": "m" * 5000}, {"prompt_lookup_min": 2**1100, "prompt_lookup_max": 3}])
def test_speculative_config_errors_echo_a_huge_value_shortened(config):
    with pytest.raises(ValueError) as info:
        EngineConfig(str(STORIES), speculative_config={"method": "ngram", "num_speculative_tokens": 2, **config})
    assert len(str(info.value)) < 300, str(info.value)[:300]


# ---- bench pd_disagg on the CPU -----------------------------------------------------------------

def test_pd_disagg_on_the_cpu_refuses_kv_pools_past_the_memory_before_starting(monkeypatch):
    # the defaults started the servers and failed 19 s later: "--num-kv-blocks 8192 needs 28.0 GiB"
    monkeypatch.setattr(pd_disagg, "available_host_bytes", lambda: 16 * 2**30)
    monkeypatch.setattr(pd_disagg, "Process", lambda *a, **k: pytest.fail("a server started"))
    with pytest.raises(BenchError) as info:
        pd_disagg.main(["--device", "cpu", "--phases", "equality"])
    message = str(info.value)
    assert "--prefill-blocks 4096 and --decode-blocks 8192" in message, message
    assert "16.0 GiB" in message and "blocks fit" in message and "--small" in message, message


def test_pd_disagg_sizes_that_fit_the_cpu_pass_the_memory_check(monkeypatch):
    monkeypatch.setattr(pd_disagg, "available_host_bytes", lambda: 16 * 2**30)
    args = pd_disagg.parse_args(["--device", "cpu", "--small"])
    pd_disagg.check_cpu_memory(args, pd_disagg.TINY)     # no error
    with pytest.raises(BenchError, match=r"--single-blocks 100000 needs"):
        big = pd_disagg.parse_args(["--device", "cpu", "--small", "--single-blocks", "100000"])
        pd_disagg.check_cpu_memory(big, pd_disagg.QWEN3_0_6B)


# ---- a KV connector needs a role -----------------------------------------------------------------

@pytest.mark.parametrize("config", [{"kv_connector": "PDConnector"}, {}, '{"kv_connector": "PDConnector"}',
                                    {"kv_connector": "PDConnector", "kv_role": None}])
def test_a_kv_connector_without_a_role_is_refused_as_vllm_refuses_it(config):
    # it started as kv_both
    with pytest.raises(ValueError, match=r"kv_transfer_config.kv_role must be given.*kv_producer, kv_consumer, "
                                         r"kv_both"):
        KVTransferConfig.from_any(config)


def test_serve_names_the_missing_role(capsys, monkeypatch):
    monkeypatch.setattr("minillm.server.app.run_server", lambda *a, **k: pytest.fail("the server started"))
    status, _, err = run_main(capsys, "serve", str(STORIES), "--device", "cpu", "--kv-transfer-config",
                              '{"kv_connector": "PDConnector"}')
    assert status == 2 and "kv_role must be given" in one_line(err) and "--kv-transfer-config" in err, err
