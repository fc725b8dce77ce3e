"""The structured-output mask kernel (cuda/token_bitmask.cu) against its NumPy twin.

Skips without CuPy or a GPU. Random logits and bitmasks at Qwen3's vocabulary (151,936) and
batch 1 to 256: rows of every density (all allowed, all forbidden, sparse, dense), unconstrained
rows left out of `rows`, -1 padding and out-of-range entries, bitmasks wider than needed, odd
vocabularies, and a replay inside a CUDA graph with new masks copied into its static buffers.
The kernel only writes -inf, so results must be bit-identical. Last, the engine with structured
outputs on the GPU against the CPU engine.
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

VOCAB = 151936
DENSITIES = (0.0, 1e-4, 0.02, 0.5, 0.98, 1.0)     # probability that a token is allowed


def random_bitmask(rng, batch: int, vocab: int, extra_words: int = 0) -> np.ndarray:
    """[batch, ceil(vocab / 32) + extra_words] int32, each row at a density from DENSITIES."""
    words = (vocab + 31) // 32 + extra_words
    p = rng.choice(DENSITIES, batch)
    allowed = rng.random((batch, words * 32)) < p[:, None]             # [batch, words * 32]
    return np.packbits(allowed, axis=1, bitorder="little").view("<i4").astype(np.int32)


def random_logits(rng, batch: int, vocab: int) -> np.ndarray:
    logits = (rng.standard_normal((batch, vocab)) * 4.0).astype(np.float32)
    logits[rng.random((batch, vocab)) < 1e-3] = -np.inf                 # already masked elsewhere
    return logits


def random_rows(rng, batch: int) -> np.ndarray:
    """About two thirds of the rows, shuffled, plus -1 padding and an out-of-range entry (at most
    batch + 3 entries: a bitmask of batch + 3 rows covers them)."""
    chosen = rng.permutation(batch)[: max(1, (2 * batch) // 3)]
    return np.concatenate([chosen, [-1, batch, -1]]).astype(np.int32)


def check(logits: np.ndarray, bitmask: np.ndarray, rows: np.ndarray) -> None:
    """The kernel against the NumPy twin: mask row i for logits row rows[i] (the first len(rows)
    rows of bitmask)."""
    bitmask = np.ascontiguousarray(bitmask[:len(rows)])
    expect = logits.copy()
    npops.apply_token_bitmask(expect, bitmask, rows)
    dev = cupy.asarray(logits)
    ops.apply_token_bitmask(dev, cupy.asarray(bitmask), cupy.asarray(rows))
    got = cupy.asnumpy(dev)
    np.testing.assert_array_equal(got, expect)
    untouched = np.setdiff1d(np.arange(logits.shape[0]), rows)
    np.testing.assert_array_equal(got[untouched], logits[untouched])


@pytest.mark.parametrize("batch", [1, 2, 7, 33, 64, 128, 255, 256])
def test_bitmask_kernel_matches_numpy_at_qwen_vocab(batch):
    rng = np.random.default_rng(batch)
    check(random_logits(rng, batch, VOCAB), random_bitmask(rng, batch + 3, VOCAB), random_rows(rng, batch))


@pytest.mark.parametrize("batch,vocab,extra_words", [(3, 1, 0), (5, 31, 0), (4, 33, 0), (16, 1000 + 7, 0),
                                                     (9, 32000 + 5, 3), (12, VOCAB, 2)])
def test_bitmask_kernel_matches_numpy_at_other_shapes(batch, vocab, extra_words):
    """Vocabularies off a multiple of 32 and bitmasks wider than the vocabulary needs."""
    rng = np.random.default_rng(vocab + batch)
    check(random_logits(rng, batch, vocab), random_bitmask(rng, batch + 3, vocab, extra_words),
          random_rows(rng, batch))


def test_bitmask_kernel_every_row_and_no_row():
    rng = np.random.default_rng(7)
    batch = 256
    logits, bitmask = random_logits(rng, batch, VOCAB), random_bitmask(rng, batch, VOCAB)
    check(logits, bitmask, np.arange(batch, dtype=np.int32))
    check(logits, bitmask, np.full(batch, -1, np.int32))
    check(logits, bitmask, np.zeros(0, np.int32))


def test_bitmask_kernel_replays_in_a_cuda_graph():
    """Captured once over static buffers; each replay masks what was copied in before it."""
    rng = np.random.default_rng(11)
    batch, words = 64, (VOCAB + 31) // 32
    logits = cupy.zeros((batch, VOCAB), np.float32)
    bitmask = cupy.full((batch, words), -1, np.int32)
    rows = cupy.full(batch, -1, np.int32)                              # fixed size, -1 padded
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        ops.apply_token_bitmask(logits, bitmask, rows)                 # compile and load first
        stream.synchronize()
        stream.begin_capture()
        ops.apply_token_bitmask(logits, bitmask, rows)
        graph = stream.end_capture()
        for _ in range(3):
            host_logits, host_mask = random_logits(rng, batch, VOCAB), random_bitmask(rng, batch, VOCAB)
            chosen = rng.permutation(batch)[: int(rng.integers(1, batch))]
            host_rows = np.full(batch, -1, np.int32)
            host_rows[: len(chosen)] = chosen
            logits.set(host_logits, stream=stream)
            bitmask.set(host_mask, stream=stream)
            rows.set(host_rows, stream=stream)
            graph.launch(stream)
            stream.synchronize()
            expect = host_logits.copy()
            npops.apply_token_bitmask(expect, host_mask, host_rows)
            np.testing.assert_array_equal(cupy.asnumpy(logits), expect)


def test_sampler_uploads_the_masks_in_one_copy():
    """The sampler's device path: page-locked masks as the manager fills them go up in one copy
    into a kept buffer and the kernel applies mask i to row rows[i], also for masks moved to other
    rows (a verification step's); each equals the NumPy twin, step after step with the buffer
    growing."""
    from minillm.sampler import Sampler
    from minillm.structured_output import GrammarBitmask, bitmask_words
    from minillm.device import make_device

    device = make_device("cuda")
    sampler = Sampler(ops, [0], device)
    rng = np.random.default_rng(5)
    words = bitmask_words(VOCAB)
    for batch, n in ((8, 3), (64, 40), (256, 256), (300, 5)):
        block = device.empty_pinned((n, words), np.int32)
        rows = rng.permutation(batch)[:n].astype(np.int32)
        block[...] = random_bitmask(rng, n, VOCAB)
        for moved in (False, True):
            logits = random_logits(rng, batch, VOCAB)
            expect = logits.copy()
            npops.apply_token_bitmask(expect, block, rows)
            mask = GrammarBitmask(block, (rows[::-1] if moved else rows).copy())
            with device.stream:
                dev = cupy.asarray(logits)
                sampler.apply_grammar_bitmask(dev, mask.at_rows(rows) if moved else mask)
                got = cupy.asnumpy(dev, stream=device.stream)
            device.synchronize()
            np.testing.assert_array_equal(got, expect)


def test_bitmask_launcher_checks_its_arguments():
    logits = cupy.zeros((4, 100), np.float32)
    rows = cupy.arange(4, dtype=np.int32)
    for bad in (cupy.zeros((4, 3), np.int32),           # too few words
                cupy.zeros((5, 4), np.int32),           # not one mask row per entry of rows
                cupy.zeros((4, 4), np.uint32),          # not int32
                cupy.zeros((4, 8), np.int32)[:, ::2]):  # not contiguous
        with pytest.raises(ValueError):
            ops.apply_token_bitmask(logits, bad, rows)
    with pytest.raises(ValueError):
        ops.apply_token_bitmask(logits.astype(np.float16), cupy.zeros((4, 4), np.int32), rows)
    with pytest.raises(ValueError):
        ops.apply_token_bitmask(logits, np.zeros((4, 4), np.int32), rows)     # host bitmask


def test_structured_engine_on_the_gpu_equals_the_cpu(stories_path):
    """stories260K in fp32: constrained and unconstrained requests together give the CPU engine's
    tokens, with graphs and eager, with and without async scheduling (the mask is filled while the
    forward pass runs; a constrained row's sampling waits for its previous token)."""
    from minillm import LLM, SamplingParams, StructuredOutputsParams
    from test_structured_engine import CHECKS

    golden = json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]
    prompts, params, kinds = [], [], []
    for i in range(24):
        prompts.append([1] + golden[1 + i: 4 + i + i % 9])
        kind = list(CHECKS)[i % 6] if i % 6 < len(CHECKS) else None
        kinds.append(kind)
        structured = StructuredOutputsParams(**CHECKS[kind][0]) if kind else None
        params.append(SamplingParams(temperature=0, max_tokens=96, ignore_eos=kind is None,
                                     structured_outputs=structured))
    cpu = [o.outputs[0] for o in LLM(str(stories_path), device="cpu").generate(prompts, params)]
    for eager, overlap in ((False, None), (True, None), (False, False)):
        llm = LLM(str(stories_path), device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=16,
                  max_num_batched_tokens=64, enforce_eager=eager, async_scheduling=overlap)
        gpu = [o.outputs[0] for o in llm.generate(prompts, params)]
        assert [g.token_ids for g in gpu] == [c.token_ids for c in cpu], f"enforce_eager={eager} async={overlap}"
        for kind, g in zip(kinds, gpu):
            if kind is not None:
                assert g.finish_reason == "stop" and CHECKS[kind][1](g.text), (kind, g.text)
        assert llm.engine.stats().num_grammar_fill_steps > 0
        llm.shutdown()
