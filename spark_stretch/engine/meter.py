"""What an engine's instances did since they were last asked: busy time and keys per bucket.

The figures an elastic controller reads (``spark_stretch.driver.elastic``): how long each
instance thread ran its kernel (its *busy* time, two ``perf_counter`` calls per instance and
segment), how many tuples the engine processed, and the load of each bucket: the keys of the
processed tuples that fall in it (a tuple with many keys counts once per key, as every key is
an update of the instance that owns its bucket). An instance's load is the sum over the
buckets it owns, so a rebalance can be computed from the buckets' loads alone.

Keys are counted for built-in operators (their keys are the kernel's own ``f_MK``, recomputed
by one jitted pass) on at most :data:`SAMPLE` tuples of a segment, evenly spaced, each
weighted by the stride: exact for segments up to that size, an estimate (a fraction of a per
cent per instance) above it, for a cost of a few milliseconds. An operator with user
functions reports busy times only.

Examples
--------
>>> import numpy as np
>>> from spark_stretch.engine import Engine, ListColumn
>>> from spark_stretch.ops import wordcount
>>> eng = Engine(wordcount(WS=10), m=2, n=2, n_buckets=8)
>>> eng.esg_in.add_sources([0], ordered=False)
True
>>> words = ListColumn([0, 2, 3], np.array(["a", "b", "a"], object))
>>> eng.esg_in.add({"ts": np.array([1, 2]), "words": words}, 0)
>>> eng.esg_in.advance_watermark(10); eng.drain()
>>> got = eng.meter.take()
>>> got["tuples"], int(got["bucket_load"].sum()), len(got["busy_s"])
(2, 3, 2)
>>> eng.meter.take()["tuples"]        # (reset by take)
0
"""

from __future__ import annotations

import threading
import time

import numpy as np
from .jit import njit

from .batch import frozen
from .buckets import bucket_of
from .kernels import _mk_builtin_keys

__all__ = ["Meter", "SAMPLE", "state_bytes"]

#: Tuples of a segment whose keys are counted (evenly spaced); more are estimated.
SAMPLE = 1 << 15


@njit(nogil=True, cache=True)
def _count_keys(stream, row, off0, val0, off1, val1, ip, nb, start, stride, keybuf, load):
    """Add ``stride`` to the bucket of each key of tuples ``start, start + stride, ...``;
    returns -1 when done, or the index of a tuple whose keys do not fit ``keybuf`` (its size
    needed is in ``keybuf[0]`` then)."""
    n = stream.shape[0]
    for i in range(start, n, stride):
        ri = row[i]
        if stream[i] == 0:
            nk = _mk_builtin_keys(off0[ri], off0[ri + 1], val0, keybuf, ip[0], ip[1])
        else:
            nk = _mk_builtin_keys(off1[ri], off1[ri + 1], val1, keybuf, ip[4], ip[5])
        if nk > keybuf.shape[0]:
            keybuf[0] = nk
            return i
        for k in range(nk):
            load[bucket_of(keybuf[k], nb)] += stride
    return -1


class Meter:
    """Busy seconds per instance, tuples processed and keys per bucket, since the last
    :meth:`take`. Each instance thread adds to its own slot only."""

    def __init__(self, n: int, n_buckets: int):
        self._lock = threading.Lock()
        self.busy = np.zeros(n, np.float64)
        self.load = np.zeros(n_buckets, np.int64)
        self.tuples = 0
        self._keybuf = np.empty(256, np.int64)

    def timed(self, j: int, fn, *args):
        """``fn(*args)`` (instance ``j``'s kernel run), its wall time added to ``j``'s busy time."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.busy[j] += time.perf_counter() - t0

    def segment(self, op, seg, cols, ip) -> None:
        """Count a segment about to be processed: its tuples and, for a built-in operator, the
        keys of (a sample of) them per bucket."""
        n = len(seg)
        self.tuples += n
        if getattr(op, "builtin_ip", None) is None or n == 0:  # (a join: no built-in keys)
            return
        (off0, val0), (off1, val1) = frozen(tuple(cols[0][:2])), frozen(tuple(cols[1][:2]))
        stride = max(1, -(-n // SAMPLE))
        start = 0
        while start >= 0:
            start = _count_keys(seg.stream, seg.row, off0, val0, off1, val1, ip,
                                self.load.shape[0], start, stride, self._keybuf, self.load)
            if start >= 0:
                self._keybuf = np.empty(2 * int(self._keybuf[0]), np.int64)

    def take(self) -> dict:
        """The figures since the last call (``busy_s`` per instance, ``tuples``,
        ``bucket_load`` per bucket), and zero them."""
        with self._lock:
            out = {"busy_s": self.busy.tolist(), "tuples": int(self.tuples),
                   "bucket_load": self.load.copy()}
            self.busy[:] = 0.0
            self.load[:] = 0
            self.tuples = 0
            return out


def state_bytes(eng, where="memory") -> int:
    """Bytes of an engine's state tables (allocated, empty slots included): those it holds in
    memory, or (``where="disk"``) those in files past its memory budget (:mod:`.spill`)."""
    total = 0
    for st in eng._states():
        if hasattr(st, "memory"):
            total += int(st.memory()[where])
        elif hasattr(st, "arrays") and where == "memory":
            total += sum(int(a.nbytes) for a in st.arrays().values())
    return total
