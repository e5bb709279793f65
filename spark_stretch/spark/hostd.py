"""The host engine process: one per host, shared by every executor and task on it.

Started by :class:`spark_stretch.spark.host.HostEngine` as ``python -m spark_stretch.spark.hostd``.
It serves the ``stretch`` data source on a Unix socket (executors write input and read results)
and the driver's control requests (``open``, ``step`` or ``submit``/``result``, ``reconfigure``,
``metrics``, ``close``) for every query kind: ``stretchAggregate`` with built-in aggregations
(:mod:`.bridge`) or an engine operator (:mod:`.operator_runtime`), and the
``applyInPandasWithState`` drop-in (:mod:`.grouped_runtime`), chosen by the ``kind`` of the
``open`` spec. It exits on ``shutdown``, on SIGTERM, or when its parent (the driver) is gone,
removing its socket.
"""

from __future__ import annotations

import argparse
import base64
import os
import shutil
import signal
import sys
import threading
import traceback
from typing import Optional

import pyarrow as pa

from .receiver import Receiver


class HostDaemon:
    """Routes data-source commits and control requests to the queries' runtimes."""

    def __init__(self, socket_path: str):
        self._QueryRuntime = None
        self._loaded = threading.Event()  # the engine modules (numba) are imported: see load()
        self._load_error: Optional[BaseException] = None
        self.queries = {}
        self._opening: dict = {}  # query -> Event, set once its open ended (well or not)
        self.stop_event = threading.Event()
        self.signalled = False  # set by SIGTERM (a handler must not take the Event's lock)
        self.receiver = Receiver(socket_path=socket_path, on_commit=self._on_commit)
        for op in ("open", "ingest_files", "step", "submit", "result", "saved", "flush", "flushed",
                   "write_delta", "create_delta", "reconfigure", "metrics", "close", "shutdown"):
            self.receiver.register(op, getattr(self, f"_op_{op}"))

    def load(self) -> None:
        """Import the engine (numba and its kernels: most of a start). Runs after READY, so
        the receiver already takes a first batch's rows while it does; ``open`` waits for it."""
        try:
            from .bridge import QueryRuntime

            self._QueryRuntime = QueryRuntime
        except BaseException as e:
            self._load_error = e
        finally:
            self._loaded.set()

    def _query(self, header):
        qid = header["query"]
        if qid not in self.queries:
            raise KeyError(f"query {qid} is not open on this host engine")
        return self.queries[qid]

    def _on_commit(self, stream: str, job: str, table) -> None:
        qid, _, rest = stream.partition(":")
        if qid not in self.queries:  # a first batch may arrive while its query is being opened
            self._opening.setdefault(qid, threading.Event()).wait(60)
        self._query({"query": qid}).ingest(rest, job, table)

    def _op_open(self, h):
        qid = h["query"]
        opened = self._opening.setdefault(qid, threading.Event())
        try:
            return self._open(qid, h)
        finally:
            opened.set()

    def _open(self, qid, h):
        self._loaded.wait()
        if self._load_error is not None:
            raise RuntimeError(f"the engine failed to load: {self._load_error!r}")
        if qid not in self.queries:
            kind = h["spec"].get("kind", "aggregate")
            if kind == "grouped":
                from .grouped_runtime import GroupedRuntime as runtime
            elif kind == "aggregate":
                runtime = self._QueryRuntime
            elif kind == "operator":
                from .operator_runtime import OperatorRuntime as runtime
            else:
                raise ValueError(f"unknown query kind {kind!r}")
            rt = self.queries[qid] = runtime(qid, h["spec"], self.receiver)
            if "input_schema" in h["spec"] and hasattr(rt, "warm_up"):
                threading.Thread(target=rt.warm_up, name="stretch-warm-up", daemon=True).start()
        return self.queries[qid].describe()

    def _op_ingest_files(self, h):
        # a batch's Parquet files, read here (StretchIngest.parquetFiles)
        schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(h["schema"])))
        return self._query(h).ingest_files(int(h["batch"]), h["files"], h["columns"], schema,
                                           h["watermarks"])

    def _op_step(self, h):
        # args: what the query kind adds (the grouped runtime: the batch's processing time)
        return self._query(h).step(int(h["batch"]), **h.get("args", {}))

    def _op_submit(self, h):
        # pipelined kinds: log the batch's input, step it in the background
        return self._query(h).submit(int(h["batch"]))

    def _op_result(self, h):
        return self._query(h).result(int(h["batch"]))

    def _op_saved(self, h):
        return self._query(h).wait_saved()

    def _op_flush(self, h):
        return self._query(h).flush(**h.get("args", {}))

    def _op_flushed(self, h):
        return self._query(h).flushed()

    def _op_write_delta(self, h):
        # The output offered on a stream, appended to a Delta table from here (delta_direct).
        from .delta_direct import append

        self._query(h)
        return append(h["path"], self.receiver.offered(h["stream"]), h["app_id"], int(h["version"]))

    def _op_create_delta(self, h):
        # The sink's table, empty (delta_direct.create), instead of a Spark job making it.
        from .delta_direct import create

        schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(h["schema"])))
        return create(h["path"], schema)

    def _op_reconfigure(self, h):
        return self._query(h).reconfigure(h.get("parallelism"), h.get("owner_map"))

    def _op_metrics(self, h):
        # writer_pids: the executor JVMs that wrote to this host engine (one engine, many JVMs)
        return {**self._query(h).metrics(), "writer_pids": sorted(self.receiver.writer_pids),
                "engine_pid": os.getpid()}

    def _op_close(self, h):
        self._opening.pop(h["query"], None)
        rt = self.queries.pop(h["query"], None)
        if rt is not None:
            rt.close()
        return {"open_queries": len(self.queries)}

    def _op_shutdown(self, h):
        self.stop_event.set()
        return {}

    def serve(self, parent: int) -> None:
        print("READY", flush=True)
        threading.Thread(target=self.load, name="stretch-load", daemon=True).start()
        while not (self.stop_event.is_set() or self.signalled):
            if parent and os.getppid() != parent:  # the driver is gone: do not outlive it
                break
            self.stop_event.wait(0.2)  # a shutdown request ends the wait at once
        orphaned = not self.stop_event.is_set()
        closing = threading.Thread(target=self._close_all, args=(orphaned,), name="stretch-close",
                                   daemon=True)
        closing.start()
        # Its driver gone (SIGTERM, or no parent), the engine does not wait long for a step in
        # flight: what is on disk is whole checkpoints and logged inputs, and a restart redoes it.
        closing.join(5.0 if orphaned else None)
        self.receiver.close()

    def _close_all(self, orphaned: bool = False) -> None:
        for rt in list(self.queries.values()):
            # An orphan's requests in flight (a Delta append) run until the process exits: it
            # keeps each query's checkpoint lock till then, so a restart cannot write beside it.
            rt.keep_checkpoint_lock = orphaned
            rt.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="spark-stretch host engine")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--parent", type=int, default=0)
    ap.add_argument("--nice", type=int, default=0, help="run behind the host's other work")
    args = ap.parse_args(argv)
    if args.nice:
        os.nice(args.nice)  # (its threads and instance processes inherit it)
    # A batch's rows arrive (a socket read per chunk, each taking the GIL back) while the
    # previous batch is stepped in another thread: hand the GIL over after 0.2 ms, not 5 ms, so
    # the executors writing them do not wait on a blocked reader (the ingest job: -6%).
    sys.setswitchinterval(0.0002)
    try:
        daemon = HostDaemon(args.socket)
    except Exception:
        traceback.print_exc()
        return 1
    # A plain flag: Event.set() in a handler can deadlock on the lock the interrupted
    # Event.wait() holds (seen: an engine outliving its driver).
    signal.signal(signal.SIGTERM, lambda *_: setattr(daemon, "signalled", True))
    try:
        daemon.serve(args.parent)
    finally:
        # The driver made the socket's directory; if the driver died first, nobody else removes it.
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
