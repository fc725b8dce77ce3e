"""Decode graphs run attention's blocks longest context first: the rows are reordered, the outputs are not."""
from __future__ import annotations

import numpy as np
import pytest

from minillm import LLM, SamplingParams
from conftest import save_tiny_model
from gpu_support import HAS_GPU

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]


def test_graph_decodes_over_reordered_rows_equal_the_eager_ones(tmp_path):
    path = save_tiny_model(tmp_path / "qwen3", "qwen3", hidden_size=256, intermediate_size=512,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=1024)
    rng = np.random.default_rng(4)
    prompts = [[1] + rng.integers(3, 512, int(n)).tolist() for n in rng.integers(3, 400, 40)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = {}
    for eager in (True, False):
        llm = LLM(str(path), device="cuda", dtype="float32", max_model_len=1024, max_num_seqs=48,
                  num_kv_blocks=2048, enforce_eager=eager)
        outs[eager] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        if not eager:
            graphs = llm.engine.runner.graphs
            qsl = graphs.query_start_loc.get()
            lens = graphs.seq_lens.get()
            b = int(np.sum(lens > 1))              # the last step's rows (padding rows hold context 1)
            assert sorted(qsl[:b].tolist()) == list(range(b)) and (np.diff(lens[:b]) <= 0).all()
            assert not (qsl[:b] == np.arange(b)).all()          # the batch's order was not already sorted
        llm.shutdown()
    for e, g in zip(outs[True], outs[False]):
        assert g.token_ids == e.token_ids
        got = [lp[t].logprob for lp, t in zip(g.logprobs, g.token_ids)]
        want = [lp[t].logprob for lp, t in zip(e.logprobs, e.token_ids)]
        np.testing.assert_allclose(got, want, atol=1e-4)
