"""Synthetic tweet and point streams for demos, tests and benchmarks (shipped, like bytewax's testing module).

Tweets have an event time ``ts`` and ``words``: 8-20 Zipf-distributed words from a fixed
vocabulary, stored as a list column. Event times grow at ``rate`` tweets per second with a little
disorder (``jitter_s``), and a fraction of tweets can be made late on purpose.

Examples
--------
>>> from spark_stretch.testing import tweets_table
>>> t = tweets_table(100, seed=1)
>>> t.column_names, t.num_rows
(['ts', 'words', 'user', 'len'], 100)
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["points_table", "publish", "tweets_table", "write_points", "write_tweets"]

_VOCAB_CACHE = {}


def _vocab(size: int) -> pa.Array:
    if size not in _VOCAB_CACHE:
        _VOCAB_CACHE[size] = pa.array([f"w{i}" for i in range(size)], pa.string())
    return _VOCAB_CACHE[size]


def tweets_table(n: int, *, start_s: float = 0.0, rate: float = 1000.0, vocab: int = 20_000,
                 zipf_a: float = 1.3, min_words: int = 8, max_words: int = 20,
                 jitter_s: float = 2.0, late_fraction: float = 0.0, late_by_s: float = 300.0,
                 users: int = 1000, seed: int = 0) -> pa.Table:
    """``n`` tweets as a pyarrow Table: ``ts`` (timestamp us, UTC), ``words`` (list<string>),
    ``user`` (string) and ``len`` (int64, number of words).

    Parameters
    ----------
    start_s, rate : float
        Event time of the first tweet (seconds) and tweets per second of event time.
    jitter_s : float
        Uniform disorder added to event times (out-of-order but mostly on time).
    late_fraction, late_by_s : float
        This fraction of tweets is moved ``late_by_s`` seconds into the past (late data).
    """
    rng = np.random.default_rng(seed)
    lens = rng.integers(min_words, max_words + 1, n)
    offsets = np.zeros(n + 1, np.int32)
    offsets[1:] = np.cumsum(lens)
    ids = (rng.zipf(zipf_a, int(offsets[-1])) - 1) % vocab
    words = pa.ListArray.from_arrays(pa.array(offsets), _vocab(vocab).take(pa.array(ids)))
    ts = _event_times(rng, n, start_s, rate, jitter_s, late_fraction, late_by_s)
    user = pa.array([f"u{u}" for u in range(users)], pa.string()).take(
        pa.array(rng.integers(0, users, n)))
    return pa.table({"ts": ts, "words": words, "user": user, "len": pa.array(lens, pa.int64())})


def _event_times(rng, n, start_s, rate, jitter_s, late_fraction, late_by_s) -> pa.Array:
    """``n`` event times ``rate`` a second from ``start_s``, with ``jitter_s`` disorder and
    ``late_fraction`` of them ``late_by_s`` seconds late (never before 0)."""
    ts_s = start_s + np.arange(n) / rate + rng.uniform(0, jitter_s, n)
    if late_fraction > 0:
        ts_s[rng.random(n) < late_fraction] -= late_by_s
    return pa.array((np.maximum(ts_s, 0) * 1e6).astype(np.int64)).cast(pa.timestamp("us", tz="UTC"))


def write_tweets(folder, n: int, files: int = 1, first_file: int = 0, seed: Optional[int] = None,
                 **kwargs) -> Path:
    """Write ``n`` tweets as ``files`` parquet files (consecutive event times) into ``folder``.

    File names and modification times both grow with event time, so a file source with
    ``maxFilesPerTrigger`` (which takes new files in modification-time order) replays the stream
    batch by batch, in order. Returns the folder.
    """
    return _write_files(folder, n, files, first_file, seed, tweets_table, "tweets",
                        kwargs.pop("rate", 1000.0), kwargs)


def points_table(n: int, *, columns=("x", "y"), integer: bool = False, start_s: float = 0.0,
                 rate: float = 100.0, span: float = 200.0, late_fraction: float = 0.0,
                 late_by_s: float = 60.0, jitter_s: float = 0.0, seed: int = 0) -> pa.Table:
    """``n`` points ``(ts, *columns)`` uniform in ``[0, span)`` (bigint with ``integer``, else
    double), ``rate`` a second in event time: the input of a band join (ScaleJoin's ``x, y``).

    Examples
    --------
    >>> points_table(3, columns=("a", "b"), integer=True).column_names
    ['ts', 'a', 'b']
    """
    rng = np.random.default_rng(seed)
    out = {"ts": _event_times(rng, n, start_s, rate, jitter_s, late_fraction, late_by_s)}
    for c in columns:
        v = rng.uniform(0, span, n)
        out[c] = pa.array(np.floor(v).astype(np.int64) if integer else np.round(v, 3))
    return pa.table(out)


def write_points(folder, n: int, files: int = 1, first_file: int = 0, seed: Optional[int] = None,
                 **kwargs) -> Path:
    """Write ``n`` :func:`points_table` points as ``files`` parquet files, like :func:`write_tweets`."""
    return _write_files(folder, n, files, first_file, seed, points_table, "points",
                        kwargs.pop("rate", 100.0), kwargs)


def _write_files(folder, n, files, first_file, seed, make, prefix, rate, kwargs) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    per = -(-n // files)
    start_s = kwargs.pop("start_s", 0.0)
    for i in range(files):
        k = min(per, n - i * per)
        if k <= 0:
            break
        f = first_file + i
        t = make(k, start_s=start_s + f * per / rate, rate=rate,
                 seed=(f if seed is None else seed * 100_003 + f), **kwargs)
        pq.write_table(t, folder / f"{prefix}-{f:06d}.parquet")
        _stamp(folder / f"{prefix}-{f:06d}.parquet")
    return folder


def publish(file, folder) -> Path:
    """Copy ``file`` into the streamed ``folder`` atomically (a hidden copy, then a rename), with a
    modification time after every file published or written here before.

    Spark's file source takes new files in modification-time order; files copied within the same
    millisecond would be taken in directory-listing order, which is arbitrary.

    Examples
    --------
    >>> import tempfile
    >>> from spark_stretch.testing import publish, write_tweets
    >>> d = tempfile.TemporaryDirectory(); tmp = Path(d.name)
    >>> src = write_tweets(tmp / "src", 100, files=2)
    >>> live = tmp / "live"; live.mkdir()
    >>> [publish(f, live).name for f in sorted(src.glob("*.parquet"))]
    ['tweets-000000.parquet', 'tweets-000001.parquet']
    >>> d.cleanup()
    """
    file, folder = Path(file), Path(folder)
    tmp = folder / f".{file.name}.tmp"
    shutil.copyfile(file, tmp)
    _stamp(tmp)
    os.replace(tmp, folder / file.name)
    return folder / file.name


_last_mtime_ns = 0


def _stamp(path: Path) -> None:
    """Set ``path``'s modification time 10 ms after the last one set (or to now, if later)."""
    global _last_mtime_ns
    t = max(time.time_ns(), _last_mtime_ns + 10_000_000)
    os.utime(path, ns=(t, t))
    _last_mtime_ns = t
