"""A query's engine on several hosts: one engine per executor host, driven as one.

When the application's executors run on hosts other than the driver's, each executor host gets
its own engine, started there by an executor (the shim's ``StretchHosts`` launcher job: one task
per host, placed by its preferred location; see ``jvm_shim/StretchHosts.scala``). The engines
listen on TCP at their host's address and admit only peers that know the application's secret
(:mod:`spark_stretch.protocol.auth`); they live on a lease this driver renews every few seconds,
so an engine whose driver is killed exits by itself.

:class:`ClusterEngine` is the query code's handle on all of them (the same
:class:`~.engine.EngineHandle` as one host's engine): a control request goes to every host and
the replies are merged, so :class:`~.recovery.Recovery`, :class:`~.pipeline.Pipeline` and the
sink run a query on several hosts unchanged:

- **key groups** (:mod:`spark_stretch.protocol.placement`): ``spark.stretch.keyGroups`` groups,
  fixed per query (in its ``query.json`` with the host map); ``open`` gives each host its share
  (:class:`~spark_stretch.protocol.specs.HostShare`) and its own state directory
  (``<checkpoint>/stretch/hosts/<i>/``);
- **one watermark**: each step reports every host's largest event times; the next ``submit``
  and ``flush`` carry the largest of all (logged with the batch's input on each host, so a
  replay after a restart sees the same);
- **one Delta commit per batch**: each host writes its rows as data files
  (``prepare_delta``), the first host commits all of them with the batch's transaction;
- a replay after a restart steps each batch on the hosts whose checkpoint is before it.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

from ..protocol import messages as M
from ..protocol.auth import new_secret
from ..protocol.framing import call as frame_call
from . import jvm
from .engine import EngineDiedError, EngineHandle, HostEngine, local_host
from .fanout import FanOut, _Query
from .routing import route, route_grouped
from .settings import QuerySettings

__all__ = ["ClusterEngine", "EngineStartError", "RemoteEngine", "acquire_engine",
           "engine_hosts"]

_LAUNCH_TIMEOUT_MS = 180_000
# The launcher's own reason (StretchHosts.whyNotStarted), out of Spark's job failure.
_CANNOT_START = re.compile(r"spark-stretch cannot start its engine on executor host [^\n]*")


class EngineStartError(RuntimeError):
    """An executor host cannot run the engine: the message names the host and what is missing
    there (the executors' Python, a module, the package's version)."""


def engine_hosts(spark, wait_s: float = 30.0) -> List[str]:
    """The executor hosts a query's engines run on: [] when every executor is on the driver's
    host (local mode, local-cluster, a one-host cluster: the driver starts the engine). On a
    cluster master, waits up to ``wait_s`` for a first executor to register."""
    master = spark.sparkContext.master
    deadline = time.monotonic() + wait_s
    while True:
        hosts = jvm.executor_hosts(spark, driver=False)
        if hosts or master.startswith("local") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if not hosts or hosts <= {local_host(), "localhost", "127.0.0.1"}:
        return []
    return sorted(hosts)


def acquire_engine(spark, settings: QuerySettings) -> EngineHandle:
    """The engine a new query runs on, with one more reference: this host's (started if need
    be), or, when executors run on other hosts, the application's engines on every executor
    host."""
    hosts = engine_hosts(spark)
    if not hosts:
        return HostEngine.acquire(niceness=settings.niceness)
    return ClusterEngine.acquire(spark, hosts, settings)


@dataclass
class RemoteEngine:
    """One executor host's engine: ``host`` as Spark names it, its Unix socket and TCP address."""

    host: str
    socket: str
    tcp: str
    pid: int

    @property
    def entry(self) -> str:
        """Its ``endpoints`` entry: ``host=/socket|tcp://address:port``."""
        return f"{self.host}={self.socket}|{self.tcp}"

    def address(self) -> str:
        """Where the driver reaches it: its socket on the driver's own host, else TCP."""
        return self.socket if self.host == local_host() else self.tcp


class ClusterEngine(FanOut, EngineHandle):
    """The application's engines on ``hosts`` (one per executor host), as one engine.

    Made by :func:`acquire_engine`; reference-counted by the queries that use it, the last one's
    release stops every engine. See the module docstring for what each request does.
    """

    _current: Optional["ClusterEngine"] = None
    _lock = threading.Lock()
    _secrets: Dict[str, bytes] = {}  # per application: its engines admit only holders
    routed = True

    def __init__(self, spark, hosts: List[str], settings: QuerySettings):
        self._spark = spark
        self.hosts = list(hosts)
        self.secret = ClusterEngine._secrets.setdefault(spark.sparkContext.applicationId,
                                                        new_secret())
        self.lease_s = settings.lease_s
        self._niceness = settings.niceness
        self._refs = 0
        self._queries: Dict[str, _Query] = {}
        self._dead: Optional[str] = None  # what failed() found
        self.engines: List[RemoteEngine] = []
        self._stop = threading.Event()
        self.launch()
        self._renewer = threading.Thread(target=self._renew, name="stretch-lease", daemon=True)
        self._renewer.start()

    # -- the engines -------------------------------------------------------------------------
    def launch(self) -> None:
        """Start the engine of every host that has none running (all of them the first time)."""
        from ..protocol.version import __version__

        # The Python PySpark's own workers run on the executors (pyspark's pythonExec: the
        # driver's PYSPARK_PYTHON, which spark-submit sets from spark.pyspark.python), in the
        # executors' own temporary directory: nothing of this machine's file system.
        python = self._spark.sparkContext.pythonExec or "python3"
        try:
            lines = jvm.launch_engines(
                self._spark, self.hosts,
                [python, "-m", "spark_stretch.host.daemon", "--nice", str(self._niceness),
                 "--driver-version", __version__],
                self.secret.decode(), "", float(self.lease_s), _LAUNCH_TIMEOUT_MS)
        except Exception as err:
            why = _CANNOT_START.search(str(err))
            if why is None:
                raise
            raise EngineStartError(why.group(0)) from err
        self.engines = []
        for line in lines:
            host, sock, tcp, pid = line.split("|")
            self.engines.append(RemoteEngine(host, sock, tcp, int(pid)))
        self._dead = None

    def _renew(self) -> None:
        while not self._stop.wait(max(0.5, self.lease_s / 4)):
            for e in list(self.engines):
                try:
                    frame_call(e.address(), M.encode_request(M.Ping()), timeout=5.0,
                               secret=self.secret)
                except ConnectionError:
                    pass  # a dead engine: the query's next request finds out

    @classmethod
    def acquire(cls, spark, hosts: List[str], settings: QuerySettings) -> "ClusterEngine":
        """The application's engines on ``hosts`` (launched if need be), one more reference."""
        with cls._lock:
            cur = cls._current
            if cur is None or cur.hosts != list(hosts):
                if cur is not None and cur._refs <= 0:
                    cur.stop()
                cur = cls._current = ClusterEngine(spark, hosts, settings)
            elif not cur.alive():
                cur.launch()  # (a host's engine died: its successor, on the same host)
            cur._refs += 1
            return cur

    @property
    def endpoint(self) -> str:
        return ",".join(e.entry for e in self.engines)

    def data_options(self) -> Dict[str, str]:
        return {"endpoints": self.endpoint, "secret": self.secret.decode()}

    def share_of(self, qid: str):
        """The query's key groups and host map (a :class:`HostShare`)."""
        return self._queries[qid].share

    def route(self, df, qid: str):
        """``df`` (a batch's input) with each row's hosts as its last column (the rows path:
        :func:`~.routing.route`)."""
        q = self._queries[qid]
        if q.key_kind == "grouped":  # (the drop-in: several grouping columns, by bucket)
            return route_grouped(df, q.key_column, q.buckets, q.share.host_map,
                                 q.share.key_groups)
        return route(df, q.key_kind, q.key_column, q.share.host_map, q.share.key_groups,
                     len(self.engines))

    def wait_ready(self) -> None:
        pass  # (the launcher returns once every engine is ready)

    def _one(self, i: int, msg: M.Request, timeout: Optional[float] = None):
        e = self.engines[i]
        try:
            return M.decode_reply(msg, frame_call(e.address(), M.encode_request(msg),
                                                  timeout=timeout, secret=self.secret,
                                                  alive=lambda: self._ping(i)))
        except ConnectionError as err:
            if not self._ping(i):
                raise EngineDiedError(self._died(i, f"during '{msg.op}'")) from err
            raise

    def _ping(self, i: int) -> bool:
        try:
            frame_call(self.engines[i].address(), M.encode_request(M.Ping()), timeout=5.0,
                       secret=self.secret)
            return True
        except ConnectionError:
            return False

    def _died(self, i: int, when: str) -> str:
        e = self.engines[i]
        self._dead = (f"the stretch host engine on {e.host} (pid {e.pid}) died or cannot be "
                      f"reached {when}")
        return self._dead

    def alive(self) -> bool:
        return all(self._ping(i) for i in range(len(self.engines)))

    def failed(self, timeout: float) -> bool:
        for i in range(len(self.engines)):
            if not self._ping(i):
                self._died(i, "")
                return True
        return False

    def death(self, when: str) -> str:
        return f"{self._dead or 'a stretch host engine died'} {when}".strip()

    def add_hosts(self) -> List[str]:
        """Start an engine on each host that has executors now and none yet (a worker added to
        the cluster, dynamic allocation): the hosts added (they get key groups from a move)."""
        now = engine_hosts(self._spark)
        new = [h for h in now if h not in self.hosts]
        if new:
            with ClusterEngine._lock:
                self.hosts = sorted(set(self.hosts) | set(new))
                self.launch()
        return new

    def restarted(self) -> "ClusterEngine":
        """After a host's engine died: its successor started on that host, or, when the host
        has no executor any more (lost, or removed by dynamic allocation), none: the engines
        of the hosts with executors now (each query is then opened again on all of them, the
        lost host's key groups taken over by the others, ``fanout._share_of``)."""
        with ClusterEngine._lock:
            deadline = time.monotonic() + _LAUNCH_TIMEOUT_MS / 1000
            while True:
                # (Spark may still list a lost host's executor for a moment: its launcher task
                # then runs elsewhere and fails; ask again)
                self.hosts = engine_hosts(self._spark) or self.hosts
                try:
                    self.launch()
                    return self
                except EngineStartError:
                    raise  # (the host cannot run it: no retry helps)
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(2.0)

    def release(self) -> None:
        with ClusterEngine._lock:
            self._refs -= 1
            if self._refs <= 0:
                self.stop()
                if ClusterEngine._current is self:
                    ClusterEngine._current = None

    def stop(self) -> None:
        """Stop every host's engine (each removes its socket directory)."""
        self._stop.set()
        for i in range(len(self.engines)):
            try:
                self._one(i, M.Shutdown(), timeout=10)
            except Exception:
                pass  # (gone already; or its lease ends it)
