"""Code of the Spark driver process behind the API: no data row passes through it.

- :mod:`.session`, :mod:`.shim`: the SparkSession set-up and the shim jar build;
- :mod:`.settings`: every ``spark.stretch.*`` setting, declared once;
- :mod:`.jvm`: every call into Spark's JVM internals (py4j), in one module;
- :mod:`.engine`: the handle on the host engine process (start, typed requests, stop);
- :mod:`.run`: a running query (start, watch, end), with its :mod:`.recovery`, :mod:`.ingest`,
  :mod:`.pipeline` (micro-batches), :mod:`.sink` and :mod:`.metrics`;
- :mod:`.kind`: what a query kind (:mod:`spark_stretch.api`) tells the driver.
"""
