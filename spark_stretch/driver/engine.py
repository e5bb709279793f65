"""The driver's handle on a query's engine: what every handle does (:class:`EngineHandle`), and
this host's engine process (:class:`HostEngine`): started on demand, stopped with the last query
that uses it, never left behind. A query on several hosts has a handle on an engine per executor
host instead (:class:`spark_stretch.driver.cluster.ClusterEngine`). Requests are
:mod:`spark_stretch.protocol.messages`'.

- **One engine per driver, on the driver's host**, when the executors run there (local mode,
  local-cluster, a one-host cluster): :meth:`HostEngine.acquire` starts ``python -m
  spark_stretch.host.daemon`` on first use and counts the queries using it; the last one's end
  stops it and removes its socket directory. It dies with the driver (``PR_SET_PDEATHSIG``,
  :mod:`spark_stretch.protocol.lifecycle`; it also polls its parent).
- **Why a process of its own**: every executor JVM of the host reaches it the same way; it can
  be killed and the death detected (a restart from the checkpoint, or ``EngineDiedError``
  inside the batch, which Spark reports as a ``StreamingQueryException``: never a hang); and its
  threads do not contend with py4j for the driver's GIL.
- **Start and stop are off the query's path**: the process does not import PySpark
  (``SPARK_STRETCH_PROCESS=host``), says READY before it imports numba (a thread does that, so the
  first batch's rows are taken meanwhile; their commit waits for the query's ``open``), and skips
  the interpreter's teardown on exit (``os._exit`` after closing every query). The driver does not
  wait for it: the query is opened in a thread while Spark starts its query, and the first
  request that needs the engine waits.
- **Niceness** (``spark.stretch.engine.niceness``, 5; its threads and instance processes inherit
  it): its work runs while Spark commits batch N and ingests N+1, so on cores Spark also needs,
  Spark's threads should go first. The first query of a host starts it with its setting."""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from typing import Dict, Optional

from ..protocol import messages as M
from ..protocol.framing import call
from ..protocol.lifecycle import spawn_child

__all__ = ["EngineHandle", "HostEngine", "EngineDiedError", "local_host"]


class EngineDiedError(RuntimeError):
    """The host engine process is gone (killed, crashed or stopped) while a query needed it."""


def local_host() -> str:
    """This host's name as its executors report it: ``$SPARK_LOCAL_IP``, else the host name."""
    return os.environ.get("SPARK_LOCAL_IP") or socket.gethostname()


class EngineHandle(ABC):
    """What the driver's query code asks of an engine, on one host or several."""

    #: a query on several hosts: each input row goes to the hosts of its keys, computed in
    #: Spark (``driver/routing.py``); False: every row goes to its executor's own host
    routed = False

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """The ``stretch`` data source's ``endpoints`` option for this engine."""

    def data_options(self) -> Dict[str, str]:
        """The ``stretch`` data source's options to reach this engine (endpoints, secret)."""
        return {"endpoints": self.endpoint}

    @abstractmethod
    def call(self, msg: M.Request, timeout: Optional[float] = None):
        """Send a control request; its typed reply (:class:`EngineDiedError` if it is gone).
        ``timeout=None``: wait for the reply as long as the engine is :meth:`alive` (a
        micro-batch's step: it takes as long as its work does)."""

    @abstractmethod
    def wait_ready(self) -> None:
        """Wait until the engine serves requests."""

    @abstractmethod
    def alive(self) -> bool:
        """Whether the engine (every host's) is up."""

    @abstractmethod
    def failed(self, timeout: float) -> bool:
        """Whether the engine died (waiting up to ``timeout`` s to tell a crash from a slow one)."""

    @abstractmethod
    def death(self, when: str) -> str:
        """What happened to the (dead) engine, ``when`` saying at what point."""

    @abstractmethod
    def release(self) -> None:
        """Drop a query's reference; the last one stops the engine."""

    @abstractmethod
    def restarted(self) -> "EngineHandle":
        """After the engine died: a running one in its place, with this query's reference."""


class HostEngine(EngineHandle):
    """One engine process per host and driver; reference-counted by the queries that use it.

    Examples
    --------
    >>> from spark_stretch.protocol.messages import Ping
    >>> eng = HostEngine.acquire()
    >>> eng.call(Ping()).pid == eng.pid
    True
    >>> eng.release()
    """

    _current: Optional["HostEngine"] = None
    _lock = threading.Lock()

    def __init__(self, start_timeout: float = 180.0, niceness: int = 0):
        self._dir = tempfile.mkdtemp(prefix="stretch-engine-")
        self.socket_path = os.path.join(self._dir, "engine.sock")
        self.host = local_host()
        self._refs = 0
        env = dict(os.environ)
        env.pop("PYSPARK_GATEWAY_PORT", None)
        env["SPARK_STRETCH_PROCESS"] = "host"  # (the package root attaches no driver API there)
        self.proc = spawn_child(
            [sys.executable, "-m", "spark_stretch.host.daemon", "--socket", self.socket_path,
             "--parent", str(os.getpid()), "--nice", str(niceness)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        # Not waited for here: the caller goes on (Spark starts its query) while the engine
        # imports numpy, pyarrow and numba; the first request waits (wait_ready).
        self._start_timeout = start_timeout
        self._niceness = niceness
        self._ready = False
        self._ready_lock = threading.Lock()
        atexit.register(self.stop)

    def wait_ready(self) -> None:
        """Wait until the engine serves requests (raise :class:`EngineDiedError` if it cannot)."""
        with self._ready_lock:
            if self._ready:
                return
            line = self._readline(self._start_timeout)
            if line.strip() != "READY":
                err = self._drain_stderr()
                self.stop()
                raise EngineDiedError(f"the stretch host engine did not start: {line!r} {err}")
            self._ready = True

    def _readline(self, timeout: float) -> str:
        out = []
        t = threading.Thread(target=lambda: out.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        return out[0] if out else ""

    def _drain_stderr(self) -> str:
        try:
            return self.proc.stderr.read()[-4000:] if self.proc.poll() is not None else ""
        except (OSError, ValueError):
            return ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def endpoint(self) -> str:
        return f"{self.host}={self.socket_path}"

    @classmethod
    def acquire(cls, niceness: int = 0) -> "HostEngine":
        """The running engine (started if needed, at nice value ``niceness``), with one more
        reference."""
        with cls._lock:
            cur = cls._current
            if cur is None or cur.proc.poll() is not None:
                if cur is not None:
                    cur.stop()
                cur = cls._current = HostEngine(niceness=niceness)
            cur._refs += 1
            return cur

    @classmethod
    def running(cls) -> bool:
        """Whether this driver's engine process is up (a query holds it)."""
        with cls._lock:
            return cls._current is not None and cls._current.alive()

    @classmethod
    def wait_stopped(cls, timeout: float = 30.0) -> bool:
        """Wait until no engine process of this driver runs (a query releases it once Spark's
        listener says it ended, after ``awaitTermination`` returned); whether none does."""
        deadline = time.monotonic() + timeout
        while cls.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        return not cls.running()

    def restarted(self) -> "HostEngine":
        self.release()
        return HostEngine.acquire(niceness=self._niceness)

    def release(self) -> None:
        """Drop a reference; the last one stops the process."""
        with HostEngine._lock:
            self._refs -= 1
            if self._refs <= 0:
                self.stop()
                if HostEngine._current is self:
                    HostEngine._current = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def failed(self, timeout: float) -> bool:
        try:  # a killed engine is reaped at once; give a crashing one a moment to exit
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def death(self, when: str) -> str:
        """What happened to the (dead) engine, ``when`` saying at what point."""
        return (f"the stretch host engine (pid {self.pid}) died (exit status "
                f"{self.proc.returncode}) {when}")

    def call(self, msg: M.Request, timeout: Optional[float] = None):
        """Send a control request; its typed reply. A failed request raises
        :class:`~spark_stretch.protocol.errors.RemoteError` (its code and message), a dead
        engine :class:`EngineDiedError` with its exit status."""
        self.wait_ready()
        try:
            return M.decode_reply(msg, call(self.socket_path, M.encode_request(msg),
                                            timeout=timeout, alive=self.alive))
        except ConnectionError as e:
            try:  # a killed process closes its sockets a moment before it can be reaped
                self.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass
            if self.proc.poll() is not None:
                raise EngineDiedError(
                    f"the stretch host engine (pid {self.pid}) died with exit status "
                    f"{self.proc.returncode} during '{msg.op}'. "
                    f"{self._drain_stderr()}".strip()) from e
            raise

    def stop(self) -> None:
        """Stop the process (politely, then by force) and remove its socket directory."""
        if self.proc.poll() is None:
            try:
                if not self._ready:  # never asked anything: SIGTERM it (below)
                    raise EngineDiedError("not started")
                self.call(M.Shutdown(), timeout=10)
                self.proc.wait(timeout=15)
            except Exception:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        for f in (self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except Exception:
                pass
        shutil.rmtree(self._dir, ignore_errors=True)
