"""Shared-nothing (SN) mode of the same engine: the baseline that shows what VSN saves (Alg. 1-2).

Each instance ``o_j`` gets its own copy of every tuple with at least one key it owns (forwardSN, Alg. 1:
the tuple is duplicated to every such instance) and keeps its own state ``sigma_j``; it processes its
copy with the same kernel (processSN, Alg. 2). A rebalance moves the buckets that change owner from one
instance's state to another's (state transfer, counted in ``metrics()["state_bytes_copied"]``).

Examples
--------
>>> from spark_stretch.ops import wordcount
>>> eng = SNEngine(wordcount(WS=10), m=2, n=2)
>>> eng.mode
'sn'
"""
from __future__ import annotations

import numpy as np

from .batch import ListColumn
from .runtime import Engine
from .state import BucketState


class SNEngine(Engine):
    """Shared-nothing O+ (same API as :class:`Engine`); see the module docstring."""

    mode = "sn"

    def _make_state(self, cap):
        op = self.op
        self.states = [BucketState(self.n_buckets, op.n_int, op.n_float, op.init_i, op.init_f, cap,
                                   self._pool_spec(), spill=self.spill) for _ in range(self.n)]
        self.state = self.states[0]
        self._m_dup = 0

    def _state_for(self, j):
        return self.states[j]

    def _pool_users(self, j):
        return [j]  # (each instance its own state and pool)

    def _states(self):
        return self.states

    def _segment_for(self, j, seg, cols):
        """forwardSN for instance j: route and copy (duplicate) the tuples it needs into its own queue."""
        c0, c1 = cols
        sel = self._route(j, self.owner_map, seg.ts, seg.stream, seg.row, c0, c1, self._ip,
                          np.empty(1 << 16, np.int64))
        ts, stream, seq = seg.ts[sel], seg.stream[sel], seg.seq[sel]
        rows = seg.row[sel]
        new_cols = []
        new_row = np.empty(sel.shape[0], np.int64)
        for s, c in enumerate((c0, c1)[: self.op.I]):
            m = stream == s
            idx = rows[m]
            new_row[m] = np.arange(idx.shape[0], dtype=np.int64)
            new_cols.append(_copy_cols(c, idx))
        if self.op.I == 1:
            new_cols.append(new_cols[0])
        self._m_dup += int(sel.shape[0])
        return ts, stream, new_row, seq, tuple(new_cols)

    def _transfer_state(self, new_owner_map):
        old = self.owner_map
        moved = np.flatnonzero(old != new_owner_map)
        copied = 0
        for b_src in np.unique(old[moved]):
            for b_dst in np.unique(new_owner_map[moved[old[moved] == b_src]]):
                bs = moved[(old[moved] == b_src) & (new_owner_map[moved] == b_dst)]
                copied += self.states[b_dst].move_buckets(self.states[b_src], bs)
        self._m["state_bytes_copied"] += copied

    def live_windows(self):
        return sum(s.live_windows() for s in self.states)

    def _dirty(self):
        d = self.states[0].dirty
        for s in self.states[1:]:
            d = d | s.dirty
        return d

    def metrics(self):
        d = super().metrics()
        d["tuples_forwarded"] = self._m_dup
        return d

    def _state_arrays(self, delta=False, lazy=False):
        return {"states": [s.compact(np.flatnonzero(s.dirty) if delta else None, lazy=lazy)
                           for s in self.states]}

    def _load_state_arrays(self, arrs):
        self.states = [BucketState.from_compact(self._narrow(a), self.spill)
                       for a in arrs["states"]]
        self.state = self.states[0]

    def _apply_state_delta(self, arrs):
        for s, a in zip(self.states, arrs["states"]):
            s.apply_compact(self._narrow(a))

    def _clear_dirty(self):
        for s in self.states:
            s.dirty[:] = 0


def _copy_cols(cols, idx):
    """Copy rows ``idx`` of a kernel column tuple; (offsets, values) pairs of list columns are detected
    by the builtin layout (first two arrays) and gathered as lists."""
    out = []
    off, vals = cols[0], cols[1]
    lc = ListColumn(off, vals).take(idx)
    out += [lc.offsets, lc.values]
    n = off.shape[0] - 1
    for c in cols[2:]:  # (a fused aggregation's values: k per row, column-major)
        k = c.shape[0] // n if n else 1
        out.append(c.reshape(k, n)[:, idx].ravel() if c.shape[0] and k > 1 else
                   c[idx] if c.shape[0] else c)
    return tuple(out)
