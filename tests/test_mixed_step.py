"""The mixed-step benchmark runs on the CPU with stories260K at tiny sizes (so it cannot rot)."""
import json

from minillm.benchmarks import mixed_step as bench


def test_mixed_step_times_a_decode_step_then_one_step_per_chunk_size(stories_path, tmp_path, capsys):
    out = tmp_path / "mixed.json"
    rc = bench.main(["--model", str(stories_path), "--device", "cpu", "--decodes", "3", "--prompt-len", "16",
                     "--chunks", "8", "40", "--repeats", "2", "--warmup", "4", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| none |" in printed and "| 8 |" in printed and "| 40 |" in printed
    costs = json.loads(out.read_text())
    assert [c["chunk"] for c in costs] == [0, 8, 40]
    for c in costs:
        assert c["forward_device_ms"] > 0 and c["forward_host_ms"] > 0
        assert c["attention_ms"] is None and c["attention_kernels"] is None     # events on a GPU only


def test_mixed_step_needs_a_model_without_a_gpu(capsys):
    rc = bench.run_main(bench.main, "mixed_step", ["--device", "cpu"])
    assert rc == 1 and "give a small model" in capsys.readouterr().err
