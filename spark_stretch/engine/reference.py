"""Plain-Python sequential O+ (Alg. 2 with one instance): the oracle the engine is tested against.

It shares no code with the kernels. Input is the *script* the engine was fed::

    ("sources", [ids], stream)      # add_sources (watermarked sources)
    ("add", source, rows)           # rows: list of dicts with 'ts' and the stream's columns
    ("wm", w)                       # advance_watermark(w) for every source
    ("swm", source, w)              # add_watermark(w, source)
    ("reconf", ...)                 # ignored: the oracle has one instance and no epochs

A tuple with ``ts <=`` its source's watermark when added is late (dropped). The non-late tuples below
the final frontier are processed in ``(ts, source, order of addition)`` order; the windows whose end is
``<=`` the final watermark are output. Rows are sorted by ``(ts, key, window_start, _seq, _sub)``.

Operator semantics come from a :class:`RefOp` (plain-Python ``f_MK`` / ``f_U`` / ``f_O`` / ``f_S``);
:func:`ref_aggregate` builds the one of a built-in aggregation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

MIN_TS = -(2 ** 62)


@dataclass
class RefOp:
    """Plain-Python O+: ``keys(stream, t) -> list``, ``init() -> state``,
    ``update(state, stream, t, key) -> (state, [row dicts])``, ``output(state, key, l) -> [row dicts]``,
    ``slide(state) -> state or None``."""

    WA: int | None
    WS: int | None
    WT: str
    keys: object
    init: object
    update: object
    output: object
    slide: object = None


def ref_aggregate(agg, key=None, keys=None, pairs=False, B=None, value=None, value_type="f", WS=None, WA=None):
    """RefOp of :func:`spark_stretch.ops.aggregate` (same parameters), written independently."""
    WA = WS if WA is None else WA
    col = key if key is not None else keys
    dist = math.inf if B is None else B

    def fkeys(stream, t):
        if key is not None:
            return [t[col]]
        ws = list(t[col])
        if not pairs:
            return ws
        return [(ws[i] << 32) | ws[j] for i in range(len(ws)) for j in range(i + 1, len(ws)) if j - i <= dist]

    def val(t):
        v = t[value]
        if agg == "longest":
            return len(v) if isinstance(v, (list, tuple)) else int(v)
        return float(v) if value_type == "f" or agg == "mean" else int(v)

    def init():
        return {"count": 0, "sum": 0, "min": None, "max": None, "longest": None}

    def update(s, stream, t, k):
        s = dict(s)
        s["count"] += 1
        if agg != "count":
            v = val(t)
            s["sum"] += v
            s["min"] = v if s["min"] is None else min(s["min"], v)
            s["max"] = v if s["max"] is None else max(s["max"], v)
            s["longest"] = s["max"]
        return s, []

    def output(s, k, l):
        name = agg
        if agg == "mean":
            v = s["sum"] / s["count"]
        elif agg == "sum" and value_type == "f":
            v = float(s["sum"])
        else:
            v = s[agg]
        return [{name: v}]

    return RefOp(WA, WS, "multi", fkeys, init, update, output)


def _windows(op, ts):
    if op.WA is None:
        return [-1]
    first = ((ts - op.WS) // op.WA + 1) * op.WA
    if op.WT == "single":
        return [first]
    return list(range(first, (ts // op.WA) * op.WA + 1, op.WA))


def reference_run(op: RefOp, script, n_streams=1):
    """Run the oracle over a script (see the module docstring); returns the sorted list of output rows."""
    src_stream, wm, tuples, order = {}, {}, [], 0
    for act in script:
        kind = act[0]
        if kind == "sources":
            for s in act[1]:
                src_stream[s] = act[2] if len(act) > 2 else 0
                wm[s] = wm.get(s, _cur_wm(wm))  # a new source starts at the current watermark
        elif kind == "add":
            _, s, rows = act
            for r in rows:
                if r["ts"] <= wm[s]:
                    continue
                tuples.append((r["ts"], s, order, src_stream[s], r))
                order += 1
        elif kind == "wm":
            for s in wm:
                wm[s] = max(wm[s], act[1])
        elif kind == "swm":
            wm[act[1]] = max(wm[act[1]], act[2])
    W = min(wm.values()) if wm else MIN_TS
    ready = sorted((t for t in tuples if t[0] <= W), key=lambda t: t[:3])
    sigma, out = {}, []

    def fire(upto):
        if op.WA is None:
            return
        for (k, l) in sorted(sigma):
            if l + op.WS > upto:
                continue
            st = sigma.pop((k, l))
            while True:
                for i, row in enumerate(op.output(st, k, l)):
                    out.append({"ts": l + op.WS, "key": k, "window_start": l, "_seq": -1, "_sub": i, **row})
                if op.WT == "single" and op.slide is not None:
                    st = op.slide(st)
                    if st is None:
                        break
                    l += op.WA
                    if l + op.WS <= upto:
                        continue
                    sigma[(k, l)] = st
                break

    for rank, (ts, s, _, stream, row) in enumerate(ready):
        fire(ts)
        for k in op.keys(stream, row):
            for l in _windows(op, ts):
                st = sigma.get((k, l))
                if st is None:
                    st = op.init()
                st, rows = op.update(st, stream, row, k)
                sigma[(k, l)] = st
                for i, r in enumerate(rows):
                    out.append({"ts": ts, "key": k, "window_start": l, "_seq": rank, "_sub": i, **r})
    fire(W)
    out.sort(key=lambda r: (r["ts"], r["key"], r["window_start"], r["_seq"], r["_sub"]))
    return out


def _cur_wm(wm):
    return min(wm.values()) if wm else MIN_TS
