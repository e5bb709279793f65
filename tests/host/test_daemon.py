"""The host engine refuses to start where it cannot run the driver's queries, saying why on one
line the executors' launcher (the shim's StretchHosts) reports with the host's name."""

from __future__ import annotations

import subprocess
import sys

import spark_stretch
from spark_stretch.host import daemon


def test_preflight_names_another_version_and_missing_modules(monkeypatch):
    assert daemon.preflight(spark_stretch.__version__) is None
    assert daemon.preflight(None) is None
    why = daemon.preflight("9.9.9")
    assert why == f"spark-stretch {spark_stretch.__version__} is installed there, the driver " \
                  "runs 9.9.9"
    monkeypatch.setattr(daemon, "_NEEDS", ("numpy", "no_such_module_x", "no_such_module_y"))
    assert daemon.preflight(None) == \
        "no module named 'no_such_module_x', 'no_such_module_y' there"


def test_the_engine_exits_with_its_reason_before_serving(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "spark_stretch.host.daemon", "--socket", str(tmp_path / "s"),
         "--driver-version", "9.9.9"], capture_output=True, text=True, timeout=120,
        env={"SPARK_STRETCH_PROCESS": "host", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 3
    assert proc.stderr.strip().splitlines()[-1] == (
        f"STRETCH-ERROR spark-stretch {spark_stretch.__version__} is installed there, the "
        "driver runs 9.9.9")
    assert not (tmp_path / "s").exists()


def test_the_engine_serves_before_it_imports_numba():
    """The daemon's own imports (what runs before it says READY) leave numba and the engine's
    kernels to the thread that loads them after: a first batch's rows arrive meanwhile."""
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, spark_stretch.host.daemon; "
         "print(sorted(m for m in sys.modules if m == 'numba' or m.startswith("
         "'spark_stretch.engine')))"],
        capture_output=True, text=True, timeout=120,
        env={"SPARK_STRETCH_PROCESS": "host", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def _engine_arrow_pool(**env) -> str:
    """The Arrow default pool of the engine's process, as ``python -m`` runs its module."""
    code = ("import runpy, sys; sys.argv = ['daemon', '--help']\n"
            "try:\n    runpy.run_module('spark_stretch.host.daemon', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "import pyarrow as pa; print(pa.default_memory_pool().backend_name)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={"SPARK_STRETCH_PROCESS": "host",
                                            "PATH": "/usr/bin:/bin", **env})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_the_engine_allocates_arrow_buffers_with_the_systems_malloc():
    """Arrow's own allocations (the Parquet reader's) come from the pool chosen when pyarrow
    loads: the engine's process asks for the system's malloc, which gives freed buffers back
    (measured in BENCHMARKS.md, aggstate.py); a pool the user chose stands."""
    import pyarrow as pa

    assert _engine_arrow_pool() == "system"
    other = next(p for p in ("mimalloc", "jemalloc") if p in pa.supported_memory_backends())
    assert _engine_arrow_pool(ARROW_DEFAULT_MEMORY_POOL=other) == other


def test_the_launcher_turns_the_engines_log_into_a_clear_error(spark):
    hosts = spark.sparkContext._jvm.org.apache.spark.sql.stretch.StretchHosts
    missing = hosts.whyNotStarted(
        "10.0.0.3", "/opt/env/bin/python", 1,
        "/opt/env/bin/python: Error while finding module specification for "
        "'spark_stretch.host.daemon' (ModuleNotFoundError: No module named 'spark_stretch')\n")
    assert missing.startswith("spark-stretch cannot start its engine on executor host "
                              "10.0.0.3: no module named 'spark_stretch' there (the executors' "
                              "Python: /opt/env/bin/python). Install spark-stretch")
    assert "On a cluster" in missing
    own = hosts.whyNotStarted("10.0.0.3", "python3", 3, "STRETCH-ERROR spark-stretch 0.1.0 is "
                              "installed there, the driver runs 9.9.9\n")
    assert own.startswith("spark-stretch cannot start its engine on executor host 10.0.0.3: "
                          "spark-stretch 0.1.0 is installed there, the driver runs 9.9.9 (the "
                          "executors' Python: python3). Install")
    other = hosts.whyNotStarted("h", "python3", 139, "Segmentation fault")
    assert other == ("the stretch host engine on h exited with status 139 before it was "
                     "ready: Segmentation fault")
