"""Session set-up: the shim jar, Delta, and the settings spark-stretch needs."""

from __future__ import annotations

import os
import sys
from typing import Dict, List, Optional

from pyspark.sql import SparkSession

__all__ = ["configure_spark_with_stretch", "delta_package", "session"]

# delta-spark 4.4.1 on PyPI has no 4.4.1 jar for Spark 4.2 on Maven Central (only 4.4.0 is
# published as delta-spark_4.2_2.13); the Python package is a thin wrapper and works with it.
_DELTA_JAR_FOR_PIP = {"4.4.1": "4.4.0"}

_DELTA_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}


def configure_spark_with_stretch(
    builder: SparkSession.Builder, extra_packages: Optional[List[str]] = None
) -> SparkSession.Builder:
    """Add the spark-stretch shim jar and Delta Lake to a SparkSession builder.

    Delta is the artifact delta's own ``configure_spark_with_delta_pip`` picks for the installed
    pyspark (``io.delta:delta-spark_4.2_2.13`` for pyspark 4.2; see :func:`delta_package`), resolved
    by Spark from Maven Central. The shim jar is compiled on first use from the bundled Scala sources and cached.

    Parameters
    ----------
    builder : SparkSession.Builder
        Your builder; it is changed in place and returned.
    extra_packages : list of str, optional
        More Maven coordinates for ``spark.jars.packages``.

    Returns
    -------
    SparkSession.Builder

    Examples
    --------
    >>> from pyspark.sql import SparkSession
    >>> from spark_stretch import configure_spark_with_stretch
    >>> builder = SparkSession.builder.master("local[2]").appName("demo")
    >>> spark = configure_spark_with_stretch(builder).getOrCreate()  # doctest: +SKIP
    >>> spark.range(3).write.format("stretch")  # doctest: +SKIP

    Notes
    -----
    Like ``configure_spark_with_delta_pip`` this sets ``spark.jars.packages``; pass your other
    packages through ``extra_packages``. An existing ``spark.jars`` setting is kept.
    """
    from .shim import shim_jar

    if type(builder) is not SparkSession.Builder:
        raise TypeError(
            "configure_spark_with_stretch needs a SparkSession.Builder, got "
            f"{type(builder).__name__}; pass SparkSession.builder")
    packages = [delta_package(), *(extra_packages or [])]
    builder = builder.config("spark.jars.packages", ",".join(packages))
    jars = builder._options.get("spark.jars")  # keep the user's jars
    jar = str(shim_jar())
    builder = builder.config("spark.jars", f"{jars},{jar}" if jars else jar)
    for key, value in _DELTA_CONF.items():
        builder = builder.config(key, value)
    return builder


def delta_package() -> str:
    """Maven coordinates of the Delta jar for the installed pyspark and delta-spark.

    The artifact is the one delta's ``configure_spark_with_delta_pip`` names
    (``io.delta:delta-spark_<spark major.minor>_2.13``); the version is the pip package's, or the
    published jar for it where Maven Central lacks that exact version. Override with
    ``$SPARK_STRETCH_DELTA_PACKAGE``.
    """
    override = os.environ.get("SPARK_STRETCH_DELTA_PACKAGE")
    if override:
        return override
    from importlib.metadata import version

    import pyspark

    spark_minor = ".".join(pyspark.__version__.split(".")[:2])
    pip_version = version("delta-spark")
    return f"io.delta:delta-spark_{spark_minor}_2.13:{_DELTA_JAR_FOR_PIP.get(pip_version, pip_version)}"


def session(master: str = "local[2]", app_name: str = "spark-stretch",
            conf: Optional[Dict[str, str]] = None) -> SparkSession:
    """A ready SparkSession for demos and tests: local Spark, Delta, and the stretch shim.

    Sets ``SPARK_LOCAL_IP=127.0.0.1`` (unless set) and ``PYSPARK_PYTHON`` to this interpreter, so
    executors and Python workers run the same environment.

    Parameters
    ----------
    master : str
        ``local[2]`` by default; ``local-cluster[2,1,1024]`` gives two executor JVMs on one host.
    app_name : str
        The application name.
    conf : dict, optional
        More Spark settings; they override the defaults here.

    Examples
    --------
    >>> import spark_stretch
    >>> spark = spark_stretch.session()  # doctest: +SKIP
    >>> spark.range(5).count()  # doctest: +SKIP
    5
    """
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    settings = {
        # Native stateful queries thrash in GC at the 1 GB default.
        "spark.driver.memory": "4g",
        "spark.sql.shuffle.partitions": "4",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.streaming.forceDeleteTempCheckpointLocation": "true",
        "spark.databricks.delta.snapshotPartitions": "2",
        "spark.sql.adaptive.enabled": "false",
    }
    from .shim import cache_dir, shim_jar

    # Our own Ivy directory: its jars/ then holds exactly the packages resolved for us.
    ivy = cache_dir() / "ivy"
    settings["spark.jars.ivy"] = str(ivy)
    if master.startswith("local-cluster"):
        # Executors that load Delta from spark.jars (a child classloader) fail to deserialize its
        # Scala lambdas (SerializedLambda -> Function1); on the system classpath they work.
        # Only Delta's own jars (Ivy names them org_artifact-version.jar): its transitive
        # dependencies (an older Jackson) must not shadow Spark's.
        group, artifact, version = delta_package().split(":")
        delta_jars = [ivy / "jars" / f"{group}_{a}-{version}.jar"
                      for a in (artifact, "delta-storage")]
        settings["spark.executor.extraClassPath"] = ":".join(map(str, [*delta_jars, shim_jar()]))
    settings.update(conf or {})
    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in settings.items():
        builder = builder.config(key, value)
    return configure_spark_with_stretch(builder).getOrCreate()
