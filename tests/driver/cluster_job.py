"""Run by test_cluster.py in its own process: the shim on local-cluster[2,1,1024]."""

import json
import sys

from chispa import assert_df_equality
from pyspark.sql import functions as F

import spark_stretch

spark = spark_stretch.session(master="local-cluster[2,1,1024]", app_name="stretch cluster test",
                              conf={"spark.driver.memory": "1g",
                                    # One partition per file, so every micro-batch of two files has
                                    # two tasks and each executor JVM (one core each) runs one.
                                    "spark.sql.files.openCostInBytes": str(1 << 30),
                                    # the executors write each batch to the engine (the shim's
                                    # path), instead of the engine reading the files itself
                                    "spark.stretch.ingest.files": "false"})
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

    # stretchAggregate with both executor JVMs feeding the one host engine, against native Spark.
    import tempfile
    from pathlib import Path

    from spark_stretch.testing import run_native, write_tweets
    from spark_stretch.testing import tweet_source as source

    tmp = Path(tempfile.mkdtemp(prefix="cluster-job-"))
    src = write_tweets(tmp / "src", 4000, files=4, rate=20.0, vocab=200, late_fraction=0.02,
                       jitter_s=4.0, seed=9)
    agg = source(spark, src, files_per_batch=2).stretchAggregate(
        keys=F.col("words"), window=("60 seconds", "30 seconds"), parallelism=2, max_parallelism=2)
    q = (agg.writeStream.format("delta").option("checkpointLocation", str(tmp / "c"))
         .trigger(availableNow=True).start(str(tmp / "s")))
    q.awaitTermination()
    got = spark.read.format("delta").load(str(tmp / "s"))
    want = run_native(spark, agg, tmp / "n")
    assert want.count() > 0
    assert_df_equality(got, want, ignore_row_order=True, ignore_nullable=True, ignore_metadata=True)
    result["engine_writer_pids"] = q.metrics()["engine"]["writer_pids"]

    # A band join of two streams (others=) the same way, against Spark's stream-stream join.
    from spark_stretch.ops import band_join
    from spark_stretch.testing import write_points

    def points(name, cols, seed):
        write_points(tmp / name, 600, files=2, rate=20.0, seed=seed, columns=cols, jitter_s=2.0)
        return (spark.readStream.schema(f"ts TIMESTAMP, {cols[0]} DOUBLE, {cols[1]} DOUBLE")
                .option("maxFilesPerTrigger", 1).parquet(str(tmp / name))
                .withWatermark("ts", "5 seconds"))

    join = points("l", ("x", "y"), 1).stretchAggregate(
        agg=band_join(WS=1, shares=4), window="10 seconds", others=points("r", ("a", "b"), 2),
        parallelism=2, max_parallelism=2, buckets=16)
    q = (join.writeStream.format("delta").option("checkpointLocation", str(tmp / "jc"))
         .trigger(availableNow=True).start(str(tmp / "j")))
    q.awaitTermination()
    result["join_writer_pids"] = q.metrics()["engine"]["writer_pids"]
    nq = (join.native().writeStream.format("delta").option("checkpointLocation", str(tmp / "jnc"))
          .trigger(availableNow=True).start(str(tmp / "jn")))
    nq.awaitTermination()
    got = spark.read.format("delta").load(str(tmp / "j"))
    # The native join emits a match when it arrives, stretch when the watermark passes it.
    wm = spark.sql(f"SELECT timestamp_micros({q.metrics()['engine']['watermark_ms'] * 1000})").first()[0]
    want = spark.read.format("delta").load(str(tmp / "jn")).where(
        F.greatest("l_ts", "r_ts") <= F.lit(wm))
    assert want.count() > 100 and got.count() == want.count()
    assert_df_equality(got, want, ignore_row_order=True, ignore_nullable=True, ignore_metadata=True)
    result["ok"] = True
finally:
    spark.stop()
print("RESULT " + json.dumps(result))
sys.exit(0 if result.get("ok") else 1)
