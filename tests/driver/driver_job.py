"""Run by test_recovery.py in its own process (the driver the test kills with -9 mid-run):
stretchAggregate over SRC into the Delta table OUT with checkpoint CKPT, availableNow."""

import sys
from pathlib import Path

from pyspark.sql import functions as F

import spark_stretch
from spark_stretch.testing import tweet_source as source

src, out, ckpt = sys.argv[1:4]
spark = spark_stretch.session(app_name="stretch driver kill test")
spark.sparkContext.setLogLevel("OFF")
agg = source(spark, Path(src)).stretchAggregate(
    keys=F.col("words"), window=("60 seconds", "30 seconds"), parallelism=2, max_parallelism=2)
q = (agg.writeStream.format("delta").option("checkpointLocation", ckpt)
     .trigger(availableNow=True).start(out))
q.awaitTermination()
spark.stop()
