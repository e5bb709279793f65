"""Run by test_grouped.py in its own process (the driver the test kills with -9 mid-run): the
drop-in's sessionization (``test_grouped.sessions``) over SRC into the Delta table OUT with
checkpoint CKPT, availableNow, one file per batch."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import spark_stretch  # noqa: E402
from test_grouped import SESSION_ARGS, source  # noqa: E402

src, out, ckpt = sys.argv[1:4]
spark = spark_stretch.session(app_name="stretch drop-in driver kill test")
spark.sparkContext.setLogLevel("OFF")
q = (source(spark, Path(src)).groupBy("user").stretchApplyInPandasWithState(*SESSION_ARGS)
     .writeStream.outputMode("update").format("delta").option("checkpointLocation", ckpt)
     .trigger(availableNow=True).start(out))
q.awaitTermination()
spark.stop()
