"""Jitted hot loops of the VSN engine (``numba.njit(nogil=True)``).

One kernel body, :func:`_agg_kernel_py`, runs Alg. 4 (processVSN) for one instance over one ready
segment of ESG_in: for every tuple it computes the keys with ``f_MK``, and for each key whose bucket the
instance owns it fires the expired window instances of that bucket and then creates/updates the window
instances the tuple falls in with ``f_U``. At the end of the segment it fires every owned bucket whose
earliest window ends at or before the segment watermark (``f_O``, then ``f_S`` or removal).

The kernel reaches the operator functions through the module globals ``_MK``, ``_UPD``, ``_OUT`` and
``_SLIDE``. The module-level compilation (``agg_kernel``) binds them to the built-in dispatchers below and
is cached on disk; its key generation, value read and f_U are written out in the body (``_BUILTIN``),
because numba increfs every array passed to a helper it inlines. :func:`specialize` makes an
uncached copy bound to user numba functions.

State layout (see :mod:`spark_stretch.engine.state`): per bucket ``b`` an open-addressing table of
``cap`` slots, one int64 record per slot ``rec[b, s] = (key, window start l or EMPTY, acc_i...)`` (one
cache line per probe) and float accumulators ``acc_f[b, s, :]``; ``bcount[b]`` live slots, ``bminl[b]``
earliest window start, ``dirty[b]`` "modified since last checkpoint". Keys are compared in full (key
and window start), so there are no hash-collision mistakes.

The kernels never block: when a bucket is full (``NEED_GROW``), the instance's output block is full
(``NEED_OUT``) or its free rows of the register pool are used up (``NEED_POOL``) they store a resume
position in ``resume`` and return; the runtime grows the arrays and calls again. Every step before the
resume position is applied exactly once.

The register pool (``pool``, ``free``; :class:`~spark_stretch.engine.state.BucketState`): an
approx_count_distinct's HLL++ registers live outside the window record, in a row of ``pool`` of their
own (the record's int slot keeps the row's number), so a window's record stays a few words wide
whatever the precision. A window takes its row when it is created, from its instance's free rows
``free[j, 1:free[j, 0] + 1]``; rows of windows gone are collected by the runtime.
"""
from __future__ import annotations

import types

import numpy as np
from numba import njit

EMPTY = np.iinfo(np.int64).min  # window start of a free slot
NO_L = np.iinfo(np.int64).max  # bminl of an empty bucket

DONE, NEED_GROW, NEED_OUT, NEED_KEYBUF, NEED_POOL = 0, 1, 2, 3, 4

# window kinds
W_NONE, W_MULTI, W_SINGLE = 0, 1, 2

# built-in f_MK kinds (ip[stream * 4 + 0]); parameter in ip[stream * 4 + 1]
MK_LIST, MK_PAIRS, MK_RANGE, MK_NONE = 0, 1, 2, 3
# built-in aggregates (ip[stream * 4 + 2])
AGG_COUNT, AGG_SUM_I, AGG_SUM_F, AGG_MIN_I, AGG_MIN_F, AGG_MAX_I, AGG_MAX_F, AGG_MEAN = range(8)
# the value of a window's tuple with the earliest (latest) timestamp whose take flag is not 0
# (ties: the first (last) to arrive); the flag is the other value column (vf of an int
# aggregate, vi of a float one) and the accumulator of the other kind keeps the value's
# timestamp (a float keeps microseconds since 1970 exactly until the year 2255)
AGG_FIRST_I, AGG_FIRST_F, AGG_LAST_I, AGG_LAST_F = range(8, 12)
# several aggregates in one state record (stream 0 only): ip[8] = K aggregates, ip[9] and
# ip[10] the int and float value columns per tuple (``vi``/``vf`` hold them row-major); then per
# aggregate q its code and value columns, ip[MULTI + 3q : MULTI + 3q + 3] (-1: none), its
# state the int slot q and the float slot q of the record's accumulators
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
AGG_HLL = 22

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
def _apply(code, ci, cf, xi, xf, t):
    """One aggregate's state (int ``ci``, float ``cf``) updated by a tuple at ``t`` with the
    values ``xi``, ``xf`` (scalars only: a helper taking arrays costs reference counts)."""
    if code == AGG_COUNT:
        ci += 1
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
    aggregate q's state in int slot ``base + q`` and float slot q (an HLL++'s registers in the
    pool row it holds; a max_by/min_by by an exact ordering also in the int slot after).
    (Called once per tuple and window, not per aggregate: the reference counts of the arrays it
    takes are paid once for all.)"""
    kv, kf = ip[9], ip[10]
    for q in range(ip[8]):
        c = MULTI + 3 * q
        code = ip[c]
        xi = vi0[ri * kv + ip[c + 1]] if ip[c + 1] >= 0 else 0
        xf = vf0[ri * kf + ip[c + 2]] if ip[c + 2] >= 0 else 0.0
        if code < AGG_MIN_S:
            rec[b, s, base + q], acc_f[b, s, q] = _apply(
                code, rec[b, s, base + q], acc_f[b, s, q], xi, xf, t)
        elif code >= AGG_HLL:  # a register in the window's pool row
            if xf != 0.0:
                w, sh, pw = _hll_at(code, xi)
                h = rec[b, s, base + q]
                w += ip[MULTI + 3 * ip[8] + q]
                pool[h, w] = _hll_max(pool[h, w], sh, pw)
        elif code < AGG_BY_KEY and xf != 0.0:  # (an AGG_BY_KEY: nothing)
            if code <= AGG_MAX_S:  # a string by its rank
                r = fp[1 + xi]
                if r < acc_f[b, s, q] if code == AGG_MIN_S else r > acc_f[b, s, q]:
                    rec[b, s, base + q] = xi
                    acc_f[b, s, q] = r
            else:  # by the ordering the AGG_BY_KEY after it reads
                o = vi0[ri * kv + ip[c + 4]]
                if code <= AGG_MINBY_L:
                    k = rec[b, s, base + q + 1]
                    if o >= k if code == AGG_MAXBY_L else o <= k:
                        rec[b, s, base + q] = xi
                        rec[b, s, base + q + 1] = o
                else:
                    r = fp[1 + o]
                    if r >= acc_f[b, s, q] if code == AGG_MAXBY_S else r <= acc_f[b, s, q]:
                        rec[b, s, base + q] = xi
                        rec[b, s, base + q + 1] = o
                        acc_f[b, s, q] = r


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
    ``base + q`` (and float slot q) into the next int (from column ``ii``) or float column."""
    ff = 0
    for q in range(ip[8]):
        code = ip[MULTI + 3 * q]
        vi, vf = _result(code, rec[b, s, base + q], acc_f[b, s, q])
        if _is_float(code):
            of[p, ff] = vf
            ff += 1
        else:
            oi[p, ii] = vi
            ii += 1


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


@njit(**HOT)
def _slot0(h, l, mask):
    """First slot of window (key, l) in its bucket: low bits of mix64(key) xor a multiple of l."""
    return np.int64((h ^ (np.uint64(l) * _GOLD)) & np.uint64(mask))


@njit(nogil=True, cache=True)
def _reinsert(b, r, af, rec, acc_f):
    mask = rec.shape[1] - 1
    s = _slot0(mix64(r[0]), r[1], mask)
    while rec[b, s, 1] != EMPTY:
        s = (s + 1) & mask
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
def rehash_into(rec, acc_f, nrec, nacc_f):
    """Copy every live slot of the old tables into the (larger, empty) new ones. Used by ``grow``."""
    for b in range(rec.shape[0]):
        for s in range(rec.shape[1]):
            if rec[b, s, 1] != EMPTY:
                _reinsert(b, rec[b, s], acc_f[b, s], nrec, nacc_f)


# ----------------------------------------------------------------------------------------------
# built-in operator functions (f_MK, f_U, f_O, f_S), selected by the integer parameters ``ip``
# builtin column layout per stream: (key_offsets int64, key_values int64, value_f float64, value_i int64)


@njit(**HOT)
def _mk_builtin(stream, cols0, cols1, row, out, ip):
    kind = ip[stream * 4]
    param = ip[stream * 4 + 1]
    if stream == 0:
        return _mk_builtin_keys(cols0[0][row], cols0[0][row + 1], cols0[1], out, kind, param)
    return _mk_builtin_keys(cols1[0][row], cols1[0][row + 1], cols1[1], out, kind, param)


@njit(**HOT)
def _mk_builtin_keys(a, e, vals, out, kind, param):
    """The keys of a tuple whose list of ids is ``vals[a:e]``, into ``out``; returns how many."""
    n = 0
    cap = out.shape[0]
    if kind == MK_LIST:
        for p in range(a, e):
            if n < cap:
                out[n] = vals[p]
            n += 1
    elif kind == MK_PAIRS:  # (a first word flagged ~id belongs to another host: no pair here)
        for p in range(a, e):
            if vals[p] < 0:
                continue
            hi = min(e, p + 1 + param)
            for q in range(p + 1, hi):
                w = vals[q]
                if n < cap:
                    out[n] = (vals[p] << 32) | (w if w >= 0 else ~w)
                n += 1
    elif kind == MK_RANGE:
        for k in range(param):
            if n < cap:
                out[n] = k
            n += 1
    return n


@njit(nogil=True, cache=True)
def _out_builtin(key, l, rec, acc_f, b, s, oi, of, p, ip, fp):
    kind = ip[2]
    if kind == AGG_MULTI:
        _multi_out(rec, acc_f, b, s, 2, oi, of, p, 0, ip)
    elif kind == AGG_MEAN:
        of[p, 0] = acc_f[b, s, 0] / rec[b, s, 2]
        oi[p, 0] = rec[b, s, 2]
    elif (kind == AGG_SUM_F or kind == AGG_MIN_F or kind == AGG_MAX_F or kind == AGG_FIRST_F
          or kind == AGG_LAST_F):
        of[p, 0] = acc_f[b, s, 0]
        oi[p, 0] = 0
    else:
        oi[p, 0] = rec[b, s, 2]
        of[p, 0] = 0.0
    return 1


@njit(nogil=True, cache=True)
def _slide_builtin(rec, acc_f, b, s, ip, fp):
    return False


@njit(nogil=True, cache=True)
def _val_none(stream, cols0, cols1, row, ip):
    return 0, 0.0


@njit(nogil=True, cache=True)
def _upd_none(stream, cols0, cols1, row, vi, vf, key, l, rec, acc_f, b, s, oi, of, p, ip, fp):
    return 0


# The built-in value read and f_U (count, sum, min, max, mean) are written out in the kernel body
# under ``if _BUILTIN`` (a compile-time constant): as helpers they were inlined with an atomic
# incref/decref of every array they took. ``specialize``d kernels set it False and call _VAL/_UPD.
_BUILTIN = True
_MK = _mk_builtin
_VAL = _val_none
_UPD = _upd_none
_OUT = _out_builtin
_SLIDE = _slide_builtin


# ----------------------------------------------------------------------------------------------
# the generic kernel bodies (plain Python functions; compiled below and by ``specialize``)


def _fire_bucket_py(b, W, WA, WS, wkind, rec, acc_f, bcount, bminl, dirty,
                    o_ts, o_key, o_l, o_seq, o_sub, o_i, o_f, opos, max_out_fire, ip, fp):
    """Emit every window of bucket ``b`` with ``l + WS <= W`` (f_O), then slide (f_S) or remove it.

    Returns False when the output block filled up (the bucket stays consistent; call again).
    """
    cap_out = o_ts.shape[0]
    changed = False
    ok = True
    for s in range(rec.shape[1]):
        l = rec[b, s, 1]
        if l == EMPTY or l + WS > W:
            continue
        key = rec[b, s, 0]
        while True:
            p = opos[0]
            if p + max_out_fire > cap_out:
                ok = False
                break
            n = _OUT(key, l, rec, acc_f, b, s, o_i, o_f, p, ip, fp)
            for r in range(n):
                o_ts[p + r] = l + WS
                o_key[p + r] = key
                o_l[p + r] = l
                o_seq[p + r] = -1
                o_sub[p + r] = r
            opos[0] = p + n
            changed = True
            if wkind == 2 and _SLIDE(rec, acc_f, b, s, ip, fp):
                l += WA
                rec[b, s, 1] = l  # the table is rebuilt below (the slot hash includes l)
                if l + WS <= W:
                    continue
            else:
                rec[b, s, 1] = EMPTY
                bcount[b] -= 1
            break
        if not ok:
            break
    if changed:
        dirty[b] = 1
        rebuild_bucket(b, rec, acc_f, bcount, bminl)
    return ok


def _agg_kernel_py(j, owner, WA, WS, wkind, w_prev, w_seg,
                   ts, stream, row, seq, cols0, cols1, ip, fp,
                   rec, acc_f, bcount, bminl, dirty, init_i, init_f, pool, free,
                   o_ts, o_key, o_l, o_seq, o_sub, o_i, o_f, opos,
                   resume, keybuf, max_out_upd, max_out_fire):
    """processVSN (Alg. 4) of instance ``j`` over one ready segment; see the module docstring."""
    nb = rec.shape[0]
    cap = rec.shape[1]
    mask = cap - 1
    n_init_i = init_i.shape[0]
    n_init_f = init_f.shape[0]
    cap_out = o_ts.shape[0]
    if _BUILTIN:  # the built-in column layout (see ``_mk_builtin``), bound once per call
        off0, val0, vf0, vi0 = cols0[0], cols0[1], cols0[2], cols0[3]
        off1, val1, vf1, vi1 = cols1[0], cols1[1], cols1[2], cols1[3]
    phase = resume[0]
    if phase == 0:
        i0 = resume[1]
        for i in range(i0, ts.shape[0]):
            t = ts[i]
            wt = w_prev if w_prev > t else t  # implicit watermark at t: every ts < t is final
            if _BUILTIN:  # built-in f_MK and value, written out (no array passed to a helper)
                st = stream[i]
                ri = row[i]
                agg = ip[st * 4 + 2]
                if st == 0:
                    nk = _mk_builtin_keys(off0[ri], off0[ri + 1], val0, keybuf, ip[0], ip[1])
                    vi, vf = vi0[ri] if vi0.shape[0] else 0, vf0[ri] if vf0.shape[0] else 0.0
                else:
                    nk = _mk_builtin_keys(off1[ri], off1[ri + 1], val1, keybuf, ip[4], ip[5])
                    vi, vf = vi1[ri] if vi1.shape[0] else 0, vf1[ri] if vf1.shape[0] else 0.0
            else:
                agg = 0
                nk = _MK(stream[i], cols0, cols1, row[i], keybuf, ip)
                vi, vf = _VAL(stream[i], cols0, cols1, row[i], ip)
            if nk > keybuf.shape[0]:
                resume[1] = i
                resume[2] = nk
                return 3
            k0 = resume[2] if i == i0 else 0
            if wkind == 0:
                lf = 0
                nw = 1
            else:
                # earliest window start with l + WS > wt (>= t): a straggler (t < w_prev, admitted
                # by per-window lateness) must not reopen a window that was already emitted
                lf = ((wt - WS) // WA + 1) * WA
                nw = t // WA - lf // WA + 1
                if nw < 0:
                    nw = 0
                elif wkind == 2 and nw > 1:
                    nw = 1
            for ki in range(k0, nk):
                key = keybuf[ki]
                h = mix64(key)
                b = _bucket_h(h, nb)
                if owner[b] != j:
                    continue
                # (a stamped built-in aggregation applies a whole batch at once: no window closes
                # at a tuple's time, only at the segment's watermark)
                if wkind != 0 and not (_BUILTIN and ip[3] != 0) and bminl[b] <= wt - WS:
                    if not _fire_bucket(b, wt, WA, WS, wkind, rec, acc_f, bcount, bminl, dirty,
                                        o_ts, o_key, o_l, o_seq, o_sub, o_i, o_f, opos, max_out_fire, ip, fp):
                        resume[1] = i
                        resume[2] = ki
                        resume[3] = 0
                        return 2
                w0 = resume[3] if (i == i0 and ki == k0) else 0
                for wi in range(w0, nw):
                    l = lf + wi * WA
                    # find-or-insert of the window, written out: passing the state arrays to a helper costs an
                    # atomic incref + decref of each (numba's reference counts), ~14 per update,
                    # on cache lines every instance thread shares
                    s = _slot0(h, l, mask)
                    while True:
                        cur = rec[b, s, 1]
                        if cur == EMPTY or (cur == l and rec[b, s, 0] == key):
                            break
                        s = (s + 1) & mask
                    p = opos[0]
                    full = cur == EMPTY and (bcount[b] + 1) * 2 > cap
                    short = cur == EMPTY and pool.shape[1] > 0 and free[j, 0] == 0
                    if full or short or p + max_out_upd > cap_out:
                        resume[1] = i
                        resume[2] = ki
                        resume[3] = wi
                        return 1 if full else (4 if short else 2)
                    if cur == EMPTY:
                        rec[b, s, 0] = key
                        rec[b, s, 1] = l
                        for q in range(n_init_i):
                            rec[b, s, 2 + q] = init_i[q]
                        for q in range(n_init_f):
                            acc_f[b, s, q] = init_f[q]
                        if pool.shape[1] > 0:
                            _pool_take(rec, b, s, 2, pool, free, j, ip)
                        bcount[b] += 1
                        if l < bminl[b]:
                            bminl[b] = l
                    if _BUILTIN:  # the built-in f_U, written out for the same reason
                        n = 0
                        if agg == AGG_MULTI:
                            _multi_update(rec, acc_f, b, s, 2, vi0, vf0, ri, t, ip, fp, pool)
                        elif agg == AGG_COUNT:
                            rec[b, s, 2] += 1
                        elif agg == AGG_SUM_I:
                            rec[b, s, 2] += vi
                        elif agg == AGG_SUM_F:
                            acc_f[b, s, 0] += vf
                        elif agg == AGG_MIN_I:
                            if vi < rec[b, s, 2]:
                                rec[b, s, 2] = vi
                        elif agg == AGG_MAX_I:
                            if vi > rec[b, s, 2]:
                                rec[b, s, 2] = vi
                        elif agg == AGG_MIN_F:
                            if vf < acc_f[b, s, 0]:
                                acc_f[b, s, 0] = vf
                        elif agg == AGG_MAX_F:
                            if vf > acc_f[b, s, 0]:
                                acc_f[b, s, 0] = vf
                        elif agg == AGG_MEAN:
                            acc_f[b, s, 0] += vf
                            rec[b, s, 2] += 1
                        else:  # (the rarer ones through the scalar helper)
                            rec[b, s, 2], acc_f[b, s, 0] = _apply(agg, rec[b, s, 2], acc_f[b, s, 0],
                                                                  vi, vf, t)
                        if ip[3] != 0:  # stamped: the batch that last updated the window
                            rec[b, s, 1 + n_init_i] = ip[7]  # (the last int slot)
                    else:
                        n = _UPD(stream[i], cols0, cols1, row[i], vi, vf, key, l, rec, acc_f, b, s, o_i, o_f, p,
                                 ip, fp)
                    for r in range(n):
                        o_ts[p + r] = t
                        o_key[p + r] = key
                        o_l[p + r] = l if wkind != 0 else -1
                        o_seq[p + r] = seq[i]
                        o_sub[p + r] = r
                    opos[0] = p + n
                if dirty[b] == 0:  # write once: no cache-line ping-pong between instances
                    dirty[b] = 1
            resume[2] = 0
            resume[3] = 0
        resume[0] = 1
        resume[1] = 0
    if wkind != 0:
        for b in range(resume[1], nb):
            if owner[b] == j and bcount[b] > 0 and bminl[b] <= w_seg - WS:
                if not _fire_bucket(b, w_seg, WA, WS, wkind, rec, acc_f, bcount, bminl, dirty,
                                    o_ts, o_key, o_l, o_seq, o_sub, o_i, o_f, opos, max_out_fire, ip, fp):
                    resume[1] = b
                    return 2
    resume[0] = 2
    return 0


def _route_py(j, owner, ts, stream, row, cols0, cols1, ip, keybuf):
    """forwardSN (Alg. 1) seen from instance ``j``: indices of the tuples with a key ``j`` owns."""
    nb = owner.shape[0]
    sel = np.empty(ts.shape[0], np.int64)
    c = 0
    for i in range(ts.shape[0]):
        nk = _MK(stream[i], cols0, cols1, row[i], keybuf, ip)
        for ki in range(min(nk, keybuf.shape[0])):
            if owner[bucket_of(keybuf[ki], nb)] == j:
                sel[c] = i
                c += 1
                break
    return sel[:c]


_fire_bucket = njit(nogil=True, cache=True)(_fire_bucket_py)
agg_kernel = njit(nogil=True, cache=True)(_agg_kernel_py)
route_kernel = njit(nogil=True, cache=True)(_route_py)


def specialize(mk, upd, out, slide, val=None):
    """Compile the kernel bodies bound to other operator functions (user numba functions).

    ``mk(stream, cols0, cols1, row, keys_out, ip) -> int``,
    ``val(stream, cols0, cols1, row, ip) -> (int, float)`` (once per tuple),
    ``upd(stream, cols0, cols1, row, vi, vf, key, l, acc_i, acc_f, b, s, out_i, out_f, p, ip, fp) -> int`` (the
    window's state is ``acc_i[b, s]``; writes output rows from ``p``),
    ``out(key, l, acc_i, acc_f, b, s, out_i, out_f, p, ip, fp) -> int``, ``slide(acc_i, acc_f, b, s, ip, fp) -> bool``.
    (Indices, not array views, are passed on the hot path: a view costs two atomic reference-count
    operations on memory shared by all instance threads.)
    Returns ``(agg_kernel, route_kernel)``; not cached on disk (compiled on first call).
    """
    g = dict(globals())
    g.update(_MK=mk, _UPD=upd, _OUT=out, _SLIDE=slide, _VAL=val or _val_none, _BUILTIN=False)

    def clone(f):
        fn = types.FunctionType(f.__code__, g, f.__name__, f.__defaults__)
        # A name of its own: numba's symbol names are the qualified name and a per-process
        # counter, and a cached kernel loaded from disk carries its callees' names from the
        # process that compiled it. A clone with the cached function's name and the same count
        # would take its place (seen: the built-in kernel calling a user operator's
        # _fire_bucket, and emitting nothing).
        fn.__qualname__ = f"{f.__qualname__}__specialized"
        return njit(nogil=True)(fn)

    g["_fire_bucket"] = clone(_fire_bucket_py)
    return clone(_agg_kernel_py), clone(_route_py)


@njit(nogil=True, cache=True)
def take_list(offsets, values, idx):
    """Gather rows ``idx`` of an Arrow-like list column (offsets, values) into a new one."""
    n = idx.shape[0]
    noff = np.empty(n + 1, np.int64)
    noff[0] = 0
    for i in range(n):
        r = idx[i]
        noff[i + 1] = noff[i] + offsets[r + 1] - offsets[r]
    nval = np.empty(noff[n], values.dtype)
    for i in range(n):
        r = idx[i]
        a = offsets[r]
        d = noff[i]
        for p in range(offsets[r + 1] - a):
            nval[d + p] = values[a + p]
    return noff, nval
