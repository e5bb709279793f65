"""Session set-up: the shim jar, Delta, and the settings spark-stretch needs; quiet by default.

``python -m spark_stretch.driver`` builds the shim jar and resolves Delta's jars once (``make
setup`` runs it), printing where they are.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Dict, List, Optional
from urllib.parse import urlparse

from pyspark.sql import SparkSession

__all__ = ["configure_spark_with_stretch", "delta_package", "delta_jars", "package_jars",
           "session"]

# Spark's own log4j settings, at ERROR and without the banner (session(verbose=False)).
QUIET_LOG4J = Path(__file__).with_name("log4j2-quiet.properties")
# What Ivy resolves differently: with one of these set, Spark resolves Delta itself.
_IVY_SETTINGS = ("spark.jars.packages", "spark.jars.repositories", "spark.jars.ivySettings",
                 "spark.jars.excludes")

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

    Both reach the driver and every executor the way Spark ships any package: Delta is the
    artifact delta's own ``configure_spark_with_delta_pip`` picks for the installed pyspark
    (``io.delta:delta-spark_4.2_2.13`` for pyspark 4.2; see :func:`delta_package`), and the shim
    jar (compiled on first use from the bundled Scala sources and cached) is published to the
    local Ivy repository Spark resolves packages from, as ``sbt publishLocal`` would
    (:func:`~spark_stretch.driver.shim.shim_package`); both go in ``spark.jars.packages``, so
    Spark resolves them on the driver and serves them to executors. No setting names a path of
    this machine for the executors.

    Parameters
    ----------
    builder : SparkSession.Builder
        Your builder; it is changed in place and returned.
    extra_packages : list of str, optional
        More Maven coordinates for ``spark.jars.packages`` (those already set on the builder are
        kept too).

    Returns
    -------
    SparkSession.Builder

    Examples
    --------
    >>> from pyspark.sql import SparkSession
    >>> from spark_stretch import configure_spark_with_stretch
    >>> builder = SparkSession.builder.master("local[2]").appName("demo")
    >>> spark = configure_spark_with_stretch(
    ...     builder, ["org.apache.spark:spark-sql-kafka-0-10_2.13:4.2.0"]).getOrCreate()  # doctest: +SKIP
    >>> spark.range(3).write.format("delta").save("/tmp/t")  # doctest: +SKIP

    Notes
    -----
    A builder that also sets ``spark.jars`` keeps those jars, but then every package is resolved
    here, once, by Spark's own Ivy (a child process; its list is cached) and shipped through
    ``spark.jars`` instead: PySpark sets the builder's ``spark.jars`` again after
    ``spark-submit`` merged the resolved packages into it, which would leave the executors
    without them. Set ``spark.jars`` and ``spark.jars.packages`` before this call, not after.
    """
    if type(builder) is not SparkSession.Builder:
        raise TypeError(
            "configure_spark_with_stretch needs a SparkSession.Builder, got "
            f"{type(builder).__name__}; pass SparkSession.builder")
    if extra_packages is not None and (isinstance(extra_packages, str)
                                       or not all(isinstance(p, str) for p in extra_packages)):
        raise TypeError("extra_packages must be a list of Maven coordinates "
                        f"('group:artifact:version'), got {extra_packages!r}")
    from .shim import shim_package

    options = builder._options  # (pyspark's Builder has no getter)
    packages = _merge(_split(options.get("spark.jars.packages")), [delta_package()],
                      list(extra_packages or []))
    if options.get("spark.jars"):
        return _ship_as_jars(builder, packages)
    packages.append(shim_package(options.get("spark.jars.ivy")))
    builder = builder.config("spark.jars.packages", ",".join(packages))
    return _with_stretch(builder)


def _ship_as_jars(builder: SparkSession.Builder, packages: List[str]) -> SparkSession.Builder:
    """``builder`` with ``packages`` resolved here, once (:func:`package_jars`, with the
    builder's own Ivy settings), and shipped through ``spark.jars`` after its own jars and the
    shim jar; no ``spark.jars.packages`` left for spark-submit to resolve."""
    from .shim import cache_dir, shim_jar

    options = builder._options
    options.pop("spark.jars.packages", None)
    ivy = Path(options.get("spark.jars.ivy") or cache_dir() / "ivy")
    ivy_conf = {k: options[k] for k in _IVY_SETTINGS if k in options}
    jars = package_jars(ivy, packages, ivy_conf)
    return _with_stretch(builder, jars=[*_split(options.get("spark.jars")), str(shim_jar()),
                                        *jars])


def _split(value: Optional[str]) -> List[str]:
    return [x.strip() for x in (value or "").split(",") if x.strip()]


def _merge(*lists: List[str]) -> List[str]:
    """The packages of ``lists`` in order, each ``group:artifact`` once (the first version)."""
    seen, out = set(), []
    for p in (p for lst in lists for p in lst):
        ga = ":".join(p.replace("/", ":").split(":")[:2])
        if ga not in seen:
            seen.add(ga)
            out.append(p)
    return out


def _with_stretch(builder: SparkSession.Builder, jars: List[str] = ()) -> SparkSession.Builder:
    """``builder`` with ``jars`` (already resolved: the whole ``spark.jars``) and Delta's SQL
    extension and catalog."""
    if jars:
        builder = builder.config("spark.jars", ",".join(jars))
    for key, value in _DELTA_CONF.items():
        if key == "spark.sql.extensions":  # (the user's own extensions are kept, Delta's added)
            mine = _split(builder._options.get(key))
            value = ",".join(mine if value in mine else [*mine, value])
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
            conf: Optional[Dict[str, str]] = None, verbose: Optional[bool] = None) -> SparkSession:
    """A ready SparkSession for demos and tests: local Spark, Delta, and the stretch shim.

    Sets ``SPARK_LOCAL_IP=127.0.0.1`` (unless set) and ``PYSPARK_PYTHON`` to this interpreter, so
    executors and Python workers run the same environment. Quiet unless ``verbose``: Spark logs
    errors only (a log4j configuration of the package's: no banner, no WARN lines;
    ``spark.sparkContext.setLogLevel("WARN")`` shows more), and Delta's jars are those resolved
    once (:func:`delta_jars`), so Spark's Ivy report is not printed at every start. What remains
    is the JVM's own ``WARNING: Using incubator modules`` line, which no setting turns off.

    Parameters
    ----------
    master : str
        ``local[2]`` by default; ``local-cluster[2,1,1024]`` gives two executor JVMs on one host.
    app_name : str
        The application name.
    conf : dict, optional
        More Spark settings; they override the defaults here.
    verbose : bool, optional
        Spark as it starts by default: its Ivy resolution report, log banner and WARN lines.
        Default: ``$SPARK_STRETCH_VERBOSE`` (``1``: verbose), else quiet.

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
    from .shim import cache_dir

    # Our own Ivy directory: its jars/ then holds exactly the packages resolved for us.
    settings["spark.jars.ivy"] = str(cache_dir() / "ivy")
    if verbose is None:
        verbose = os.environ.get("SPARK_STRETCH_VERBOSE", "").lower() in ("1", "true", "yes")
    if not verbose:
        settings["spark.driver.extraJavaOptions"] = \
            f"-Dlog4j2.configurationFile={QUIET_LOG4J.as_uri()}"
    settings.update(conf or {})
    packages = _split(settings.pop("spark.jars.packages", None))
    builder = SparkSession.builder.master(master).appName(app_name).config(map=settings)
    if verbose and not _split(settings.get("spark.jars")):
        # Spark's own resolution, with its report: the packages through spark.jars.packages
        if packages:
            builder = builder.config("spark.jars.packages", ",".join(packages))
        return configure_spark_with_stretch(builder).getOrCreate()
    # Quiet: every package resolved once by Spark's Ivy in a child process (its list cached),
    # all of them shipped through spark.jars as spark-submit --jars ships local jars.
    builder = _ship_as_jars(builder, _merge([delta_package()], packages))
    with warnings.catch_warnings():
        # pyspark warns that pandas 3 is new to it when its first JVM call imports its test
        # utilities; only that warning, only here (the user's own calls still warn)
        warnings.filterwarnings("ignore", "PySpark does not yet fully support pandas",
                                FutureWarning)
        import pyspark.testing.utils  # noqa: F401

    return builder.getOrCreate()


def delta_jars(ivy: Path, package: Optional[str] = None) -> List[str]:
    """The local jars of Delta (``package``, default :func:`delta_package`) and its
    dependencies, resolved by Spark's own Ivy into ``ivy`` once (:func:`package_jars`)."""
    return package_jars(ivy, [package or delta_package()])


def package_jars(ivy: Path, packages: List[str],
                 ivy_conf: Optional[Dict[str, str]] = None) -> List[str]:
    """The local jars of the Maven ``packages`` and their dependencies, resolved by Spark's own
    Ivy into ``ivy`` once and listed beside them (``ivy_conf``: Spark's other Ivy settings,
    ``spark.jars.repositories``, ``spark.jars.ivySettings``, ``spark.jars.excludes``).

    The first call resolves them in a child process whose output is kept (one line says so; a
    failure shows it all), later calls read the list. Delete ``<ivy>/spark-stretch-jars-*`` to
    resolve again.
    """
    ivy_conf = {k: v for k, v in (ivy_conf or {}).items() if k != "spark.jars.ivy"}
    key = json.dumps([list(packages), sorted(ivy_conf.items())])
    listed = Path(ivy) / f"spark-stretch-jars-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    jars = listed.read_text().split() if listed.exists() else []
    if jars and all(os.path.isfile(j) for j in jars):
        return jars
    print(f"spark-stretch: resolving {','.join(packages)} with Spark's Ivy into {ivy} "
          "(once) ...", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, "-m", "spark_stretch.driver", "--resolve",
                           str(ivy), ",".join(packages), json.dumps(ivy_conf)],
                          capture_output=True, text=True,
                          env=dict(os.environ, SPARK_LOCAL_IP=os.environ.get(
                              "SPARK_LOCAL_IP", "127.0.0.1"), PYSPARK_PYTHON=sys.executable))
    lines = [x for x in proc.stdout.splitlines() if x.startswith("JARS ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"resolving {','.join(packages)} failed (Spark's Ivy, into {ivy}):\n"
                           + (proc.stdout + proc.stderr)[-6000:])
    jars = lines[-1][len("JARS "):].split(",")
    Path(ivy).mkdir(parents=True, exist_ok=True)
    tmp = listed.with_name(f".{listed.name}.{os.getpid()}.tmp")
    tmp.write_text("\n".join(jars) + "\n")
    os.replace(tmp, listed)
    return jars


def resolve(ivy: str, packages: str, ivy_conf: Optional[Dict[str, str]] = None) -> List[str]:
    """Have Spark's Ivy resolve ``packages`` (comma-separated) into ``ivy`` (a throwaway local
    session); the resolved local jars (spark-submit puts them in ``spark.repl.local.jars``)."""
    builder = (SparkSession.builder.master("local[1]").appName("spark-stretch resolve")
               .config("spark.ui.enabled", "false").config("spark.jars.ivy", ivy)
               .config("spark.jars.packages", packages))
    for key, value in (ivy_conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    try:
        local = spark.sparkContext.getConf().get("spark.repl.local.jars", "") or ""
    finally:
        spark.stop()
    here = Path(ivy) / "jars"
    jars = [p for p in (urlparse(u).path for u in local.split(",") if u)
            if Path(p).parent == here and os.path.isfile(p)]
    if not jars:
        raise RuntimeError(f"Spark resolved no jars of {packages} into {here}")
    return jars
