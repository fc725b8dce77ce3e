"""The block tables of a step's sequences as one host array, kept in step with their lists.

A sequence's block table (a list the block manager owns) only grows while the sequence runs: the
block manager extends it in place, and hands the sequence a new list when it frees or reallocates
its blocks. BlockTables keeps a row per sequence in one int32 array and copies into it only what
a list gained since the step before (a new list object, or a shorter one, rewrites the row), so a
step's [B, W] table is one gather, not B conversions of Python lists (about 5 us each at 60
blocks). Rows of sequences that stop being scheduled are reused once the array is full.
"""
from __future__ import annotations

from typing import Sequence as Seq

import numpy as np

from minillm.sequence import Sequence


class BlockTables:
    """Host rows of the scheduled sequences' block tables (the model runner's)."""

    def __init__(self, num_rows: int, width: int = 64) -> None:
        self.rows = np.zeros((max(1, num_rows), max(1, width)), np.int32)   # [R, W] block ids, 0 past a table
        self._filled = np.zeros(self.rows.shape[0], np.int64)             # [R] entries of a row that may be nonzero
        self._entries: dict[int, list] = {}   # seq_id -> [row, the list synced, its length then]
        self._free: list[int] = list(range(self.rows.shape[0] - 1, -1, -1))

    def table(self, seqs: Seq[Sequence]) -> np.ndarray:
        """block_tables: [len(seqs), longest table] int32 of these sequences, padded with 0."""
        rows, width = [], 1
        entries = self._entries
        for seq in seqs:
            table, n = seq.block_table, len(seq.block_table)
            entry = entries.get(seq.seq_id)
            if entry is not None and entry[1] is table and entry[2] == n:   # most steps: the row is current
                rows.append(entry[0])
                if n > width:
                    width = n
                continue
            if entry is None:
                entry = self._entries[seq.seq_id] = [self._take_row(seqs), None, 0]
            row = entry[0]
            if n > self.rows.shape[1]:
                self._widen(n)
            if entry[1] is not table or n < entry[2]:          # a new list: the row is rewritten
                self.rows[row, :n] = table
                if self._filled[row] > n:
                    self.rows[row, n:self._filled[row]] = 0
                self._filled[row] = n
            elif n > entry[2]:                                  # the same list, grown at its end
                self.rows[row, entry[2]:n] = table[entry[2]:]
                self._filled[row] = max(self._filled[row], n)
            entry[1], entry[2] = table, n
            rows.append(row)
            width = max(width, n)
        return self.rows[rows, :width]

    def _take_row(self, seqs: Seq[Sequence]) -> int:
        """A free row; when none is left, the rows of sequences not in this step are freed first."""
        if not self._free:
            scheduled = {seq.seq_id for seq in seqs}
            for seq_id in [s for s in self._entries if s not in scheduled]:
                self._free.append(self._entries.pop(seq_id)[0])
        if not self._free:                                      # more sequences in one step than rows
            old = self.rows.shape[0]
            self.rows = np.concatenate([self.rows, np.zeros_like(self.rows)])
            self._filled = np.concatenate([self._filled, np.zeros_like(self._filled)])
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()

    def _widen(self, n: int) -> None:
        """Make room for tables of n blocks."""
        wider = np.zeros((self.rows.shape[0], max(n, 2 * self.rows.shape[1])), np.int32)
        wider[:, :self.rows.shape[1]] = self.rows
        self.rows = wider
