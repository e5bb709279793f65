"""Checkpoints of an :class:`~spark_stretch.engine.runtime.Engine`: :meth:`Snapshots.snapshot`
and :meth:`Snapshots.restore`.

A snapshot pickles (protocol 5) the buckets, owner map, epoch, both ESGs (pending tuples and watermarks),
the interner and the counters; an incremental one (``delta=True``) holds only the buckets
changed since the previous snapshot, which :meth:`~Snapshots.restore` applies on top of its
base. The engines keep their state differently (shared buckets, the shared-nothing engine's
per-instance ones, the join's tuple store): each says how through ``_state_arrays``,
``_load_state_arrays``, ``_apply_state_delta``, ``_clear_dirty`` and ``_check_layout``.

:class:`Snapshots` is a part of :class:`~spark_stretch.engine.runtime.Engine` (a base class of
it): it reads the engine's state, ESGs and locks.

A snapshot is a :class:`Blob`: the pickle of its structure, with the buffers of its large arrays
(the live windows, copied once by ``compact``) kept *out of band* and written after it as they
are, so a checkpoint of N windows holds them once in memory, not twice (a copy and its pickled
bytes). :func:`loads` reads a blob, its bytes, or a snapshot written before blobs (one pickle).

Examples
--------
>>> import numpy as np
>>> b = dumps({"rec": np.arange(300_000), "epoch": 3})
>>> len(bytes(b)) == len(b), int(loads(bytes(b))["rec"][-1]), loads(b)["epoch"]
(True, 299999, 3)
"""
from __future__ import annotations

import io
import mmap
import os
import pickle
import struct
from pathlib import Path

import numpy as np

from .errors import EngineError
from .esg import Control
from .spill import write_dropping
from .state import BucketState, narrow_floats


MAGIC = b"STRETCH-SNAP-5\n"  # (a pickle starts with b"\x80": a snapshot before blobs)
_LEN = struct.Struct("<Q")
OUT_OF_BAND = 1 << 16  # buffers from this size are written after the pickle, not copied into it


class Blob:
    """A snapshot: ``MAGIC``, the pickle's length, the pickle, the buffer count, then each
    out-of-band buffer's length and bytes (little-endian lengths). ``len()`` is its size in
    bytes, :meth:`write_to` writes it to a file without joining its parts, ``bytes()`` joins
    them."""

    def __init__(self, head: bytes, buffers: list):
        self.head, self.buffers = head, buffers

    def __len__(self) -> int:
        return (len(MAGIC) + 2 * _LEN.size + len(self.head)
                + sum(_LEN.size + b.nbytes for b in self.buffers))

    def write_to(self, f) -> None:
        f.write(MAGIC)
        f.write(_LEN.pack(len(self.head)))
        f.write(self.head)
        f.write(_LEN.pack(len(self.buffers)))
        for b in self.buffers:
            f.write(_LEN.pack(b.nbytes))
            write_dropping(f, b)  # (a spilled state's copy: a chunk at a time)

    def __bytes__(self) -> bytes:
        out = io.BytesIO()
        self.write_to(out)
        return out.getvalue()


def map_file(path):
    """A snapshot file mapped read-only, for :func:`loads` (its arrays views of the page cache,
    not a copy on the heap: a large state restores within its memory budget)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size else b""


def dumps(obj) -> Blob:
    """``obj`` as a :class:`Blob` (its large contiguous buffers referenced, not copied: they must
    not change until the blob is written)."""
    bufs: list = []

    def out_of_band(pb) -> bool:
        raw = pb.raw()
        if raw.nbytes < OUT_OF_BAND:
            return True  # (in band: small, and maybe an array the engine keeps changing)
        bufs.append(raw)
        return False

    return Blob(pickle.dumps(obj, protocol=5, buffer_callback=out_of_band), bufs)


def loads(src):
    """The object of a :class:`Blob`, of its bytes (read without copying its buffers), or of
    a snapshot written as one pickle."""
    if isinstance(src, Blob):
        return pickle.loads(src.head, buffers=src.buffers)
    mv = memoryview(src)
    if bytes(mv[:len(MAGIC)]) != MAGIC:
        return pickle.loads(src)
    at = len(MAGIC)
    (n,) = _LEN.unpack_from(mv, at)
    head = mv[at + _LEN.size:at + _LEN.size + n]
    at += _LEN.size + n
    (k,) = _LEN.unpack_from(mv, at)
    at += _LEN.size
    bufs = []
    for _ in range(k):
        (m,) = _LEN.unpack_from(mv, at)
        bufs.append(mv[at + _LEN.size:at + _LEN.size + m])
        at += _LEN.size + m
    return pickle.loads(head, buffers=bufs)


class Snapshots:
    """Snapshot and restore of an engine (mixed into :class:`~spark_stretch.engine.runtime.Engine`)."""

    def _state_arrays(self, delta=False):
        only = np.flatnonzero(self.state.dirty) if delta else None
        return {"shared": self.state.compact(only)}

    def _narrow(self, compact: dict) -> dict:
        """A restored compact with the float slots the operator keeps (older ones kept more)."""
        return narrow_floats(compact, getattr(self.op, "float_cols", None))

    def _load_state_arrays(self, arrs):
        self.state = BucketState.from_compact(self._narrow(arrs["shared"]), self.spill)

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
        self.state.apply_compact(self._narrow(arrs["shared"]))

    def _clear_dirty(self):
        self.state.dirty[:] = 0

    def snapshot(self, path=None, clear_dirty=True, delta=False):
        """The engine state as a :class:`Blob` (or written to ``path``/engine.snap): buckets, owner map, epoch,
        watermarks, pending ESG tuples, interner. Call when idle (after :meth:`drain`).

        With ``delta=True`` the buckets part holds only the buckets changed since the previous
        snapshot (an incremental checkpoint: :meth:`restore` applies it on top of its base).
        Everything else is always whole (it is small).
        """
        with self._drain_lock:
            snap_in = self.esg_in.snapshot()
            snap_in["log"] = [_strip(it) for it in snap_in["log"]]
            blob = dumps({
                "mode": self.mode, "m": self.m, "n": self.n, "n_buckets": self.n_buckets,
                "lateness": self.lateness, "delta": bool(delta),
                "state": self._state_arrays(delta), "owner_map": self.owner_map, "epoch": self.epoch,
                "active": self.active, "esg_in": snap_in, "esg_out": self.esg_out.snapshot(),
                "interner": self.interner.strings(), "metrics": self._m})
            if clear_dirty:
                self._clear_dirty()
        if path is not None:
            p = Path(path)
            p.mkdir(parents=True, exist_ok=True)
            with open(p / "engine.snap", "wb") as f:
                blob.write_to(f)
        return blob

    @classmethod
    def restore(cls, op, src, threads=True, deltas=(), spill=None):
        """An engine continuing from :meth:`snapshot` bytes or directory, running operator ``op``.

        ``deltas``: incremental snapshots taken after ``src``, oldest first, applied in order;
        ``spill``: the state's memory budget (:class:`~spark_stretch.engine.spill.Spill`).
        """
        if isinstance(src, (str, Path)):
            src = map_file(Path(src) / "engine.snap")
        d = loads(src)
        if d["mode"] != cls.mode:
            raise EngineError(f"snapshot is of a {d['mode']!r} engine; restore it with that engine class")
        if d.get("delta"):
            raise EngineError("restore needs a full snapshot first; incremental ones go in deltas=")
        ds = [loads(blob) for blob in deltas]
        base, d = d, (ds[-1] if ds else d)  # the engine as of the last snapshot
        eng = cls(op, d["m"], d["n"], n_buckets=d["n_buckets"], threads=threads, out_reader=None,
                  lateness=d.get("lateness", "tuple"), spill=spill)
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
