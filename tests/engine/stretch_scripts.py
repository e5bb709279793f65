"""Hypothesis strategies: random input scripts with random watermarks and reconfiguration schedules."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st


def _row(draw, t, jitter, schema):
    r = {"ts": t + draw(st.integers(-3, jitter))}  # negative offsets make some tuples late
    for name, kind in schema.items():
        if kind == "list":
            r[name] = draw(st.lists(st.integers(0, 7), max_size=6))
        elif kind == "int64":
            r[name] = draw(st.integers(-5, 5))
        elif kind == "sub":
            r[name] = draw(st.integers(0, 2))
        else:
            r[name] = float(draw(st.integers(-8, 8))) / 4
    return r


@st.composite
def scripts(draw, schemas=({"words": "list"},), n=3, n_buckets=16, reconf=True, max_steps=12, jitter=12):
    """A script for :func:`helpers.run_engine` / :func:`reference_run`: sources per stream, batches of
    rows, global watermark advances, and reconfigurations (provision/decommission/rebalance)."""
    script = []
    sources = []
    for stream, _ in enumerate(schemas):
        k = draw(st.integers(1, 2))
        ids = list(range(len(sources), len(sources) + k))
        script.append(("sources", ids, stream))
        sources += [(s, stream) for s in ids]
    t = 0
    for _ in range(draw(st.integers(1, max_steps))):
        for s, stream in sources:
            if draw(st.booleans()):
                rows = [_row(draw, t, jitter, schemas[stream]) for _ in range(draw(st.integers(1, 6)))]
                script.append(("add", s, rows))
        if reconf and draw(st.integers(0, 3)) == 0:
            script.append(("reconf", draw(reconfigurations(n, n_buckets))))
        t += draw(st.integers(0, 8))
        script.append(("wm", t))
    return script


@st.composite
def reconfigurations(draw, n, n_buckets):
    kind = draw(st.sampled_from(["m", "instances", "rebalance"]))
    if kind == "m":
        return {"m": draw(st.integers(1, n))}
    inst = sorted(draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n)))
    if kind == "instances":
        return {"instances": inst}
    om = np.array(draw(st.lists(st.sampled_from(inst), min_size=n_buckets, max_size=n_buckets)), np.int64)
    return {"instances": inst, "owner_map": om}
