"""Word count on a tweet stream with stretchAggregate, into a local Delta table, rescaled live.

Generates a tweet stream (parquet files in a local folder), runs a sliding-window word count with
``stretchAggregate`` into a local Delta table with a progress bar, rescales from 1 to 2 instances
while the query runs (no restart, no shuffle, no state moved), then prints the top words and the
time the rescale took.

Run it::

    python examples/wordcount_delta.py [--tweets 200000] [--out DIR] [--verbose]

``--verbose`` (or ``SPARK_STRETCH_VERBOSE=1``) shows Spark's start-up output and its WARN lines.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from pyspark.sql import functions as F
from tqdm import tqdm

import spark_stretch
from spark_stretch.testing import write_tweets

SCHEMA = "ts TIMESTAMP, words ARRAY<STRING>, user STRING, len BIGINT"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tweets", type=int, default=200_000)
    ap.add_argument("--files", type=int, default=10, help="input files = micro-batches")
    ap.add_argument("--out", help="working folder (default: a temporary one, removed after)")
    ap.add_argument("--verbose", action="store_true",
                    help="show Spark's start-up output (Ivy, log banner) and its WARN lines")
    args = ap.parse_args()
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="stretch-wordcount-"))
    src, table, ckpt = work / "tweets", work / "wordcount", work / "checkpoint"

    print(f"generating {args.tweets:,} tweets into {src} ...")
    write_tweets(src, args.tweets, files=args.files, rate=500.0, late_fraction=0.001)
    spark = spark_stretch.session(app_name="spark-stretch word count", verbose=args.verbose or None)
    try:
        counts = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(src))
                  .withWatermark("ts", "10 seconds")
                  .stretchAggregate(keys=F.col("words"), window=("120 seconds", "60 seconds"),
                                    agg="count", parallelism=1, max_parallelism=2))
        q = (counts.writeStream.format("delta").option("checkpointLocation", str(ckpt))
             .trigger(availableNow=True).start(str(table)))
        rescale = None
        with tqdm(total=args.files, unit="batch", desc="stretchAggregate") as bar:
            while q.isActive:
                done = q.metrics()["batches"]
                bar.update(done - bar.n)
                if rescale is None and done >= args.files // 3:
                    rescale = q.reconfigure(parallelism=2)   # online: the query keeps running
                time.sleep(0.1)
            q.awaitTermination()
            bar.update(q.metrics()["batches"] - bar.n)
        m = q.metrics()
        out = spark.read.format("delta").load(str(table))
        print(f"\n{out.count():,} window counts in {table}; top words over all windows:")
        out.groupBy("key").agg(F.sum("count").alias("count")).orderBy(F.desc("count")).show(10)
        if rescale:
            print(f"rescaled 1 -> 2 instances while running, after batch {rescale.get('after_batch', '?')}: "
                  f"epoch switch {rescale['switch_ms']:.2f} ms with {rescale['live_windows']:,} live "
                  "windows (no state moved)")
        print(f"batches: {m['batches']}, late rows dropped: {m['engine']['late_rows']}")
    finally:
        spark.stop()
        if not args.out:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
