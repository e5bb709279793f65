"""session() starts quietly: what a user sees is their own output and real errors, not Spark's."""

from __future__ import annotations

import os
import subprocess
import sys

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


def test_a_session_starts_without_spark_logs_or_ivy_reports():
    proc = _start()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "COUNT 5"
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [JVM_WARNING], \
        proc.stderr[-3000:]


def test_verbose_shows_what_spark_prints_as_it_starts():
    proc = _start(verbose=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ":: resolving dependencies" in proc.stderr and "Setting default log level" in proc.stderr


def test_a_failing_start_still_says_why():
    proc = _start(SCRIPT.replace('session(app_name="quiet test")',
                                        'session(master="local[abc]")'))
    assert proc.returncode != 0
    assert "Could not parse Master URL: 'local[abc]'" in proc.stderr, proc.stderr[-3000:]
