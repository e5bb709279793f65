"""Checkpoints of an :class:`~spark_stretch.engine.runtime.Engine`: :meth:`Snapshots.snapshot`
and :meth:`Snapshots.restore`.

A snapshot pickles the buckets, owner map, epoch, both ESGs (pending tuples and watermarks),
the interner and the counters; an incremental one (``delta=True``) holds only the buckets
changed since the previous snapshot, which :meth:`~Snapshots.restore` applies on top of its
base. The engines keep their state differently (shared buckets, the shared-nothing engine's
per-instance ones, the join's tuple store): each says how through ``_state_arrays``,
``_load_state_arrays``, ``_apply_state_delta``, ``_clear_dirty`` and ``_check_layout``.

:class:`Snapshots` is a part of :class:`~spark_stretch.engine.runtime.Engine` (a base class of
it): it reads the engine's state, ESGs and locks.
"""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from .errors import EngineError
from .esg import Control
from .state import BucketState


class Snapshots:
    """Snapshot and restore of an engine (mixed into :class:`~spark_stretch.engine.runtime.Engine`)."""

    def _state_arrays(self, delta=False):
        only = np.flatnonzero(self.state.dirty) if delta else None
        return {"shared": self.state.compact(only)}

    def _load_state_arrays(self, arrs):
        self.state = BucketState.from_compact(arrs["shared"])

    def _check_layout(self, op):
        """Refuse restored state whose windows are laid out for another operator."""
        want = (op.n_int, op.n_float, sum(w for _, _, w in getattr(op, "pool", ())))
        for st in self._states():
            have = (st.init_i.shape[0], st.init_f.shape[0], st.pool.shape[1])
            if have != want:
                raise EngineError(f"the snapshot's windows keep {have[0]} ints, {have[1]} floats "
                                  f"and {have[2]} pool words each, operator {op.name}'s "
                                  f"{want[0]}, {want[1]} and {want[2]} (another version or "
                                  "query): restart it from a new checkpoint location")

    def _apply_state_delta(self, arrs):
        self.state.apply_compact(arrs["shared"])

    def _clear_dirty(self):
        self.state.dirty[:] = 0

    def snapshot(self, path=None, clear_dirty=True, delta=False):
        """The engine state as bytes (or written to ``path``/engine.snap): buckets, owner map, epoch,
        watermarks, pending ESG tuples, interner. Call when idle (after :meth:`drain`).

        With ``delta=True`` the buckets part holds only the buckets changed since the previous
        snapshot (an incremental checkpoint: :meth:`restore` applies it on top of its base).
        Everything else is always whole (it is small).
        """
        with self._drain_lock:
            snap_in = self.esg_in.snapshot()
            snap_in["log"] = [_strip(it) for it in snap_in["log"]]
            blob = pickle.dumps({
                "mode": self.mode, "m": self.m, "n": self.n, "n_buckets": self.n_buckets,
                "lateness": self.lateness, "delta": bool(delta),
                "state": self._state_arrays(delta), "owner_map": self.owner_map, "epoch": self.epoch,
                "active": self.active, "esg_in": snap_in, "esg_out": self.esg_out.snapshot(),
                "interner": self.interner.strings(), "metrics": self._m}, protocol=5)
            if clear_dirty:
                self._clear_dirty()
        if path is not None:
            p = Path(path)
            p.mkdir(parents=True, exist_ok=True)
            (p / "engine.snap").write_bytes(blob)
        return blob

    @classmethod
    def restore(cls, op, src, threads=True, deltas=()):
        """An engine continuing from :meth:`snapshot` bytes or directory, running operator ``op``.

        ``deltas``: incremental snapshots taken after ``src``, oldest first, applied in order.
        """
        if isinstance(src, (str, Path)):
            src = (Path(src) / "engine.snap").read_bytes()
        d = pickle.loads(src)
        if d["mode"] != cls.mode:
            raise EngineError(f"snapshot is of a {d['mode']!r} engine; restore it with that engine class")
        if d.get("delta"):
            raise EngineError("restore needs a full snapshot first; incremental ones go in deltas=")
        ds = [pickle.loads(blob) for blob in deltas]
        base, d = d, (ds[-1] if ds else d)  # the engine as of the last snapshot
        eng = cls(op, d["m"], d["n"], n_buckets=d["n_buckets"], threads=threads, out_reader=None,
                  lateness=d.get("lateness", "tuple"))
        eng._load_state_arrays(base["state"])
        for x in ds:
            eng._apply_state_delta(x["state"])
        eng._check_layout(op)
        eng.interner.__init__(d["interner"])
        eng.owner_map, eng.epoch, eng.active = d["owner_map"], d["epoch"], list(d["active"])
        eng.esg_in.restore(d["esg_in"])
        eng.esg_out.restore(d["esg_out"])
        eng._m = dict(d["metrics"])
        eng._clear_dirty()
        return eng


def _strip(it):
    if isinstance(it, Control):
        return Control(it.epoch, it.instances, it.owner_map, it.gamma)
    return it
