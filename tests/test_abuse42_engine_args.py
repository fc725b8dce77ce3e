"""Engine arguments at their extremes: a thread count past what a C int holds, a keyword LLM() has no
setting of, and engine options given to `minillm chat --url`, which loads no engine. Each is refused
before anything loads, naming the argument, or works."""
from __future__ import annotations

import pytest
from test_abuse29b_cli import one_line
from test_cli import STORIES, run_main
from threadpoolctl import threadpool_limits

from minillm import LLM, EngineArgs
from minillm.config import MAX_BLAS_THREADS
from minillm.device import THREAD_VARIABLES, CpuDevice, cpu_threads

HUGE = str(10**20)       # past a C long: ctypes refused it as OpenBLAS's thread count with an OverflowError


@pytest.fixture
def thread_variables(monkeypatch):
    """The BLAS thread variables unset, and put back after the test (the CLI's --threads sets them)."""
    for name in THREAD_VARIABLES:
        monkeypatch.setenv(name, "1")
        monkeypatch.delenv(name)


# ---- --threads and the variables it sets ---------------------------------------------------------------------

@pytest.mark.parametrize("value", [HUGE, str(2**63), str(MAX_BLAS_THREADS + 1)])
def test_threads_past_the_bound_is_a_usage_error(capsys, thread_variables, value):
    # It reached the engine and ended in ctypes' "int too long to convert" traceback (2**63 was cut to a
    # C int's low bits, 0, without a word).
    status, _, err = run_main(capsys, "generate", str(STORIES), "-p", "x", "--device", "cpu", "-t", value)
    line = one_line(err)
    assert status == 2 and "'--threads'" in line and str(MAX_BLAS_THREADS) in line, line


@pytest.mark.parametrize("name", THREAD_VARIABLES)
def test_a_thread_variable_past_the_bound_runs_at_the_bound(monkeypatch, thread_variables, name):
    # OpenBLAS caps a variable past its own maximum; the engine read it back and set it through ctypes.
    monkeypatch.setenv(name, HUGE)
    assert cpu_threads() == MAX_BLAS_THREADS
    with threadpool_limits(limits=1, user_api="blas"):      # the BLAS thread count put back after
        CpuDevice()


def test_a_thread_variable_within_the_bound_is_taken_as_it_is(monkeypatch, thread_variables):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads() == 3


# ---- LLM() and EngineArgs take only settings the engine reads ------------------------------------------------

@pytest.mark.parametrize("value", [5, {"max_model_len": 64}, None])
def test_llm_refuses_extra_as_any_keyword_it_has_no_setting_of(value):
    # EngineConfig had an `extra` field nothing read: LLM(extra={"max_model_len": 64}) ran at 512, silently.
    with pytest.raises(TypeError, match="unexpected keyword argument 'extra'"):
        LLM(str(STORIES), device="cpu", extra=value)
    with pytest.raises(TypeError, match="extra"):
        EngineArgs(model=str(STORIES), extra=value)


# ---- chat --url loads no engine: its options are refused, not ignored ----------------------------------------

@pytest.mark.parametrize("args, flag", [
    (["--max-model-len", "0"], "--max-model-len"),          # a bad value was not even read
    (["--device", "cuda"], "--device"),
    (["--max-model-len", "64"], "--max-model-len"),
    (["--no-enable-prefix-caching"], "--enable-prefix-caching"),
    (["--num-gpu-blocks-override", "4"], "--num-kv-blocks"),
    (["-t", "2"], "--threads"),
])
def test_chat_with_url_refuses_engine_options(capsys, args, flag):
    # Port 1 answers nothing: reaching for it would end in "cannot reach" (status 1), after the options were
    # passed over without a word.
    status, _, err = run_main(capsys, "chat", "--url", "http://127.0.0.1:1", "-q", "hi", *args)
    line = one_line(err)
    assert status == 2 and flag in line and "--url" in line, line


def test_chat_with_url_still_takes_its_sampling_options(capsys):
    status, _, err = run_main(capsys, "chat", "--url", "http://127.0.0.1:1", "-q", "hi", "--temperature", "0",
                              "--max-tokens", "3", "--seed", "1")
    assert status == 1 and "cannot reach" in one_line(err)


# ---- bench serving: the mixed workload's own options need it ---------------------------------------------------

@pytest.mark.parametrize("extra, flag", [
    (["--duration", "-1"], "--duration"),          # a bad value was passed over unread
    (["--long-every-s", "0"], "--long-every-s"),
    (["--long-input-len", "64"], "--long-input-len"),
    (["--long-output-len", "2"], "--long-output-len"),
])
def test_bench_serving_refuses_mixed_workload_options_without_mixed_users(extra, flag):
    from minillm.benchmarks import serving as bench
    from minillm.benchmarks.cli_args import BenchUsageError
    with pytest.raises(BenchUsageError, match=rf"{flag} is used by --mixed-users only"):
        bench.parse_args(extra)


def test_bench_serving_takes_mixed_workload_options_with_mixed_users():
    from minillm.benchmarks import serving as bench
    args = bench.parse_args(["--mixed-users", "2", "--duration", "5", "--long-every-s", "1", "--long-input-len", "64",
                             "--long-output-len", "2"])
    assert (args.duration, args.long_every_s, args.long_input_len, args.long_output_len) == (5.0, 1.0, 64, 2)
