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

State layout: the buckets' window tables (:mod:`spark_stretch.engine.buckets`, with the
key-to-bucket hash) and the aggregates' accumulators in them (:mod:`spark_stretch.engine.aggregates`,
whose codes and arithmetic the session kernel shares); both are imported here, and so remain
``kernels.<name>`` for the code that reads them through this module.

The kernels never block: when a bucket is full (``NEED_GROW``), the instance's output block is full
(``NEED_OUT``) or its free rows of the register pool are used up (``NEED_POOL``) they store a resume
position in ``resume`` and return; the runtime grows the arrays and calls again. (So too, for state
past a memory budget, every ``resume[4]`` tuples, once the tuples are applied, and every
``resume[5]`` buckets spanned emitting windows at the watermark: ``NEED_TRIM``, and the runtime
drops the pages touched.) Every step before the resume position is applied exactly once.
"""
from __future__ import annotations

import types

import numpy as np
from .jit import njit

# (what the kernel bodies use, and the codes and table helpers the engine's other modules read
# as ``kernels.<name>``)
from .aggregates import (AGG_BY_KEY, AGG_COUNT, AGG_COUNT_ANY, AGG_FIRST_F, AGG_FIRST_I,
                         AGG_HLL, AGG_LAST_F, AGG_LAST_I, AGG_MAX_F, AGG_MAX_I, AGG_MAX_S,
                         AGG_MAXBY_I, AGG_MAXBY_L, AGG_MAXBY_S, AGG_MEAN, AGG_MIN_F, AGG_MIN_I,
                         AGG_MIN_S, AGG_MINBY_I, AGG_MINBY_L, AGG_MINBY_S, AGG_MULTI, AGG_SUM_F,
                         AGG_SUM_I, MULTI, _apply, _multi_out, _multi_update, _pool_take)
from .buckets import (EMPTY, HOT, NO_L, _bucket_h, _next, _slot0, bucket_full, bucket_of,
                      buckets_of, insert_rows, mix64, rebuild_bucket, rehash_into)

DONE, NEED_GROW, NEED_OUT, NEED_KEYBUF, NEED_POOL, NEED_TRIM = 0, 1, 2, 3, 4, 5
# ip[3] of a built-in aggregation: tuples applied one by one in event-time order, windows fired
# as the tuples' times pass them (IN_ORDER); or whole batches, windows fired at the segment's
# watermark only, each window stamped with the batch that last updated it (STAMPED: Spark's
# update and complete modes) or not (WHOLE: append mode, aggregates the order does not change)
IN_ORDER, STAMPED, WHOLE = 0, 1, 2

# window kinds
W_NONE, W_MULTI, W_SINGLE = 0, 1, 2

# built-in f_MK kinds (ip[stream * 4 + 0]); parameter in ip[stream * 4 + 1]
MK_LIST, MK_PAIRS, MK_RANGE, MK_NONE = 0, 1, 2, 3


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
            if i - i0 == resume[4] and i > i0:  # (past a memory budget: drop the pages)
                resume[1] = i
                return NEED_TRIM
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
                # (a built-in aggregation applying whole batches, STAMPED or WHOLE: no window
                # closes at a tuple's time, only at the segment's watermark)
                if wkind != 0 and not (_BUILTIN and ip[3] != IN_ORDER) and bminl[b] <= wt - WS:
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
                    s = _slot0(h, l, cap)
                    while True:
                        cur = rec[b, s, 1]
                        if cur == EMPTY or (cur == l and rec[b, s, 0] == key):
                            break
                        s = _next(s, cap)
                    p = opos[0]
                    full = cur == EMPTY and bucket_full(bcount[b], cap)
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
                        if ip[3] == STAMPED:  # the batch that last updated the window
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
        if resume[4] > 0 and ts.shape[0] > i0:  # (the tuples' pages dropped before emitting)
            return NEED_TRIM
    if wkind != 0:
        b0 = resume[1]
        for b in range(b0, nb):
            if owner[b] == j and bcount[b] > 0 and bminl[b] <= w_seg - WS:
                if resume[5] > 0 and b - b0 >= resume[5]:
                    # (a budget's worth of bucket rows spanned, whether fired or mapped around
                    # one that was: drop their pages)
                    resume[1] = b
                    return NEED_TRIM
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
    from .jit import require_numba

    require_numba()  # (numba compiles these: the globals they call must be numba's)
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
