"""Keys to buckets, and each bucket's open-addressing table of windows (jitted helpers of the
kernels, :mod:`spark_stretch.engine.kernels` and :mod:`spark_stretch.engine.sessions`, and of
:class:`~spark_stretch.engine.state.BucketState`).

A key's bucket is ``((mix64(key) >> 32) * B) >> 32`` of ``B`` buckets
(:func:`bucket_of`; the placement policy of :mod:`spark_stretch.protocol.placement`): all
windows of a key share it. Per bucket ``b`` an open-addressing table of ``cap`` slots (any
count: :func:`next_cap` grows it by an eighth), one int64 record per slot
``rec[b, s] = (key, window start l or EMPTY, acc_i...)`` (unpadded; a bucket at most 15/16
full, the buckets holding windows at most 13/16 on average: the runtime grows the tables past
that, ``Engine._grow_if_loaded``) and float accumulators ``acc_f[b, s, :]``; ``bcount[b]`` live
slots, ``bminl[b]`` earliest window start (``NO_L`` when empty), ``dirty[b]`` "modified since
last checkpoint". A window's first slot is :func:`_slot0` of its key's hash and its start,
then linear probing; keys are compared in full (key and window start), so there are no
hash-collision mistakes.

Examples
--------
>>> import numpy as np
>>> from spark_stretch.engine.buckets import buckets_of
>>> buckets_of(np.array([0, 1, 2, 3], np.int64), 8).tolist()   # as protocol.placement.bucket_of
[7, 4, 4, 0]
"""
from __future__ import annotations

import numpy as np
from .jit import njit

EMPTY = np.iinfo(np.int64).min  # window start of a free slot
NO_L = np.iinfo(np.int64).max  # bminl of an empty bucket

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)
HOT = dict(nogil=True, cache=True, inline="always")  # hot helpers: inlined at numba IR level


@njit(**HOT)
def mix64(x):
    """splitmix64 finaliser of an int64 (as uint64)."""
    z = np.uint64(x) + _GOLD
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@njit(**HOT)
def _bucket_h(h, nb):
    return np.int64(((h >> np.uint64(32)) * np.uint64(nb)) >> np.uint64(32))


@njit(**HOT)
def bucket_of(key, nb):
    """Bucket of a key: ``((mix64(key) >> 32) * B) >> 32`` (B buckets). All windows of a key share it."""
    return _bucket_h(mix64(key), nb)


@njit(nogil=True, cache=True)
def buckets_of(keys, nb):
    out = np.empty(keys.shape[0], np.int64)
    for i in range(keys.shape[0]):
        out[i] = bucket_of(keys[i], nb)
    return out


def next_cap(cap: int) -> int:
    """Slots per bucket after a grow: an eighth more (grown past 13/16 full on average, the
    tables are 13/18 to 13/16 full; grown by a quarter at 3/4 they were 3/5 to 3/4, and the
    records of 5M windows took 16% more memory: BENCHMARKS.md, aggregation state at scale)."""
    return cap + max(cap // 8, 8)


def loaded(windows: int, buckets: int, cap: int) -> bool:
    """Whether ``buckets`` tables of ``cap`` slots holding ``windows`` are past 13/16 full on
    average: the runtime grows them (``Engine._grow_if_loaded``). Probing stays cheap at that
    load (5M windows: the kernels' time outside grows unchanged); growing by eighths rehashes
    more often than by quarters (+6-8% end to end at 5M and 20M keys, BENCHMARKS.md)."""
    return windows * 16 > buckets * cap * 13


def cap_for(windows: int, buckets: int, cap: int) -> int:
    """The first size after ``cap`` in :func:`next_cap`'s steps at which ``buckets`` tables
    holding ``windows`` are not :func:`loaded`: one rehash instead of one per step."""
    cap = next_cap(cap)
    while loaded(windows, buckets, cap):
        cap = next_cap(cap)
    return cap


@njit(**HOT)
def bucket_full(count, cap):
    """Whether a bucket of ``cap`` slots holding ``count`` would pass 15/16 with one more: a
    kernel then stops for the tables to grow (the runtime grows them earlier, once the buckets
    holding windows are past 13/16 full on average: :func:`loaded`). Among thousands of buckets the
    fullest is a few standard deviations above the average: 15/16 leaves it room."""
    return (count + 1) * 16 > cap * 15


@njit(**HOT)
def _slot0(h, l, cap):
    """First slot of window (key, l) in its bucket of ``cap`` slots: the low 32 bits of
    mix64(key) xor a multiple of l, scaled to ``cap`` (the bucket took the high 32 bits)."""
    x = (h ^ (np.uint64(l) * _GOLD)) & np.uint64(0xFFFFFFFF)
    return np.int64((x * np.uint64(cap)) >> np.uint64(32))


@njit(**HOT)
def _next(s, cap):
    """The slot after ``s`` (linear probing, wrapping)."""
    s += 1
    return 0 if s == cap else s


# (inlined: its callers pass rows read-only (restored) or writable, which would compile it
# once for each)
@njit(nogil=True, cache=True, inline="always")
def _reinsert(b, r, af, rec, acc_f):
    cap = rec.shape[1]
    s = _slot0(mix64(r[0]), r[1], cap)
    while rec[b, s, 1] != EMPTY:
        s = _next(s, cap)
    rec[b, s, :] = r
    acc_f[b, s, :] = af


@njit(nogil=True, cache=True)
def insert_rows(bs, rows, afs, rec, acc_f):
    """Insert compacted live slots (bucket ``bs[i]``, record ``rows[i]``) into empty tables."""
    for i in range(bs.shape[0]):
        _reinsert(bs[i], rows[i], afs[i], rec, acc_f)


@njit(nogil=True, cache=True)
def rebuild_bucket(b, rec, acc_f, bcount, bminl):
    """Re-pack bucket ``b`` after removals / window shifts (its own slots only)."""
    n = bcount[b]
    rr = np.empty((n, rec.shape[2]), np.int64)
    ff = np.empty((n, acc_f.shape[2]), np.float64)
    c = 0
    for s in range(rec.shape[1]):
        if rec[b, s, 1] != EMPTY:
            rr[c, :] = rec[b, s, :]
            ff[c, :] = acc_f[b, s, :]
            c += 1
            rec[b, s, 1] = EMPTY
    mn = NO_L
    for q in range(c):
        _reinsert(b, rr[q], ff[q], rec, acc_f)
        if rr[q, 1] < mn:
            mn = rr[q, 1]
    bcount[b] = c
    bminl[b] = mn


@njit(nogil=True, cache=True)
def rehash_into(rec, acc_f, bcount, nrec, nacc_f):
    """Copy every live slot of the old tables into the empty new ones (larger; smaller for
    ``BucketState.shrink``, still room for every window). Used by ``grow``. A bucket holding
    no window (``bcount``) is not read: its pages may have been given back
    (``BucketState.give_back_empty``) and read as zeros."""
    for b in range(rec.shape[0]):
        if bcount[b] == 0:
            continue
        for s in range(rec.shape[1]):
            if rec[b, s, 1] != EMPTY:
                _reinsert(b, rec[b, s], acc_f[b, s], nrec, nacc_f)
