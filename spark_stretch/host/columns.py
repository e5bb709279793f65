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

from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..engine import Interner

__all__ = ["TS", "list_parts", "window_array", "KeyCodec", "sample"]

TS = pa.timestamp("us", tz="UTC")


def list_parts(arr: pa.Array):
    """A list array's offsets (from 0, int64) and flat values; a null list has no elements (as
    ``explode``)."""
    arr = pc.fill_null(arr, pa.scalar([], arr.type))
    return pc.subtract(arr.offsets, arr.offsets[0]).to_numpy().astype(np.int64), arr.flatten()


def window_array(start, window_us: int) -> pa.StructArray:
    """Spark's ``window`` column (``start``, ``end`` timestamps) of windows starting at ``start`` (us)."""
    start = np.asarray(start, np.int64)
    return pa.StructArray.from_arrays(
        [pa.array(start).cast(TS), pa.array(start + window_us).cast(TS)], names=["start", "end"])


class KeyCodec:
    """Keys to exact int64 ids and back: strings interned (the interner only grows, so an id
    means the same string for the life of the query and across its checkpoints)."""

    def __init__(self, interner: Optional[Interner] = None):
        self.interner = interner or Interner()
        self._dict: Optional[pa.Array] = None  # interned values, id order

    def ids(self, arr: pa.Array, force_intern: bool = False) -> np.ndarray:
        """Exact int64 ids: strings interned (each distinct string once per batch), longs as is."""
        if (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)
                or pa.types.is_binary(arr.type) or force_intern):
            return self.interner.intern(arr)
        return pc.cast(arr, pa.int64()).to_numpy(zero_copy_only=False)

    def strings(self, ids: np.ndarray) -> pa.Array:
        return self._dictionary(pa.string()).take(pa.array(ids))

    def binaries(self, ids: np.ndarray) -> pa.Array:
        return self._dictionary(pa.binary()).take(pa.array(ids))

    def longs(self, ids: np.ndarray) -> pa.Array:
        return self._dictionary(pa.int64()).take(pa.array(ids))

    def _dictionary(self, typ) -> pa.Array:
        """The interned values as one Arrow array (id i at position i), grown by the new ones only,
        so decoding output keys is an Arrow ``take``, not a Python loop over rows."""
        known = self._dict
        n = len(self.interner)
        if known is None or len(known) < n:
            new = pa.array(self.interner.strings()[0 if known is None else len(known):n], typ)
            known = new if known is None else pa.concat_arrays([known, new])
            self._dict = known
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
