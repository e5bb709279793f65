"""Run the same file stream through native Spark and through stretchAggregate (test helper)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pyspark.sql import DataFrame, functions as F

TWEETS = "ts TIMESTAMP, words ARRAY<STRING>, user STRING, len BIGINT"


def source(spark, src: Path, delay: str = "10 seconds", files_per_batch: int = 1) -> DataFrame:
    return (spark.readStream.schema(TWEETS).option("maxFilesPerTrigger", files_per_batch)
            .parquet(str(src)).withWatermark("ts", delay))


def run_native(spark, agg, out: Path) -> DataFrame:
    """The native equivalent of a StretchAggregation, append mode into Delta, availableNow."""
    q = (agg.native().writeStream.format("delta").outputMode("append")
         .option("checkpointLocation", str(out) + "-ckpt").trigger(availableNow=True).start(str(out)))
    q.awaitTermination()
    return spark.read.format("delta").load(str(out))


def run_stretch(spark, agg, out: Path, checkpoint=None, **trigger) -> DataFrame:
    q = (agg.writeStream.format("delta")
         .option("checkpointLocation", str(checkpoint or str(out) + "-ckpt"))
         .trigger(**(trigger or {"availableNow": True})).start(str(out)))
    q.awaitTermination()
    return spark.read.format("delta").load(str(out))


def sorted_rows(df: DataFrame):
    return sorted(tuple(r) for r in df.select("window.start", "window.end", "key",
                                              *[c for c in df.columns if c not in ("window", "key")]
                                              ).collect())


def key_str(df: DataFrame) -> DataFrame:
    """Pair keys (structs) as strings, for comparisons that sort rows."""
    if dict(df.dtypes)["key"].startswith("struct"):
        return df.withColumn("key", F.concat_ws(" ", "key._1", "key._2"))
    return df


def run_job(script: str, *args) -> dict:
    """Run ``script`` (next to this file) in its own Python process; return its ``RESULT`` json."""
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name(script)), *map(str, args)],
                          capture_output=True, text=True, timeout=600, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])
