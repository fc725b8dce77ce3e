"""The padded sizes the CUDA graphs are captured at (the graphs themselves: tests/*_gpu.py)."""
from __future__ import annotations


def test_graph_sizes_cover_every_step_they_are_asked_for():
    """Piecewise token counts and verification batch sizes: sorted, capped, the cap included."""
    from minillm.cuda_graphs import VERIFY_GRAPH_MAX_TOKENS, verify_graph_batch_sizes
    from minillm.piecewise_graphs import piecewise_token_sizes
    for cap in (1, 100, 512, 8192, 16384, 20000):
        sizes = piecewise_token_sizes(cap)
        assert sizes == sorted(set(sizes)) and sizes[-1] == cap and all(s <= cap for s in sizes)
        gaps = [b / a for a, b in zip(sizes, sizes[1:]) if a >= 256]
        assert all(g <= 2.0 for g in gaps)               # padding costs at most as much again
    assert verify_graph_batch_sizes(256, 5) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96]
    assert all(s * 7 <= VERIFY_GRAPH_MAX_TOKENS for s in verify_graph_batch_sizes(256, 7)[1:])
    assert verify_graph_batch_sizes(16, 600) == [1]


def test_decode_graphs_order_attention_rows_longest_context_first():
    """The order decode graphs give attention's rows: by decreasing context, ties in the batch's order."""
    import numpy as np
    from minillm.cuda_graphs import longest_first
    assert longest_first(np.array([5, 9, 5, 12, 1], np.int32)).tolist() == [3, 1, 0, 2, 4]
    assert longest_first(np.array([], np.int32)).tolist() == []
