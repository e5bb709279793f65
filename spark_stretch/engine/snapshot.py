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
kept *out of band* and written after it as they are, so a checkpoint of N windows holds them
once in memory, not twice (a copy and its pickled bytes). A snapshot written at once (``lazy``:
the host's checkpoints) holds the live windows not even once: they are
:class:`~spark_stretch.engine.spill.Gathered`, referenced from the pickle by a persistent id and
copied a chunk of buckets at a time as the blob is written. :func:`loads` reads a blob, its
bytes, or a snapshot of an earlier format (without gathered arrays, or one pickle).

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
from .spill import Gathered, write_dropping
from .state import BucketState, narrow_floats


MAGIC = b"STRETCH-SNAP-6\n"  # (a pickle starts with b"\x80": a snapshot before blobs)
MAGIC_5 = b"STRETCH-SNAP-5\n"  # (blobs without gathered arrays; read as they are)
_LEN = struct.Struct("<Q")
OUT_OF_BAND = 1 << 16  # buffers from this size are written after the pickle, not copied into it


class Blob:
    """A snapshot: ``MAGIC``, the pickle's length, the pickle, the buffer count, then each
    out-of-band buffer's length and bytes, then the count of gathered arrays and each one's
    length and bytes (little-endian lengths). ``len()`` is its size in bytes, :meth:`write_to`
    writes it to a file without joining its parts (a gathered array a part at a time),
    ``bytes()`` joins them."""

    def __init__(self, head: bytes, buffers: list, gathered: list = ()):
        self.head, self.buffers, self.gathered = head, buffers, list(gathered)

    def __len__(self) -> int:
        return (len(MAGIC) + 3 * _LEN.size + len(self.head)
                + sum(_LEN.size + b.nbytes for b in self.buffers + self.gathered))

    def write_to(self, f) -> None:
        f.write(MAGIC)
        f.write(_LEN.pack(len(self.head)))
        f.write(self.head)
        f.write(_LEN.pack(len(self.buffers)))
        for b in self.buffers:
            f.write(_LEN.pack(b.nbytes))
            write_dropping(f, b)  # (a spilled state's copy: a chunk at a time)
        f.write(_LEN.pack(len(self.gathered)))
        for g in self.gathered:
            f.write(_LEN.pack(g.nbytes))
            for part in g.parts():
                if part.nbytes:  # (a cast of a view with a 0 in its shape is refused)
                    f.write(memoryview(part).cast("B"))

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


class _Pickler(pickle.Pickler):
    """Pickles a :class:`~spark_stretch.engine.spill.Gathered` as a reference to the blob's
    gathered arrays (its bytes come after the pickle)."""

    def __init__(self, f, buffer_callback):
        super().__init__(f, protocol=5, buffer_callback=buffer_callback)
        self.gathered: list = []

    def persistent_id(self, obj):
        if isinstance(obj, Gathered):
            self.gathered.append(obj)
            return ("gathered", len(self.gathered) - 1, obj.dtype.str, obj.shape)
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, f, buffers, gathered):
        super().__init__(f, buffers=buffers)
        self.gathered = gathered

    def persistent_load(self, pid):
        kind, j, dtype, shape = pid
        if kind != "gathered":
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r} in a snapshot")
        g = self.gathered[j]
        return np.asarray(g) if isinstance(g, Gathered) else \
            np.frombuffer(g, np.dtype(dtype)).reshape(shape)


def dumps(obj) -> Blob:
    """``obj`` as a :class:`Blob` (its large contiguous buffers referenced, not copied: they must
    not change until the blob is written; nor may the state a ``Gathered`` copies)."""
    bufs: list = []

    def out_of_band(pb) -> bool:
        raw = pb.raw()
        if raw.nbytes < OUT_OF_BAND:
            return True  # (in band: small, and maybe an array the engine keeps changing)
        bufs.append(raw)
        return False

    f = io.BytesIO()
    p = _Pickler(f, out_of_band)
    p.dump(obj)
    return Blob(f.getvalue(), bufs, p.gathered)


def _sections(mv, at: int, count: int) -> tuple:
    out = []
    for _ in range(count):
        (m,) = _LEN.unpack_from(mv, at)
        out.append(mv[at + _LEN.size:at + _LEN.size + m])
        at += _LEN.size + m
    return out, at


def loads(src):
    """The object of a :class:`Blob`, of its bytes (read without copying its buffers), or of
    a snapshot of an earlier format."""
    if isinstance(src, Blob):
        return _Unpickler(io.BytesIO(src.head), src.buffers, src.gathered).load()
    mv = memoryview(src)
    magic = bytes(mv[:len(MAGIC)])
    if magic not in (MAGIC, MAGIC_5):
        return pickle.loads(src)
    at = len(MAGIC)
    (n,) = _LEN.unpack_from(mv, at)
    head = mv[at + _LEN.size:at + _LEN.size + n]
    at += _LEN.size + n
    (k,) = _LEN.unpack_from(mv, at)
    bufs, at = _sections(mv, at + _LEN.size, k)
    gathered = []
    if magic == MAGIC:
        (g,) = _LEN.unpack_from(mv, at)
        gathered, at = _sections(mv, at + _LEN.size, g)
    return _Unpickler(io.BytesIO(head), bufs, gathered).load()


class Snapshots:
    """Snapshot and restore of an engine (mixed into :class:`~spark_stretch.engine.runtime.Engine`)."""

    def _state_arrays(self, delta=False, lazy=False):
        only = np.flatnonzero(self.state.dirty) if delta else None
        return {"shared": self.state.compact(only, lazy=lazy)}

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

    def snapshot(self, path=None, clear_dirty=True, delta=False, lazy=False):
        """The engine state as a :class:`Blob` (or written to ``path``/engine.snap): buckets, owner map, epoch,
        watermarks, pending ESG tuples, interner. Call when idle (after :meth:`drain`).

        With ``delta=True`` the buckets part holds only the buckets changed since the previous
        snapshot (an incremental checkpoint: :meth:`restore` applies it on top of its base).
        Everything else is always whole (it is small). With ``lazy=True`` the live windows are
        copied as the blob is written, a chunk at a time: write it before the engine runs again.
        """
        with self._drain_lock:
            snap_in = self.esg_in.snapshot()
            snap_in["log"] = [_strip(it) for it in snap_in["log"]]
            blob = dumps({
                "mode": self.mode, "m": self.m, "n": self.n, "n_buckets": self.n_buckets,
                "lateness": self.lateness, "delta": bool(delta),
                "state": self._state_arrays(delta, lazy), "owner_map": self.owner_map, "epoch": self.epoch,
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
