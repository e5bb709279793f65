"""The engine's window tables alone: time, grows and load while 5M keys' windows fill them.

    python python/bench/table_load.py [--keys 5000000] [--events 15000000] [--batches 10]

One engine, one instance, 4,096 buckets, ``count`` over a 1-hour tumbling window (the shape of
``aggstate.py``'s query, without Spark, Arrow or Delta): ``--events`` events of keys drawn
uniformly from ``--keys`` random ids, event time rising through one hour so that every window
stays live, applied in ``--batches`` batches of 262,144-row slices as the host applies a
batch's slices. Reports the whole time, the time spent growing the tables (``BucketState.grow``
timed), the number of grows, the final slots per bucket and the load (live windows over
slots). Checks the live windows against the distinct keys drawn (numpy's ``unique``), and
every window's count against numpy's counts of the keys.

Run it on two checkouts (``PYTHONPATH=<checkout>``) to compare growth policies side by side.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from spark_stretch.engine import Engine
from spark_stretch.engine.state import BucketState
from spark_stretch.ops import count

HOUR = 3_600_000_000
SLICE = 1 << 18


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=5_000_000)
    p.add_argument("--events", type=int, default=15_000_000)
    p.add_argument("--batches", type=int, default=10)
    a = p.parse_args()
    rng = np.random.default_rng(1)
    ids = rng.integers(0, a.keys * 4, a.keys)
    keys = ids[rng.integers(0, a.keys, a.events)]
    ts = np.sort(rng.integers(0, HOUR - 1, a.events))

    grow, spent = BucketState.grow, [0.0]

    def timed_grow(self, cap=None):
        t = time.perf_counter()
        try:
            return grow(self, cap)
        finally:
            spent[0] += time.perf_counter() - t

    BucketState.grow = timed_grow
    eng = Engine(count(key="k", WS=HOUR, WA=HOUR), m=1, n=1, n_buckets=4096)
    eng.esg_in.add_sources([0], ordered=False)
    t0 = time.perf_counter()
    per = a.events // a.batches
    for b in range(a.batches):
        end = (b + 1) * per if b < a.batches - 1 else a.events  # (the last takes the rest)
        for lo in range(b * per, end, SLICE):
            hi = min(lo + SLICE, end)
            eng.esg_in.add({"ts": ts[lo:hi], "k": keys[lo:hi]}, 0)
            eng.esg_in.advance_watermark(int(ts[hi - 1]))
            eng.drain()
    took = time.perf_counter() - t0
    st = eng.state
    live, cap, grows = st.live_windows(), st.cap, eng.metrics()["grows"]
    eng.esg_in.advance_watermark(2 * HOUR)  # (every window closes: its count, checked)
    eng.drain()
    out, _ = eng.esg_out.get_batch("driver")
    want_k, want_n = np.unique(keys, return_counts=True)
    order = np.argsort(out["key"])
    equal = (live == len(want_k) and np.array_equal(out["key"][order], want_k)
             and np.array_equal(out["count"][order], want_n))
    eng.close()
    print(f"took {took:.2f} s, grows {grows} taking {spent[0]:.2f} s, {cap} slots a bucket, "
          f"{live:,} live windows, load {live / (4096 * cap):.3f}, equal: {equal}")
    if not equal:
        raise SystemExit("the tables' windows are not the keys' counts")


if __name__ == "__main__":
    main()
