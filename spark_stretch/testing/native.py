"""Run a stretch query and its native Spark equivalent on the same stream, and compare them.

The oracle of spark-stretch's own tests, shipped so that a user can hold their query to native
Spark the same way (in the spirit of ``bytewax.testing``): every stretch result kind has
``.native()``, the native query with the same rows.

Examples
--------
>>> from spark_stretch.testing import TWEETS, run_native, run_stretch, tweet_source, write_tweets
>>> src = write_tweets(tmp / "src", 2000, files=4)                         # doctest: +SKIP
>>> agg = tweet_source(spark, src).stretchAggregate(keys="words", window="60 seconds")  # doctest: +SKIP
>>> got = run_stretch(spark, agg, tmp / "out")                             # doctest: +SKIP
>>> sorted_rows(got) == sorted_rows(run_native(spark, agg, tmp / "native"))  # doctest: +SKIP
True
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pyspark.sql import DataFrame, functions as F

__all__ = ["TWEETS", "tweet_source", "run_native", "run_stretch", "sorted_rows", "key_str",
           "run_script", "assert_same_rows"]

#: The schema of :func:`spark_stretch.testing.write_tweets`'s files, as Spark reads them.
TWEETS = "ts TIMESTAMP, words ARRAY<STRING>, user STRING, len BIGINT"


def tweet_source(spark, src: Path, delay: str = "10 seconds",
                 files_per_batch: int = 1) -> DataFrame:
    """The tweet files in ``src`` as a stream, ``files_per_batch`` files a micro-batch, with a
    watermark of ``delay`` on ``ts``."""
    return (spark.readStream.schema(TWEETS).option("maxFilesPerTrigger", files_per_batch)
            .parquet(str(src)).withWatermark("ts", delay))


def run_native(spark, agg, out: Path) -> DataFrame:
    """The native equivalent of a stretch result (``agg.native()``), append mode into Delta at
    ``out``, run ``availableNow``; the table."""
    q = (agg.native().writeStream.format("delta").outputMode("append")
         .option("checkpointLocation", str(out) + "-ckpt").trigger(availableNow=True)
         .start(str(out)))
    q.awaitTermination()
    return spark.read.format("delta").load(str(out))


def run_stretch(spark, agg, out: Path, checkpoint=None, **trigger) -> DataFrame:
    """A stretch result into Delta at ``out`` (``availableNow`` unless a trigger is given);
    the table."""
    q = (agg.writeStream.format("delta")
         .option("checkpointLocation", str(checkpoint or str(out) + "-ckpt"))
         .trigger(**(trigger or {"availableNow": True})).start(str(out)))
    q.awaitTermination()
    return spark.read.format("delta").load(str(out))


def assert_same_rows(got: DataFrame, want: DataFrame) -> None:
    """Fail unless ``got`` and ``want`` hold the same rows, duplicates counted (``exceptAll``
    both ways), naming a few rows extra and missing."""
    extra, missing = got.exceptAll(want), want.exceptAll(got)
    assert extra.isEmpty() and missing.isEmpty(), (
        f"{got.count()} rows, {want.count()} expected; extra: {extra.limit(5).collect()}, "
        f"missing: {missing.limit(5).collect()}")


def sorted_rows(df: DataFrame):
    """A window aggregation's rows, sorted: ``(window start, window end, key, *values)``."""
    return sorted(tuple(r) for r in df.select("window.start", "window.end", "key",
                                              *[c for c in df.columns if c not in ("window", "key")]
                                              ).collect())


def key_str(df: DataFrame) -> DataFrame:
    """Pair keys (structs) as strings, for comparisons that sort rows."""
    if dict(df.dtypes)["key"].startswith("struct"):
        return df.withColumn("key", F.concat_ws(" ", "key._1", "key._2"))
    return df


def run_script(script, *args, timeout: float = 600) -> dict:
    """Run a Python ``script`` in its own process (with this interpreter and Spark's local
    settings); the JSON of its last ``RESULT <json>`` line. It fails with the script's output
    if the script fails or prints no result."""
    env = dict(os.environ, SPARK_LOCAL_IP=os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"),
               PYSPARK_PYTHON=sys.executable)
    proc = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"{script} failed (exit {proc.returncode}):\n"
                             + proc.stdout[-3000:] + proc.stderr[-3000:])
    return json.loads(lines[-1][len("RESULT "):])
