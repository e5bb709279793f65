"""Synthetic tweets for tests and benchmarks: Zipf-distributed word ids, 8-20 words per tweet,
timestamps increasing at a configurable rate (tooling; not part of the installed package).

Example
-------
>>> from datagen import tweets
>>> t = tweets(1000, rate=100.0, seed=1)
>>> len(t["ts"]), int(t["offsets"][-1]) == len(t["words"])
(1000, True)
"""
from __future__ import annotations

import numpy as np


def tweets(n, rate=1000.0, vocab=50_000, zipf_a=1.2, min_words=8, max_words=20, seed=0, ts_unit=1000):
    """``n`` tweets as columns: ``ts`` (int64, sorted; ``rate`` tweets per second in units of
    ``1/ts_unit`` s), ``offsets`` (int64, n + 1) and ``words`` (int64 word ids in [0, vocab), Zipf)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(min_words, max_words + 1, n)
    offsets = np.zeros(n + 1, np.int64)
    offsets[1:] = np.cumsum(lens)
    words = rng.zipf(zipf_a, int(offsets[-1]))
    words = ((words - 1) % vocab).astype(np.int64)
    gaps = rng.exponential(ts_unit / rate, n)
    ts = np.cumsum(gaps).astype(np.int64)
    return {"ts": ts, "offsets": offsets, "words": words}


def batches(tw, size):
    """Split tweets into consecutive batches of ``size`` (views)."""
    n = len(tw["ts"])
    for a in range(0, n, size):
        b = min(n, a + size)
        off = tw["offsets"][a:b + 1]
        yield {"ts": tw["ts"][a:b], "offsets": off - off[0], "words": tw["words"][off[0]:off[-1]]}
