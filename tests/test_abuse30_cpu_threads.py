"""The CPU backend's BLAS threads: every CPU but one by default (OpenBLAS took one a CPU, and on a
busy 2-core machine its second thread made decode steps 3-5x slower), OPENBLAS_NUM_THREADS or
OMP_NUM_THREADS when set, and llama.cpp's --threads/-t on the commands that load a model."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_cli import STORIES, run_main

BLAS_THREADS = ("import json, numpy; from threadpoolctl import threadpool_info; "
                "from minillm.device import CpuDevice; CpuDevice(); "
                "print(json.dumps([p['num_threads'] for p in threadpool_info() if p['user_api'] == 'blas']))")


def blas_threads_in_a_fresh_process(**env: str) -> list[int]:
    """The BLAS thread counts a new CpuDevice leaves in a fresh interpreter with env (the variables
    the tests' own process sets left out)."""
    base = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", BLAS_THREADS], env={**base, **env}, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return json.loads(out)


def test_the_cpu_backend_leaves_one_cpu_to_the_engine_and_server_threads():
    from minillm.device import usable_cpus
    # It was OpenBLAS's default: one thread a CPU.
    assert blas_threads_in_a_fresh_process() == [max(1, usable_cpus() - 1)]


def test_openblas_or_omp_num_threads_wins_over_the_default():
    assert blas_threads_in_a_fresh_process(OMP_NUM_THREADS="3") == [3]
    assert blas_threads_in_a_fresh_process(OPENBLAS_NUM_THREADS="2", OMP_NUM_THREADS="3") == [2]


@pytest.mark.parametrize("value", ["0", "-1", "abc", ""])
def test_a_thread_variable_that_is_no_count_is_left_to_the_default(monkeypatch, value):
    from minillm.device import cpu_threads, usable_cpus
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert cpu_threads() == max(1, usable_cpus() - 1)


def test_threads_flag_sets_the_blas_threads_of_the_engine_and_the_processes_it_starts(capsys, monkeypatch):
    from threadpoolctl import threadpool_info

    from minillm.device import set_blas_threads
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.setenv(name, "1")          # put back after the test, as the flag sets them
    try:
        status, _, err = run_main(capsys, "generate", str(STORIES), "--device", "cpu", "--temperature", "0",
                                  "--max-tokens", "2", "-p", "Once", "-t", "3")
        assert status == 0, err
        # Every BLAS library loaded into this process (a test before may have loaded a second) runs 3.
        blas = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
        assert blas and set(blas) == {3}, blas
        assert (os.environ["OPENBLAS_NUM_THREADS"], os.environ["OMP_NUM_THREADS"]) == ("3", "3")
    finally:
        set_blas_threads(1)


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_a_bad_thread_count_is_a_usage_error_naming_the_flag(capsys, value):
    status, out, err = run_main(capsys, "generate", str(STORIES), "--device", "cpu", "-p", "x", "--threads", value)
    assert (status, out) == (2, "")
    assert "Invalid value for '--threads'" in err
