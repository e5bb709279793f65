"""Run by test_cluster.py in its own process: the shim on local-cluster[2,1,1024]."""

import json
import sys

import pyarrow as pa
from chispa import assert_df_equality
from pyspark.sql import functions as F

import spark_stretch

spark = spark_stretch.session(master="local-cluster[2,1,1024]", app_name="stretch cluster test",
                              conf={"spark.driver.memory": "1g"})
spark.sparkContext.setLogLevel("ERROR")
result = {}
try:
    with spark_stretch.Receiver() as r:
        df = spark.range(0, 200_000, 1, 8).select(
            "id", F.expr("cast(id % 13 as string)").alias("w"), F.expr("timestamp_seconds(id)").alias("ts"))
        df.write.format("stretch").mode("append").options(**r.options("in")).save()
        got = r.take("in")
        assert_df_equality(df, spark.createDataFrame(got), ignore_row_order=True, ignore_nullable=True)
        result["writer_pids"] = sorted(r.writer_pids)
        r.offer("out", got)
        back = spark.read.format("stretch").options(**r.options("out")).load()
        assert_df_equality(df, back, ignore_row_order=True, ignore_nullable=True)
        result["executors"] = spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1
        result["ok"] = True
finally:
    spark.stop()
print("RESULT " + json.dumps(result))
sys.exit(0 if result.get("ok") else 1)
