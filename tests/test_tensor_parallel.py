"""Tensor parallelism on the CPU: N processes, shared-memory collectives, the logits and greedy
tokens of one process, and no process left behind."""
import dataclasses
import gc
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from minillm import LLM, SamplingParams
from minillm.attention import AttentionMetadata
from minillm.config import EngineConfig
from minillm.device import CpuDevice
from minillm.loader import expected_weight_shapes, load_model_config, load_weights
from minillm.ops import get_ops
from minillm.parallel import channel
from minillm.parallel.communicator import ShmCommunicator, ShmGroup
from minillm.parallel.errors import TensorParallelError
from minillm.parallel.executor import TensorParallelExecutor
from minillm.parallel.sharding import check_tensor_parallel_size, shard_model_config, shard_weights

from conftest import REPO, STORIES

# Tiny random models with 8 query heads and 4 KV heads, so 2 and 4 ranks split them.
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
              bos_token_id=1, eos_token_id=2, torch_dtype="float32")
TINY = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512,
                  tie_word_embeddings=False),
    # 510 rows split over 4 ranks: the last rank's vocabulary shard is padded
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=510,
                  tie_word_embeddings=False),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=512, head_dim=16,
                  tie_word_embeddings=True),
}
# Small enough to chunk every long prompt and to preempt while the batch decodes.
ENGINE = dict(device="cpu", block_size=4, num_kv_blocks=24, max_num_seqs=4, max_num_batched_tokens=16)
PROMPTS = [[1] + list(np.random.default_rng(i).integers(3, 500, size=n)) for i, n in
           enumerate([37, 5, 22, 9, 30, 14])]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def write_tiny_model(out, arch: str):
    """config.json, random safetensors weights (no torch needed) and a word-level tokenizer."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models
    out.mkdir(parents=True, exist_ok=True)
    cfg = {**COMMON, **TINY[arch]}
    (out / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    weights = {name: (rng.normal(0.0, 0.2 if len(shape) > 1 else 1.0, shape)).astype(np.float32)
               for name, shape in expected_weight_shapes(load_model_config(out)).items()}
    save_file(weights, str(out / "model.safetensors"))
    vocab = {f"<t{i}>": i for i in range(cfg["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="<t0>")).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<t2>"}))
    return out


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_models")
    return {arch: str(write_tiny_model(root / arch, arch)) for arch in TINY}


def step_logits(runner) -> list[np.ndarray]:
    """Logits [B, V] at each sequence's last token, three steps, through scattered blocks:
    prefill chunks, then a chunk of one sequence with decodes of the others, then decodes only."""
    seqs = {"a": PROMPTS[0][:20] + [7, 8], "b": PROMPTS[2][:10] + [9, 10], "c": PROMPTS[4][:6] + [11, 12]}
    tables = {"a": [5, 2, 7, 0, 9, 11], "b": [3, 8, 1], "c": [13, 6]}
    steps = [[("a", 0, 12), ("b", 0, 10), ("c", 0, 6)], [("a", 12, 21), ("b", 10, 11), ("c", 6, 7)],
             [("a", 21, 22), ("b", 11, 12), ("c", 7, 8)]]
    out = []
    for step in steps:
        ids, pos, slots, qsl, lens = [], [], [], [0], []
        for name, start, end in step:
            toks = seqs[name]
            p = np.arange(start, end)
            table = np.asarray(tables[name])
            ids += toks[start:end]
            pos.append(p)
            slots.append(table[p // 4] * 4 + p % 4)
            qsl.append(qsl[-1] + end - start)
            lens.append(end)
        block_tables = np.asarray([t + [0] * (6 - len(t)) for t in tables.values()], np.int32)
        meta = AttentionMetadata(np.asarray(qsl, np.int32), np.asarray(lens, np.int32), block_tables,
                                 np.concatenate(slots).astype(np.int32), max(np.diff(qsl)), max(lens),
                                 all(n == 1 for n in np.diff(qsl)))
        logits = runner.compute_logits(np.asarray(ids, np.int32), np.concatenate(pos).astype(np.int32), meta,
                                 list(range(len(step))))
        out.append(np.array(logits))
    return out


@pytest.fixture(scope="module")
def references(tiny_models):
    """Per model, on one process: the step logits and the greedy tokens of the batch."""
    refs = {}
    for arch, path in tiny_models.items():
        with LLM(path, **ENGINE) as llm:
            logits = step_logits(llm.engine.runner)
            tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
            assert llm.engine.scheduler.num_preemptions > 0
        refs[arch] = (logits, tokens)
    return refs


def assert_no_workers(pids):
    assert mp.active_children() == []
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("arch", list(TINY))
def test_logits_and_greedy_tokens_equal_one_process(tiny_models, references, arch, tp):
    ref_logits, ref_tokens = references[arch]
    # TP=4 also keeps a step in flight: its inputs wait on tokens the last step sampled on rank 0.
    with LLM(tiny_models[arch], tensor_parallel_size=tp, async_scheduling=tp == 4, **ENGINE) as llm:
        pids = llm.engine.runner.workers.pids
        assert len(pids) == tp - 1 and all(p.is_alive() for p in mp.active_children())
        for ours, ref in zip(step_logits(llm.engine.runner), ref_logits):
            assert ours.shape == ref.shape
            assert np.abs(ours - ref).max() <= 1e-5 * np.abs(ref).max()
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.block_manager.num_used_blocks == 0
    assert tokens == ref_tokens
    assert_no_workers(pids)


def test_shards_put_back_together_are_the_weights(tiny_models):
    config = load_model_config(tiny_models["qwen2"])          # biases, and a vocabulary of 510
    rng = np.random.default_rng(3)
    weights = {n: rng.standard_normal(s).astype(np.float32) for n, s in expected_weight_shapes(config).items()}
    shards = [shard_weights(weights, config, r, 4) for r in range(4)]
    p = "model.layers.1."
    for name, axis in [(p + "self_attn.q_proj.weight", 0), (p + "self_attn.k_proj.bias", 0),
                       (p + "self_attn.v_proj.weight", 0), (p + "mlp.gate_proj.weight", 0),
                       (p + "self_attn.o_proj.weight", 1), (p + "mlp.down_proj.weight", 1)]:
        np.testing.assert_array_equal(np.concatenate([s[name] for s in shards], axis=axis), weights[name])
    # KV heads: each rank holds one of the 4 whole heads (head_dim 8 rows)
    assert shards[2][p + "self_attn.k_proj.weight"].shape == (config.head_dim, config.hidden_size)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = np.concatenate([s[name] for s in shards])       # [4 * 128, D]: two padding rows
        np.testing.assert_array_equal(rows[:510], weights[name])
        assert rows.shape[0] == 512 and not rows[510:].any()
    assert shards[3][p + "input_layernorm.weight"] is weights[p + "input_layernorm.weight"]
    rank = shard_model_config(config, 4)
    assert (rank.num_heads, rank.num_kv_heads, rank.intermediate_size, rank.vocab_size) == (2, 1, 24, 510)


def _collective_rank(handle, rank: int, results) -> None:
    """A spawned rank: checks its own results (results[rank] = 1 if right); then rank 2 leaves
    and rank 1 waits on."""
    comm = ShmCommunicator(handle, rank, lambda: None, timeout=60)
    results[rank] = int(_check_collectives(comm))
    if rank == 1:
        comm.all_reduce(np.ones(4, np.float32))     # never completes: rank 2 is gone


def _check_collectives(comm) -> bool:
    """all_reduce and all_gather of arrays ten slots long (the slot is 64 bytes)."""
    n, r = comm.world_size, comm.rank
    x = np.arange(160, dtype=np.float32).reshape(10, 16) * (r + 1) + r
    want = sum(np.arange(160, dtype=np.float32).reshape(10, 16) * (k + 1) + k for k in range(n))
    parts = [np.full((3, 7), k, np.int32) + np.arange(7, dtype=np.int32) for k in range(n)]
    ok = np.array_equal(comm.all_reduce(x), want)
    ok &= np.array_equal(comm.all_gather(parts[r]), np.concatenate(parts, axis=1))
    return bool(ok & np.array_equal(comm.all_reduce(x[:1, :3]), want[:1, :3]))   # shorter than a slot


def test_collectives_in_slot_sized_chunks_and_a_rank_that_leaves():
    ctx = mp.get_context("spawn")
    group = ShmGroup(ctx, 3, 64)
    results = ctx.Array("b", 3)
    procs = [ctx.Process(target=_collective_rank, args=(group.handle, r, results)) for r in (1, 2)]
    for p in procs:
        p.start()

    def check_peers():
        for r, p in enumerate(procs, 1):
            if not p.is_alive():
                raise TensorParallelError(f"rank {r} exited with code {p.exitcode}")

    try:
        comm = ShmCommunicator(group.handle, 0, check_peers, timeout=60)
        assert _check_collectives(comm)
        procs[1].join(60)
        assert list(results) == [0, 1, 1]           # ranks 1 and 2 got the right results too
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 2 exited with code 0"):
            comm.all_reduce(np.ones(4, np.float32))
        assert time.monotonic() - t0 < 30           # found by the liveness check, not the time limit
        assert procs[0].is_alive()
    finally:
        for p in procs:
            p.terminate()
            p.join()
        group.close()


def test_bad_sizes_are_value_errors_and_start_nothing(tiny_models):
    for size, needle in [(3, r"tensor_parallel_size 3 must divide the model's num_attention_heads \(8\)"),
                         (16, "tensor_parallel_size 16 must divide"), (0, "tensor_parallel_size must be"),
                         (True, "tensor_parallel_size must be")]:
        with pytest.raises(ValueError, match=needle):
            LLM(tiny_models["llama"], tensor_parallel_size=size, **ENGINE)
    assert mp.active_children() == []
    config = load_model_config(tiny_models["llama"])
    with pytest.raises(ValueError, match="intermediate_size"):
        check_tensor_parallel_size(dataclasses.replace(config, intermediate_size=90), 4, "numpy")
    with pytest.raises(ValueError, match="CPU backend only"):
        check_tensor_parallel_size(config, 2, "cuda")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model="m", tensor_parallel_size=1.5)


def test_a_dead_worker_is_an_error_not_a_hang(tiny_models):
    llm = LLM(tiny_models["llama"], tensor_parallel_size=4, **ENGINE)
    llm.generate(PROMPTS[:2], GREEDY)
    procs = mp.active_children()
    victim = llm.engine.runner.workers.peers.procs[1]           # rank 2
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(60)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 2 \(pid \d+\) exited with code -9"):
        llm.generate(PROMPTS[:2], GREEDY)
    with pytest.raises(TensorParallelError, match="rank 2"):    # the group stays stopped
        llm.generate(PROMPTS[:1], GREEDY)
    assert time.monotonic() - t0 < 30
    assert not any(p.is_alive() for p in procs)                 # the others were stopped with it
    llm.shutdown()
    assert_no_workers([p.pid for p in procs])


def test_a_worker_error_reaches_rank_0_with_its_message(tiny_models):
    with LLM(tiny_models["qwen3"], tensor_parallel_size=2, **ENGINE) as llm:
        pids = llm.engine.runner.workers.pids
        llm.engine.runner.workers.send("no_such_call")
        with pytest.raises(TensorParallelError, match="rank 1 .* code 1: ValueError: unknown call 'no_such_call'"):
            llm.generate(PROMPTS[:2], GREEDY)
    assert_no_workers(pids)


def test_calls_larger_than_the_channel_move_it_and_workers_never_outlive_the_engine(
        tiny_models, references, monkeypatch):
    monkeypatch.setattr(channel, "INITIAL_BYTES", 256)     # smaller than a step's inputs
    llm = LLM(tiny_models["llama"], tensor_parallel_size=2, **ENGINE)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == references["llama"][1]
    assert llm.engine.runner.workers.channel.capacity > 256
    # prompt_logprobs gathers the LM head's rows over the ranks too; the group goes on in step
    [scored] = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert len(scored.prompt_logprobs) == len(PROMPTS[0]) and scored.prompt_logprobs[1]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == references["llama"][1]
    pids = llm.engine.runner.workers.pids
    del llm                                         # never shut down: the engine's __del__ does it
    gc.collect()
    assert_no_workers(pids)
    # A start-up that fails after the workers started: they go with the half-built engine.
    with pytest.raises(ValueError, match="max_model_len 200 needs 50 KV blocks") as failed:
        LLM(tiny_models["llama"], tensor_parallel_size=2, max_model_len=200, **ENGINE)
    pids = [p.pid for p in mp.active_children()]
    del failed
    gc.collect()
    assert_no_workers(pids)
    # Rank 0 fails to build its own shard while the workers start: they are stopped at once.
    config = EngineConfig(model=tiny_models["qwen3"], tensor_parallel_size=4, **ENGINE)
    model_config = load_model_config(config.model)
    weights = load_weights(config.model, model_config, "float32")
    del weights["model.norm.weight"]
    with pytest.raises(KeyError, match="model.norm.weight"):
        TensorParallelExecutor(model_config, config, get_ops("numpy"), CpuDevice(), weights, "float32", [2])
    assert mp.active_children() == []


@pytest.mark.skipif(not (STORIES / "reference.json").is_file(), reason=f"stories260K not found at {STORIES}")
def test_cli_generate_over_four_processes_matches_the_reference_text():
    reference = json.loads((STORIES / "reference.json").read_text())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "minillm.cli", "generate", str(STORIES), "--device", "cpu",
                             "--tensor-parallel-size", "4", "-p", "Once upon a time", "--temperature", "0",
                             "--max-tokens", "40", "--ignore-eos"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    from minillm.tokenizer import Tokenizer
    expected = Tokenizer.from_pretrained(STORIES).decode(reference["greedy_from_bos_200_ids"][1:5 + 40])
    assert result.stdout.strip() == expected.strip()
    assert time.monotonic() - t0 < 60


@pytest.mark.skipif(not (STORIES / "reference.json").is_file(), reason=f"stories260K not found at {STORIES}")
def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path):
    """Workers are spawned and import the script again: building the LLM at its top level is a clear
    error in the worker and in the script (it was Python's bootstrapping RuntimeError and an EOFError)."""
    script = tmp_path / "unguarded.py"
    script.write_text(f"from minillm import LLM\nLLM({str(STORIES)!r}, device='cpu', tensor_parallel_size=2)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1
    assert 'build the LLM under `if __name__ == "__main__":`' in result.stderr
    assert "tensor-parallel worker rank 1 exited during start-up" in result.stderr.splitlines()[-1]
    assert "EOFError" not in result.stderr and "bootstrapping phase" not in result.stderr


@pytest.mark.skipif(not (STORIES / "reference.json").is_file(), reason=f"stories260K not found at {STORIES}")
def test_a_server_over_two_ranks_scores_an_echoed_prompt():
    """echo with logprobs scores the prompt over the ranks (it was a 400 naming echo), as vLLM does."""
    import httpx
    from test_server_helpers import running_server

    with running_server(STORIES, tensor_parallel_size=2) as (url, _):
        body = {"model": "stories", "prompt": "Tom had a ball", "max_tokens": 3, "temperature": 0}
        reply = httpx.post(f"{url}/v1/completions", json={**body, "echo": True, "logprobs": 1}, timeout=60)
        assert reply.status_code == 200, reply.text
        scores = reply.json()["choices"][0]["logprobs"]["token_logprobs"]
        assert scores[0] is None and len(scores) > 4 and all(lp <= 0 for lp in scores[1:])
        for extra in ({"echo": True}, {"logprobs": 1}):
            assert httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=60).status_code == 200
