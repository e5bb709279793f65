"""Run-wide fixtures and checks: the environment Spark needs, one local[2] session for the run, a
receiver per test, and a leak check at the end.

``STRETCH_TEST_MASTER`` gives the session another master (``test_hosts.py`` runs pyspark's own
drop-in tests on its two-host standalone cluster that way), with the settings of
``STRETCH_TEST_CONF`` (``key=value`` pairs, comma-separated), once ``STRETCH_TEST_HOSTS``
executor hosts have registered.

The leak check fails the run if a Spark JVM started by this process, a host engine or one of its
instance processes, a receiver socket directory, or a query's state directory in shared memory
(``/dev/shm/stretch-*``) outlives the tests.
"""

from __future__ import annotations

import glob
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ["PYSPARK_PYTHON"] = sys.executable

_TMP = tempfile.gettempdir()
_SHM = "/dev/shm"
_BEFORE = set(glob.glob(os.path.join(_TMP, "stretch-*")))
_SHM_BEFORE = set(glob.glob(os.path.join(_SHM, "stretch-*")))


def _engines() -> set:
    """Host engine processes (``python -m spark_stretch.host.daemon``) and their instance
    processes (``python -m spark_stretch.worker``) on this machine."""
    out = set()
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            cmd = Path(cmdline).read_bytes()
            if b"spark_stretch.host.daemon" in cmd or b"spark_stretch.worker" in cmd:
                out.add(int(cmdline.split("/")[2]))
        except OSError:
            continue
    return out


_ENGINES_BEFORE = _engines()


@pytest.fixture(scope="session")
def spark():
    import spark_stretch

    master = os.environ.get("STRETCH_TEST_MASTER", "local[2]")
    conf = dict(kv.split("=", 1) for kv in os.environ.get("STRETCH_TEST_CONF", "").split(",")
                if kv)
    session = spark_stretch.session(master=master, app_name="spark-stretch tests", conf=conf)
    hosts = int(os.environ.get("STRETCH_TEST_HOSTS", "0"))
    if hosts:  # (a cluster's executors register after the session starts)
        from spark_stretch.driver import jvm

        deadline = time.time() + 120
        while len(jvm.executor_hosts(session, driver=False)) < hosts:
            assert time.time() < deadline, f"fewer than {hosts} executor hosts after 120 s"
            time.sleep(0.3)
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture
def receiver():
    import spark_stretch

    with spark_stretch.Receiver() as r:
        yield r


def _child_jvms(pid: int) -> list:
    """Java processes descending from ``pid`` (read from /proc, no psutil needed)."""
    parents = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
            parents[int(stat.split("/")[2])] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue

    def descends(p):
        while p > 1:
            p = parents.get(p, 0)
            if p == pid:
                return True
        return False

    out = []
    for p in parents:
        if descends(p):
            try:
                cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "java" in cmd.split(" ", 1)[0]:
                out.append((p, cmd[:200]))
    return out


def pytest_sessionfinish(session, exitstatus):
    # Stop the gateway JVM too (pyspark keeps it for the life of the process otherwise).
    SparkContext = getattr(sys.modules.get("pyspark"), "SparkContext", None)
    if SparkContext is not None and SparkContext._gateway is not None:
        SparkContext._gateway.shutdown()
        proc = getattr(SparkContext._gateway, "proc", None)
        if proc is not None:
            proc.stdin.close()
            proc.wait(timeout=30)
        SparkContext._gateway = None
        SparkContext._jvm = None
    deadline = time.time() + 30
    while _child_jvms(os.getpid()) and time.time() < deadline:
        time.sleep(0.5)
    while _engines() - _ENGINES_BEFORE and time.time() < deadline:
        time.sleep(0.5)
    leaks = [f"JVM {p}: {c}" for p, c in _child_jvms(os.getpid())]
    leaks += [f"host engine or instance process {p}" for p in _engines() - _ENGINES_BEFORE]
    leaks += [f"temp dir {d}" for d in set(glob.glob(os.path.join(_TMP, "stretch-*"))) - _BEFORE]
    leaks += [f"shared-memory dir {d}"
              for d in set(glob.glob(os.path.join(_SHM, "stretch-*"))) - _SHM_BEFORE]
    if leaks:
        print("\nLEAKED after the tests:\n  " + "\n  ".join(leaks), file=sys.stderr)
        session.exitstatus = 1
