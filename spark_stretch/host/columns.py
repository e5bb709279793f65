"""Arrow columns to the engine's numpy columns and back, in the host engine process.

Keys become exact int64 ids (strings interned: each distinct string once, never a Python object
per row); outputs decode them with an Arrow ``take`` over the interned values.

Examples
--------
>>> import pyarrow as pa
>>> from spark_stretch.host.columns import list_parts, window_array
>>> offsets, values = list_parts(pa.array([["a", "b"], None, ["c"]]))
>>> offsets.tolist(), values.to_pylist()
([0, 2, 2, 3], ['a', 'b', 'c'])
>>> window_array([0], 60_000_000).to_pylist()[0]["end"].isoformat()
'1970-01-01T00:01:00+00:00'
"""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..engine import Interner
from ..engine.errors import EngineError

__all__ = ["TS", "NULL_LONG_KEY", "list_parts", "window_array", "KeyCodec", "sample", "finish", "prepare",
           "unsafe_rows", "unsafe_row_field"]

TS = pa.timestamp("us", tz="UTC")
NULL_LONG_KEY = np.iinfo(np.int64).min  # the null key of a nullable long key column


def list_parts(arr: pa.Array):
    """A list array's offsets (from 0, int64) and flat values; a null list has no elements (as
    ``explode``)."""
    arr = pc.fill_null(arr, pa.scalar([], arr.type))
    return pc.subtract(arr.offsets, arr.offsets[0]).to_numpy().astype(np.int64), arr.flatten()


def window_array(start, window_us: int) -> pa.StructArray:
    """Spark's ``window`` column (``start``, ``end`` timestamps) of windows starting at ``start`` (us)."""
    start = np.asarray(start, np.int64)
    return window_struct(start, start + window_us)


def window_struct(start, end) -> pa.StructArray:
    """Spark's ``window`` (or ``session_window``) column of windows from ``start`` to ``end`` (us)."""
    return pa.StructArray.from_arrays(
        [pa.array(np.asarray(start, np.int64)).cast(TS), pa.array(np.asarray(end, np.int64)).cast(TS)],
        names=["start", "end"])


class KeyCodec:
    """Keys to exact int64 ids and back: strings interned (the interner only grows, so an id
    means the same string for the life of the query and across its checkpoints)."""

    def __init__(self, interner: Optional[Interner] = None):
        self.interner = interner or Interner()
        self._dict: Dict[pa.DataType, pa.Array] = {}  # interned values, id order, per type

    def ids(self, arr: pa.Array, force_intern: bool = False) -> np.ndarray:
        """Exact int64 ids: strings interned (each distinct string once per batch), longs as is."""
        if (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)
                or pa.types.is_binary(arr.type) or force_intern):
            return self.interner.intern(arr)
        return pc.cast(arr, pa.int64()).to_numpy(zero_copy_only=False)

    def key_ids(self, arr: pa.Array) -> np.ndarray:
        """:meth:`ids` of a scalar key column that may hold nulls: the null key is -1 (strings:
        every interned id is >= 0) or :data:`NULL_LONG_KEY` (longs; that value itself is then
        refused, naming it), so a nullable key column is never encoded as binary keys."""
        null = -1 if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type) \
            else NULL_LONG_KEY
        if not arr.null_count:
            ids = self.ids(arr)
            if null == NULL_LONG_KEY and len(ids) and ids.min() == NULL_LONG_KEY:
                raise EngineError(f"key value {NULL_LONG_KEY} of a nullable key column: the "
                                  "engine keeps the null key in its place; group by another "
                                  "column, or make the column non-nullable")
            return ids
        out = np.full(len(arr), null, np.int64)
        out[pc.is_valid(arr).to_numpy(zero_copy_only=False)] = self.key_ids(arr.drop_null())
        return out

    def key_values(self, ids: np.ndarray, typ: str) -> pa.Array:
        """The key column of ``ids`` from :meth:`key_ids` (``typ``: ``string`` or ``long``)."""
        if typ == "string":
            return self.strings(pa.array(ids, pa.int64(), mask=ids < 0))
        return pa.array(ids, pa.int64(), mask=ids == NULL_LONG_KEY)

    def strings(self, ids: np.ndarray) -> pa.Array:
        return self._dictionary(pa.string()).take(pa.array(ids))

    def binaries(self, ids: np.ndarray) -> pa.Array:
        return self._dictionary(pa.binary()).take(pa.array(ids))

    def ranks(self) -> np.ndarray:
        """Each interned string's place among them all in Spark's order of strings (by their
        UTF-8 bytes): ``ranks()[id]``, from 1."""
        return pc.rank(self._dictionary(pa.binary()), sort_keys="ascending",
                       tiebreaker="first").to_numpy()

    def longs(self, ids: np.ndarray) -> pa.Array:
        return self._dictionary(pa.int64()).take(pa.array(ids))

    def _dictionary(self, typ) -> pa.Array:
        """The interned values as one Arrow array (id i at position i), grown by the new ones only,
        so decoding output keys is an Arrow ``take``, not a Python loop over rows."""
        known = self._dict.get(typ)
        n = len(self.interner)
        if known is None or len(known) < n:  # (keys and string values share the interner)
            new = pa.array(self.interner.strings()[0 if known is None else len(known):n], typ)
            known = new if known is None else pa.concat_arrays([known, new])
            self._dict[typ] = known
        return known


def sample(t: pa.DataType) -> pa.Array:
    """Two made-up values of type ``t`` (no nulls), for a runtime's warm-up."""
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        a, b = sample(t.value_type).to_pylist()
        return pa.array([[a, b], [b]], t)
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return pa.array(["a", "b"], t)
    if pa.types.is_integer(t) or pa.types.is_timestamp(t):
        return pa.array([0, 1], t)  # (a stream tag: one row of each stream)
    if pa.types.is_floating(t):
        return pa.array([0.5, 1.5], t)
    raise TypeError(f"no sample values of {t}")


_FINISH_TYPES = {"long": pa.int64(), "int": pa.int32(), "short": pa.int16(), "byte": pa.int8(),
                 "double": pa.float64(), "float": pa.float32(), "string": pa.string(),
                 "bool": pa.bool_(), "date": pa.date32(), "timestamp": pa.timestamp("us", "UTC"),
                 "binary": pa.binary()}


def unsafe_row_field(keys: pa.Array, fields: int, j: int, typ: str) -> pa.Array:
    """Field ``j`` of Spark ``UnsafeRow`` s of ``fields`` fields (the bytes of a composite key,
    the shim's ``StretchKeyEncode``), as an Arrow array of ``typ`` (a ``_FINISH_TYPES`` name).

    The row format (Spark's ``UnsafeRow``): a null bit set of 8-byte words, one 8-byte slot per
    field (fixed-width values in place, little-endian; strings and binaries as the offset from
    the row's start and the size, ``offset << 32 | size``), then the variable-length bytes.
    """
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    n = len(keys)
    offsets = np.frombuffer(keys.buffers()[1], np.int32, n + 1, keys.offset * 4).astype(np.int64)
    data = np.frombuffer(keys.buffers()[2], np.uint8)
    base = offsets[:-1]

    def word(pos: int) -> np.ndarray:
        return np.ascontiguousarray(data[(base + pos)[:, None] + np.arange(8)]).view("<i8")[:, 0]

    null = ((word(8 * (j // 64)) >> (j % 64)) & 1).astype(bool)
    v = word(((fields + 63) // 64) * 8 + 8 * j)
    t = _FINISH_TYPES[typ]
    if typ in ("string", "binary"):
        size = np.where(null, 0, v & 0xFFFFFFFF)
        start = base + (v >> 32)
        ends = np.cumsum(size)
        out_offsets = np.concatenate([[0], ends]).astype(np.int32)
        idx = np.repeat(start - (ends - size), size) + np.arange(int(ends[-1]) if n else 0)
        valid = pa.array(~null, pa.bool_()).buffers()[1]
        return pa.Array.from_buffers(t, n, [valid, pa.py_buffer(out_offsets),
                                            pa.py_buffer(np.ascontiguousarray(data[idx]))])
    if typ == "double":
        vals = v.view(np.float64)
    elif typ == "float":
        vals = (v & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    elif typ == "bool":
        vals = (v & 0xFF) != 0
    elif typ in ("int", "date"):
        vals = v.astype(np.int32)
    elif typ == "short":
        vals = v.astype(np.int16)
    elif typ == "byte":
        vals = v.astype(np.int8)
    else:  # long, timestamp (microseconds)
        vals = v
    raw = pa.array(vals, mask=null)
    return raw if raw.type == t else raw.cast(t)


def _divide(a, b):
    """Spark's ``/``: in double (a zero divisor is guarded by an ``if`` in every expression the
    shim makes)."""
    return pc.divide(pc.cast(a, pa.float64()), pc.cast(b, pa.float64()))


def _size(e: dict, arr):
    """Spark's ``size``: the list's length; of a null list null, or -1 under
    ``spark.sql.legacy.sizeOfNull`` (without ANSI mode)."""
    n = pc.list_value_length(arr)
    return pc.fill_null(n, -1) if e.get("legacy") else n


def _bitcast(arr, to):
    """A double column's IEEE bits as longs (``to`` int64), or longs' bits as doubles (nulls
    kept): how a max_by/min_by of doubles keeps its value in the engine's int slot."""
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    frm = np.float64 if to == np.int64 else np.int64
    values = pc.fill_null(pc.cast(arr, pa.from_numpy_dtype(frm)), 0).to_numpy(
        zero_copy_only=False).view(to)
    return pa.array(values, mask=arr.is_null().to_numpy(zero_copy_only=False) if arr.null_count
                    else None)


def _double_order(arr):
    """Doubles as longs that order as Spark orders doubles (nulls kept): -0.0 as 0.0, every
    NaN as one, above +inf; the IEEE bits, a negative number's other bits flipped (the shim's
    ``StretchDoubleOrder``, a max_by/min_by's ordering)."""
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    d = pc.fill_null(pc.cast(arr, pa.float64()), 0.0).to_numpy(zero_copy_only=False) + 0.0
    d[np.isnan(d)] = np.nan  # (-0.0 + 0.0 is 0.0; one NaN)
    b = d.view(np.int64)
    keys = b ^ ((b >> 63) & np.int64(0x7FFFFFFFFFFFFFFF))
    return pa.array(keys, mask=arr.is_null().to_numpy(zero_copy_only=False) if arr.null_count
                    else None)


def _coalesce(first, *rest):
    """Spark's ``coalesce``; a first argument without nulls is its result as it is, not a copy
    (a sum's or max's value column of a nullable column that has no nulls, the common case,
    then shares the scan's buffer: a batch in flight holds one copy less per aggregate)."""
    if all(x.type == first.type for x in rest) and \
            (first.is_valid if isinstance(first, pa.Scalar) else first.null_count == 0):
        return first
    return pc.coalesce(first, *rest)


def _if(p, a, b):
    """Spark's ``if``: a null predicate takes the else branch (Arrow's ``if_else`` gives null)."""
    return pc.if_else(pc.fill_null(p, False), a, b)


# Spark's arithmetic on longs wraps around (non-ANSI), as Arrow's unchecked kernels do; its
# and/or are three-valued (Kleene's), its comparisons null when a side is
_OPS = {"add": pc.add, "sub": pc.subtract, "mul": pc.multiply, "div": _divide,
        "eq": pc.equal, "lt": pc.less, "le": pc.less_equal, "gt": pc.greater,
        "ge": pc.greater_equal, "bitand": pc.bit_wise_and, "sqrt": pc.sqrt, "if": _if,
        "coalesce": _coalesce, "isnull": pc.is_null, "or": pc.or_kleene, "and": pc.and_kleene,
        "not": pc.invert,
        "bits": lambda a: _bitcast(a, np.int64), "unbits": lambda a: _bitcast(a, np.float64),
        "dorder": _double_order}


def _evaluate(e: dict, table: pa.Table):
    """One expression of the shim's small language over ``table`` (Arrow compute, as Spark
    evaluates it): see :func:`finish` and :func:`prepare`."""
    v = _ev(e, table)
    return pa.repeat(v, table.num_rows) if isinstance(v, pa.Scalar) else v


def _ev(e: dict, table: pa.Table):
    # (a function of its own, not a closure over ``table`` calling itself: that closure is a
    # reference cycle, and held each batch's input until Python's cyclic collector ran, which
    # in the engine's process is rarely: 4-6 batches' columns at once, BENCHMARKS.md)
    if "ref" in e:
        return table.column(e["ref"])
    if "col" in e:
        return table.column(e["col"])
    if "keyfield" in e:
        return unsafe_row_field(table.column(1), e["fields"], e["keyfield"], e["type"])
    if "lit" in e:  # (Jackson writes NaN and +-Infinity as strings: a min/max's sentinel)
        v = e["lit"]
        if isinstance(v, str) and e["type"] in ("double", "float"):
            v = float(v)
        return pa.scalar(v, _FINISH_TYPES[e["type"]])
    if "cast" in e:  # (unchecked: an if_else evaluates both branches, and the one not
        #               taken may hold a min/max sentinel out of the target's range)
        return pc.cast(_ev(e["cast"], table), _FINISH_TYPES[e["type"]], safe=False)
    if "size" in e:
        return _size(e, _ev(e["size"][0], table))
    if "addus" in e:  # a timestamp plus microseconds, as microseconds
        return pc.add(pc.cast(_ev(e["addus"], table), pa.int64()), e["us"])
    if "row" in e:
        return unsafe_rows([_ev(x, table) for x in e["row"]], e["types"], table.num_rows)
    for op, fn in _OPS.items():
        if op in e:
            return fn(*(_ev(x, table) for x in e[op]))
    raise ValueError(f"unknown expression {e}")


def finish(table: pa.Table, columns: list) -> pa.Table:
    """The engine's output columns (window, key, primitives) as a query's result columns.

    ``columns`` is the shim's translation of Spark's result expressions
    (``StretchEngineJson.finish``): ``{"name": ..., "expr": e}`` each, ``e`` one of ``{"ref": i}``
    (output column i), ``{"keyfield": j, "fields": n, "type": t}`` (field ``j`` of the
    composite key, :func:`unsafe_row_field`), ``{"lit": v, "type": t}``,
    ``{"cast": e, "type": t}``, or an operator of ``_OPS`` over its arguments
    (``{"if": [p, a, b]}``, ``{"div": [a, b]}``, ...), evaluated with Arrow compute as Spark
    evaluates them.
    """
    return _columns(table, columns)


def _columns(table: pa.Table, columns: list) -> pa.Table:
    return pa.Table.from_arrays([_evaluate(c["expr"], table) for c in columns],
                                names=[c["name"] for c in columns])


def prepare(table: pa.Table, columns: list) -> pa.Table:
    """A batch's input columns (the scan's own) as the engine's input: the shim's translation
    of the input projection (``StretchEngineJson.prepareJs``), ``{"name": ..., "expr": e}`` each,
    ``e`` as for :func:`finish` with ``{"col": name}`` for an input column, ``{"size": [e]}``,
    ``{"addus": e, "us": n}`` (a timestamp plus ``n`` microseconds, as microseconds) and
    ``{"row": [e...], "types": [...]}`` (a composite key, :func:`unsafe_rows`).

    Examples
    --------
    >>> t = pa.table({"v": pa.array([1, None], pa.int32())})
    >>> prepare(t, [{"name": "x", "expr": {"coalesce": [
    ...     {"cast": {"col": "v"}, "type": "long"}, {"lit": 0, "type": "long"}]}}]).to_pydict()
    {'x': [1, 0]}
    """
    return _columns(table, columns)


_FIELD_MASK = {"int": 0xFFFFFFFF, "date": 0xFFFFFFFF, "short": 0xFFFF, "byte": 0xFF, "bool": 1}


def unsafe_rows(fields: list, types: list, n: int) -> pa.Array:
    """Spark ``UnsafeRow`` s of ``fields`` (Arrow arrays of ``types``, ``_FINISH_TYPES`` names
    of fixed width or ``string``), byte for byte as Spark's ``UnsafeProjection`` writes them:
    the null bits, a zeroed 8-byte slot per field (a value narrower than 8 bytes in its low
    bytes), strings after the slots padded with zeros to 8 bytes; the inverse of
    :func:`unsafe_row_field`.

    Examples
    --------
    >>> rows = unsafe_rows([pa.array(["ab", None]), pa.array([7, 8], pa.int32())],
    ...                    ["string", "int"], 2)
    >>> unsafe_row_field(rows, 2, 0, "string").to_pylist(), unsafe_row_field(rows, 2, 1, "int").to_pylist()
    (['ab', None], [7, 8])
    """
    nf = len(fields)
    bit_words = (nf + 63) // 64
    head = 8 * (bit_words + nf)
    fields = [f.combine_chunks() if isinstance(f, pa.ChunkedArray) else f for f in fields]
    nulls = [f.is_null().to_numpy(zero_copy_only=False) for f in fields]
    strings = {}
    var = np.zeros(n, np.int64)
    for j, (f, t) in enumerate(zip(fields, types)):
        if t == "string":
            f = pc.fill_null(f, "") if f.null_count else f
            f = f.cast(pa.string()) if f.type != pa.string() else f
            offs = np.frombuffer(f.buffers()[1], np.int32, n + 1, f.offset * 4).astype(np.int64)
            size = np.diff(offs)
            strings[j] = (f, offs, size, var.copy())
            var += (size + 7) // 8 * 8
    starts = np.zeros(n + 1, np.int64)
    np.cumsum(head + var, out=starts[1:])
    words = np.zeros(int(starts[-1]) // 8, np.int64)
    w0 = starts[:-1] // 8
    for j, (f, t) in enumerate(zip(fields, types)):
        null = nulls[j]
        if null.any():
            words[w0[null] + j // 64] |= np.int64(1) << np.int64(j % 64)
        if t == "string":
            f, offs, size, at = strings[j]
            words[w0 + bit_words + j] = np.where(null, 0, ((head + at) << 32) | size)
            continue
        if t == "date":  # (Arrow casts days to int32 only)
            f = pc.cast(f, pa.int32())
        v = pc.cast(pc.fill_null(f, pa.scalar(0, f.type) if t != "bool" else False),
                    pa.int64()).to_numpy(zero_copy_only=False)
        if t in _FIELD_MASK:
            v = v & _FIELD_MASK[t]
        words[w0 + bit_words + j] = v
    data = words.view(np.uint8)
    for j, (f, offs, size, at) in strings.items():
        total = int(size.sum())
        if total:
            src = np.frombuffer(f.buffers()[2], np.uint8)[offs[0]:offs[0] + total]
            dst = starts[:-1] + head + at
            data[np.repeat(dst - (np.cumsum(size) - size), size) + np.arange(total)] = src
    return pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(starts.astype(np.int32)),
                                                   pa.py_buffer(data)])
