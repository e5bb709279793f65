"""Compile the engine's kernels on this machine before a query needs them.

The engine's hot loops are numba kernels, compiled on their first use and cached on disk
(``__pycache__`` next to the package, or numba's cache directory where that is read-only). A
fresh install therefore compiles them in the first batch of the first query of each kind: 10-50
seconds of that batch, once per machine. :func:`warm` runs a few small queries through
``stretch(df)`` on a local Spark session (windowed count, sum and max by a bigint key; a count
by a string key in update mode; a session window; a distinct count; a restart from a
checkpoint) and one through ``stretchAggregate`` (a count by every word of an array column), so
that the kernels those paths use are compiled and cached before a real query runs. ``make
setup`` runs it; run it on each executor host of a cluster after installing (for
example in the image's build), as the same user and Python as the executors.

Run it::

    python -m spark_stretch warm

Examples
--------
>>> import spark_stretch
>>> from spark_stretch.api.warm import warm
>>> spark = spark_stretch.session()     # doctest: +SKIP
>>> round(warm(spark)) >= 0             # doctest: +SKIP
True
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

__all__ = ["warm"]

_SCHEMA = "ts TIMESTAMP, user BIGINT, word STRING, x BIGINT"
_ROWS = 2000  # (per file: enough for a grow of the state tables, a few windows closed)


def _write(src: Path, part: int) -> None:
    rng = np.random.default_rng(part)
    ts = (np.arange(part * _ROWS, (part + 1) * _ROWS) * 20_000).astype(np.int64)  # 50 rows/s
    pq.write_table(pa.table({
        "ts": pa.array(ts, pa.timestamp("us", tz="UTC")),
        "user": pa.array(rng.integers(0, 500, _ROWS), pa.int64()),
        # (more distinct words than a string table's first size: its growth is compiled too)
        "word": pa.array([f"w{i}" for i in rng.integers(0, 4000, _ROWS)]),
        "x": pa.array(rng.integers(-100, 100, _ROWS), pa.int64()),
    }), src / f"part-{part:03d}.parquet")


def _queries(df):
    """The query kinds whose kernels are compiled: (name, aggregated DataFrame or a
    ``stretchAggregate``, output mode)."""
    return [
        ("window count, sum, max by a bigint key",
         df.groupBy(F.window("ts", "10 seconds"), "user")
         .agg(F.count("*").alias("n"), F.sum("x").alias("s"), F.max("x").alias("m")), "append"),
        ("sliding window count by a string key, update mode",
         df.groupBy(F.window("ts", "10 seconds", "5 seconds"), "word").count(), "update"),
        ("session window", df.groupBy(F.session_window("ts", "5 seconds"), "user").count(),
         "append"),
        ("distinct count", df.groupBy(F.window("ts", "10 seconds"))
         .agg(F.approx_count_distinct("user").alias("d")), "append"),
        ("count by every word of an array column (stretchAggregate)",
         df.withColumn("words", F.array("word", F.concat(F.lit("u"), F.col("user").cast("string"))))
         .stretchAggregate(keys="words", window="10 seconds", parallelism=2, max_parallelism=2),
         "append"),
    ]


def warm(spark: SparkSession, work: str | Path | None = None) -> float:
    """Run small queries through ``stretch(df)`` so that the engine's kernels are compiled and
    cached on this machine; returns the seconds it took.

    Parameters
    ----------
    spark : SparkSession
        A session set up for spark-stretch (:func:`spark_stretch.session`, or a builder given
        :func:`spark_stretch.configure_spark_with_stretch`).
    work : str or Path, optional
        A folder for the queries' input, output and checkpoints (default: a temporary one,
        removed after).

    Notes
    -----
    What is compiled depends on this machine's CPU and numba's version, so the cache is made
    where it is used: on each host that runs an engine. A kernel whose inputs have other types
    than these queries' still compiles on its first use. Each query's output is checked to have
    rows, so a warm-up that ran nothing fails instead of passing silently.
    """
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="stretch-warm-", dir=work) as d:
        src = Path(d) / "in"
        src.mkdir()
        for part in range(2):
            _write(src, part)
        df = (spark.readStream.schema(_SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(src))
              .withWatermark("ts", "5 seconds"))
        for i, (name, agg, mode) in enumerate(_queries(df)):
            _run(spark, name, agg, mode, Path(d), i)
            if i == 0:  # (the first again, on a new file: restored from its checkpoint)
                _write(src, 2)
                _run(spark, name, agg, mode, Path(d), i)
    _hash_keys()
    return time.perf_counter() - t0


def _hash_keys() -> None:
    """The kernels an engine on several hosts runs besides these queries' (Spark's xxhash64 of
    each key, for its key group: ``host/share.py``, ``host/grouped_state.py``), run here, in
    this process, and kept with the engines' signatures for the kernels' library: the queries
    above run on one host, where no key is hashed."""
    from ..engine import hashing, jit

    words, longs = pa.array(["a", "bb"]), pa.array([1, 2], pa.int64())
    hashing.xxhash64(words)
    hashing.xxhash64(pa.array(["a", "bb"], pa.large_string()))
    hashing.xxhash64(longs)
    hashing.spark_xxhash64([words, longs, pa.array([1, 2], pa.int32())])
    jit.record_signatures()


def _run(spark: SparkSession, name: str, agg, mode: str, work: Path, i: int) -> None:
    """Query ``i`` through ``stretch(df)`` until its input is read, into Delta under ``work``
    (which a restart continues), or in update mode into the memory sink; fails if it gave no
    rows."""
    from .native_spelling import stretch

    if isinstance(agg, DataFrame):  # (a native aggregation: else stretchAggregate's already)
        agg = stretch(agg, parallelism=2, max_parallelism=2)
    w = (agg.writeStream.outputMode(mode)
         .option("checkpointLocation", str(work / f"checkpoint-{i}"))
         .trigger(availableNow=True))
    view, out = f"stretch_warm_{i}", work / f"out-{i}"
    memory = mode == "update"
    q = w.format("memory").queryName(view).start() if memory else w.format("delta").start(str(out))
    try:
        q.awaitTermination()
    finally:
        q.stop()
    n = (spark.table(view) if memory else spark.read.format("delta").load(str(out))).count()
    if memory:
        spark.catalog.dropTempView(view)
    if not n:
        raise RuntimeError(f"the warm-up query '{name}' gave no rows")
