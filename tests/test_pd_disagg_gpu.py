"""Prefill/decode disaggregation on one GPU by CUDA IPC: a prefill server, a decode server and the
router as processes (a tiny random Qwen3, fp32), greedy text through the router equal to the
prefill server's own. The Qwen3-0.6B-shaped run and the mixed workload: benchmarks/pd_disagg.py.
"""
import pytest

pytestmark = pytest.mark.gpu

from gpu_support import HAS_GPU
if not HAS_GPU:
    pytest.skip("no CUDA GPU", allow_module_level=True)

from minillm.benchmarks import pd_disagg  # noqa: E402


def test_cuda_ipc_transfer_gives_the_single_servers_text(tmp_path, capsys):
    status = pd_disagg.main(["--device", "cuda", "--small", "--phases", "equality", "--equality-dtype", "float32",
                             "--log-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "8/8 texts equal" in out and "loaded 376 prompt tokens (expected 376) and computed 8" in out, out
