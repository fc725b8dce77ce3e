"""Tensor parallelism over more ranks than the model has KV heads, as vLLM's QKVParallelLinear does it:
N ranks over Hk < N KV heads (N a multiple of Hk) each hold one KV head, the one their query heads
read, its k/v projection rows and biases replicated on N / Hk ranks, and a KV pool of one head.
The outputs are one process's; the shapes vLLM refuses are refused at entry, naming the sizes."""
import dataclasses
import json
import multiprocessing as mp
import shutil
import subprocess
import sys

import numpy as np
import pytest

from minillm import LLM, SamplingParams
from minillm.loader import expected_weight_shapes, load_model_config
from minillm.model_runner import kv_bytes_per_block
from minillm.parallel.sharding import check_tensor_parallel_size, shard_model_config, shard_weights

from conftest import REPO
from make_fixtures import GREEDY_TOKENS, TINY_DIR

# Chunks of 16 tokens; blocks of 4 (a pool of 24 preempts when four long prompts decode together).
ENGINE = dict(device="cpu", block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)


def random_weights(config) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in expected_weight_shapes(config).items()}


@pytest.mark.parametrize("model, size", [("stories", 8), ("qwen2-bias", 2), ("qwen2-bias", 4)])
def test_each_rank_holds_the_kv_head_its_query_heads_read(stories_path, model, size):
    path = stories_path if model == "stories" else TINY_DIR / model       # qwen2-bias: 4 heads, 1 KV head, biases
    config = load_model_config(str(path))
    weights = random_weights(config)
    dh, group = config.head_dim, config.num_heads // config.num_kv_heads
    q_per_rank = config.num_heads // size
    rank_config = shard_model_config(config, size)
    assert (rank_config.num_heads, rank_config.num_kv_heads) == (q_per_rank, 1)
    # each rank's pool caches one head: a block costs 1 / Hk of one process's
    assert kv_bytes_per_block(rank_config, 4, 4) * config.num_kv_heads == kv_bytes_per_block(config, 4, 4)
    a = "model.layers.1.self_attn."
    for rank in range(size):
        shard = shard_weights(weights, config, rank, size)
        heads = range(rank * q_per_rank, (rank + 1) * q_per_rank)
        kv_head = {h // group for h in heads}                 # the model's GQA mapping of this rank's q heads
        assert len(kv_head) == 1
        kv_head = kv_head.pop()
        np.testing.assert_array_equal(shard[a + "q_proj.weight"], weights[a + "q_proj.weight"][heads[0] * dh:
                                                                                              (heads[-1] + 1) * dh])
        names = ["k_proj.weight", "v_proj.weight"] + (["k_proj.bias", "v_proj.bias"] if config.attention_bias else [])
        for name in names:
            np.testing.assert_array_equal(shard[a + name], weights[a + name][kv_head * dh:(kv_head + 1) * dh])
    # up to Hk ranks still split the KV heads (no replication)
    assert shard_model_config(config, 2).num_kv_heads == max(1, config.num_kv_heads // 2)


def test_shapes_vllm_refuses_name_the_sizes_at_entry(stories_path):
    config = load_model_config(str(stories_path))                         # 8 heads, 4 KV heads, MLP 172
    refused = [(config, 3, r"tensor_parallel_size 3 must divide the model's num_attention_heads \(8\)"),
               (config, 16, r"tensor_parallel_size 16 must divide the model's num_attention_heads \(8\)"),
               (config, 8, r"tensor_parallel_size 8 must divide the model's intermediate_size \(172\)"),
               (dataclasses.replace(config, num_heads=12, intermediate_size=96), 6,
                r"tensor_parallel_size 6 is above the model's num_key_value_heads \(4\) and must be a multiple"),
               (dataclasses.replace(config, num_heads=12, num_kv_heads=6, intermediate_size=96), 4,
                r"tensor_parallel_size 4 must divide the model's num_key_value_heads \(6\)")]
    for shape, size, message in refused:
        with pytest.raises(ValueError, match=message):
            check_tensor_parallel_size(shape, size, "numpy")
    check_tensor_parallel_size(dataclasses.replace(config, intermediate_size=176), 8, "numpy")
    earlier = set(mp.active_children())      # another test's processes in this worker may still be ending
    with pytest.raises(ValueError, match=r"tensor_parallel_size 8 must divide the model's intermediate_size"):
        LLM(str(stories_path), device="cpu", tensor_parallel_size=8)
    assert set(mp.active_children()) <= earlier                            # refused before any rank started
    # the server's command line: a usage error naming the flag, no traceback
    proc = subprocess.run([sys.executable, "-m", "minillm", "serve", str(stories_path), "--device", "cpu", "-tp", "6",
                           "--port", "0"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Invalid value for '--tensor-parallel-size': 6 must divide the model's num_attention_heads (8)" \
        in proc.stderr
    assert "Traceback" not in proc.stderr


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("model, size", [("qwen2-bias", 2), ("qwen3-qk-norm", 4)])
def test_ranks_sharing_a_kv_head_match_transformers(model, size):
    """qwen2-bias: one KV head (MQA) with biases on 2 ranks; qwen3-qk-norm: 2 KV heads with k norms on 4."""
    path = TINY_DIR / model
    ref = np.load(path / "reference.npz")
    ids = ref["prompt_ids"].tolist()
    with LLM(str(path), tensor_parallel_size=size, num_kv_blocks=40, **ENGINE) as llm:
        assert llm.engine.runner.kv_pool.shape[4] == 1                    # [L, 2, blocks, bs, Hk, Dh] on rank 0
        greedy, scored = llm.generate(
            [{"prompt_token_ids": ref["greedy_prompt_ids"].tolist()}, {"prompt_token_ids": ids}],
            [SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)], use_tqdm=False)
    assert greedy.outputs[0].token_ids == ref["greedy_ids"].tolist()
    want = log_softmax(ref["prompt_logits"])                              # [len(ids), V]
    ours = [scored.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i]
    np.testing.assert_allclose(ours, [want[i - 1, t] for i, t in enumerate(ids) if i], atol=2e-3)


@pytest.fixture(scope="module")
def stories_176(stories_path, tmp_path_factory):
    """stories260K with its MLP widened from 172 to 176 by zero rows and columns (the same function),
    so that 8 ranks split it: vLLM refuses an MLP width the ranks do not divide."""
    from safetensors.numpy import load_file, save_file
    out = tmp_path_factory.mktemp("stories176")
    for f in stories_path.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    config = json.loads((stories_path / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "intermediate_size": 176}))
    weights = load_file(str(stories_path / "model.safetensors"))
    for name, w in weights.items():
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            weights[name] = np.concatenate([w, np.zeros((4, w.shape[1]), w.dtype)])
        elif name.endswith("down_proj.weight"):
            weights[name] = np.concatenate([w, np.zeros((w.shape[0], 4), w.dtype)], axis=1)
    save_file(weights, str(out / "model.safetensors"))
    return out


def assert_same_outputs(got, want) -> None:
    """Tokens, texts and cache hits equal; log-probabilities (ids and ranks equal) within float error."""
    for g, w in zip(got, want, strict=True):
        assert g.num_cached_tokens == w.num_cached_tokens
        for a, b in zip(g.outputs, w.outputs, strict=True):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert [(t, x[t].rank) for t in x] == [(t, y[t].rank) for t in y]
                np.testing.assert_allclose([x[t].logprob for t in x], [y[t].logprob for t in y], atol=1e-4)


def test_eight_ranks_over_four_kv_heads_give_one_processes_outputs(stories_path, stories_176):
    golden = json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]
    batches = [  # the reference's greedy text, prefix-cache hits, preemption in the small pool, seeded n > 1
        ([{"prompt_token_ids": golden[:10]}, {"prompt_token_ids": golden[:30]},
          {"prompt_token_ids": golden[:30] + golden[60:64]}],
         SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)),
        ([{"prompt_token_ids": golden[i:i + 22]} for i in (0, 25, 50, 75)],
         SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)),
        (["Once upon a time", "The little dog"], SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=8, logprobs=2)),
    ]
    # 30720 bytes hold 24 blocks of one KV head a rank (4 tokens x 5 layers x K, V x 8 dims x 4 bytes each)
    with LLM(str(stories_path), num_kv_blocks=24, **ENGINE) as one, \
            LLM(str(stories_176), tensor_parallel_size=8, kv_cache_memory_bytes=30720, **ENGINE) as eight:
        stats = eight.engine.stats()
        assert (stats.kv_num_blocks, stats.memory.kv_pool_bytes) == (24, 30720)
        assert one.engine.stats().memory.kv_pool_bytes == 4 * 30720
        assert eight.engine.runner.kv_pool.shape[4] == 1 and len(eight.engine.runner.workers.pids) == 7
        results = []
        for prompts, params in batches:
            before = [llm.engine.scheduler.num_preemptions for llm in (one, eight)]
            want, got = one.generate(prompts, params, use_tqdm=False), eight.generate(prompts, params, use_tqdm=False)
            assert_same_outputs(got, want)
            results.append((got, [llm.engine.scheduler.num_preemptions - b for llm, b in zip((one, eight), before)]))
    assert mp.active_children() == []
    (greedy, _), (_, preempted), (sampled, _) = results
    assert greedy[0].outputs[0].token_ids == golden[10:34]
    assert greedy[2].num_cached_tokens > 0
    assert preempted[1] == preempted[0] > 0
    assert len({tuple(c.token_ids) for c in sampled[0].outputs}) > 1               # n=3 seeded samples differ
