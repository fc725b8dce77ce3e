"""Constrained requests with n-gram drafts on the GPU: the masks of every verified position uploaded
and applied by the CUDA kernel as the NumPy twin applies them, and the engine's tokens the CPU
engine's without speculation.

Skips without CuPy or a GPU.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from minillm.ops import numpy as npops

from gpu_support import HAS_GPU, cupy
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]

if HAS_GPU:
    from minillm.ops import cuda as ops

SPEC = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.mark.parametrize("vocab", [512, 151936])
def test_masks_of_verified_positions_land_on_their_logits_rows(vocab):
    """A verification step's rows: sequence b's d_b drafts and bonus row; constrained ones get a mask per
    position (GrammarBitmask.positions), the others none. The sampler's upload and the kernel against
    the NumPy twin on the same rows."""
    from minillm.sampler import Sampler
    from minillm.structured_output import GrammarBitmask, mask_layout

    rng = np.random.default_rng(vocab)
    num_drafts = np.array([3, 0, 6, 1, 0, 2], np.int64)                    # [B]
    rows = num_drafts + 1
    row_starts = np.cumsum(rows) - rows                                    # [B]
    constrained = [0, 1, 2, 5]                                             # sampling indices with a grammar
    drafts = [[7] * int(num_drafts[b]) for b in constrained]
    first, positions = mask_layout(drafts)
    words = (vocab + 31) // 32
    bitmask = rng.integers(-2**31, 2**31, (len(positions), words), dtype=np.int64).astype(np.int32)
    mask = GrammarBitmask(bitmask, np.repeat(np.array(constrained, np.int32), [1 + len(d) for d in drafts]),
                          positions).at_verify_rows(row_starts)
    logits = rng.standard_normal((int(rows.sum()), vocab)).astype(np.float32)
    expect = logits.copy()
    npops.apply_token_bitmask(expect, mask.bitmask, mask.rows)
    dev = cupy.asarray(logits)
    Sampler(ops, [2]).apply_grammar_bitmask(dev, mask)
    np.testing.assert_array_equal(cupy.asnumpy(dev), expect)
    untouched = np.setdiff1d(np.arange(logits.shape[0]), mask.rows)
    assert len(untouched) == 2 + 1                                         # sequences 3 and 4: no grammar
    np.testing.assert_array_equal(cupy.asnumpy(dev)[untouched], logits[untouched])


@pytest.mark.parametrize("grammar_process", [False, True])
def test_constrained_drafts_on_the_gpu_give_the_cpu_greedy(stories_path, grammar_process):
    """fp32 on the GPU (verify graphs and eager, async scheduling on and off): constrained and
    unconstrained requests with drafts give the CPU engine's greedy tokens without speculation, and
    the constrained ones accept drafts."""
    from minillm import LLM, SamplingParams
    from minillm.sampling_params import StructuredOutputsParams
    from minillm.tokenizer import Tokenizer

    golden = json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]
    tok = Tokenizer.from_pretrained(stories_path)
    jsonish = tok.encode('{"name": "Lily and Tom went to the park", "age": 3}', add_special_tokens=False)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    repeat = [1] + golden[1:30] + golden[1:8]
    constrained = [([1] + jsonish * 3, dict(json=schema)), (repeat, dict(regex="( [a-z]+){1,12}\\.")),
                   ([1] + golden[1:10] * 3, dict(grammar='root ::= " Once upon a time" (" Once upon a time")*')),
                   (repeat, dict(grammar='start: WORD+ "."\nWORD: /( [a-z]+)/'))]
    prompts = [p for p, _ in constrained] + [repeat, [1] + golden[60:70] * 3]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(**c))
              for _, c in constrained] + [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 2
    cpu = [o.outputs[0].token_ids for o in LLM(str(stories_path), device="cpu").generate(prompts, params)]
    for eager, overlap in ((False, True), (False, False), (True, True)):
        llm = LLM(str(stories_path), device="cuda", dtype="float32", num_kv_blocks=128, max_num_seqs=16,
                  enforce_eager=eager, async_scheduling=overlap, speculative_config=SPEC,
                  grammar_process=grammar_process)
        gpu = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert gpu == cpu, f"enforce_eager={eager} async_scheduling={overlap}"
        before = llm.engine.stats().spec_decode.num_accepted_tokens
        again = [o.outputs[0].token_ids for o in llm.generate(prompts[:len(constrained)], params[:len(constrained)])]
        assert again == cpu[:len(constrained)]
        assert llm.engine.stats().spec_decode.num_accepted_tokens > before   # the constrained ones alone
        assert llm.engine.block_manager.num_used_blocks == 0
        llm.shutdown()
