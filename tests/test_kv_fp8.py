"""FP8 E4M3 KV cache on the CPU: the quantisation rule, the NumPy ops, the pool, the engine, stats."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import ml_dtypes
import numpy as np
import pytest

from minillm import LLM, SamplingParams
from minillm.attention import AttentionMetadata
from minillm.config import EngineConfig
from minillm.engine_stats import describe_engine
from minillm.fp8 import decode_e4m3, encode_e4m3, scales_from_absmax
from minillm.model_runner import kv_bytes_per_block
from minillm.ops import numpy as npops

E4M3 = ml_dtypes.float8_e4m3fn
ALL_CODES = np.arange(256, dtype=np.uint8)
NAN_CODES = (0x7F, 0xFF)


# ---- the rule ---------------------------------------------------------------------------------

def test_decode_of_every_code_is_ml_dtypes_value():
    got = decode_e4m3(ALL_CODES, 1.0)
    ref = ALL_CODES.view(E4M3).astype(np.float32)
    np.testing.assert_array_equal(got, ref)                    # NaN where ml_dtypes has NaN (0x7F, 0xFF)
    assert np.isnan(got[list(NAN_CODES)]).all() and np.isfinite(np.delete(got, NAN_CODES)).all()
    assert np.nanmax(got) == 448.0 and got[1] == 2.0 ** -9      # largest finite, smallest subnormal


def test_encode_round_trips_every_finite_code_bit_for_bit():
    finite = np.delete(ALL_CODES, NAN_CODES)
    np.testing.assert_array_equal(encode_e4m3(decode_e4m3(finite, 1.0), 1.0), finite)   # -0 -> 0x80 too


def test_encode_in_range_equals_ml_dtypes_rounding():
    rng = np.random.default_rng(0)
    mags = 2.0 ** rng.uniform(-12, np.log2(448), 200_000)
    x = (mags * rng.choice([-1, 1], mags.size)).astype(np.float32)
    np.testing.assert_array_equal(encode_e4m3(x, 1.0), x.astype(E4M3).view(np.uint8))


def test_encode_rounds_midpoints_to_the_even_code():
    values = decode_e4m3(np.arange(0, 0x7F, dtype=np.uint8), 1.0).astype(np.float64)   # 0 .. 448, ascending
    mids = ((values[:-1] + values[1:]) / 2).astype(np.float32)
    assert np.all(mids.astype(np.float64) == (values[:-1] + values[1:]) / 2)           # exact in fp32
    codes = encode_e4m3(mids, 1.0)
    below = np.arange(0, 0x7E, dtype=np.uint8)
    np.testing.assert_array_equal(codes, np.where(below % 2 == 0, below, below + 1))
    np.testing.assert_array_equal(codes, mids.astype(E4M3).view(np.uint8))


def test_encode_saturates_to_448_where_a_plain_cast_overflows_to_nan():
    big = np.array([448, 449, 463.9, 464, 465, 480, 1e6, 3e38, np.inf], np.float32)
    np.testing.assert_array_equal(encode_e4m3(big, 1.0), np.full(big.size, 0x7E, np.uint8))
    np.testing.assert_array_equal(encode_e4m3(-big, 1.0), np.full(big.size, 0xFE, np.uint8))
    assert np.isnan(big[5:].astype(E4M3).astype(np.float32)).all()     # what the clip prevents


def test_no_finite_input_stores_a_nan():
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2**32, 1_000_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[np.isfinite(x)]
    for scale in (1.0, 0.01, 37.5):
        assert not np.isin(encode_e4m3(x, scale), NAN_CODES).any()
    assert not np.isin(encode_e4m3(np.array([np.inf, -np.inf], np.float32), 1.0), NAN_CODES).any()


def test_scale_divides_before_rounding_and_multiplies_after():
    rng = np.random.default_rng(2)
    x = rng.standard_normal(10_000).astype(np.float32) * 40
    for scale in (0.07, 1.0, 3.3):
        s = np.float32(scale)
        np.testing.assert_array_equal(encode_e4m3(x, s), encode_e4m3(x / s, 1.0))
        np.testing.assert_array_equal(decode_e4m3(encode_e4m3(x, s), s), decode_e4m3(encode_e4m3(x, s), 1.0) * s)
    np.testing.assert_array_equal(scales_from_absmax([448.0, 0.0, np.inf, 89.6]),
                                  np.float32([1.0, 1.0, 1.0, 89.6]) / np.float32([1.0, 1.0, 1.0, 448.0]))


# ---- NumPy ops -------------------------------------------------------------------------------

def _caches(rng, num_blocks=12, block_size=4, kv_heads=2, head_dim=8):
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return np.zeros(shape, np.uint8), np.zeros(shape, np.uint8)


def test_kv_append_quantises_and_attention_dequantises():
    rng = np.random.default_rng(3)
    k_cache, v_cache = _caches(rng)
    tokens = 20
    k = rng.standard_normal((tokens, 2, 8)).astype(np.float32) * 3
    v = rng.standard_normal((tokens, 2, 8)).astype(np.float32)
    scales = np.array([0.02, 0.5], np.float32)
    table = rng.permutation(12)[:5].astype(np.int32)
    pos = np.arange(tokens)
    slots = (table[pos // 4] * 4 + pos % 4).astype(np.int32)
    npops.kv_append(k, v, k_cache, v_cache, slots, scales)
    np.testing.assert_array_equal(k_cache[table[pos // 4], pos % 4], encode_e4m3(k, 0.02))
    np.testing.assert_array_equal(v_cache[table[pos // 4], pos % 4], encode_e4m3(v, 0.5))
    meta = AttentionMetadata(np.array([0, 3], np.int32), np.array([tokens], np.int32), table[None], slots[-3:],
                             3, tokens, False)
    q = rng.standard_normal((3, 4, 8)).astype(np.float32)
    got = npops.paged_attention(q, k_cache, v_cache, meta, 8 ** -0.5, scales)
    ref = npops.paged_attention(q, decode_e4m3(k_cache, 0.02), decode_e4m3(v_cache, 0.5), meta, 8 ** -0.5)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="kv_scales"):
        npops.kv_append(k, v, k_cache, v_cache, slots)


def test_calculate_kv_scales_from_the_largest_magnitudes():
    k = np.array([[[1.0, -89.6]]], np.float32)
    v = np.array([[[np.nan, 4.48]]], np.float32)                    # NaN skipped
    scales = np.ones(2, np.float32)
    npops.calculate_kv_scales(k, v, scales)
    np.testing.assert_array_equal(scales, np.float32([89.6, 4.48]) / np.float32(448))
    npops.calculate_kv_scales(np.zeros((0, 1, 2), np.float32), np.zeros((0, 1, 2), np.float32), scales)
    np.testing.assert_array_equal(scales, [1.0, 1.0])


def test_an_engine_without_an_fp8_cache_never_loads_ml_dtypes():
    """Loading ml_dtypes costs most of a second: every engine, core and worker process would pay it."""
    code = ("import sys, minillm.cli, minillm.engine, minillm.server.app, minillm.parallel.executor\n"
            "print('ml_dtypes' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[1])     # this checkout's minillm
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False"]


# ---- config and pool -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["auto", "fp8", "fp8_e4m3"])
def test_kv_cache_dtype_accepts_vllm_names(name):
    assert EngineConfig(model="m", kv_cache_dtype=name).kv_cache_dtype == name


def test_kv_cache_dtype_refuses_e5m2_and_unknown_names():
    with pytest.raises(ValueError, match="fp8_e5m2.*not supported.*E4M3"):
        EngineConfig(model="m", kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        EngineConfig(model="m", kv_cache_dtype="int8")


def test_pool_holds_more_tokens_in_the_same_bytes(stories_path):
    budget = 5 << 20                          # small enough that neither pool is capped by what it can use
    pools = {kvd: LLM(str(stories_path), device="cpu", kv_cache_memory_bytes=budget, kv_cache_dtype=kvd).engine
             for kvd in ("auto", "fp8")}
    f32, fp8 = (pools[k].runner for k in ("auto", "fp8"))
    assert fp8.kv_pool.dtype == np.uint8 and f32.kv_pool.dtype == np.float32
    assert fp8.num_blocks == 4 * f32.num_blocks                      # one byte against four (bf16: two)
    assert f32.kv_pool.nbytes <= budget and fp8.kv_pool.nbytes <= budget
    assert fp8.kv_pool.nbytes == f32.kv_pool.nbytes
    mc = f32.model_config
    assert kv_bytes_per_block(mc, 16, 2) == 2 * kv_bytes_per_block(mc, 16, 1)


# ---- the engine on stories260K ---------------------------------------------------------------

def test_fp8_engine_runs_stories_and_follows_the_golden_text(stories_path):
    golden = json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]
    llm = LLM(str(stories_path), device="cpu", kv_cache_dtype="fp8", num_kv_blocks=64, block_size=4)
    out = llm.generate([[golden[0]]], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 200
    first_miss = next((i for i, (a, b) in enumerate(zip(out.token_ids, golden[1:])) if a != b), 200)
    assert first_miss >= 50, f"FP8 greedy left the golden text at token {first_miss}"
    assert llm.engine.stats().kv_cache_dtype == "fp8_e4m3"
    assert llm.engine.block_manager.num_used_blocks == 0


def test_teacher_forced_fp8_logprobs_close_to_float32_and_transformers(stories_path):
    """The figures benchmarks/kv_fp8_accuracy.py prints for stories260K, held to bounds."""
    from minillm.benchmarks.kv_fp8_accuracy import stories_rows
    rows = {(r.kv_cache, r.reference): r for r in stories_rows(stories_path)}
    baseline = rows[("float32", "transformers")]
    assert baseline.max_abs_err < 1e-3 and baseline.greedy_agreement == 1.0
    tf = rows[("fp8 scale 1.0", "float32 cache")]
    assert tf.positions == 201 and tf.mean_abs_err < 0.35 and tf.greedy_agreement >= 0.9
    assert rows[("fp8 scale 1.0", "transformers")].greedy_agreement == 1.0
    assert rows[("fp8 calibrated", "transformers")].mean_abs_err < rows[("fp8 scale 1.0", "transformers")].mean_abs_err
    assert rows[("fp8 scale 1.0 (engine)", "golden greedy ids")].greedy_agreement > 0.25


def test_calculate_kv_scales_from_the_first_prefill_then_fixed(stories_path):
    golden = json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]
    llm = LLM(str(stories_path), device="cpu", kv_cache_dtype="fp8", calculate_kv_scales=True,
              num_kv_blocks=64, block_size=4, enable_prefix_caching=False)
    runner = llm.engine.runner
    np.testing.assert_array_equal(runner.model.kv_scales, 1.0)
    prompt = golden[:40]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    scales = runner.model.kv_scales.copy()
    assert (scales != 1.0).all() and (scales > 0).all()
    # The prompt's largest |k| and |v| of each layer land on 448 exactly: the blocks still hold them.
    pool = runner.kv_pool                                        # [L, 2, blocks, bs, Hk, Dh]
    blocks = np.arange(-(-len(prompt) // 4))                     # a fresh pool hands out blocks 0, 1, ...
    held = pool[:, :, blocks].reshape(pool.shape[0], 2, -1, pool.shape[-2], pool.shape[-1])[:, :, :len(prompt)]
    top = (held & 0x7F).reshape(pool.shape[0], 2, -1).max(axis=-1)
    np.testing.assert_array_equal(top, 0x7E)
    llm.generate([golden[50:90]], SamplingParams(temperature=0, max_tokens=5))
    np.testing.assert_array_equal(runner.model.kv_scales, scales)


# ---- stats -------------------------------------------------------------------------------------

def test_stats_and_load_report_name_the_kv_dtype(stories_path):
    from test_server_helpers import running_server
    with running_server(stories_path, kv_cache_dtype="fp8", num_kv_blocks=64) as (url, engine):
        stats = httpx.get(f"{url}/v1/stats", timeout=30).json()
    assert stats["kv_cache_dtype"] == "fp8_e4m3"
    plain = LLM(str(stories_path), device="cpu", num_kv_blocks=64).engine.stats()
    assert plain.kv_cache_dtype == "float32"
    assert "KV pool float32 64 blocks" in describe_engine(plain)
