"""The model runner's host block tables (minillm/block_tables.py) against the plain construction."""
from __future__ import annotations

import numpy as np

from minillm.block_tables import BlockTables


class Seq:
    """What BlockTables reads of a sequence."""

    def __init__(self, seq_id: int) -> None:
        self.seq_id, self.block_table = seq_id, []


def plain(seqs) -> np.ndarray:
    """[B, longest] int32, padded with 0: the table as a step's metadata holds it."""
    out = np.zeros((len(seqs), max(1, max(len(s.block_table) for s in seqs))), np.int32)
    for b, seq in enumerate(seqs):
        out[b, :len(seq.block_table)] = seq.block_table
    return out


def test_tables_follow_the_lists_as_the_block_manager_changes_them():
    rng = np.random.default_rng(0)
    seqs = [Seq(i) for i in range(40)]
    tables = BlockTables(num_rows=12, width=4)      # small: rows are reused, grown and widened
    next_block = 1
    for _ in range(400):
        for seq in rng.choice(seqs, size=int(rng.integers(1, 8)), replace=False):
            action = rng.random()
            if action < 0.6:                                         # append_slots: extended in place
                grow = int(rng.integers(0, 3))
                seq.block_table.extend(range(next_block, next_block + grow))
                next_block += grow
            elif action < 0.8:                                       # allocate: a new list (prefix hits first)
                kept = seq.block_table[:int(rng.integers(0, len(seq.block_table) + 1))]
                seq.block_table = kept + list(range(next_block, next_block + 3))
                next_block += 3
            else:                                                    # free (preemption, the end)
                seq.block_table = []
        step = list(rng.choice(seqs, size=int(rng.integers(1, 20)), replace=False))
        got = tables.table(step)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, plain(step))
    assert tables.rows.shape[0] >= 19 and tables.rows.shape[1] > 4   # grew past 12 rows and 4 blocks


def test_a_step_copies_only_what_the_lists_gained():
    seqs = [Seq(i) for i in range(3)]
    for seq in seqs:
        seq.block_table = [10 * seq.seq_id + k for k in range(5)]
    tables = BlockTables(num_rows=8)
    tables.table(seqs)
    tables.rows[tables._entries[1][0], 0] = -7        # a block already copied is not copied again ...
    seqs[1].block_table.append(99)
    got = tables.table(seqs)
    assert got[1, 0] == -7 and got[1, 5] == 99
    seqs[1].block_table = [1, 2]                      # ... but a new list is copied whole
    np.testing.assert_array_equal(tables.table(seqs), plain(seqs))
