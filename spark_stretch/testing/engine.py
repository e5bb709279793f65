"""Drive the VSN engine with a script, as the reference oracle (:mod:`spark_stretch.engine.reference`)
runs it, and compare the two row by row.

A script is a list of actions: ``("sources", [ids], stream)``, ``("add", source, rows)``,
``("wm", watermark)``, ``("swm", source, watermark)``, ``("reconf", {"m": 2})``.

Examples
--------
>>> from spark_stretch.ops import wordcount
>>> rows, _ = run_engine(wordcount(WS=10, WA=10), [("sources", [0]),
...     ("add", 0, [{"ts": 1, "words": [1, 2, 1]}]), ("wm", 20)], [{"words": "list"}])
>>> [(r["key"], r["count"]) for r in rows]
[(1, 2), (2, 1)]
"""
from __future__ import annotations

import numpy as np

from spark_stretch.engine import Engine, ListColumn


__all__ = ["rows_to_batch", "run_engine", "batch_to_rows", "same_rows"]


def rows_to_batch(rows, columns):
    """list of row dicts -> columnar batch; ``columns``: {name: 'list' | numpy dtype}."""
    b = {"ts": np.array([r["ts"] for r in rows], np.int64)}
    for name, kind in columns.items():
        if kind == "list":
            lens = [len(r[name]) for r in rows]
            off = np.zeros(len(rows) + 1, np.int64)
            off[1:] = np.cumsum(lens)
            vals = [v for r in rows for v in r[name]]
            b[name] = ListColumn(off, np.array(vals, np.int64) if vals else np.empty(0, np.int64))
        else:
            b[name] = np.array([r[name] for r in rows], kind)
    return b


def run_engine(op, script, columns, m=1, n=1, engine_cls=Engine, n_buckets=64, drain_each=True, **kw):
    """Feed a reference-style script to an engine; returns (rows, engine). ``columns``: per stream."""
    eng = engine_cls(op, m, n, n_buckets=n_buckets, **kw)
    src_stream = {}
    try:
        for act in script:
            kind = act[0]
            if kind == "sources":
                stream = act[2] if len(act) > 2 else 0
                eng.esg_in.add_sources(act[1], stream=stream, ordered=False)
                for s in act[1]:
                    src_stream[s] = stream
            elif kind == "add":
                _, s, rows = act
                if rows:
                    eng.esg_in.add(rows_to_batch(rows, columns[src_stream[s]]), s)
            elif kind == "wm":
                eng.esg_in.advance_watermark(act[1])
                if drain_each:
                    eng.drain()
            elif kind == "swm":
                eng.esg_in.add_watermark(act[2], act[1])
            elif kind == "reconf":
                eng.reconfigure(**act[1])
                if drain_each:
                    eng.drain()
        eng.drain()
        out, _ = eng.read_output(decode=False)
    finally:
        eng.close()
    return batch_to_rows(out), eng


def batch_to_rows(out):
    n = len(out["ts"])
    names = [k for k in out if k != "window_end"]
    return [{k: out[k][i].item() for k in names} for i in range(n)]


def same_rows(got, want, value_cols):
    """Compare engine rows and oracle rows (same order), on ts/key/window/_seq/_sub and value columns."""
    assert len(got) == len(want), f"{len(got)} rows vs oracle {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        for c in ("ts", "key", "window_start", "_seq", "_sub", *value_cols):
            assert g[c] == w[c], f"row {i} column {c}: engine {g[c]!r} != oracle {w[c]!r}\n{g}\n{w}"
