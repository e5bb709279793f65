"""session() starts quietly: what a user sees is their own output and real errors, not Spark's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import spark_stretch
spark = spark_stretch.session(app_name="quiet test")
print("COUNT", spark.range(5).count())
spark.stop()
"""
# The JVM prints this for the vector module Spark's launcher always adds; no setting turns it off.
JVM_WARNING = "WARNING: Using incubator modules: jdk.incubator.vector"


def _start(script=SCRIPT, verbose=False):
    env = {k: v for k, v in os.environ.items() if k != "SPARK_STRETCH_VERBOSE"}
    env.update(SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    if verbose:
        env["SPARK_STRETCH_VERBOSE"] = "1"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.mark.slow  # (for time: the default run stays under 20 minutes; CI runs -m slow)
def test_a_session_starts_without_spark_logs_or_ivy_reports():
    proc = _start()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "COUNT 5"
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [JVM_WARNING], \
        proc.stderr[-3000:]


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_verbose_shows_what_spark_prints_as_it_starts():
    proc = _start(verbose=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ":: resolving dependencies" in proc.stderr and "Setting default log level" in proc.stderr


def test_a_failing_start_still_says_why():
    proc = _start(SCRIPT.replace('session(app_name="quiet test")',
                                        'session(master="local[abc]")'))
    assert proc.returncode != 0
    assert "Could not parse Master URL: 'local[abc]'" in proc.stderr, proc.stderr[-3000:]


KAFKA = "org.apache.spark:spark-sql-kafka-0-10_2.13:4.2.0"


def test_configure_puts_shim_and_delta_in_packages_beside_the_users(tmp_path):
    # No session started: what the builder will hand spark-submit. The shim is a package (from
    # the local Ivy repository it was published to), never a jar path of this machine.
    from pyspark.sql import SparkSession

    from spark_stretch import configure_spark_with_stretch
    from spark_stretch.driver.session import delta_package
    from spark_stretch.driver.shim import SHIM_ARTIFACT, SHIM_GROUP, shim_jar

    b = (SparkSession.builder.config("spark.jars.ivy", str(tmp_path))
         .config("spark.jars.packages", KAFKA).config("spark.sql.extensions", "my.Ext"))
    opts = configure_spark_with_stretch(b)._options
    packages = opts["spark.jars.packages"].split(",")
    assert packages[:2] == [KAFKA, delta_package()]
    group, artifact, version = packages[2].split(":")
    assert (group, artifact) == (SHIM_GROUP, SHIM_ARTIFACT) and len(packages) == 3
    assert "spark.jars" not in opts
    assert opts["spark.sql.extensions"] == "my.Ext,io.delta.sql.DeltaSparkSessionExtension"
    published = tmp_path / "local" / group / artifact / version
    assert (published / "jars" / f"{artifact}.jar").read_bytes() == shim_jar().read_bytes()
    assert f'revision="{version}"' in (published / "ivys" / "ivy.xml").read_text()
    # a second call (another session) finds it published, the same coordinates
    again = configure_spark_with_stretch(SparkSession.builder.config("spark.jars.ivy",
                                                                     str(tmp_path)))
    assert again._options["spark.jars.packages"].split(",")[-1] == packages[2]


def test_configure_with_users_jars_resolves_packages_into_spark_jars(tmp_path):
    # PySpark sets a builder's spark.jars again after spark-submit merged the resolved packages
    # into it: with the user's own jars, every package is resolved here and shipped in spark.jars
    from pyspark.sql import SparkSession

    from spark_stretch import configure_spark_with_stretch
    from spark_stretch.driver.shim import cache_dir, shim_jar

    mine = tmp_path / "mine.jar"
    mine.write_bytes(b"PK")
    b = (SparkSession.builder.config("spark.jars", str(mine))
         .config("spark.jars.ivy", str(cache_dir() / "ivy")))
    opts = configure_spark_with_stretch(b)._options
    jars = opts["spark.jars"].split(",")
    assert jars[:2] == [str(mine), str(shim_jar())]
    assert any("io.delta_delta-spark_4.2_2.13" in j for j in jars)
    assert all(os.path.isfile(j) for j in jars)
    assert "spark.jars.packages" not in opts


def test_configure_refuses_a_string_of_packages():
    import pytest
    from pyspark.sql import SparkSession

    from spark_stretch import configure_spark_with_stretch

    with pytest.raises(TypeError, match="extra_packages must be a list"):
        configure_spark_with_stretch(SparkSession.builder, KAFKA)


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_a_session_keeps_the_users_packages_beside_delta_and_the_shim():
    proc = _start(SCRIPT.replace(
        'session(app_name="quiet test")',
        f'session(app_name="quiet test", conf={{"spark.jars.packages": "{KAFKA}"}})').replace(
        'print("COUNT", spark.range(5).count())',
        'print("JARS", spark.sparkContext.getConf().get("spark.jars"))\n'
        'print("COUNT", spark.range(5).count())'))
    assert proc.returncode == 0, proc.stderr[-3000:]
    jars = next(x for x in proc.stdout.splitlines() if x.startswith("JARS "))
    for name in ("spark-sql-kafka-0-10_2.13-4.2.0", "kafka-clients", "delta-spark_4.2_2.13",
                 "spark-stretch-shim"):
        assert name in jars, jars
    assert "COUNT 5" in proc.stdout
