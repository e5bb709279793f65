"""The host side of the ``stretch`` data source: a Unix-socket server speaking Arrow IPC.

Executor JVMs on this host write partitions to it (``df.write.format("stretch")``) and read what
it offers (``spark.read.format("stretch")``). Rows travel as Arrow record batches end to end: the
JVM converts with Spark's own ``ArrowWriter``, Python reads them with ``pyarrow.ipc``; no per-row
Python runs anywhere. It runs in the host engine process (:mod:`.daemon`), which also registers
its control operations on it, or standalone in any process (the bare data-source plumbing).

Frames and messages are :mod:`spark_stretch.protocol`'s: one request per connection, its typed
message decoded first (anything else is refused with ``BAD_REQUEST``; the connection closes and
other clients are not affected).

- ``write`` (job, partition, task): stage the batches of one task attempt.
- ``commit`` (job, attempts): publish exactly the listed attempts, in partition order; drop the
  rest of the job (failed or speculative attempts never deliver).
- ``abort`` (job): drop everything staged for the job.
- ``schema`` / ``read``: the schema / the batches offered on a stream.
"""

from __future__ import annotations

import logging
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

from ..protocol import messages as M
from ..protocol.auth import challenge, verify
from ..protocol.errors import BadRequest, NotOffered, StretchError, error_reply
from ..protocol.framing import read_header, write_header
from . import faults

__all__ = ["Receiver"]

_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid of the peer
_AUTH_TIMEOUT_S = 10.0  # a TCP peer answers the challenge within this, or is dropped
_log = logging.getLogger("spark_stretch.host")
CommitCallback = Callable[[str, str, pa.Table], None]
Handler = Callable[[M.Request], M.Reply]


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


def _plain(batches: list, schema: pa.Schema):
    """The batches (and schema) with dictionary-encoded string lists cast back to lists of
    strings: the shim encodes them on their way to another host (``DictionaryLists``)."""
    fields = [f.with_type(pa.list_(f.type.value_field.with_type(f.type.value_type.value_type)))
              if pa.types.is_list(f.type) and pa.types.is_dictionary(f.type.value_type) else f
              for f in schema]
    plain = pa.schema(fields, metadata=schema.metadata)
    if plain.equals(schema):
        return batches, schema
    return [pa.RecordBatch.from_arrays([c.cast(f.type) for c, f in zip(b.columns, plain)],
                                       schema=plain) for b in batches], plain


class _Counted:
    """A binary file read through, counting the bytes (what crossed the socket)."""

    def __init__(self, f):
        self._f = f
        self.n = 0
        self.closed = False

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        b = self._f.read(size)
        self.n += len(b)
        return b


class _Handler(socketserver.StreamRequestHandler):
    rbufsize = 1 << 20
    wbufsize = 1 << 20

    def handle(self) -> None:
        receiver: Receiver = self.server.receiver  # type: ignore[attr-defined]
        tcp = self.server.secret is not None  # type: ignore[attr-defined]
        if tcp and not self._authenticated(receiver):
            return
        try:
            msg = M.decode_request(read_header(self.rfile))
            if isinstance(msg, (M.Write, M.Read)):
                faults.inject(msg.op, faults.batch_of(msg.stream))
            if receiver.on_request is not None:
                receiver.on_request(msg)
            if isinstance(msg, M.Write):
                if not tcp:  # (the executor JVM's pid: a Unix socket tells it)
                    creds = self.request.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                    _CREDS.size)
                    receiver.writer_pids.add(_CREDS.unpack(creds)[0])
                counted = _Counted(self.rfile)
                reader = pa.ipc.open_stream(counted)
                batches, schema = _plain(list(reader), reader.schema)
                rows = receiver._stage(msg, batches, schema)
                receiver.bytes_in["tcp" if tcp else "unix"] += counted.n
                write_header(self.wfile, M.encode_reply(M.Staged(rows)))
            elif isinstance(msg, (M.Schema, M.Read)):
                self._send_table(receiver, msg)
            else:
                write_header(self.wfile, M.encode_reply(receiver._handle(msg)))
        except ConnectionError:
            return  # the peer went away: nobody to answer
        except Exception as e:  # the JVM side raises this as an IOException naming the endpoint
            try:
                write_header(self.wfile, error_reply(e))
            except OSError:
                pass

    def _authenticated(self, receiver: "Receiver") -> bool:
        """A TCP peer first answers the challenge (:mod:`spark_stretch.protocol.auth`); one that
        does not is logged and dropped, the others served as before."""
        peer = self.client_address
        try:
            self.request.settimeout(_AUTH_TIMEOUT_S)
            ok = verify(self.rfile, self.server.secret, challenge(self.wfile))  # type: ignore
            self.request.settimeout(None)
        except OSError as e:
            ok, why = False, f"{type(e).__name__}: {e}"
        else:
            why = "a wrong or missing answer to the challenge"
        if not ok:
            receiver.refused += 1
            _log.warning("stretch engine: refused the connection from %s (%s)", peer, why)
        return ok

    def _send_table(self, receiver: "Receiver", msg) -> None:
        table = receiver.offered(msg.stream)
        if isinstance(msg, M.Read) and msg.splits > 1:
            # Input partition `split` of `splits` reads its contiguous slice of rows.
            k, j, n = msg.splits, msg.split, table.num_rows
            table = table.slice(n * j // k, n * (j + 1) // k - n * j // k)
        write_header(self.wfile, M.encode_reply(M.Empty()))
        with pa.ipc.new_stream(self.wfile, table.schema) as writer:
            if isinstance(msg, M.Read):
                for batch in table.to_batches(max_chunksize=receiver.batch_rows):
                    writer.write_batch(batch)
        self.wfile.flush()


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    secret = None


class _TcpServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


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
    >>> from spark_stretch import Receiver
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
                 on_commit: Optional[CommitCallback] = None, batch_rows: int = 65536,
                 tcp_host: Optional[str] = None, secret: Optional[bytes] = None):
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
        self._handlers: Dict[type, Handler] = {
            M.Commit: self._commit, M.Abort: self._abort,
            M.Ping: lambda msg: M.Pong(os.getpid())}
        self.jobs_committed = 0
        #: pids of the processes (executor JVMs) that wrote to this receiver
        self.writer_pids: set = set()
        self.refused = 0  # TCP connections refused (no or a wrong answer to the challenge)
        #: bytes of rows written to this receiver (as sent: compressed from other hosts), over
        #: TCP (from other hosts) and Unix sockets
        self.bytes_in = {"tcp": 0, "unix": 0}
        #: called with every request before it is served (the daemon's lease)
        self.on_request: Optional[Callable[[M.Request], None]] = None
        self._servers = [_Server(self.socket_path, _Handler)]
        if tcp_host is not None:  # (a specific address, never a wildcard; a port of its own)
            if not secret:
                raise ValueError("a TCP endpoint needs the application's secret")
            if tcp_host in ("", "0.0.0.0", "::"):
                raise ValueError(f"tcp_host={tcp_host!r}: bind to the host's own address")
            tcp = _TcpServer((tcp_host, 0), _Handler)
            tcp.secret = secret
            self._servers.append(tcp)
        self.tcp_port = self._servers[1].server_address[1] if tcp_host is not None else None
        self.tcp_host = tcp_host
        self._threads = []
        for srv in self._servers:
            srv.receiver = self  # type: ignore[attr-defined]
            # serve_forever polls for shutdown() every poll_interval (default 0.5 s, paid by
            # every engine stop)
            t = threading.Thread(target=srv.serve_forever, args=(0.05,), name="stretch-receiver",
                                 daemon=True)
            t.start()
            self._threads.append(t)

    # -- public ---------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """``host=/socket/path``: the value of the data source's ``endpoints`` option."""
        return f"{self.host}={self.socket_path}"

    @property
    def tcp_endpoint(self) -> Optional[str]:
        """``tcp://host:port`` of the TCP listener (None: Unix socket only)."""
        return None if self.tcp_port is None else f"tcp://{self.tcp_host}:{self.tcp_port}"

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

    def register(self, message: type, handler: Handler) -> None:
        """Serve the control request ``message`` (a :class:`~spark_stretch.protocol.messages.Request`
        class) with ``handler(msg) -> reply``."""
        if message in (M.Write, M.Commit, M.Abort, M.Schema, M.Read, M.Ping):
            raise ValueError(f"op '{message.op}' is part of the data protocol")
        self._handlers[message] = handler

    def take(self, stream: str) -> Optional[pa.Table]:
        """Remove and return everything committed on ``stream`` so far (None if nothing)."""
        with self._lock:
            tables = self._committed.pop(stream, [])
        return pa.concat_tables(tables) if tables else None

    def offered(self, stream: str) -> pa.Table:
        """The table offered on ``stream`` (:class:`~spark_stretch.protocol.errors.NotOffered` if
        none)."""
        with self._lock:
            table = self._offers.get(stream)
        if table is None:
            raise NotOffered(f"nothing is offered on stream '{stream}'")
        return table

    def close(self) -> None:
        """Stop serving and remove the socket (and its temporary directory)."""
        for srv in self._servers:
            stopping = threading.Thread(target=srv.shutdown, name="stretch-receiver-stop")
            stopping.start()
            while stopping.is_alive():  # a connection wakes serve_forever's poll
                try:
                    with socket.socket(socket.AF_UNIX) as s:
                        s.connect(self.socket_path)
                except OSError:
                    pass
                stopping.join(0.005)
            srv.server_close()
        for t in self._threads:
            t.join(timeout=10)
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
    def _handle(self, msg: M.Request) -> M.Reply:
        handler = self._handlers.get(type(msg))
        if handler is None:
            raise BadRequest(f"op '{msg.op}' is not served here (a data-source endpoint without "
                             "an engine)")
        return handler(msg)

    def _stage(self, msg: M.Write, batches: List[pa.RecordBatch], schema: pa.Schema) -> int:
        key = (msg.stream, msg.job)
        with self._lock:
            self._staged[key][(msg.partition, msg.task)] = batches
            self._schemas[key] = schema
        return sum(b.num_rows for b in batches)

    def _commit(self, msg: M.Commit) -> M.Staged:
        faults.inject("commit", faults.batch_of(msg.stream))
        attempts = [tuple(a) for a in msg.attempts]
        with self._lock:
            staged = self._staged.pop((msg.stream, msg.job), {})
            schema = self._schemas.pop((msg.stream, msg.job), None)
            missing = [a for a in attempts if a not in staged]
            if missing:
                raise StretchError(f"job {msg.job} commits attempts {missing} that were never "
                                   "staged")
            batches = [b for a in sorted(attempts) for b in staged[a]]
        if schema is None:  # every partition was empty: nothing was ever written to us
            return M.Staged(0)
        table = pa.Table.from_batches(batches, schema=schema)
        if self._on_commit is not None:
            self._on_commit(msg.stream, msg.job, table)
        else:
            with self._lock:
                self._committed[msg.stream].append(table)
        with self._lock:
            self.jobs_committed += 1
        return M.Staged(table.num_rows)

    def _abort(self, msg: M.Abort) -> M.Empty:
        with self._lock:
            self._staged.pop((msg.stream, msg.job), None)
            self._schemas.pop((msg.stream, msg.job), None)
        return M.Empty()
