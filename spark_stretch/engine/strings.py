"""Jitted kernels of the string interner (:class:`~spark_stretch.engine.state.Interner`).

A string table maps UTF-8 byte strings to ids 0, 1, 2, ... in order of first appearance: the bytes
of string ``i`` are ``data[offs[i]:offs[i + 1]]``, its 64-bit FNV-1a hash ``hashes[i]``, and an
open-addressing table ``slots`` (a power of two, at most half full, ``-1`` free) holds the ids.
:func:`intern_run` maps an Arrow string array's values (its offsets and data buffers, as they
arrive from Spark) to ids in one pass, adding the new ones: no Python string per value and no
per-batch dictionary. It stops early, returning how far it got, when the table or a buffer must
grow; the caller grows them and calls again from there.
"""

from __future__ import annotations

import numpy as np
from .jit import njit

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)


@njit(nogil=True, cache=True, inline="always")
def _fnv1a(data, a, b):
    h = _FNV_OFFSET
    for k in range(a, b):
        h = (h ^ np.uint64(data[k])) * _FNV_PRIME
    return h


@njit(nogil=True, cache=True)
def intern_run(offsets, data, j, n, ids, slots, hashes, offs, store, count):
    """Ids of values ``j .. n-1`` of a string array (``offsets``/``data`` buffers) into ``ids``.

    Returns ``(j, count)``: the first value not done (``n`` when all are) and the table's new
    size. It stops before adding a string when ``slots`` would pass half full, ``hashes``/``offs``
    are full, or ``store`` has no room for its bytes.
    """
    mask = np.uint64(len(slots) - 1)
    limit = len(slots) // 2
    while j < n:
        a = offsets[j]
        b = offsets[j + 1]
        length = b - a
        h = _fnv1a(data, a, b)
        i = h & mask
        while True:
            sid = slots[i]
            if sid < 0:  # not there: add it
                start = offs[count]
                if count >= limit or count >= len(hashes) or start + length > len(store):
                    return j, count
                for k in range(length):
                    store[start + k] = data[a + k]
                offs[count + 1] = start + length
                hashes[count] = h
                slots[i] = count
                ids[j] = count
                count += 1
                break
            if hashes[sid] == h and offs[sid + 1] - offs[sid] == length:
                s = offs[sid]
                same = True
                for k in range(length):
                    if store[s + k] != data[a + k]:
                        same = False
                        break
                if same:
                    ids[j] = sid
                    break
            i = (i + np.uint64(1)) & mask
        j += 1
    return j, count


def rehash(hashes, count, size):
    """A new ``slots`` table of ``size`` (a power of two) holding ids ``0 .. count-1``."""
    slots = np.full(size, -1, np.int64)
    _rehash_into(hashes, count, slots)
    return slots


@njit(nogil=True, cache=True)
def _rehash_into(hashes, count, slots):
    """Put ids ``0 .. count-1`` into the empty table ``slots`` (made by the caller: the kernels'
    library built ahead of time returns no new array)."""
    mask = np.uint64(slots.shape[0] - 1)
    for sid in range(count):
        i = hashes[sid] & mask
        while slots[i] >= 0:
            i = (i + np.uint64(1)) & mask
        slots[i] = sid
