"""The host side of the ``stretch`` data source: a Unix-socket server speaking Arrow IPC.

Executor JVMs on this host write partitions to it (``df.write.format("stretch")``) and read what
it offers (``spark.read.format("stretch")``). Rows travel as Arrow record batches end to end: the
JVM converts with Spark's own ``ArrowWriter``, Python reads them with ``pyarrow.ipc``; no per-row
Python runs anywhere.

Protocol (one request per connection): a 4-byte big-endian length and a UTF-8 JSON header, then
for ``write`` an Arrow IPC stream. Replies are a framed JSON header (``{"ok": true, ...}`` or
``{"ok": false, "error": ...}``), then for ``read``/``schema`` an Arrow IPC stream.

- ``write`` (job, partition, task): stage the batches of one task attempt.
- ``commit`` (job, attempts): publish exactly the listed attempts, in partition order; drop the
  rest of the job (failed or speculative attempts never deliver).
- ``abort`` (job): drop everything staged for the job.
- ``schema`` / ``read``: the schema / the batches offered on a stream.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import socketserver
import struct
import tempfile
import threading
from collections import defaultdict
from typing import Callable, Dict, List, Optional, Tuple

import pyarrow as pa

from . import faults

__all__ = ["Receiver", "request"]

_LEN = struct.Struct(">i")
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid of the peer
CommitCallback = Callable[[str, str, pa.Table], None]


def _read_frame(f) -> dict:
    head = f.read(4)
    if len(head) < 4:
        raise ConnectionError("peer closed before sending a header")
    (n,) = _LEN.unpack(head)
    return json.loads(f.read(n))


def _write_frame(f, obj: dict) -> None:
    body = json.dumps(obj).encode()
    f.write(_LEN.pack(len(body)) + body)
    f.flush()


def request(socket_path: str, header: dict, timeout: float = 120.0) -> dict:
    """Send one control request to a receiver and return its reply (raising its error).

    Raises
    ------
    ConnectionError
        The receiver is gone (its process died or was stopped) or did not answer in time.
    RuntimeError
        The receiver answered with an error.
    """
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(socket_path)
            with s.makefile("rwb") as f:
                _write_frame(f, header)
                reply = _read_frame(f)
    except (OSError, ConnectionError, ValueError) as e:
        raise ConnectionError(f"stretch engine at '{socket_path}' is unreachable or did not answer "
                              f"'{header.get('op')}' ({type(e).__name__}: {e})") from e
    if not reply.get("ok"):
        raise RuntimeError(reply.get("error", "unknown error"))
    return reply


def _spark_compatible(table: pa.Table) -> pa.Table:
    """Cast types Spark's Arrow reader does not take (large strings, non-microsecond timestamps)."""
    fields = []
    for field in table.schema:
        t = field.type
        if pa.types.is_large_string(t):
            t = pa.string()
        elif pa.types.is_large_binary(t):
            t = pa.binary()
        elif pa.types.is_timestamp(t) and t.unit != "us":
            t = pa.timestamp("us", tz=t.tz)
        fields.append(field.with_type(t))
    schema = pa.schema(fields)
    return table if schema.equals(table.schema) else table.cast(schema)


class _Handler(socketserver.StreamRequestHandler):
    rbufsize = 1 << 20
    wbufsize = 1 << 20

    def handle(self) -> None:
        receiver: Receiver = self.server.receiver  # type: ignore[attr-defined]
        try:
            header = _read_frame(self.rfile)
        except (ConnectionError, ValueError):
            return
        try:
            op = header.get("op")
            if op in ("write", "read"):
                faults.inject(op, faults.batch_of(header.get("stream", "")))
            if op == "write":
                creds = self.request.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                _CREDS.size)
                receiver.writer_pids.add(_CREDS.unpack(creds)[0])
                reader = pa.ipc.open_stream(self.rfile)
                batches = list(reader)
                rows = receiver._stage(header, batches, reader.schema)
                _write_frame(self.wfile, {"ok": True, "rows": rows})
            elif op == "commit":
                faults.inject("commit", faults.batch_of(header["stream"]))
                rows = receiver._commit(header["stream"], header["job"],
                                        [tuple(a) for a in header["attempts"]])
                _write_frame(self.wfile, {"ok": True, "rows": rows})
            elif op == "abort":
                receiver._abort(header["stream"], header["job"])
                _write_frame(self.wfile, {"ok": True})
            elif op in ("schema", "read"):
                table = receiver.offered(header["stream"])
                if op == "read" and int(header.get("splits", 1)) > 1:
                    # Input partition `split` of `splits` reads its contiguous slice of rows.
                    k, j, n = int(header["splits"]), int(header["split"]), table.num_rows
                    table = table.slice(n * j // k, n * (j + 1) // k - n * j // k)
                _write_frame(self.wfile, {"ok": True})
                with pa.ipc.new_stream(self.wfile, table.schema) as writer:
                    if op == "read":
                        for batch in table.to_batches(max_chunksize=receiver.batch_rows):
                            writer.write_batch(batch)
                self.wfile.flush()
            elif op == "ping":
                _write_frame(self.wfile, {"ok": True, "pid": os.getpid()})
            elif op in receiver._ops:
                _write_frame(self.wfile, {"ok": True, **(receiver._ops[op](header) or {})})
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:  # the JVM side raises this text as an IOException
            try:
                _write_frame(self.wfile, {"ok": False, "error": f"{type(e).__name__}: {e}"})
            except OSError:
                pass


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True


class Receiver:
    """A host-side endpoint for the ``stretch`` data source.

    Parameters
    ----------
    socket_path : str, optional
        Where to listen. Default: a fresh temporary directory, removed on :meth:`close`.
    host : str, optional
        The host name executors on this machine report (used to route writes and to place reads).
        Default: ``$SPARK_LOCAL_IP`` or this machine's host name.
    on_commit : callable, optional
        ``on_commit(stream, job, table)`` runs once per committed write job, before the driver's
        ``save()`` returns. When given, committed data is handed over and not kept.
    batch_rows : int
        Rows per Arrow batch when serving reads.

    Examples
    --------
    >>> import pyarrow as pa
    >>> from spark_stretch.spark.receiver import Receiver
    >>> with Receiver() as r:
    ...     r.offer("out", pa.table({"x": [1, 2, 3]}))
    ...     r.endpoint.endswith(".sock")
    True

    With a session from :func:`spark_stretch.session`::

        df.write.format("stretch").mode("append").options(**r.options("in")).save()
        r.take("in")          # the committed rows, as a pyarrow.Table
        spark.read.format("stretch").options(**r.options("out")).load()
    """

    def __init__(self, socket_path: Optional[str] = None, host: Optional[str] = None,
                 on_commit: Optional[CommitCallback] = None, batch_rows: int = 65536):
        if batch_rows <= 0:
            raise ValueError(f"batch_rows must be positive, got {batch_rows}")
        self._tmpdir = None
        if socket_path is None:
            self._tmpdir = tempfile.mkdtemp(prefix="stretch-")
            socket_path = os.path.join(self._tmpdir, "receiver.sock")
        self.socket_path = str(socket_path)
        self.host = host or os.environ.get("SPARK_LOCAL_IP") or socket.gethostname()
        self.batch_rows = batch_rows
        self._on_commit = on_commit
        self._lock = threading.Lock()
        self._staged: Dict[Tuple[str, str], Dict[Tuple[int, int], List[pa.RecordBatch]]] = \
            defaultdict(dict)
        self._schemas: Dict[Tuple[str, str], pa.Schema] = {}
        self._committed: Dict[str, List[pa.Table]] = defaultdict(list)
        self._offers: Dict[str, pa.Table] = {}
        self._ops: Dict[str, Callable[[dict], Optional[dict]]] = {}
        self.jobs_committed = 0
        #: pids of the processes (executor JVMs) that wrote to this receiver
        self.writer_pids: set = set()
        self._server = _Server(self.socket_path, _Handler)
        self._server.receiver = self  # type: ignore[attr-defined]
        # serve_forever polls for shutdown() every poll_interval (default 0.5 s, paid by every
        # engine stop)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name="stretch-receiver", daemon=True)
        self._thread.start()

    # -- public ---------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """``host=/socket/path``: the value of the data source's ``endpoints`` option."""
        return f"{self.host}={self.socket_path}"

    def options(self, stream: str) -> Dict[str, str]:
        """Options for ``format("stretch")`` reading or writing ``stream`` through this receiver."""
        return {"endpoints": self.endpoint, "stream": stream}

    def offer(self, stream: str, data) -> None:
        """Offer ``data`` (a pyarrow Table or RecordBatch, or None to withdraw) to readers of ``stream``."""
        if data is None:
            with self._lock:
                self._offers.pop(stream, None)
            return
        if isinstance(data, pa.RecordBatch):
            data = pa.Table.from_batches([data])
        if not isinstance(data, pa.Table):
            raise TypeError(f"offer() needs a pyarrow Table or RecordBatch, got {type(data).__name__}")
        with self._lock:
            self._offers[stream] = _spark_compatible(data)

    def register(self, op: str, handler: Callable[[dict], Optional[dict]]) -> None:
        """Serve control requests ``{"op": op, ...}`` with ``handler(header) -> dict`` (the reply)."""
        if op in ("write", "commit", "abort", "schema", "read", "ping"):
            raise ValueError(f"op '{op}' is part of the data protocol")
        self._ops[op] = handler

    def take(self, stream: str) -> Optional[pa.Table]:
        """Remove and return everything committed on ``stream`` so far (None if nothing)."""
        with self._lock:
            tables = self._committed.pop(stream, [])
        return pa.concat_tables(tables) if tables else None

    def close(self) -> None:
        """Stop serving and remove the socket (and its temporary directory)."""
        stopping = threading.Thread(target=self._server.shutdown, name="stretch-receiver-stop")
        stopping.start()
        while stopping.is_alive():  # a connection wakes serve_forever's poll to see shutdown()
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(self.socket_path)
            except OSError:
                pass
            stopping.join(0.005)
        self._server.server_close()
        self._thread.join(timeout=10)
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> "Receiver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- protocol -------------------------------------------------------------------------------
    def _stage(self, header: dict, batches: List[pa.RecordBatch], schema: pa.Schema) -> int:
        key = (header["stream"], header["job"])
        with self._lock:
            self._staged[key][(int(header["partition"]), int(header["task"]))] = batches
            self._schemas[key] = schema
        return sum(b.num_rows for b in batches)

    def _commit(self, stream: str, job: str, attempts: List[Tuple[int, int]]) -> int:
        with self._lock:
            staged = self._staged.pop((stream, job), {})
            schema = self._schemas.pop((stream, job), None)
            missing = [a for a in attempts if a not in staged]
            if missing:
                raise RuntimeError(f"job {job} commits attempts {missing} that were never staged")
            batches = [b for a in sorted(attempts) for b in staged[a]]
        if schema is None:  # every partition was empty: nothing was ever written to us
            return 0
        table = pa.Table.from_batches(batches, schema=schema)
        if self._on_commit is not None:
            self._on_commit(stream, job, table)
        else:
            with self._lock:
                self._committed[stream].append(table)
        with self._lock:
            self.jobs_committed += 1
        return table.num_rows

    def _abort(self, stream: str, job: str) -> None:
        with self._lock:
            self._staged.pop((stream, job), None)
            self._schemas.pop((stream, job), None)

    def offered(self, stream: str) -> pa.Table:
        """The table offered on ``stream`` (KeyError if none)."""
        with self._lock:
            table = self._offers.get(stream)
        if table is None:
            raise KeyError(f"nothing is offered on stream '{stream}'")
        return table
