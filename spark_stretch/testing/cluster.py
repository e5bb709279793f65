"""A real multi-host Spark standalone cluster on one machine, for tests and demos.

Every 127/8 address is loopback on Linux, so a master on 127.0.0.1 and workers bound to
127.0.0.2, 127.0.0.3, ... (``SPARK_LOCAL_IP`` and ``--host``) give executors on distinct hosts
as Spark sees them: a query's engines run one per host, reached over TCP. The pip ``pyspark``
ships what it needs (``bin/spark-class``).

Each worker, and so its executors and the engines they start, runs with a home directory of its
own (``HOME``, ``XDG_CACHE_HOME``; no ``SPARK_STRETCH_CACHE``), as on a machine of its own: what
reaches an executor comes through Spark's shipping (``spark.jars``, ``spark.jars.packages``,
``spark.archives``), never from the driver's caches. The disk, ``/tmp`` and ``/dev/shm`` are
still this machine's; the workers' and executors' JVMs keep their temporary files
(``java.io.tmpdir``: the engines' directories among them) in the cluster's directory. The
cluster is always stopped on exit, its processes (workers, their executors, and what those
started) ended, its directories removed.

Examples
--------
::

    from spark_stretch.testing.cluster import StandaloneCluster

    with StandaloneCluster(hosts=("127.0.0.2", "127.0.0.3")) as cluster:
        spark = spark_stretch.session(master=cluster.url)
        ...
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import List, Sequence

from .processes import end_process_groups

__all__ = ["StandaloneCluster", "free_port"]

# The driver's own places, not passed to the cluster's processes (a worker on another machine
# has none of them).
_DRIVER_ONLY = ("SPARK_STRETCH_CACHE", "XDG_CACHE_HOME", "PYTHONPATH", "SPARK_CONF_DIR")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class StandaloneCluster:
    """A standalone master on ``master_host`` and one worker per address in ``hosts`` (each with
    ``cores`` cores and ``memory``), started on ``__enter__`` and stopped on ``__exit__``."""

    def __init__(self, hosts: Sequence[str] = ("127.0.0.2", "127.0.0.3"), cores: int = 1,
                 memory: str = "2g", master_host: str = "127.0.0.1", start_timeout: float = 120):
        import pyspark

        self.hosts = list(hosts)
        self.cores = cores
        self.memory = memory
        self.master_host = master_host
        self.start_timeout = start_timeout
        self._spark_class = str(Path(pyspark.__file__).parent / "bin" / "spark-class")
        self._dir = Path(tempfile.mkdtemp(prefix="stretch-cluster-"))
        self._procs: List[subprocess.Popen] = []
        self.port = free_port(master_host)
        self.ui_port = free_port(master_host)
        self.url = f"spark://{master_host}:{self.port}"

    @property
    def path(self) -> Path:
        """The cluster's directory: its logs, and each worker's work, home and temporary
        directories (removed on stop)."""
        return self._dir

    def _start(self, name: str, host: str, args: List[str], env: dict) -> subprocess.Popen:
        log = open(self._dir / f"{name}.log", "wb")
        proc = subprocess.Popen(
            [self._spark_class, *args], stdout=log, stderr=subprocess.STDOUT,
            env={**{k: v for k, v in os.environ.items() if k not in _DRIVER_ONLY},
                 "SPARK_LOCAL_IP": host, **env}, start_new_session=True)
        log.close()
        self._procs.append(proc)
        return proc

    def workers_alive(self) -> int:
        """How many workers the master has registered (ALIVE)."""
        try:
            with urllib.request.urlopen(f"http://{self.master_host}:{self.ui_port}/json/",
                                        timeout=2) as r:
                info = json.loads(r.read())
        except (OSError, ValueError):
            # (not up yet; or, with other clusters starting at once, another process's page on
            # the port free_port found: the wait times out naming the logs)
            return 0
        return sum(1 for w in info.get("workers", []) if w.get("state") == "ALIVE")

    def __enter__(self) -> "StandaloneCluster":
        try:
            self._start("master", self.master_host,
                        ["org.apache.spark.deploy.master.Master", "--host", self.master_host,
                         "--port", str(self.port), "--webui-port", str(self.ui_port)], {})
            for h in list(self.hosts):
                self._worker(h)
            self._wait_workers()
        except BaseException:
            self.stop()
            raise
        return self

    def _worker(self, h: str) -> None:
        work = self._dir / f"worker-{h}"
        home = self._dir / f"home-{h}"
        # (short: an engine's socket is in here, stretch-engine-<app>-<host>/engine.sock, and
        # must fit a Unix socket's address, or the launcher moves the engine to /tmp)
        java_tmp = self._dir / f"tmp{self.hosts.index(h)}"
        (home / ".cache").mkdir(parents=True)
        work.mkdir()
        java_tmp.mkdir()
        # The worker's JVM and the executors' it starts (they inherit its environment) keep
        # their temporary files in the cluster's directory, as a machine of their own would:
        # the lz4 and snappy libraries they unpack (deleted only when a JVM exits normally)
        # and the engines' directories. stop() removes it: an executor killed by a test leaves
        # nothing in the machine's /tmp.
        tool_opts = f"{os.environ.get('JAVA_TOOL_OPTIONS', '')} -Djava.io.tmpdir={java_tmp}"
        self._start(f"worker-{h}", h,
                    ["org.apache.spark.deploy.worker.Worker", "--host", h, "--cores",
                     str(self.cores), "--memory", self.memory, "--webui-port", "0",
                     "--work-dir", str(work), self.url],
                    {"SPARK_WORKER_DIR": str(work), "HOME": str(home),
                     "XDG_CACHE_HOME": str(home / ".cache"),
                     "JAVA_TOOL_OPTIONS": tool_opts.strip()})

    def _wait_workers(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while self.workers_alive() < len(self.hosts):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self._procs):
                raise RuntimeError(f"the standalone cluster did not start: see {self._dir}")
            time.sleep(0.3)

    def add_worker(self, host: str) -> None:
        """Start one more worker, on ``host`` (its executors join running applications that
        want more cores), and wait until the master has it."""
        self.hosts.append(host)
        self._worker(host)
        self._wait_workers()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """End the workers (and their executors), then the master; remove the work dirs."""
        end_process_groups(self._procs, term_wait=15.0)
        self._procs = []
        shutil.rmtree(self._dir, ignore_errors=True)
