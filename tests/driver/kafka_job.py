"""Run by test_kafka.py in its own process (a driver the test may kill with -9 mid-run): a
windowed word count over a Kafka topic, natively or through ``stretch(df)``, into a Delta table,
availableNow, ``maxOffsetsPerTrigger`` records a batch.

Arguments: BOOTSTRAP TOPIC OUT CKPT SPELLING (native|stretch) MAX_OFFSETS. Prints ``RESULT
{json}``: the batches run and, through stretch, the engine's restarts."""

import json
import sys

from pyspark.sql import functions as F

import spark_stretch
from spark_stretch.testing.kafka import SPARK_KAFKA_PACKAGE

bootstrap, topic, out, ckpt, spelling, max_offsets = sys.argv[1:7]
spark = spark_stretch.session(app_name="stretch kafka test",
                              conf={"spark.jars.packages": SPARK_KAFKA_PACKAGE})
spark.sparkContext.setLogLevel("OFF")
events = (spark.readStream.format("kafka").option("kafka.bootstrap.servers", bootstrap)
          .option("subscribe", topic).option("startingOffsets", "earliest")
          .option("maxOffsetsPerTrigger", max_offsets).load()
          .select(F.col("timestamp").alias("ts"), F.col("value").cast("string").alias("word"))
          .withWatermark("ts", "30 seconds"))
counts = events.groupBy(F.window("ts", "20 seconds", "10 seconds"), "word").agg(
    F.count("*").alias("n"), F.max("ts").alias("last"))
if spelling == "stretch":
    counts = spark_stretch.stretch(counts, parallelism=2, max_parallelism=2)
q = (counts.writeStream.format("delta").option("checkpointLocation", ckpt)
     .trigger(availableNow=True).start(out))
q.awaitTermination()
result = {"batches": q.lastProgress["batchId"] + 1 if q.lastProgress else 0}
if spelling == "stretch":
    result["restarts"] = q.metrics().get("engine_restarts", [])
print("RESULT " + json.dumps(result), flush=True)
spark.stop()
