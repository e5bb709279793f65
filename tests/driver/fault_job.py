"""Run by test_recovery.py in its own process: Spark task failures injected in the ingest write
and in the output read, on local[2,3] so that Spark retries the failed tasks."""

import json
import os
import sys
import tempfile
from pathlib import Path

from pyspark.sql import functions as F

import spark_stretch
from spark_stretch.host.faults import ENV
from spark_stretch.testing import run_native, write_tweets
from spark_stretch.testing import tweet_source as source

tmp = Path(tempfile.mkdtemp(prefix="fault-job-"))
# Batch 1's first ingest write and batch 3's first output read fail (once each).
os.environ[ENV] = f"fail@write:1:{tmp / 'write'},fail@read:3:{tmp / 'read'}"
spark = spark_stretch.session(master="local[2,3]", app_name="stretch fault test",
                              # the output read is a Spark job only when Spark writes the output
                              # and the ingest one when the executors write the batch
                              conf={"spark.stretch.delta.directWrite": "false",
                                    "spark.stretch.ingest.files": "false"})
spark.sparkContext.setLogLevel("OFF")
result = {}
try:
    src = write_tweets(tmp / "src", 1500, files=5, rate=10.0, vocab=80, late_fraction=0.03,
                       jitter_s=5.0, seed=31)

    def agg():
        return source(spark, src).stretchAggregate(keys=F.col("words"),
                                                   window=("60 seconds", "30 seconds"))

    q_out = tmp / "s"
    q = (agg().writeStream.format("delta").option("checkpointLocation", str(tmp / "c"))
         .trigger(availableNow=True).start(str(q_out)))
    q.awaitTermination()
    got = spark.read.format("delta").load(str(q_out))
    want = run_native(spark, agg(), tmp / "n")
    diff = got.exceptAll(want).count() + want.exceptAll(got).count()
    assert diff == 0 and want.count() > 0, f"{diff} rows differ from native"
    result = {"fired": sorted(p for p in ("read", "write") if (tmp / p).exists()),
              "engine_restarts": len(q.metrics().get("engine_restarts", [])),
              "ok": True}
finally:
    spark.stop()
    __import__("shutil").rmtree(tmp, ignore_errors=True)
print("RESULT " + json.dumps(result))
sys.exit(0 if result.get("ok") else 1)
