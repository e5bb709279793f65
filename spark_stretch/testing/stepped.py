"""Keyed event streams whose rate steps, for elastic queries (tests, the demo, the benchmark).

An event is ``(ts, k, v)``: an event time, a long key (uniform over ``keys``, or Zipf-skewed
with exponent ``zipf``: key ``r - 1`` has the r-th largest share) and a double value. A stepped
stream is a file per micro-batch, each spanning ``span_s`` seconds of event time, with the
file's number of events as its rate: files of different sizes are the low and high steps of
STRETCH's Q5 (stretch-tpds §8.5) replayed by a file source, one file a trigger.
:func:`publish_steps` writes them live instead, each file when its time comes, its events' times
the wall-clock interval before it, so the event-time latency of the results is real.

Examples
--------
>>> from spark_stretch.testing.stepped import events_table, steps
>>> events_table(5, keys=10, seed=1).column_names
['ts', 'k', 'v']
>>> steps(low=100, high=1000, before=2, during=3, after=2)
[100, 100, 1000, 1000, 1000, 100, 100]
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .data import _event_times, _stamp

__all__ = ["EVENTS", "events_table", "event_source", "publish_steps", "steps", "write_steps"]

#: The schema of :func:`write_steps`'s files, as Spark reads them.
EVENTS = "ts TIMESTAMP, k BIGINT, v DOUBLE"


def events_table(n: int, *, start_s: float = 0.0, rate: float = 1000.0, keys: int = 100_000,
                 zipf: Optional[float] = None, jitter_s: float = 0.5, seed: int = 0) -> pa.Table:
    """``n`` events ``(ts, k, v)``, ``rate`` a second of event time from ``start_s``, keys
    uniform over ``range(keys)`` or, with ``zipf``, Zipf-distributed (truncated to ``keys``)."""
    rng = np.random.default_rng(seed)
    if zipf is None:
        k = rng.integers(0, keys, n)
    else:
        k = (rng.zipf(zipf, n) - 1) % keys
    return pa.table({"ts": _event_times(rng, n, start_s, rate, jitter_s, 0.0, 0.0),
                     "k": pa.array(k.astype(np.int64)),
                     "v": pa.array(np.round(rng.uniform(0, 100, n), 3))})


def steps(low: int, high: int, before: int, during: int, after: int) -> List[int]:
    """Events per file of a low -> high -> low stream."""
    return [low] * before + [high] * during + [low] * after


def write_steps(folder, sizes: Sequence[int], span_s: float = 10.0, first_file: int = 0,
                seed: int = 0, **kwargs) -> Path:
    """One Parquet file per entry of ``sizes`` (that many events, spanning ``span_s`` seconds
    of event time after the previous file's), named and stamped in order (a file source with
    ``maxFilesPerTrigger=1`` reads one a trigger). Returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for i, n in enumerate(sizes):
        f = first_file + i
        t = events_table(int(n), start_s=f * span_s, rate=max(n, 1) / span_s,
                         seed=seed * 100_003 + f, **kwargs)
        path = folder / f"events-{f:06d}.parquet"
        pq.write_table(t, path)
        _stamp(path)
    return folder


def publish_steps(folder, sizes: Sequence[int], interval_s: float, seed: int = 0,
                  stop: Optional[threading.Event] = None, **kwargs) -> threading.Thread:
    """A live stepped stream: file ``i`` (``sizes[i]`` events, their times spread over the
    ``interval_s`` seconds of wall-clock time before it) is written ``i * interval_s`` seconds
    after the call (``stop`` ends it early). Returns the writing thread, started; its
    ``published`` lists ``(file, wall-clock time)``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stop = stop or threading.Event()

    def run():
        t0 = time.time()
        for i, n in enumerate(sizes):
            due = t0 + (i + 1) * interval_s
            if stop.wait(max(0.0, due - time.time())):
                return
            now = time.time()
            t = events_table(int(n), start_s=now - interval_s, rate=max(n, 1) / interval_s,
                             jitter_s=0.0, seed=seed * 100_003 + i, **kwargs)
            path = folder / f"events-{i:06d}.parquet"
            tmp = folder / f".events-{i:06d}.parquet.tmp"
            pq.write_table(t, tmp)
            _stamp(tmp)
            tmp.rename(path)
            thread.published.append((path.name, now))

    thread = threading.Thread(target=run, name="stretch-publish-steps", daemon=True)
    thread.published = []
    thread.start()
    return thread


def event_source(spark, src, delay: str = "1 second", files_per_batch: int = 1):
    """The event files in ``src`` as a stream, ``files_per_batch`` a micro-batch, with a
    watermark of ``delay`` on ``ts``."""
    return (spark.readStream.schema(EVENTS).option("maxFilesPerTrigger", files_per_batch)
            .parquet(str(src)).withWatermark("ts", delay))
