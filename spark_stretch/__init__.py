"""spark-stretch: STRETCH's virtual shared-nothing (VSN) elastic stateful operators for Spark.

Set-up::

    import spark_stretch
    spark = spark_stretch.session()                       # local Spark + Delta + the shim
    # or, with your own builder:
    spark = spark_stretch.configure_spark_with_stretch(SparkSession.builder).getOrCreate()
"""

import os as _os

__version__ = "0.1.0"

if _os.environ.get("SPARK_STRETCH_HOSTD") == "1":
    # The host engine process (spark_stretch.spark.hostd) runs the engine, never Spark: importing
    # PySpark there would only add a fifth of a second to every engine start.
    __all__ = ["__version__"]
else:
    from pyspark.sql.streaming.state import GroupState, GroupStateTimeout

    from .spark.api import StretchAggregation, StretchQuery, _install, stretch_aggregate
    from .spark.grouped import StretchGroupedAggregation, stretch_apply_in_pandas_with_state
    from .spark.receiver import Receiver
    from .spark.session import configure_spark_with_stretch, session
    from .spark.spec import pairs

    _install()  # df.stretchAggregate(...), df.groupBy(...).stretchAggregate(func, ...)

    __all__ = ["GroupState", "GroupStateTimeout", "Receiver", "StretchAggregation",
               "StretchGroupedAggregation", "StretchQuery", "configure_spark_with_stretch",
               "pairs", "session", "stretch_aggregate", "stretch_apply_in_pandas_with_state",
               "__version__"]
