"""Row ordering kernels: the stable lexicographic sort of a block and the merge of sorted blocks.

The engine's outputs leave in ``(ts, key, window_start, _seq, _sub)`` order, whatever m and the
owner map (each instance sorts its block, ESG_out merges the blocks). These two steps cost as much
as the windowed updates themselves for queries with many results, so they are kernels too:

- :func:`lexsort` sorts by the first two varying columns with two numpy sorts (an unstable
  quicksort of the second, a stable sort of the first: half the time of ``np.lexsort`` over three
  or more columns), then orders each run of equal first-two values by the other columns and the row
  index (runs are short: in an aggregation the first two columns nearly identify a row).
- :func:`merge_runs` merges concatenated sorted runs (the instances' blocks) in O(n log k) instead
  of sorting the concatenation again; ties keep the concatenation order, as a stable sort would.

Both return a permutation and give exactly what ``np.lexsort(cols[::-1])`` gives.

Examples
--------
>>> import numpy as np
>>> ts, key = np.array([2, 1, 2, 1]), np.array([5, 7, 5, 3])
>>> lexsort([ts, key, np.array([1, 0, 0, 0])]).tolist()
[3, 1, 2, 0]
>>> merge_runs([np.array([1, 3, 2, 2]), np.array([0, 0, 0, 1])], [0, 2, 4]).tolist()
[0, 2, 3, 1]
"""
from __future__ import annotations

import numpy as np
from .jit import njit

_SHORT = 32  # runs of ties up to this long are insertion-sorted in the kernel; longer: np.lexsort


@njit(nogil=True, cache=True, inline="always")
def _less(keys, a, b):
    """Row ``a`` before row ``b`` by the columns of ``keys`` (k x n), then by index."""
    for c in range(keys.shape[0]):
        x = keys[c, a]
        y = keys[c, b]
        if x != y:
            return x < y
    return a < b


@njit(nogil=True, cache=True)
def _fix_ties(perm, c0, c1, rest, long_runs):
    """Sort each run of ``perm`` with equal ``(c0, c1)`` by ``rest`` then index; returns how many
    long runs it left to the caller, one ``(start, end)`` row each of ``long_runs`` (made by the
    caller: the kernels' library built ahead of time returns no new array)."""
    n = perm.shape[0]
    m = 0
    i = 0
    while i < n:
        a = perm[i]
        j = i + 1
        while j < n and c0[perm[j]] == c0[a] and c1[perm[j]] == c1[a]:
            j += 1
        if j - i > _SHORT:
            long_runs[m, 0] = i
            long_runs[m, 1] = j
            m += 1
        elif j - i > 1:
            for u in range(i + 1, j):  # insertion sort: runs are short
                x = perm[u]
                v = u - 1
                while v >= i and _less(rest, x, perm[v]):
                    perm[v + 1] = perm[v]
                    v -= 1
                perm[v + 1] = x
        i = j
    return m


def _varying(cols):
    """The columns that are not constant (a constant column orders nothing)."""
    n = len(cols[0])
    return [c for c in cols if n and (c[0] != c[-1] or (c != c[0]).any())]


def lexsort(cols):
    """Stable permutation ordering rows by ``cols[0]``, then ``cols[1]``, ... (int64 columns)."""
    n = len(cols[0])
    varying = _varying(cols)
    if not varying:
        return np.arange(n)
    if len(varying) == 1:
        return np.argsort(varying[0], kind="stable")
    c0, c1 = varying[0], varying[1]
    perm = np.argsort(c1)  # ties are put right below
    perm = perm[np.argsort(c0[perm], kind="stable")]
    rest = np.stack(varying[2:]) if len(varying) > 2 else np.empty((0, n), np.int64)
    runs = np.empty((n // (_SHORT + 1) + 1, 2), np.int64)
    m = _fix_ties(perm, c0, c1, rest, runs)
    for i, j in runs[:m].tolist():
        run = np.sort(perm[i:j])  # row index order, then stable by the other columns
        perm[i:j] = run[np.lexsort([c[run] for c in varying[:1:-1]])] if len(varying) > 2 else run
    return perm


@njit(nogil=True, cache=True)
def _merge_pass(keys, src, dst, bounds, out_bounds):
    nr = bounds.shape[0] - 1
    q = 0
    for r in range(0, nr, 2):
        a, m = bounds[r], bounds[r + 1]
        e = bounds[r + 2] if r + 2 <= nr else m
        i, j, o = a, m, a
        while i < m and j < e:
            if _less(keys, src[j], src[i]):  # equal rows: the earlier run first (stable)
                dst[o] = src[j]
                j += 1
            else:
                dst[o] = src[i]
                i += 1
            o += 1
        while i < m:
            dst[o] = src[i]
            i += 1
            o += 1
        while j < e:
            dst[o] = src[j]
            j += 1
            o += 1
        out_bounds[q] = a
        q += 1
    out_bounds[q] = bounds[nr]
    return q


def merge_runs(cols, bounds):
    """Stable permutation ordering rows by ``cols`` when rows ``bounds[r]:bounds[r + 1]`` are each
    sorted already (pairwise merges, log2(runs) passes)."""
    n = len(cols[0])
    bounds = np.asarray(bounds, np.int64)
    varying = _varying(cols)
    src = np.arange(n)
    if not varying or bounds.shape[0] <= 2:
        return src
    keys = np.stack(varying)
    dst = np.empty_like(src)
    while bounds.shape[0] > 2:
        nb = np.empty(bounds.shape[0], np.int64)
        q = _merge_pass(keys, src, dst, bounds, nb)
        bounds = nb[:q + 1]
        src, dst = dst, src
    return src

