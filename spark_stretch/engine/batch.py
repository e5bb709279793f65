"""Columnar batches as the engine holds them: a dict of equal-length columns, an int64 ``ts``
among them, each a numpy array or a :class:`ListColumn` (Arrow's list layout: offsets and
values), strings interned to int64 ids.

:func:`normalize_batch` makes one from a ``pyarrow.RecordBatch``/``Table`` or a dict of arrays
(what :meth:`ESG.add <spark_stretch.engine.esg.ESG.add>` takes), :func:`to_arrow` turns one back;
:func:`batch_take`, :func:`batch_concat` and :func:`sort_rows` gather, join and order rows (on
every core for large batches).

Examples
--------
>>> import numpy as np
>>> from spark_stretch.engine.batch import ListColumn, batch_take, to_arrow
>>> b = {"ts": np.array([3, 1]), "words": ListColumn([0, 2, 3], np.array([7, 8, 9]))}
>>> b = batch_take(b, np.array([1, 0]))
>>> to_arrow(b).to_pydict()
{'ts': [1, 3], 'words': [[9], [7, 8]]}
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
from .jit import njit

from .errors import EngineError
from .order import lexsort


def take_list(offsets, values, idx):
    """Gather rows ``idx`` of an Arrow-like list column (offsets, values) into a new one."""
    lens = offsets[idx + 1] - offsets[idx]
    noff = np.zeros(idx.shape[0] + 1, np.int64)
    np.cumsum(lens, out=noff[1:])
    nval = np.empty(noff[-1], values.dtype)
    _take_list_into(offsets, values, idx, noff, nval)
    return noff, nval


@njit(nogil=True, cache=True)
def _take_list_into(offsets, values, idx, noff, nval):
    """Copy rows ``idx`` of (offsets, values) into ``nval`` at ``noff`` (the kernel fills arrays
    the caller made: the kernels' library built ahead of time returns no new array)."""
    for i in range(idx.shape[0]):
        r = idx[i]
        a = offsets[r]
        d = noff[i]
        for p in range(offsets[r + 1] - a):
            nval[d + p] = values[a + p]


class ListColumn:
    """Arrow-like list column: row ``r`` is ``values[offsets[r]:offsets[r + 1]]`` (offsets start at 0)."""

    __slots__ = ("offsets", "values")

    def __init__(self, offsets, values):
        self.offsets = np.ascontiguousarray(offsets, np.int64)
        self.values = np.ascontiguousarray(values)

    def __len__(self):
        return self.offsets.shape[0] - 1

    def take(self, idx):
        off, val = take_list(self.offsets, self.values, np.ascontiguousarray(idx, np.int64))
        return ListColumn(off, val)

    def slice(self, a, b):
        return ListColumn(self.offsets[a:b + 1] - self.offsets[a], self.values[self.offsets[a]:self.offsets[b]])

    def lengths(self):
        return np.diff(self.offsets)

    def to_pylist(self):
        v = self.values.tolist()
        o = self.offsets.tolist()
        return [v[o[i]:o[i + 1]] for i in range(len(self))]

    @staticmethod
    def concat(cols):
        if len(cols) == 1:
            return cols[0]
        offs = [np.zeros(1, np.int64)]
        base = 0
        for c in cols:
            offs.append(c.offsets[1:] + base)
            base += int(c.offsets[-1])
        return ListColumn(np.concatenate(offs), np.concatenate([c.values for c in cols]))


def frozen(x):
    """``x`` (an array, or a tuple of them) as read-only views.

    numba compiles a kernel once per argument types, and an array's read-only flag is part of its
    type: a batch's columns are read-only when Arrow lent them and writable when they were
    computed, so without this a query compiled the (large) kernel twice, each 20-50 s. Kernels
    take their inputs through this.
    """
    if isinstance(x, np.ndarray):
        if not x.flags.writeable:
            return x
        v = x.view()
        v.flags.writeable = False
        return v
    if type(x) is tuple:  # (not a named tuple: its type is the kernel's too)
        return tuple(frozen(a) for a in x)
    return x


def _take(col, idx):
    return col.take(idx) if isinstance(col, ListColumn) else col[idx]


def _slice(col, a, b):
    return col.slice(a, b) if isinstance(col, ListColumn) else col[a:b]


def _concat(cols):
    if isinstance(cols[0], ListColumn):
        return ListColumn.concat(cols)
    return cols[0] if len(cols) == 1 else np.concatenate(cols)


PARALLEL_ROWS = 1 << 18  # batches at least this long are gathered / concatenated column-parallel
_pool = None
_pool_lock = threading.Lock()


def _columns(fn, names, rows):
    """``{name: fn(name)}``, on all cores for large batches: numpy's gathers and copies release the
    GIL, and in an ESG_out merge they are the one sequential step between two parallel ones."""
    global _pool
    if rows < PARALLEL_ROWS or len(names) < 2:
        return {k: fn(k) for k in names}
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(os.cpu_count() or 2, thread_name_prefix="stretch-columns")
    return dict(zip(names, _pool.map(fn, names)))


def batch_take(batch, idx):
    return _columns(lambda k: _take(batch[k], idx), list(batch), len(idx))


def batch_concat(batches):
    if len(batches) == 1:
        return batches[0]
    return _columns(lambda k: _concat([b[k] for b in batches]), list(batches[0]),
                    sum(batch_len(b) for b in batches))


def batch_len(batch):
    return len(batch["ts"])


def to_arrow(batch) -> pa.RecordBatch:
    """A columnar batch (dict of numpy arrays / :class:`ListColumn`) as a ``pyarrow.RecordBatch``."""
    arrays, names = [], []
    for k, v in batch.items():
        if isinstance(v, ListColumn):
            arrays.append(pa.ListArray.from_arrays(pa.array(v.offsets.astype(np.int32)), pa.array(v.values)))
        else:
            arrays.append(pa.array(v))
        names.append(k)
    return pa.RecordBatch.from_arrays(arrays, names=names)


def normalize_batch(batch, interner=None, ts_column="ts") -> dict:
    """Turn a RecordBatch / Table / dict of arrays into a dict of numpy arrays and ListColumns.

    Strings (and lists of strings) are interned to exact int64 ids with ``interner``.
    """
    if isinstance(batch, (pa.RecordBatch, pa.Table)):
        cols = {name: batch.column(i) for i, name in enumerate(batch.schema.names)}
    elif isinstance(batch, dict):
        cols = dict(batch)
    else:
        raise EngineError(f"batch has type {type(batch).__name__}; add() needs a pyarrow.RecordBatch, "
                          "a pyarrow.Table or a dict of numpy arrays")
    if ts_column not in cols:
        raise EngineError(f"batch has no timestamp column '{ts_column}' (columns: {sorted(cols)})")
    out = {}
    for name, c in cols.items():
        out[name] = _normalize_column(name, c, interner)
    ts = out.pop(ts_column)
    if isinstance(ts, ListColumn) or not np.issubdtype(ts.dtype, np.integer):
        raise EngineError(f"timestamp column '{ts_column}' has dtype {getattr(ts, 'dtype', 'list')}; "
                          "it must hold int64 timestamps (any unit)")
    n = len(ts)
    for name, c in out.items():
        if len(c) != n:
            raise EngineError(f"column '{name}' has {len(c)} rows but '{ts_column}' has {n}")
    return {"ts": np.ascontiguousarray(ts, np.int64), **out}


def _normalize_column(name, c, interner):
    if isinstance(c, ListColumn):
        if c.values.dtype.kind in "OUS":
            return ListColumn(c.offsets, _intern(name, c.values, interner))
        return c
    if isinstance(c, pa.ChunkedArray):
        c = c.combine_chunks()
    if isinstance(c, pa.Array):
        t = c.type
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            offs = c.offsets.to_numpy().astype(np.int64)
            vals = c.values.slice(int(offs[0]), int(offs[-1] - offs[0]))
            offs = offs - offs[0]
            return ListColumn(offs, _normalize_column(name, vals, interner))
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            return _intern(name, c, interner)
        if pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_duration(t):
            return c.cast(pa.int64()).to_numpy()
        if c.null_count:
            raise EngineError(f"column '{name}' has {c.null_count} nulls; the engine needs non-null columns")
        return c.to_numpy(zero_copy_only=False)
    a = np.asarray(c)
    if a.dtype.kind in "OUS":
        return _intern(name, a, interner)
    return a


def _intern(name, c, interner):
    if interner is None:
        raise EngineError(f"column '{name}' holds strings but this ESG has no interner")
    arr = c if isinstance(c, pa.Array) else pa.array(c.tolist(), pa.string())
    return interner.intern(arr)


def sort_rows(batch, tie_columns):
    """Stable permutation sorting a batch by ``(ts, *tie_columns)`` (int64 columns)."""
    return lexsort([batch["ts"]] + [batch[c] for c in tie_columns])
