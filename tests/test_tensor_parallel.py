"""Tensor parallelism on the CPU: N processes, shared-memory collectives, the logits and greedy
tokens of one process, and no process left behind."""
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
from minillm.loader import expected_weight_shapes, load_model_config
from minillm.parallel.communicator import ShmCommunicator, ShmGroup
from minillm.parallel.errors import TensorParallelError
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
        logits = runner._forward(np.asarray(ids, np.int32), np.concatenate(pos).astype(np.int32), meta,
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
