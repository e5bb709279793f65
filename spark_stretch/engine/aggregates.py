"""The built-in aggregates' codes and their jitted per-tuple arithmetic, shared by the window
kernel (:mod:`spark_stretch.engine.kernels`) and the session kernel
(:mod:`spark_stretch.engine.sessions`).

An aggregate is an integer code (``AGG_*``) in the operator's integer parameters ``ip``; its
state is an int and a float accumulator of the window's record (``rec[b, s, base + q]``,
``acc_f[b, s, f]``: :mod:`spark_stretch.engine.buckets`); a fused aggregation keeps a float
slot only for the aggregates that use one (:func:`uses_float`). :func:`_apply` updates one aggregate
by one tuple's values, :func:`_result` reads its result; a *fused* aggregation
(``AGG_MULTI``: several aggregates in one record, ``ops.aggregate_many``) goes through
:func:`_multi_update` and :func:`_multi_out`. The helpers take scalars and indices, never array
views: a helper taking arrays costs atomic reference counts on memory every instance shares.

The register pool (``pool``, ``free``; :class:`~spark_stretch.engine.state.BucketState`): an
approx_count_distinct's HLL++ registers live outside the window record, in a row of ``pool`` of
their own (the record's int slot keeps the row's number), so a window's record stays a few
words wide whatever the precision. A window takes its row when it is created
(:func:`_pool_take`), from its instance's free rows ``free[j, 1:free[j, 0] + 1]``; rows of
windows gone are collected by the runtime.
"""
from __future__ import annotations

import numpy as np
from .jit import njit

from .buckets import HOT

# built-in aggregates (ip[stream * 4 + 2])
AGG_COUNT, AGG_SUM_I, AGG_SUM_F, AGG_MIN_I, AGG_MIN_F, AGG_MAX_I, AGG_MAX_F, AGG_MEAN = range(8)
# the value of a window's tuple with the earliest (latest) timestamp whose take flag is not 0
# (ties: the first (last) to arrive); the flag is the other value column (vf of an int
# aggregate, vi of a float one) and the accumulator of the other kind keeps the value's
# timestamp (a float keeps microseconds since 1970 exactly until the year 2255)
AGG_FIRST_I, AGG_FIRST_F, AGG_LAST_I, AGG_LAST_F = range(8, 12)
# several aggregates in one state record (stream 0 only): ip[8] = K aggregates, ip[9] and
# ip[10] the int and float value columns per tuple (``vi``/``vf`` hold them column-major); then per
# aggregate q its code and value columns, ip[MULTI + 3q : MULTI + 3q + 3] (-1: none), its
# state the int slot q of the record and, if it keeps a float (:func:`uses_float`), the float
# slot ip[MULTI + 4K + q] of its accumulators (-1: none; a count, sum, min or max of ints has
# none, so a window of count, sum and max keeps no floats)
AGG_MULTI = 12
MULTI = 11
# the int value of the tuple with the largest (smallest) float ordering value ``vf``, ties: the
# last (Spark's max_by/min_by); a NaN ordering value (null) is skipped; the float slot keeps
# the extremum
AGG_MAXBY_I, AGG_MINBY_I = 13, 14
# min/max of strings: the int value is an interned string's id, the float slot keeps the rank of
# the extremum's string among all interned strings, ``fp[1 + id]`` (the engine's float
# parameters, :meth:`Engine.order_strings`, which also re-ranks the state when strings are
# added); the other value column is a take flag (0: a null, skipped)
AGG_MIN_S, AGG_MAX_S = 15, 16
# max_by/min_by by an exact ordering, in two aggregates: this one (the value, int, and a take
# flag, vf: 0 for a null ordering, skipped) and the AGG_BY_KEY right after it, which reads the
# ordering (vi) and keeps the extremum's in its int slot. _L: the ordering is an int64 key
# (compared as such; ties: the last); _S: an interned string's id, compared by its rank
# ``fp[1 + id]`` (as AGG_MIN_S), the rank of the extremum in this one's float slot
AGG_MAXBY_L, AGG_MINBY_L, AGG_MAXBY_S, AGG_MINBY_S, AGG_BY_KEY = 17, 18, 19, 20, 21
# Spark's approx_count_distinct (HLL++, HyperLogLogPlusPlusHelper): 2**p registers of 6 bits, 10
# to an int64 word (Spark's buffer), W = 2**p // 10 + 1 words in the window's row of the register
# pool (the module docstring) from word ip[MULTI + 3 * K + q] on, K the fused aggregates; code
# AGG_HLL + p (4 <= p <= 18), reading the value's 64-bit hash (vi) and a take flag (vf, 0: a
# null, skipped); its int slot holds the row. Spark estimates the count from the words.
AGG_HLL = 23
# count(*) with flags in its word: the tuples counted in bits 0-47, and bits 48-62 the or of the
# tuples' int values (a mask of up to 15 flags: the shim's "a non-null x" of each column whose
# sum, min or max needs only whether there was one; kept here, they cost the record no word of
# their own). Its result is the word.
AGG_COUNT_ANY = 22
ANY_SHIFT = 48
ANY_COUNT = (np.int64(1) << ANY_SHIFT) - 1  # (the count's bits)


@njit(**HOT)
def _apply(code, ci, cf, xi, xf, t):
    """One aggregate's state (int ``ci``, float ``cf``) updated by a tuple at ``t`` with the
    values ``xi``, ``xf`` (scalars only: a helper taking arrays costs reference counts)."""
    if code == AGG_COUNT:
        ci += 1
    elif code == AGG_COUNT_ANY:
        ci = (ci + 1) | ((xi & 0x7FFF) << ANY_SHIFT)
    elif code == AGG_SUM_I:
        ci += xi
    elif code == AGG_SUM_F:
        cf += xf
    elif code == AGG_MIN_I:
        if xi < ci:
            ci = xi
    elif code == AGG_MAX_I:
        if xi > ci:
            ci = xi
    elif code == AGG_MIN_F:
        if xf < cf:
            cf = xf
    elif code == AGG_MAX_F:
        if xf > cf:
            cf = xf
    elif code == AGG_MEAN:
        cf += xf
        ci += 1
    elif code == AGG_FIRST_I or code == AGG_LAST_I:
        if xf != 0.0 and (t < cf if code == AGG_FIRST_I else t >= cf):
            ci = xi
            cf = t
    elif code == AGG_FIRST_F or code == AGG_LAST_F:
        if xi != 0 and (t < ci if code == AGG_FIRST_F else t >= ci):
            cf = xf
            ci = t
    elif code == AGG_MAXBY_I or code == AGG_MINBY_I:
        if xf >= cf if code == AGG_MAXBY_I else xf <= cf:
            ci = xi
            cf = xf
    return ci, cf


@njit(**HOT)
def _hll_at(code, x):
    """HLL++'s update by the hash ``x`` (as Spark's): the word (from the aggregate's first
    slot), the shift of the register in it, and the register's candidate value (the leading
    zeros of the hash's bits after the index, plus one)."""
    p = code - AGG_HLL
    u = np.uint64(x)
    idx = np.int64(u >> np.uint64(64 - p))
    v = (u << np.uint64(p)) | (np.uint64(1) << np.uint64(p - 1))
    pw = 1
    while v < np.uint64(0x8000000000000000):  # (ends: the padding bit is set)
        v = v << np.uint64(1)
        pw += 1
    w = idx // 10
    return w, 6 * (idx - 10 * w), pw


@njit(**HOT)
def _hll_max(word, shift, pw):
    """``word`` with its register at ``shift`` raised to ``pw`` if that is larger."""
    if pw > ((word >> shift) & 63):
        return (word & ~(np.int64(63) << shift)) | (np.int64(pw) << shift)
    return word


def uses_float(code: int) -> bool:
    """Whether the aggregate ``code`` keeps a float accumulator (its value, a timestamp, an
    ordering or a string's rank); the others keep their state in their int slot (or a pool row)."""
    return code not in (AGG_COUNT, AGG_SUM_I, AGG_MIN_I, AGG_MAX_I, AGG_MAXBY_L, AGG_MINBY_L,
                        AGG_BY_KEY, AGG_COUNT_ANY) and code < AGG_HLL


@njit(**HOT)
def _fslot(ip, q):
    """Fused aggregate q's float slot (-1: it keeps none)."""
    return ip[MULTI + 4 * ip[8] + q]


@njit(**HOT)
def _is_float(code):
    """Whether the aggregate's result is a float (else an int)."""
    return (code == AGG_SUM_F or code == AGG_MIN_F or code == AGG_MAX_F or code == AGG_MEAN
            or code == AGG_FIRST_F or code == AGG_LAST_F)


@njit(**HOT)
def _result(code, ci, cf):
    """The aggregate's result from its state: (int, float), the one of its kind set."""
    if code == AGG_MEAN:
        return ci, cf / ci
    if _is_float(code):
        return 0, cf
    return ci, 0.0


@njit(**HOT)
def _hll_words(code):
    """The words of an HLL++ aggregate's registers (ten 6-bit registers to a word)."""
    return (np.int64(1) << (code - AGG_HLL)) // 10 + 1


@njit(**HOT)
def _multi_update(rec, acc_f, b, s, base, vi0, vf0, ri, t, ip, fp, pool):
    """A fused aggregation's update by tuple row ``ri`` at ``t`` of the window in slot ``s``:
    aggregate q's state in int slot ``base + q`` and its float slot (an HLL++'s registers in the
    pool row it holds; a max_by/min_by by an exact ordering also in the int slot after).
    (Called once per tuple and window, not per aggregate: the reference counts of the arrays it
    takes are paid once for all.)"""
    ni = vi0.shape[0] // ip[9] if ip[9] > 0 else 0  # (the tuples: value columns are
    nf = vf0.shape[0] // ip[10] if ip[10] > 0 else 0  # column-major, k at [k * n, (k + 1) * n))
    for q in range(ip[8]):
        c = MULTI + 3 * q
        code = ip[c]
        f = _fslot(ip, q)
        xi = vi0[ip[c + 1] * ni + ri] if ip[c + 1] >= 0 else 0
        xf = vf0[ip[c + 2] * nf + ri] if ip[c + 2] >= 0 else 0.0
        if code < AGG_MIN_S or code == AGG_COUNT_ANY:
            ci, cf = _apply(code, rec[b, s, base + q], acc_f[b, s, f] if f >= 0 else 0.0,
                            xi, xf, t)
            rec[b, s, base + q] = ci
            if f >= 0:
                acc_f[b, s, f] = cf
        elif code >= AGG_HLL:  # a register in the window's pool row
            if xf != 0.0:
                w, sh, pw = _hll_at(code, xi)
                h = rec[b, s, base + q]
                w += ip[MULTI + 3 * ip[8] + q]
                pool[h, w] = _hll_max(pool[h, w], sh, pw)
        elif code < AGG_BY_KEY and xf != 0.0:  # (an AGG_BY_KEY: nothing)
            if code <= AGG_MAX_S:  # a string by its rank
                r = fp[1 + xi]
                if r < acc_f[b, s, f] if code == AGG_MIN_S else r > acc_f[b, s, f]:
                    rec[b, s, base + q] = xi
                    acc_f[b, s, f] = r
            else:  # by the ordering the AGG_BY_KEY after it reads
                o = vi0[ip[c + 4] * ni + ri]
                if code <= AGG_MINBY_L:
                    k = rec[b, s, base + q + 1]
                    if o >= k if code == AGG_MAXBY_L else o <= k:
                        rec[b, s, base + q] = xi
                        rec[b, s, base + q + 1] = o
                else:
                    r = fp[1 + o]
                    if r >= acc_f[b, s, f] if code == AGG_MAXBY_S else r <= acc_f[b, s, f]:
                        rec[b, s, base + q] = xi
                        rec[b, s, base + q + 1] = o
                        acc_f[b, s, f] = r


@njit(**HOT)
def _pool_take(rec, b, s, base, pool, free, j, ip):
    """Give the new window in slot ``s`` a zeroed row of the register pool, from instance ``j``'s
    free rows (it has one), in the int slot of each of its HLL++ aggregates."""
    n = free[j, 0]
    h = free[j, n]
    free[j, 0] = n - 1
    for w in range(pool.shape[1]):
        pool[h, w] = 0
    for q in range(ip[8]):
        if ip[MULTI + 3 * q] >= AGG_HLL:
            rec[b, s, base + q] = h


@njit(**HOT)
def _multi_out(rec, acc_f, b, s, base, oi, of, p, ii, ip):
    """Output row ``p`` of a fused aggregation: aggregate q's result from the record's slot
    ``base + q`` (and its float slot) into the next int (from column ``ii``) or float column."""
    ff = 0
    for q in range(ip[8]):
        code = ip[MULTI + 3 * q]
        f = _fslot(ip, q)
        vi, vf = _result(code, rec[b, s, base + q], acc_f[b, s, f] if f >= 0 else 0.0)
        if _is_float(code):
            of[p, ff] = vf
            ff += 1
        else:
            oi[p, ii] = vi
            ii += 1
