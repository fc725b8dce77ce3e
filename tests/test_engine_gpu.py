"""The whole engine on the GPU against the CPU engine: greedy tokens, bf16 logits, graphs vs eager."""
import json

import numpy as np
import pytest

from minillm import LLM, SamplingParams

from conftest import save_tiny_model
from test_model_parity import minillm_prompt_logits

from gpu_support import HAS_GPU, cupy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]


def gpu_prompt_logits(path, ids, dtype):
    """Logits at every prompt position from the CUDA decoder (bf16 / fp32), as float32 on the host."""
    from minillm.attention import AttentionMetadata
    from minillm.loader import load_model_config, load_weights
    from minillm.models.decoder import DecoderModel
    from minillm.ops import get_ops

    config = load_model_config(path)
    ops = get_ops("cuda")
    model = DecoderModel(config, load_weights(path, config, dtype), ops, dtype, 256)
    block_size = 16
    num_blocks = len(ids) // block_size + 4
    pool = cupy.zeros((config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim),
                      dtype=cupy.dtype(dtype))
    table = np.random.default_rng(0).permutation(num_blocks)[: len(ids) // block_size + 1].astype(np.int32)
    pos = np.arange(len(ids), dtype=np.int32)
    meta = AttentionMetadata(ops.asarray(np.array([0, len(ids)], np.int32)), ops.asarray(np.array([len(ids)], np.int32)),
                             ops.asarray(table[None]), ops.asarray((table[pos // block_size] * block_size
                                                                    + pos % block_size).astype(np.int32)),
                             len(ids), len(ids), False)
    hidden = model.forward(ops.asarray(np.asarray(ids, np.int32)), ops.asarray(pos), meta, pool)
    return ops.to_numpy(model.compute_logits(hidden)).astype(np.float32)


def test_stories_fp32_gpu_equals_cpu_200_greedy(stories_path):
    ref = json.loads((stories_path / "reference.json").read_text())
    greedy = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    cpu = LLM(str(stories_path), device="cpu").generate([[1]], greedy)[0].outputs[0].token_ids
    gpu_llm = LLM(str(stories_path), device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=16)
    gpu = gpu_llm.generate([[1]], greedy)[0].outputs[0]
    assert gpu.token_ids == cpu == ref["greedy_from_bos_200_ids"][1:]
    assert gpu.text == ref["greedy_from_bos_200_text"]


def test_stories_gpu_batch_under_graphs_and_eager_equals_cpu(stories_path):
    golden = json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]
    prompts = [[1] + golden[1 + i: 1 + i + 3 + i % 11] for i in range(24)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    cpu = [o.outputs[0].token_ids for o in LLM(str(stories_path), device="cpu").generate(prompts, params)]
    for eager, overlap in ((False, None), (True, None), (False, False)):
        llm = LLM(str(stories_path), device="cuda", dtype="float32", num_kv_blocks=64, max_num_seqs=16,
                  max_num_batched_tokens=64, enforce_eager=eager, async_scheduling=overlap)
        assert llm.engine.async_scheduling == (overlap is None)
        gpu = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert gpu == cpu, f"enforce_eager={eager} async_scheduling={overlap}"
        assert llm.engine.block_manager.num_used_blocks == 0
        pieces = llm.engine.runner.piecewise
        assert (pieces is None) == eager
        if not eager:                    # prefill and mixed steps replayed the piecewise graphs
            assert pieces.num_runs > 0


def test_random_qwen3_bf16_logits_match_cpu(tmp_path, stories_path):
    path = save_tiny_model(tmp_path / "qwen3", "qwen3", dtype="bfloat16", hidden_size=256, intermediate_size=512,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
    ids = [1] + list(np.random.default_rng(3).integers(3, 512, size=70))
    ref = minillm_prompt_logits(path, ids)              # NumPy, fp32 compute from the bf16 checkpoint
    got = gpu_prompt_logits(path, ids, "bfloat16")
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 3e-2, f"bf16 logits relative error {err:.3g}"
    agree = (got.argmax(-1) == ref.argmax(-1)).mean()
    assert agree > 0.9


def test_gpu_sampling_seeded_and_aborts_free_blocks(stories_path):
    llm = LLM(str(stories_path), device="cuda", dtype="float32", num_kv_blocks=128, max_num_seqs=8)
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=7, max_tokens=30, ignore_eos=True)
    a = llm.generate(["Once upon a time"], p)[0].outputs[0].token_ids
    b = llm.generate(["Once upon a time", "Lily", "Tom"], [p, p, p])[0].outputs[0].token_ids
    assert a == b
    engine = llm.engine
    engine.add_request("x", "Once upon a time", SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request("x")
    engine.step()
    assert engine.block_manager.num_used_blocks == 0


def test_stories_gpu_logprob_ranks_equal_cpu(stories_path):
    """Each sampled and prompt token's Logprob rank (tokens outside the top-k included) and value on
    the GPU equal the CPU engine's (fp32, greedy)."""
    prompts = ["Once upon a time there was a banana", "The little dog ran"]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=1, prompt_logprobs=2, ignore_eos=True)
    runs = [LLM(str(stories_path), device="cpu").generate(prompts, params),
            LLM(str(stories_path), device="cuda", dtype="float32", num_kv_blocks=64, max_num_seqs=4)
            .generate(prompts, params)]
    for cpu, gpu in zip(*runs):
        assert gpu.outputs[0].token_ids == cpu.outputs[0].token_ids
        pairs = list(zip(cpu.prompt_logprobs[1:] + cpu.outputs[0].logprobs,
                         gpu.prompt_logprobs[1:] + gpu.outputs[0].logprobs))
        assert any(max(lp.rank for lp in c.values()) > 3 for c, _ in pairs)    # ranks past the top-k occur
        for c, g in pairs:
            assert {t: lp.rank for t, lp in c.items()} == {t: lp.rank for t, lp in g.items()}
            np.testing.assert_allclose([float(g[t]) for t in c], [float(c[t]) for t in c], atol=2e-4)


def test_stories_gpu_allowed_ids_and_bad_words_equal_cpu(stories_path):
    """allowed_token_ids and bad_words give the CPU engine's greedy tokens on the GPU, in one batch
    with a plain request (graphs, async scheduling), and the plain request keeps its own tokens."""
    prompt = "Once upon a time there was a little girl named"
    cpu = LLM(str(stories_path), device="cpu")
    gpu = LLM(str(stories_path), device="cuda", dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    free = cpu.generate([prompt], plain)[0].outputs[0].token_ids
    allowed = sorted(set(free[::2]))
    params = [plain, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, allowed_token_ids=allowed),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, bad_words=["Lily", "girl"])]
    want = [o.outputs[0].token_ids for o in cpu.generate([prompt] * 3, params)]
    got = [o.outputs[0].token_ids for o in gpu.generate([prompt] * 3, params)]
    assert got == want
    assert want[0] == free and set(want[1]) <= set(allowed) and want[1] != free and want[2] != free
