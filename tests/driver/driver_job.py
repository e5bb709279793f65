"""Run by test_recovery.py in its own process (the driver the test kills with -9 mid-run):
stretchAggregate (or, with a fourth argument ``stretch``, ``stretch(df)`` of the same native
word count) over SRC into the Delta table OUT with checkpoint CKPT, availableNow."""

import sys
from pathlib import Path

from pyspark.sql import functions as F

import spark_stretch
from spark_stretch.testing import tweet_source as source

src, out, ckpt = sys.argv[1:4]
spelling = sys.argv[4] if len(sys.argv) > 4 else "stretchAggregate"
spark = spark_stretch.session(app_name="stretch driver kill test")
spark.sparkContext.setLogLevel("OFF")
if spelling == "stretch":
    agg = spark_stretch.stretch(
        source(spark, Path(src)).select(F.explode("words").alias("word"), "ts")
        .groupBy(F.window("ts", "60 seconds", "30 seconds"), "word").count(),
        parallelism=2, max_parallelism=2)
else:
    agg = source(spark, Path(src)).stretchAggregate(
        keys=F.col("words"), window=("60 seconds", "30 seconds"), parallelism=2,
        max_parallelism=2)
q = (agg.writeStream.format("delta").option("checkpointLocation", ckpt)
     .trigger(availableNow=True).start(out))
q.awaitTermination()
spark.stop()
