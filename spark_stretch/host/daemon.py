"""The host engine process: one per host and application, shared by every executor and task on it.

Started as ``python -m spark_stretch.host.daemon``: by the driver on its own host
(:class:`spark_stretch.driver.engine.HostEngine`), or, for a query on several hosts, by an
executor on each executor host (the shim's ``StretchHosts`` launcher job: then it also listens
on TCP at the host's address, takes the application's secret on its standard input, and lives
on a lease the driver renews). It serves the ``stretch`` data source on a Unix socket (executors
write input and read results: :mod:`.receiver`) and the driver's control requests
(:mod:`spark_stretch.protocol.messages`: ``open``, ``step`` or ``submit``/``result``,
``reconfigure``, ``metrics``, ``close``, ...) for every query kind, opening the runtime the
spec's ``kind`` names: ``aggregate`` (:mod:`.aggregate`), ``operator`` (:mod:`.operator`) or
``grouped`` (:mod:`.grouped`). It exits on ``shutdown``, on SIGTERM, or when its parent (the
driver) is gone, removing its socket. No PySpark import in this process.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from typing import Dict, Optional

from . import allocator

if __name__ == "__main__":
    # Arrow's C++ default pool, which the Parquet reader and compute kernels allocate from, is
    # chosen from this variable when pyarrow loads (below); pa.set_memory_pool in
    # allocator.set_up sets only the pool that Python calls pass. A user's choice stands.
    os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
    # (read by deltalake's jemalloc when it first allocates: see allocator)
    os.environ.setdefault("_RJEM_MALLOC_CONF", allocator.DELTALAKE_MALLOC_CONF)
    allocator.tune_malloc()  # (before numpy, pyarrow and their threads allocate)

from ..protocol import messages as M
from ..protocol.errors import UnknownQuery
from ..protocol.specs import spec_from_wire
from .receiver import Receiver
from .runtime import Runtime

__all__ = ["HostDaemon", "main"]


class HostDaemon:
    """Routes data-source commits and control requests to the queries' runtimes."""

    def __init__(self, socket_path: str, tcp_host: Optional[str] = None,
                 secret: Optional[bytes] = None, lease_s: float = 0.0):
        self._runtimes: Dict[str, type] = {}
        self.lease_s = lease_s
        self.renewed = time.monotonic()  # the driver's last request (its lease)
        self._loaded = threading.Event()  # the engine modules (numba) are imported: see load()
        self._load_error: Optional[BaseException] = None
        self.queries: Dict[str, Runtime] = {}
        self._opening: Dict[str, threading.Event] = {}  # set once its open ended (well or not)
        self.stop_event = threading.Event()
        self.signalled = False  # set by SIGTERM (a handler must not take the Event's lock)
        self.receiver = Receiver(socket_path=socket_path, on_commit=self._on_commit,
                                 tcp_host=tcp_host, secret=secret)
        self.receiver.on_request = self._renew
        for message, handler in (
                (M.Open, self._open), (M.IngestFiles, self._ingest_files), (M.Step, self._step),
                (M.Submit, lambda m: self._query(m).submit(m.batch, m.stream_max_ms,
                                                            m.watermark_ms, m.await_result)),
                (M.Result, lambda m: self._query(m).result(m.batch)),
                (M.Saved, lambda m: self._query(m).wait_saved()),
                (M.Flush, self._flush),
                (M.Flushed, lambda m: self._query(m).flushed()),
                (M.WriteDelta, self._write_delta), (M.CreateDelta, self._create_delta),
                (M.PrepareDelta, self._prepare_delta), (M.CommitDelta, self._commit_delta),
                (M.Reconfigure, lambda m: self._query(m).reconfigure(m.parallelism, m.owner_map,
                                                                     m.persist)),
                (M.Cancel, lambda m: self._query(m).cancel(m.batch) or M.Empty()),
                (M.Metrics, self._metrics), (M.Close, self._close), (M.Shutdown, self._shutdown)):
            self.receiver.register(message, handler)

    def load(self) -> None:
        """Import the runtimes (numba and its kernels: most of a start). Runs after READY, so
        the receiver already takes a first batch's rows while it does; ``open`` waits for it."""
        try:
            from .aggregate import AggregateRuntime
            from .grouped import GroupedRuntime
            from .operator import OperatorRuntime

            self._runtimes = {"aggregate": AggregateRuntime, "operator": OperatorRuntime,
                              "grouped": GroupedRuntime}
        except BaseException as e:
            self._load_error = e
        finally:
            self._loaded.set()

    def _renew(self, msg: M.Request) -> None:
        # The driver's requests (a ping, any control op, a job's commit) renew its lease; the
        # executors' data requests do not: an engine whose driver is gone must end.
        if not isinstance(msg, (M.Write, M.Read, M.Schema)):
            self.renewed = time.monotonic()

    def _query(self, msg) -> Runtime:
        return self._runtime(msg.query)

    def _runtime(self, qid: str) -> Runtime:
        rt = self.queries.get(qid)
        if rt is None:
            raise UnknownQuery(f"query {qid} is not open on this host engine")
        return rt

    def _on_commit(self, stream: str, job: str, table) -> None:
        qid, _, rest = stream.partition(":")
        if qid not in self.queries:  # a first batch may arrive while its query is being opened
            self._opening.setdefault(qid, threading.Event()).wait(60)
        self._runtime(qid).ingest(rest, job, table)

    def _open(self, msg: M.Open) -> M.Opened:
        opened = self._opening.setdefault(msg.query, threading.Event())
        try:
            spec = spec_from_wire(msg.spec)
            self._loaded.wait()
            if self._load_error is not None:
                raise RuntimeError(f"the engine failed to load: {self._load_error!r}")
            if msg.query not in self.queries:
                rt = self.queries[msg.query] = self._runtimes[spec.kind](msg.query, spec,
                                                                        self.receiver)
                if spec.input_schema is not None and hasattr(rt, "warm_up"):
                    threading.Thread(target=rt.warm_up, name="stretch-warm-up",
                                     daemon=True).start()
            return self.queries[msg.query].describe()
        finally:
            opened.set()

    def _ingest_files(self, msg: M.IngestFiles) -> M.FilesIngested:
        return self._query(msg).ingest_files(msg)

    def _step(self, msg: M.Step) -> M.StepResult:
        return self._query(msg).step(msg.batch, msg.batch_ts_ms, msg.stream_max_ms,
                                     watermarks=msg.watermarks)

    def _flush(self, msg: M.Flush) -> M.FlushResult:
        rt = self._query(msg)
        if msg.stream_max_ms:
            with rt.lock:
                rt.fold_event_times(msg.stream_max_ms)
        return rt.flush()

    def _write_delta(self, msg: M.WriteDelta) -> M.DeltaWritten:
        # The output offered on a stream, appended to a Delta table from here.
        from .delta import append

        self._query(msg)
        return M.DeltaWritten(**append(msg.path, self.receiver.offered(msg.stream), msg.app_id,
                                       msg.version))

    def _prepare_delta(self, msg: M.PrepareDelta) -> M.DeltaPrepared:
        from .delta import prepare

        self._query(msg)
        got = prepare(msg.path, self.receiver.offered(msg.stream), msg.app_id, msg.version)
        return M.DeltaPrepared(**{k: v for k, v in got.items() if k != "written"})

    def _commit_delta(self, msg: M.CommitDelta) -> M.DeltaWritten:
        from .delta import commit

        return M.DeltaWritten(**commit(msg.path, msg.actions, msg.app_id, msg.version))

    def _create_delta(self, msg: M.CreateDelta) -> M.DeltaCreated:
        # The sink's table, empty, instead of a Spark job making it.
        from .delta import create

        return M.DeltaCreated(**create(msg.path, M.schema_from_wire(msg.schema)))

    def _metrics(self, msg: M.Metrics) -> M.Figures:
        # writer_pids: the executor JVMs that wrote to this host engine (one engine, many JVMs)
        return M.Figures({**self._query(msg).metrics(),
                          "writer_pids": sorted(self.receiver.writer_pids),
                          "bytes_in": dict(self.receiver.bytes_in),
                          "refused": self.receiver.refused,
                          "engine_pid": os.getpid(), "kernels": _kernels()})

    def _close(self, msg: M.Close) -> M.Closed:
        self._opening.pop(msg.query, None)
        rt = self.queries.pop(msg.query, None)
        if rt is not None:
            rt.close()
            _record_signatures()
        return M.Closed(len(self.queries))

    def _shutdown(self, msg: M.Shutdown) -> M.Empty:
        self.stop_event.set()
        return M.Empty()

    def serve(self, parent: int) -> None:
        tcp = self.receiver.tcp_endpoint
        print("READY" if tcp is None else f"READY {tcp} {os.getpid()}", flush=True)
        threading.Thread(target=self.load, name="stretch-load", daemon=True).start()
        while not (self.stop_event.is_set() or self.signalled):
            if parent and os.getppid() != parent:  # the driver is gone: do not outlive it
                break
            if self.lease_s and time.monotonic() - self.renewed > self.lease_s:
                print(f"stretch engine {os.getpid()}: the driver did not renew its lease in "
                      f"{self.lease_s:g} s; exiting", file=sys.stderr, flush=True)
                break  # (the driver is gone, or cannot reach this host any more)
            self.stop_event.wait(0.2)  # a shutdown request ends the wait at once
        orphaned = not self.stop_event.is_set()
        closing = threading.Thread(target=self._close_all, args=(orphaned,), name="stretch-close",
                                   daemon=True)
        closing.start()
        # Its driver gone (SIGTERM, or no parent), the engine does not wait long for a step in
        # flight: what is on disk is whole checkpoints and logged inputs, and a restart redoes it.
        closing.join(5.0 if orphaned else None)
        if closing.is_alive():  # (a step still runs: what it leaves on the host goes now)
            for rt in list(self.queries.values()):
                try:
                    rt.abandon()
                except Exception:
                    traceback.print_exc()
        self.receiver.close()

    def _close_all(self, orphaned: bool = False) -> None:
        for rt in list(self.queries.values()):
            # An orphan's requests in flight (a Delta append) run until the process exits: it
            # keeps each query's checkpoint lock till then, so a restart cannot write beside it.
            rt.keep_checkpoint_lock = orphaned
            rt.close()
        _record_signatures()


def _kernels() -> Optional[str]:
    """What runs the engine's kernels in this process: ``"library"`` (built ahead of time,
    numba not imported), ``"numba"``, or None (no kernel loaded: the drop-in's queries)."""
    jit = sys.modules.get("spark_stretch.engine.jit")
    if jit is None:
        return None
    return "numba" if jit.numba_loaded() else "library"


def _record_signatures() -> None:
    """Keep the kernel signatures numba compiled here, for the kernels' library
    (``engine/aot.py``: ``python -m spark_stretch warm`` builds it). Best effort."""
    if "spark_stretch.engine.jit" not in sys.modules:
        return  # (the engine never loaded: nothing compiled)
    try:
        from ..engine.jit import record_signatures

        record_signatures()
    except Exception:
        traceback.print_exc()


# What the engine imports (some of it lazily, in a thread): missing ones are named at start.
_NEEDS = ("numpy", "pyarrow", "numba", "msgspec", "deltalake", "pandas")


def preflight(driver_version: Optional[str]) -> Optional[str]:
    """Why this Python cannot run the driver's engine (another spark-stretch version, a missing
    dependency), or None."""
    from importlib.util import find_spec

    from ..protocol.version import __version__

    if driver_version and driver_version != __version__:
        return (f"spark-stretch {__version__} is installed there, the driver runs "
                f"{driver_version}")
    missing = [m for m in _NEEDS if find_spec(m) is None]
    if missing:
        return "no module named " + ", ".join(f"'{m}'" for m in missing) + " there"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spark_stretch.host.daemon",
                                 description="spark-stretch host engine")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--parent", type=int, default=0)
    ap.add_argument("--nice", type=int, default=0, help="run behind the host's other work")
    ap.add_argument("--tcp", default=None, help="also listen on TCP at this (host's) address; "
                    "the application's secret is the first line of standard input")
    ap.add_argument("--lease", type=float, default=0.0,
                    help="exit when the driver has sent nothing for this many seconds")
    ap.add_argument("--driver-version", default=None,
                    help="the driver's spark-stretch version: refuse to start on another")
    args = ap.parse_args(argv)
    problem = preflight(args.driver_version)
    if problem:  # (the launcher on an executor host reports this line, naming the host)
        print(f"STRETCH-ERROR {problem}", file=sys.stderr, flush=True)
        return 3
    secret = sys.stdin.buffer.readline().strip() if args.tcp else None
    if args.nice:
        os.nice(args.nice)  # (its threads and instance processes inherit it)
    # A batch's rows arrive (a socket read per chunk, each taking the GIL back) while the
    # previous batch is stepped in another thread: hand the GIL over after 0.2 ms, not 5 ms, so
    # the executors writing them do not wait on a blocked reader (the ingest job: -6%).
    sys.setswitchinterval(0.0002)
    allocator.set_up()
    try:
        daemon = HostDaemon(args.socket, tcp_host=args.tcp, secret=secret, lease_s=args.lease)
    except Exception:
        traceback.print_exc()
        return 1
    # A plain flag: Event.set() in a handler can deadlock on the lock the interrupted
    # Event.wait() holds (seen: an engine outliving its driver).
    signal.signal(signal.SIGTERM, lambda *_: setattr(daemon, "signalled", True))
    try:
        daemon.serve(args.parent)
    finally:
        # The driver (or the launcher) made the socket's directory; if the driver died first,
        # nobody else removes it.
        sock_dir = os.path.dirname(args.socket)
        if os.path.basename(sock_dir).startswith("stretch-engine-"):
            shutil.rmtree(sock_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # main() has closed every query and removed the socket: skip the interpreter's teardown
    # (unloading numba and LLVM adds a tenth of a second to every engine stop).
    os._exit(code)
