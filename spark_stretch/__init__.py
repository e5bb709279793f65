"""spark-stretch: STRETCH's virtual shared-nothing (VSN) elastic stateful operators for Spark.

Set-up::

    import spark_stretch
    spark = spark_stretch.session()                       # local Spark + Delta + the shim
    # or, with your own builder:
    spark = spark_stretch.configure_spark_with_stretch(SparkSession.builder).getOrCreate()

The package is laid out by the process that runs its code: ``api/`` and ``driver/`` (the Spark
driver), ``host/`` (the host engine process), ``worker/`` (the drop-in's instance processes),
``protocol/`` (what they exchange), ``engine/`` and ``ops/`` (the VSN engine and its operators,
run by the host engine), ``testing/`` (data generators and native comparisons).
"""

import os as _os

from .protocol.version import __version__

if _os.environ.get("SPARK_STRETCH_PROCESS") in ("host", "worker"):
    # A process the driver or its engine started (spark_stretch.host.daemon, spark_stretch.worker)
    # runs no driver code: the host engine never imports PySpark (a fifth of a second more at
    # every engine start), and neither imports the driver's API.
    __all__ = ["__version__"]
else:
    from pyspark.sql.streaming.state import GroupState, GroupStateTimeout

    from .api import (BatchMetrics, Decision, ElasticPolicy, FallbackWarning, Policy,
                      StretchAggregation, StretchControl,
                      StretchGroupedAggregation, StretchQuery, control, install, pairs, stretch,
                      stretch_aggregate, stretch_apply_in_pandas_with_state)
    from .driver.session import configure_spark_with_stretch, session
    from .host.receiver import Receiver

    install()  # df.stretchAggregate(...), df.groupBy(...).stretchAggregate(func, ...)

    __all__ = ["BatchMetrics", "Decision", "ElasticPolicy", "Policy",
               "FallbackWarning", "GroupState", "GroupStateTimeout", "Receiver",
               "StretchAggregation", "StretchControl", "StretchGroupedAggregation", "control",
               "stretch", "StretchQuery", "configure_spark_with_stretch",
               "pairs", "session", "stretch_aggregate", "stretch_apply_in_pandas_with_state",
               "__version__"]
