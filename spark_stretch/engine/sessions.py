"""Session windows (Spark's ``session_window``) as an O+ type: the jitted kernel of a built-in
aggregation over sessions, in one of two ways of keeping them.

- **Append** (:func:`_session_kernel_py`): tuples come in timestamp order (the ESG releases them
  under the watermark), a key has one open session, and a session is emitted when a later tuple
  of its key starts after its end or when the watermark passes its end; then it is gone.
- **Kept** (a ``stamped`` operator, Spark's complete output mode): every tuple is applied when it
  arrives, in any order, and no session is ever emitted or evicted; the output is the state
  (``Engine.state_rows``). A key's latest session sits in the slot ``(key, l=0)``, each earlier
  one in a slot ``(key, l=start | CLOSED)``. A tuple ``[t, e)`` merges, as Spark does, with every
  session ``[s, end)`` of its key with ``s <= e`` and ``t <= end``: the sessions it bridges
  become one (their aggregates merged by :func:`_absorb`). The sessions of a key never overlap,
  so a tuple at or after the latest session's start touches that one only; an earlier one
  (out of order: a later batch's, not late) scans its bucket for the key's earlier sessions.

State per slot: ``rec[b, s] = (key, l, start, end, accumulators...)``, ``acc_f[b, s]`` the float
accumulators (the layout of :mod:`spark_stretch.engine.buckets`; the aggregates of
:mod:`spark_stretch.engine.aggregates`, as the window kernel's).
"""
from __future__ import annotations

import numpy as np
from .jit import njit

from .aggregates import (AGG_COUNT, AGG_COUNT_ANY, AGG_FIRST_F, AGG_FIRST_I, AGG_HLL, AGG_LAST_F,
                         AGG_LAST_I, AGG_MAX_F, AGG_MAX_I, AGG_MAX_S, AGG_MAXBY_I, AGG_MAXBY_L,
                         AGG_MAXBY_S, AGG_MEAN, AGG_MIN_F, AGG_MIN_I, AGG_MIN_S, AGG_MINBY_I,
                         AGG_MINBY_L, AGG_MINBY_S, AGG_MULTI, AGG_SUM_F, AGG_SUM_I, ANY_COUNT,
                         MULTI, _apply, _fslot, _hll_words, _multi_out, _multi_update,
                         _pool_take)
from .buckets import EMPTY, HOT, _bucket_h, _next, _slot0, bucket_full, mix64, rebuild_bucket
from .kernels import NEED_POOL, _mk_builtin_keys

CLOSED = np.int64(1) << np.int64(62)  # l of a key's earlier session: its start | CLOSED (never 0 or EMPTY)


@njit(**HOT)
def _merge(code, ci, cf, di, df):
    """One aggregate's state (int ``ci``, float ``cf``) merged with another session's
    (``di``, ``df``) of the same aggregate: what applying both sessions' tuples gives."""
    if code == AGG_COUNT or code == AGG_SUM_I:
        ci += di
    elif code == AGG_COUNT_ANY:  # (the counts add up, the flags or)
        ci = ((ci & ANY_COUNT) + (di & ANY_COUNT)) | ((ci | di) & ~ANY_COUNT)
    elif code == AGG_SUM_F:
        cf += df
    elif code == AGG_MEAN:
        ci += di
        cf += df
    elif code == AGG_MIN_I:
        if di < ci:
            ci = di
    elif code == AGG_MAX_I:
        if di > ci:
            ci = di
    elif code == AGG_MIN_F:
        if df < cf:
            cf = df
    elif code == AGG_MAX_F:
        if df > cf:
            cf = df
    elif code == AGG_FIRST_I or code == AGG_LAST_I:  # (the value's timestamp in the float)
        if df < cf if code == AGG_FIRST_I else df >= cf:
            ci = di
            cf = df
    elif code == AGG_FIRST_F or code == AGG_LAST_F:  # (the value's timestamp in the int)
        if di < ci if code == AGG_FIRST_F else di >= ci:
            ci = di
            cf = df
    elif code == AGG_MIN_S or code == AGG_MAX_S:  # (the string's rank in the float)
        if df < cf if code == AGG_MIN_S else df > cf:
            ci = di
            cf = df
    elif code == AGG_MAXBY_I or code == AGG_MINBY_I:  # (the ordering's extremum in the float)
        if df >= cf if code == AGG_MAXBY_I else df <= cf:
            ci = di
            cf = df
    return ci, cf


@njit(**HOT)
def _hll_merge(a, d):
    """A word of ten 6-bit HLL++ registers merged with another's: each register the larger."""
    w = np.int64(0)
    for r in range(10):
        sh = 6 * r
        x = (a >> sh) & 63
        y = (d >> sh) & 63
        w |= (x if x > y else y) << sh
    return w


@njit(**HOT)
def _absorb(rec, acc_f, b, into, frm, ip, pool):
    """Session ``into`` merged with session ``frm`` (its span and its aggregates; an HLL++'s
    registers into its pool row)."""
    if rec[b, frm, 2] < rec[b, into, 2]:
        rec[b, into, 2] = rec[b, frm, 2]
    if rec[b, frm, 3] > rec[b, into, 3]:
        rec[b, into, 3] = rec[b, frm, 3]
    if ip[2] == AGG_MULTI:
        for q in range(ip[8]):
            code = ip[MULTI + 3 * q]
            f = _fslot(ip, q)
            if code >= AGG_MAXBY_L and code <= AGG_MINBY_S:  # (its ordering in the slot after)
                if code <= AGG_MINBY_L:
                    c, d = rec[b, into, 5 + q], rec[b, frm, 5 + q]
                    take = d >= c if code == AGG_MAXBY_L else d <= c
                else:  # (by the strings' ranks)
                    take = (acc_f[b, frm, f] >= acc_f[b, into, f] if code == AGG_MAXBY_S
                            else acc_f[b, frm, f] <= acc_f[b, into, f])
                if take:
                    rec[b, into, 4 + q] = rec[b, frm, 4 + q]
                    rec[b, into, 5 + q] = rec[b, frm, 5 + q]
                    if f >= 0:
                        acc_f[b, into, f] = acc_f[b, frm, f]
            elif code >= AGG_HLL:
                hi, hf = rec[b, into, 4 + q], rec[b, frm, 4 + q]
                at = ip[MULTI + 3 * ip[8] + q]
                for w in range(at, at + _hll_words(code)):
                    pool[hi, w] = _hll_merge(pool[hi, w], pool[hf, w])
            elif f >= 0:
                rec[b, into, 4 + q], acc_f[b, into, f] = _merge(
                    code, rec[b, into, 4 + q], acc_f[b, into, f], rec[b, frm, 4 + q],
                    acc_f[b, frm, f])
            else:
                rec[b, into, 4 + q] = _merge(code, rec[b, into, 4 + q], 0.0,
                                             rec[b, frm, 4 + q], 0.0)[0]
    else:
        rec[b, into, 4], acc_f[b, into, 0] = _merge(ip[2], rec[b, into, 4], acc_f[b, into, 0],
                                                    rec[b, frm, 4], acc_f[b, frm, 0])


@njit(**HOT)
def _open(rec, acc_f, b, s, key, l, t, e, init_i, init_f, pool, free, j, ip):
    """A new session ``[t, e)`` of ``key`` in slot ``s`` (``l``: 0 the key's latest), with a
    row of the register pool if it needs one."""
    rec[b, s, 0] = key
    rec[b, s, 1] = l
    rec[b, s, 2] = t
    rec[b, s, 3] = e
    for q in range(init_i.shape[0] - 2):
        rec[b, s, 4 + q] = init_i[2 + q]
    for q in range(init_f.shape[0]):
        acc_f[b, s, q] = init_f[q]
    if pool.shape[1] > 0:
        _pool_take(rec, b, s, 4, pool, free, j, ip)


@njit(**HOT)
def _free(rec, b, h, l):
    """The free slot where a record ``(key with hash h, l)`` goes."""
    cap = rec.shape[1]
    s = _slot0(h, l, cap)
    while rec[b, s, 1] != EMPTY:
        s = _next(s, cap)
    return s


@njit(nogil=True, cache=True)
def _keep(rec, acc_f, b, key, h, t, e, vi0, vf0, ri, vi, vf, ip, fp, init_i, init_f, bcount,
          bminl, pool, free, j):
    """A kept session aggregation's update by one tuple ``[t, e)`` of ``key`` (the module
    docstring): bucket ``b`` has a free slot for the one new record this may need (and
    instance ``j`` a free pool row)."""
    cap = rec.shape[1]
    s = _slot0(h, 0, cap)
    while rec[b, s, 1] != EMPTY and not (rec[b, s, 1] == 0 and rec[b, s, 0] == key):
        s = _next(s, cap)
    into = s
    removed = False
    if rec[b, s, 1] == EMPTY:  # the key's first session
        _open(rec, acc_f, b, s, key, 0, t, e, init_i, init_f, pool, free, j, ip)
        bcount[b] += 1
        if bminl[b] > 0:
            bminl[b] = 0
    elif t > rec[b, s, 3]:  # after the latest session, which is kept as an earlier one
        c = _free(rec, b, h, rec[b, s, 2] | CLOSED)
        rec[b, c, :] = rec[b, s, :]
        acc_f[b, c, :] = acc_f[b, s, :]
        rec[b, c, 1] = rec[b, s, 2] | CLOSED
        bcount[b] += 1
        _open(rec, acc_f, b, s, key, 0, t, e, init_i, init_f, pool, free, j, ip)
    elif t < rec[b, s, 2]:  # out of order: earlier sessions may overlap it (none can otherwise)
        if e < rec[b, s, 2]:  # (and it does not reach the latest)
            into = -1
        for c in range(rec.shape[1]):
            lc = rec[b, c, 1]
            if (lc == EMPTY or lc == 0 or rec[b, c, 0] != key or rec[b, c, 3] < t
                    or rec[b, c, 2] > e):
                continue
            if into < 0:
                into = c
            else:  # bridged: one session
                _absorb(rec, acc_f, b, into, c, ip, pool)
                rec[b, c, 1] = EMPTY
                bcount[b] -= 1
                removed = True
        if into < 0:  # overlaps none: an earlier session of its own
            into = _free(rec, b, h, t | CLOSED)
            _open(rec, acc_f, b, into, key, t | CLOSED, t, e, init_i, init_f, pool, free, j, ip)
            bcount[b] += 1
    if t < rec[b, into, 2]:
        rec[b, into, 2] = t
    if e > rec[b, into, 3]:
        rec[b, into, 3] = e
    if ip[2] == AGG_MULTI:
        _multi_update(rec, acc_f, b, into, 4, vi0, vf0, ri, t, ip, fp, pool)
    else:
        rec[b, into, 4], acc_f[b, into, 0] = _apply(ip[2], rec[b, into, 4], acc_f[b, into, 0],
                                                    vi, vf, t)
    if removed:  # (linear probing: the freed slots must not cut a probe short)
        rebuild_bucket(b, rec, acc_f, bcount, bminl)


@njit(**HOT)
def _session_emit(rec, acc_f, b, s, o_ts, o_key, o_l, o_seq, o_sub, o_i, o_f, p, agg, ip):
    """Output row ``p``: the session in slot ``s`` (ts = its end, window start = its start,
    ``o_i[p, 0]`` its end, then the aggregate: ``o_i[p, 1]`` if an int, else ``o_f[p, 0]``)."""
    end = rec[b, s, 3]
    o_ts[p] = end
    o_key[p] = rec[b, s, 0]
    o_l[p] = rec[b, s, 2]
    o_seq[p] = -1
    o_sub[p] = 0
    o_i[p, 0] = end
    if agg == AGG_MULTI:
        _multi_out(rec, acc_f, b, s, 4, o_i, o_f, p, 1, ip)
    elif agg == AGG_MEAN:  # (float results have one int output column, the end)
        o_f[p, 0] = acc_f[b, s, 0] / rec[b, s, 4]
    elif (agg == AGG_SUM_F or agg == AGG_MIN_F or agg == AGG_MAX_F or agg == AGG_FIRST_F
          or agg == AGG_LAST_F):
        o_f[p, 0] = acc_f[b, s, 0]
    else:
        o_i[p, 1] = rec[b, s, 4]
        o_f[p, 0] = 0.0


def _session_kernel_py(j, owner, WA, WS, wkind, w_prev, w_seg,
                       ts, stream, row, seq, cols0, cols1, ip, fp,
                       rec, acc_f, bcount, bminl, dirty, init_i, init_f, pool, free,
                       o_ts, o_key, o_l, o_seq, o_sub, o_i, o_f, opos,
                       resume, keybuf, max_out_upd, max_out_fire):
    """processVSN for a built-in aggregation over session windows (Spark's ``session_window``),
    in append mode as follows; a ``stamped`` one (``ip[3]``) keeps its sessions (:func:`_keep`).

    A tuple at ``t`` with session end ``e`` (``t`` + its gap) opens the session ``[t, e)``; a
    session takes every later tuple of its key with ``t <= end`` (Spark merges a session
    starting at or before the current one's end), growing to ``max(end, e)``. Tuples come in
    timestamp order, so a key has one open session: a tuple after its end closes and emits it
    (no later tuple can reach it: a straggler of a later batch is late unless its own session
    reaches past the watermark, which this session's end does not), and at the end of the
    segment every session ending by the watermark is emitted (Spark's eviction). A straggler
    (``t`` at or before the previous watermark, its end after it) always overlaps its key's open
    session, whose start is at or before that watermark and whose end is after it.

    State: one slot per key, window start 0; ``rec[b, s, 2]`` the session's start,
    ``rec[b, s, 3]`` its end, ``rec[b, s, 4]`` the int accumulator, ``acc_f[b, s, 0]`` the
    float one. The columns: the built-in layout and the ends, ``(key_offsets, key_values,
    value_f, value_i, end)``.
    """
    nb = rec.shape[0]
    cap = rec.shape[1]
    cap_out = o_ts.shape[0]
    off0, val0, vf0, vi0, end0 = cols0[0], cols0[1], cols0[2], cols0[3], cols0[4]
    agg = ip[2]
    keep = ip[3] != 0  # kept sessions (complete mode); else append (the docstring)
    if resume[0] == 0:
        i0 = resume[1]
        for i in range(i0, ts.shape[0]):
            t = ts[i]
            ri = row[i]
            e = end0[ri]
            nk = _mk_builtin_keys(off0[ri], off0[ri + 1], val0, keybuf, ip[0], ip[1])
            if nk > keybuf.shape[0]:
                resume[1] = i
                resume[2] = nk
                return 3
            vi = vi0[ri] if vi0.shape[0] else 0
            vf = vf0[ri] if vf0.shape[0] else 0.0
            k0 = resume[2] if i == i0 else 0
            for ki in range(k0, nk):
                key = keybuf[ki]
                h = mix64(key)
                b = _bucket_h(h, nb)
                if owner[b] != j:
                    continue
                if keep:
                    full = bucket_full(bcount[b], cap)
                    if full or (pool.shape[1] > 0 and free[j, 0] == 0):
                        resume[1] = i
                        resume[2] = ki
                        return 1 if full else NEED_POOL
                    _keep(rec, acc_f, b, key, h, t, e, vi0, vf0, ri, vi, vf, ip, fp, init_i,
                          init_f, bcount, bminl, pool, free, j)
                    if dirty[b] == 0:
                        dirty[b] = 1
                    continue
                s = _slot0(h, 0, cap)
                while True:
                    cur = rec[b, s, 1]
                    if cur == EMPTY or rec[b, s, 0] == key:
                        break
                    s = _next(s, cap)
                p = opos[0]
                fresh = cur == EMPTY or t > rec[b, s, 3]
                if cur == EMPTY and bucket_full(bcount[b], cap):
                    resume[1] = i
                    resume[2] = ki
                    return 1
                if cur != EMPTY and fresh and p + 1 > cap_out:
                    resume[1] = i
                    resume[2] = ki
                    return 2
                if fresh and pool.shape[1] > 0 and free[j, 0] == 0:
                    resume[1] = i
                    resume[2] = ki
                    return NEED_POOL
                if cur == EMPTY:
                    rec[b, s, 0] = key
                    rec[b, s, 1] = 0
                    bcount[b] += 1
                    if bminl[b] > 0:
                        bminl[b] = 0
                elif fresh:  # the key's session ended before t: emit it, open another
                    _session_emit(rec, acc_f, b, s, o_ts, o_key, o_l, o_seq, o_sub, o_i, o_f, p, agg, ip)
                    opos[0] = p + 1
                if fresh:
                    rec[b, s, 2] = t
                    rec[b, s, 3] = e
                    for q in range(init_i.shape[0] - 2):
                        rec[b, s, 4 + q] = init_i[2 + q]
                    for q in range(init_f.shape[0]):
                        acc_f[b, s, q] = init_f[q]
                    if pool.shape[1] > 0:  # (the emitted session's row is collected later)
                        _pool_take(rec, b, s, 4, pool, free, j, ip)
                else:
                    if t < rec[b, s, 2]:
                        rec[b, s, 2] = t
                    if e > rec[b, s, 3]:
                        rec[b, s, 3] = e
                if agg == AGG_MULTI:
                    _multi_update(rec, acc_f, b, s, 4, vi0, vf0, ri, t, ip, fp, pool)
                else:  # (scalars only: inlined without reference counts)
                    rec[b, s, 4], acc_f[b, s, 0] = _apply(agg, rec[b, s, 4], acc_f[b, s, 0], vi, vf, t)
                if dirty[b] == 0:
                    dirty[b] = 1
            resume[2] = 0
        resume[0] = 1
        resume[1] = 0
    if keep:  # (no session is ever evicted)
        resume[0] = 2
        return 0
    for b in range(resume[1], nb):  # Spark's eviction: every session ending by the watermark
        if owner[b] != j or bcount[b] == 0:
            continue
        changed = False
        for s in range(cap):
            if rec[b, s, 1] != EMPTY and rec[b, s, 3] <= w_seg:
                p = opos[0]
                if p + 1 > cap_out:
                    if changed:
                        rebuild_bucket(b, rec, acc_f, bcount, bminl)
                    resume[1] = b
                    return 2
                _session_emit(rec, acc_f, b, s, o_ts, o_key, o_l, o_seq, o_sub, o_i, o_f, p, agg, ip)
                opos[0] = p + 1
                rec[b, s, 1] = EMPTY
                bcount[b] -= 1
                changed = True
        if changed:
            dirty[b] = 1
            rebuild_bucket(b, rec, acc_f, bcount, bminl)
    resume[0] = 2
    return 0



session_kernel = njit(nogil=True, cache=True)(_session_kernel_py)
