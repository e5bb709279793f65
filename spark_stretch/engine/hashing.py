"""Spark's ``xxhash64`` of keys, in numba: the content hash that puts a key in its key group.

A key's group (:func:`spark_stretch.protocol.placement.key_group`) must be the same in the JVM
that routes a row (Spark's own ``xxhash64`` expression) and in every host's engine, whatever ids
each engine interned: so it is a hash of the key's content, exactly Spark's (XXH64 with seed
42: ``XXH64.hashUnsafeBytes`` over a string's UTF-8 bytes or a binary's bytes, ``hashLong``
over a long). Strings are hashed straight from an Arrow array's offsets and data buffers.

Examples
--------
>>> import pyarrow as pa
>>> from spark_stretch.engine.hashing import xxhash64
>>> xxhash64(pa.array(["a", ""])).tolist()          # Spark: SELECT xxhash64('a'), xxhash64('')
[-8582455328737087284, -7444071767201028348]
>>> xxhash64(pa.array([0, 1], pa.int64())).tolist()  # SELECT xxhash64(0L), xxhash64(1L)
[-5252525462095825812, -7001672635703045582]
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from .jit import njit

from ..protocol.placement import XXHASH_SEED

__all__ = ["spark_xxhash64", "xxhash64"]

_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P3 = np.uint64(0x165667B19E3779F9)
_P4 = np.uint64(0x85EBCA77C2B2AE63)
_P5 = np.uint64(0x27D4EB2F165667C5)


@njit(nogil=True, cache=True, inline="always")
def _rotl(x, r):
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


@njit(nogil=True, cache=True, inline="always")
def _round(acc, v):
    return _rotl(acc + v * _P2, 31) * _P1


@njit(nogil=True, cache=True, inline="always")
def _fmix(h):
    h ^= h >> np.uint64(33)
    h *= _P2
    h ^= h >> np.uint64(29)
    h *= _P3
    h ^= h >> np.uint64(32)
    return h


@njit(nogil=True, cache=True, inline="always")
def _u64(data, p):
    v = np.uint64(0)
    for k in range(8):
        v |= np.uint64(data[p + k]) << np.uint64(8 * k)
    return v


@njit(nogil=True, cache=True)
def _bytes(offsets, data, seeds, out):
    """XXH64 of each value ``data[offsets[i]:offsets[i + 1]]`` (Spark's ``hashUnsafeBytes``),
    with seed ``seeds[i]``."""
    for i in range(out.shape[0]):
        s = np.uint64(seeds[i])
        p = np.int64(offsets[i])
        end = np.int64(offsets[i + 1])
        n = end - p
        if n >= 32:
            v1 = s + _P1 + _P2
            v2 = s + _P2
            v3 = s
            v4 = s - _P1
            while p + 32 <= end:
                v1 = _round(v1, _u64(data, p))
                v2 = _round(v2, _u64(data, p + 8))
                v3 = _round(v3, _u64(data, p + 16))
                v4 = _round(v4, _u64(data, p + 24))
                p += 32
            h = _rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)
            for v in (v1, v2, v3, v4):
                h = (h ^ _round(np.uint64(0), v)) * _P1 + _P4
        else:
            h = s + _P5
        h += np.uint64(n)
        while p + 8 <= end:
            h ^= _round(np.uint64(0), _u64(data, p))
            h = _rotl(h, 27) * _P1 + _P4
            p += 8
        if p + 4 <= end:
            w = np.uint64(0)
            for k in range(4):
                w |= np.uint64(data[p + k]) << np.uint64(8 * k)
            h ^= w * _P1
            h = _rotl(h, 23) * _P2 + _P3
            p += 4
        while p < end:
            h ^= np.uint64(data[p]) * _P5
            h = _rotl(h, 11) * _P1
            p += 1
        out[i] = _fmix(h)


@njit(nogil=True, cache=True)
def _longs(values, seeds, out):
    """XXH64 of each 8-byte value (Spark's ``hashLong``), with seed ``seeds[i]``."""
    for i in range(out.shape[0]):
        h = np.uint64(seeds[i]) + _P5 + np.uint64(8)
        h ^= _round(np.uint64(0), np.uint64(values[i]))
        out[i] = _fmix(_rotl(h, 27) * _P1 + _P4)


@njit(nogil=True, cache=True)
def _ints(values, seeds, out):
    """XXH64 of each 4-byte value (Spark's ``hashInt``), with seed ``seeds[i]``."""
    for i in range(out.shape[0]):
        h = np.uint64(seeds[i]) + _P5 + np.uint64(4)
        h ^= (np.uint64(values[i]) & np.uint64(0xFFFFFFFF)) * _P1
        out[i] = _fmix(_rotl(h, 23) * _P2 + _P3)


def xxhash64(arr, seed: int = XXHASH_SEED) -> np.ndarray:
    """Spark's ``xxhash64(value)`` of each value of ``arr`` (int64): an Arrow string or binary
    array (its bytes), or integers (as longs, Spark's hash of a ``bigint``; cast an int column
    to ``bigint`` in Spark for the same value). A null's hash is ``seed``, as Spark's."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    out = np.empty(len(arr), np.uint64)
    seeds = np.full(len(arr), seed, np.int64)
    if isinstance(arr, pa.Array) and _is_bytes(arr.type):
        _bytes(*_offsets_data(arr), seeds, out)
    else:
        values = (pc.fill_null(pc.cast(arr, pa.int64()), 0).to_numpy() if isinstance(arr, pa.Array)
                  else np.asarray(arr, np.int64))
        _longs(np.ascontiguousarray(values, np.int64), seeds, out)
    if isinstance(arr, pa.Array) and arr.null_count:
        out[~arr.is_valid().to_numpy(zero_copy_only=False)] = np.uint64(seed)
    return out.view(np.int64)


def _is_bytes(t: pa.DataType) -> bool:
    return (pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t)
            or pa.types.is_large_binary(t))


def _offsets_data(arr: pa.Array):
    big = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    _, offsets, data = arr.buffers()
    offsets = np.frombuffer(offsets, np.int64 if big else np.int32)[
        arr.offset:arr.offset + len(arr) + 1]
    data = np.frombuffer(data, np.uint8) if data is not None else np.empty(0, np.uint8)
    return offsets, data


def spark_xxhash64(columns, seed: int = XXHASH_SEED) -> np.ndarray:
    """Spark's ``xxhash64(c1, c2, ...)`` of each row of the Arrow ``columns``: each column's
    value hashed with the previous one's hash as its seed, a null leaving it as it was, each
    type as Spark hashes it: strings and binaries by their bytes; ``bigint`` and timestamps
    (microseconds) by ``hashLong``; ``int``, ``smallint``, ``tinyint``, ``boolean`` (0/1) and
    dates (days) by ``hashInt``; ``double`` by ``hashLong`` of its bits and ``float`` by
    ``hashInt`` of its bits (-0.0 as 0.0). Other types raise ``TypeError``.

    Examples
    --------
    >>> import pyarrow as pa
    >>> from spark_stretch.engine.hashing import spark_xxhash64
    >>> spark_xxhash64([pa.array(["a"]), pa.array([1], pa.int32())]).tolist()
    ... # Spark: SELECT xxhash64('a', 1)
    [-4810547614043336770]
    """
    cols = [c.combine_chunks() if isinstance(c, pa.ChunkedArray) else c for c in columns]
    n = len(cols[0]) if cols else 0
    h = np.full(n, seed, np.int64)
    for c in cols:
        out = np.empty(n, np.uint64)
        t = c.type
        if _is_bytes(t):
            _bytes(*_offsets_data(c), h, out)
        else:
            if pa.types.is_boolean(t):
                c = pc.cast(c, pa.int32())
            elif pa.types.is_float64(t):
                c = pc.if_else(pc.equal(c, 0.0), pa.scalar(0.0), c)  # (-0.0 as 0.0)
                c = pa.Array.from_buffers(pa.int64(), len(c), c.buffers(), c.null_count,
                                          c.offset)
            elif pa.types.is_float32(t):
                c = pc.if_else(pc.equal(c, pa.scalar(0.0, pa.float32())),
                               pa.scalar(0.0, pa.float32()), c)
                c = pa.Array.from_buffers(pa.int32(), len(c), c.buffers(), c.null_count,
                                          c.offset)
            elif pa.types.is_timestamp(t):
                c = pc.cast(c, pa.timestamp("us", t.tz)).cast(pa.int64())
            elif pa.types.is_date32(t):
                c = c.cast(pa.int32())
            elif not pa.types.is_integer(t) or pa.types.is_unsigned_integer(t):
                raise TypeError(f"Spark's xxhash64 of a {t} column is not computed here")
            values = np.ascontiguousarray(pc.fill_null(c, 0).to_numpy(zero_copy_only=False))
            if values.dtype.itemsize == 8:
                _longs(values.astype(np.int64, copy=False), h, out)
            else:
                _ints(values.astype(np.int64), h, out)
        valid = (np.ones(n, np.bool_) if c.null_count == 0
                 else c.is_valid().to_numpy(zero_copy_only=False))
        h = np.where(valid, out.view(np.int64), h)
    return h
