"""The host engine refuses to start where it cannot run the driver's queries, saying why on one
line the executors' launcher (the shim's StretchHosts) reports with the host's name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def _scala_seq(spark, words: list):
    """``words`` as the Scala ``Seq[String]`` a launcher's command is (``StretchHosts.ensure``)."""
    jvm = spark.sparkContext._jvm
    out = jvm.java.util.ArrayList()
    for word in words:
        out.add(word)
    return jvm.scala.jdk.javaapi.CollectionConverters.asScala(out).toSeq()


def test_an_engine_that_exits_before_reading_its_secret_is_a_clear_error(spark, tmp_path):
    """A Python that exits at once (one without the package) can be gone before the launcher
    writes its secret; the JDK has then closed its stdin. The launcher reports why it exited
    and leaves no directory, as for any failed start (seen in CI: 'Stream closed', and the
    engine's directory left behind). ``/bin/false`` exits at once; 40 launches each."""
    import os

    hosts = spark.sparkContext._jvm.org.apache.spark.sql.stretch.StretchHosts
    for words, status in ((["/bin/false"], 1), (["/bin/sh", "-c", "echo gone >&2; exit 3"], 3)):
        cmd = _scala_seq(spark, words)
        for i in range(40):
            app = f"app-exits-{status}-{i}"
            with pytest.raises(Exception) as e:
                hosts.ensure("127.0.0.1", app, cmd, "a-secret", str(tmp_path), 30.0, 60_000)
            msg = str(e.value)
            assert (f"the stretch host engine on 127.0.0.1 exited with status {status} before "
                    "it was ready") in msg, msg
            assert not os.path.exists(hosts.engineDir(str(tmp_path), app, "127.0.0.1").getPath())


def test_an_engine_under_a_long_temporary_directory_gets_a_socket_that_fits(spark, tmp_path):
    """An executor's ``java.io.tmpdir`` can be long (YARN's is inside the container's
    directory): where the engine's socket would not fit a Unix socket's address, the launcher
    puts the engine's directory in /tmp under a hash of the long path, the same for every
    launcher of the host; the engine starts there, answers, and removes it when it ends."""
    import os
    import signal
    import time

    hosts = spark.sparkContext._jvm.org.apache.spark.sql.stretch.StretchHosts
    short = hosts.engineDir("/var/tmp", "app-1", "10.0.0.3").getPath()
    assert short == "/var/tmp/stretch-engine-app-1-10.0.0.3"  # (fits: where it was)
    base = tmp_path / ("container_e01_1700000000000_0001_01_000002-" * 2)
    base.mkdir()
    long_dir = hosts.engineDir(str(base), "application_1700000000000_0001", "127.0.0.1")
    path = long_dir.getPath()
    assert path.startswith("/tmp/stretch-engine-") and len(path) + len("/engine.sock") <= 100
    assert hosts.engineDir(str(base), "application_1700000000000_0001",
                           "127.0.0.1").getPath() == path  # (every launcher finds the same)

    cmd = _scala_seq(spark, [sys.executable, "-m", "spark_stretch.host.daemon",
                             "--driver-version", spark_stretch.__version__])
    line = hosts.ensure("127.0.0.1", "application_1700000000000_0001", cmd, "a-secret",
                        str(base), 30.0, 120_000)
    host, sock, tcp, pid = line.split("|")
    try:
        assert (host, os.path.dirname(sock)) == ("127.0.0.1", path)
        assert os.path.exists(sock) and tcp.startswith("tcp://127.0.0.1:")
        # a second launcher of the host finds the running engine
        again = hosts.ensure("127.0.0.1", "application_1700000000000_0001", cmd, "a-secret",
                             str(base), 30.0, 120_000)
        assert again == line
    finally:
        os.kill(int(pid), signal.SIGTERM)
    deadline = time.time() + 60
    while os.path.exists(path) and time.time() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(path)


def _maps_llvm(pid: int) -> bool:
    """Whether process ``pid`` has LLVM (llvmlite's library, which numba compiles with) mapped."""
    with open(f"/proc/{pid}/maps") as f:
        return "libllvmlite" in f.read()


def test_the_engine_says_what_runs_its_kernels(spark, tmp_path):
    """``q.metrics()["engine"]["kernels"]`` says whether the engine's process runs the kernels'
    library built ahead of time or numba: as the engine process's own memory map shows (numba's
    LLVM is mapped where numba compiles, not where the library runs). Where a library for this
    machine and these sources exists (``make setup`` builds it), a word count over an array
    column (as the README's examples count words) runs on it."""
    from spark_stretch.engine import native
    from spark_stretch.testing import tweet_source, write_tweets

    src = write_tweets(tmp_path / "src", 6000, files=3, rate=20.0, seed=3)
    agg = tweet_source(spark, src).stretchAggregate(keys="words", window="60 seconds")
    q = (agg.writeStream.format("delta").option("checkpointLocation", str(tmp_path / "c"))
         .start(str(tmp_path / "o")))
    try:
        q.processAllAvailable()
        engine = q.metrics()["engine"]
        assert engine["kernels"] in ("library", "numba")
        assert _maps_llvm(engine["engine_pid"]) == (engine["kernels"] == "numba"), engine
    finally:
        q.stop()
    pkg = Path(spark_stretch.__file__).parent / "engine"
    if native.library_path(pkg).exists() and os.environ.get("SPARK_STRETCH_AOT") != "0":
        assert engine["kernels"] == "library"
