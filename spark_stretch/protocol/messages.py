"""One typed message per operation on a host engine, each with its typed reply.

On the wire a request is the header ``{"v": PROTOCOL_VERSION, "op": <op>, <fields>}`` and a
reply ``{"ok": true, <fields>}`` (see :mod:`.framing`; a failed reply is :mod:`.errors`'). The
receiver decodes a header with :func:`decode_request`, which refuses an unknown op, a missing or
ill-typed field and another protocol version as :class:`~.errors.BadRequest`; fields it does not
know are ignored, so a newer peer may add some.

*Data* operations come from executor JVMs (``jvm_shim/``: ``write``, ``commit``, ``abort``,
``schema``, ``read``); *control* operations from the driver (:mod:`spark_stretch.driver`).

Examples
--------
>>> from spark_stretch.protocol.messages import Step, decode_request, encode_request
>>> wire = encode_request(Step(query="q1", batch=3))
>>> wire["op"], wire["batch"]
('step', 3)
>>> decode_request(wire)
Step(query='q1', batch=3, batch_ts_ms=None, stream_max_ms=None, watermarks=None)
>>> decode_request({"v": 1, "op": "step", "query": "q1", "batch": "three"})
Traceback (most recent call last):
...
spark_stretch.protocol.errors.BadRequest: 'step': Expected `int`, got `str` - at `$.batch`
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import ClassVar, Dict, List, Optional, Tuple

import msgspec
import pyarrow as pa

from .errors import BadRequest

__all__ = ["PROTOCOL_VERSION", "Request", "Reply", "decode_request", "encode_request",
           "decode_reply", "encode_reply", "schema_to_wire", "schema_from_wire", "Write", "Commit", "Abort", "Schema", "Read", "Ping",
           "Open", "IngestFiles", "Step", "Submit", "Result", "Saved", "Flush", "Flushed",
           "WriteDelta", "PrepareDelta", "CommitDelta", "CreateDelta", "Reconfigure", "Metrics", "Cancel", "Close",
           "Shutdown", "Empty", "Staged", "Pong", "Opened", "FilesIngested", "StepResult", "Submitted",
           "SaveStats", "FlushResult", "DeltaWritten", "DeltaPrepared", "DeltaCreated", "Reconfigured",
           "Figures", "Closed"]

PROTOCOL_VERSION = 1
_REQUESTS: Dict[str, type] = {}


class Reply:
    """Base of replies: :meth:`to_dict` is the reply without its unset (None) fields."""

    def to_dict(self) -> dict:
        return {k: v for k, v in msgspec.to_builtins(self).items() if v is not None}


class Request:
    """Base of requests: ``op`` names it on the wire, ``reply`` is the type of its answer."""

    op: ClassVar[str] = ""
    reply: ClassVar[type] = Reply

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.op:
            _REQUESTS[cls.op] = cls


# -- replies -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Empty(Reply):
    """A request done, nothing to report."""


@dataclass(frozen=True)
class Staged(Reply):
    rows: int


@dataclass(frozen=True)
class Pong(Reply):
    pid: int


@dataclass(frozen=True)
class Opened(Reply):
    """The query is open. ``replay``: the batches to step and write again, in order (a
    checkpoint's stored output, then logged inputs); ``checkpoint``: the batch of the state it
    continued from (None: from the start)."""

    query: str
    parallelism: int
    max_parallelism: int
    replay: List[int] = field(default_factory=list)
    checkpoint: Optional[int] = None
    instance_pids: List[int] = field(default_factory=list)
    stream_max_ms: Optional[List[Optional[int]]] = None  # (the event times its state has seen)


@dataclass(frozen=True)
class FilesIngested(Reply):
    """The batch's files were read (``rows``, and per watermark column ``[max, min, avg,
    count]`` of its event times in ms), or ``unsupported`` says why Spark must read them."""

    rows: int = 0
    event_times: List[Tuple[int, int, float, int]] = field(default_factory=list)
    unsupported: Optional[str] = None


@dataclass(frozen=True)
class StepResult(Reply):
    """A step's output: ``rows`` offered on ``stream`` for the executors (or a Delta append)."""

    rows: int
    stream: str
    metrics: Dict[str, object] = field(default_factory=dict)
    replayed: bool = False


@dataclass(frozen=True)
class Submitted(Reply):
    batch: int


@dataclass(frozen=True)
class SaveStats(Reply):
    """The last checkpoint: ``kind`` is ``full``, ``delta`` or ``log`` (the batch is in the input
    log, ``checkpoint`` the one it builds on)."""

    batch: Optional[int] = None
    kind: Optional[str] = None
    checkpoint: Optional[int] = None
    buckets: Optional[int] = None
    changed_rows: Optional[int] = None  # (the drop-in's: rows its changelogs hold)
    bytes: Optional[int] = None
    snapshot_ms: Optional[float] = None
    write_ms: Optional[float] = None


@dataclass(frozen=True)
class FlushResult(Reply):
    """Spark's no-data batch after ``batch``: ``rows`` on ``stream``; ``changed``: the state
    moved (the watermark), so it must be checkpointed once the sink has the rows."""

    rows: int
    batch: int
    stream: Optional[str] = None
    changed: bool = False
    metrics: Dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class DeltaWritten(Reply):
    """``written`` False and no ``unsupported``: the table had the version already (a replay).
    ``unsupported``: Spark must write it, this once (``permanent`` False) or from now on."""

    written: bool
    ms: Optional[float] = None
    unsupported: Optional[str] = None
    permanent: Optional[bool] = None


@dataclass(frozen=True)
class DeltaPrepared(Reply):
    """A host's data files for one Delta commit (``actions``: their add actions), or why the
    engine cannot write the table (then Spark does, as for :class:`DeltaWritten`)."""

    actions: List[Dict[str, object]] = field(default_factory=list)
    done: bool = False                 # the table holds the version already: nothing written
    ms: Optional[float] = None
    unsupported: Optional[str] = None
    permanent: Optional[bool] = None


@dataclass(frozen=True)
class DeltaCreated(Reply):
    created: bool
    ms: Optional[float] = None
    unsupported: Optional[str] = None


@dataclass(frozen=True)
class Reconfigured(Reply):
    """An epoch switch: the fields of both runtimes (the unset ones are left out of
    :meth:`to_dict`)."""

    epoch: int
    parallelism: int
    switch_ms: float
    after_batch: int
    live_windows: Optional[int] = None
    moved_buckets: Optional[int] = None
    state_keys: Optional[int] = None
    state_copied_bytes: Optional[int] = None


@dataclass(frozen=True)
class Figures(Reply):
    """A runtime's figures (counters, watermark, switches, ...): free-form by design."""

    figures: Dict[str, object]


@dataclass(frozen=True)
class Closed(Reply):
    open_queries: int


# -- data operations (executor JVMs) ---------------------------------------------------------
@dataclass(frozen=True)
class Write(Request):
    """Stage one task attempt's Arrow stream (follows the header) under (job, partition, task)."""

    op: ClassVar[str] = "write"
    reply: ClassVar[type] = Staged
    stream: str
    job: str
    partition: int
    task: int
    attempt: int = 0


@dataclass(frozen=True)
class Commit(Request):
    """Publish exactly the listed ``[partition, task]`` attempts of ``job``; drop the rest."""

    op: ClassVar[str] = "commit"
    reply: ClassVar[type] = Staged
    stream: str
    job: str
    attempts: List[Tuple[int, int]]


@dataclass(frozen=True)
class Abort(Request):
    op: ClassVar[str] = "abort"
    reply: ClassVar[type] = Empty
    stream: str
    job: str


@dataclass(frozen=True)
class Schema(Request):
    """The schema offered on ``stream`` (an Arrow IPC stream with no batches follows)."""

    op: ClassVar[str] = "schema"
    reply: ClassVar[type] = Empty
    stream: str
    partition: int = 0


@dataclass(frozen=True)
class Read(Request):
    """Input partition ``split`` of ``splits`` of what is offered on ``stream`` (Arrow follows)."""

    op: ClassVar[str] = "read"
    reply: ClassVar[type] = Empty
    stream: str
    partition: int = 0
    split: int = 0
    splits: int = 1


@dataclass(frozen=True)
class Ping(Request):
    op: ClassVar[str] = "ping"
    reply: ClassVar[type] = Pong


# -- control operations (the driver) ---------------------------------------------------------
@dataclass(frozen=True)
class Open(Request):
    """Open a query (its spec: :func:`.specs.spec_to_wire`); idempotent for an open one."""

    op: ClassVar[str] = "open"
    reply: ClassVar[type] = Opened
    query: str
    spec: Dict[str, object]


@dataclass(frozen=True)
class IngestFiles(Request):
    """Read a batch's Parquet files as its input (Spark would only read them)."""

    op: ClassVar[str] = "ingest_files"
    reply: ClassVar[type] = FilesIngested
    query: str
    batch: int
    files: List[str]
    columns: List[str]
    schema: str             # the columns' Arrow schema (base64 IPC)
    watermarks: List[str]   # the columns whose event-time statistics Spark keeps


@dataclass(frozen=True)
class Step(Request):
    """Step a batch now (the drop-in; a replayed batch). ``batch_ts_ms``: its processing time."""

    op: ClassVar[str] = "step"
    reply: ClassVar[type] = StepResult
    query: str
    batch: int
    batch_ts_ms: Optional[int] = None
    # A query on several hosts: each input stream's largest event time (ms) over every host
    # up to the batch before (the engine folds it into its own, so all agree on W_N)
    stream_max_ms: Optional[List[Optional[int]]] = None
    # Spark's watermarks of the batch (ms), late events' and eviction's (W_{N-1}, W_N), where
    # Spark's own operator has them (the drop-in inside Spark's plan): used in place of the
    # engine's own
    watermarks: Optional[List[int]] = None


@dataclass(frozen=True)
class Submit(Request):
    """Log a batch's input (then Spark may commit it) and step it in the background."""

    op: ClassVar[str] = "submit"
    reply: ClassVar[type] = Submitted
    query: str
    batch: int
    stream_max_ms: Optional[List[Optional[int]]] = None  # (as for Step)
    # Spark's own watermark for the batch (its state operator's eviction watermark, ms), which
    # the engine then takes as W_N in place of its own (``stretch(df)``: an aggregation of
    # another's windows, or of one of several streams, has Spark's global watermark)
    watermark_ms: Optional[int] = None
    # The driver asks for the Result before Spark may commit the batch (inside Spark's plan):
    # the input is logged while the batch steps, and Result waits for both. Otherwise Spark may
    # commit the batch once this returns, so the input is logged before it does.
    await_result: bool = False


@dataclass(frozen=True)
class Result(Request):
    """Wait for a submitted batch's step."""

    op: ClassVar[str] = "result"
    reply: ClassVar[type] = StepResult
    query: str
    batch: int


@dataclass(frozen=True)
class Saved(Request):
    """Wait until the last checkpoint is on disk; its figures."""

    op: ClassVar[str] = "saved"
    reply: ClassVar[type] = SaveStats
    query: str


@dataclass(frozen=True)
class Flush(Request):
    """Spark's no-data batch: emit what the next watermark closes."""

    op: ClassVar[str] = "flush"
    reply: ClassVar[type] = FlushResult
    query: str
    stream_max_ms: Optional[List[Optional[int]]] = None  # (as for Step)


@dataclass(frozen=True)
class Flushed(Request):
    """The sink holds the last flush: checkpoint the state after it."""

    op: ClassVar[str] = "flushed"
    reply: ClassVar[type] = Submitted
    query: str


@dataclass(frozen=True)
class _DeltaOutput(Request):
    """The output offered on ``stream``, for the Delta table at ``path`` as (app, version)."""

    query: str
    stream: str
    path: str
    app_id: str
    version: int


@dataclass(frozen=True)
class WriteDelta(_DeltaOutput):
    """Append what is offered on ``stream`` to the Delta table at ``path`` as (app, version)."""

    op: ClassVar[str] = "write_delta"
    reply: ClassVar[type] = DeltaWritten


@dataclass(frozen=True)
class PrepareDelta(_DeltaOutput):
    """Write the output offered on a stream into a Delta table's directory as data files,
    uncommitted: their add actions, for one commit of every host's files (:class:`CommitDelta`)."""

    op: ClassVar[str] = "prepare_delta"
    reply: ClassVar[type] = DeltaPrepared


@dataclass(frozen=True)
class CommitDelta(Request):
    """Commit data files that hosts wrote (:class:`PrepareDelta`) as one Delta commit of
    transaction ``(app_id, version)``, unless the table already holds it."""

    op: ClassVar[str] = "commit_delta"
    reply: ClassVar[type] = DeltaWritten
    query: str
    path: str
    app_id: str
    version: int
    actions: List[Dict[str, object]]


@dataclass(frozen=True)
class CreateDelta(Request):
    """Create the sink's Delta table, empty, with ``schema`` (base64 Arrow IPC)."""

    op: ClassVar[str] = "create_delta"
    reply: ClassVar[type] = DeltaCreated
    path: str
    schema: str


@dataclass(frozen=True)
class Reconfigure(Request):
    """Switch epoch between two batches: a new parallelism and/or owner map. ``persist``:
    checkpoint the state after the switch (an elastic controller's switches are not: a restart
    re-applies or re-decides them). ``host``: on several hosts, the host whose instances switch
    (the driver sends it there only; None: every host's)."""

    op: ClassVar[str] = "reconfigure"
    reply: ClassVar[type] = Reconfigured
    query: str
    parallelism: Optional[int] = None
    owner_map: Optional[List[int]] = None
    persist: bool = True
    host: Optional[str] = None


@dataclass(frozen=True)
class Metrics(Request):
    op: ClassVar[str] = "metrics"
    reply: ClassVar[type] = Figures
    query: str


@dataclass(frozen=True)
class Cancel(Request):
    """Give up the step of ``batch`` if it is still running (Spark is stopping the query): it
    fails at once instead of running to its end; the query's close comes next."""

    op: ClassVar[str] = "cancel"
    reply: ClassVar[type] = Empty
    query: str
    batch: int


@dataclass(frozen=True)
class Close(Request):
    op: ClassVar[str] = "close"
    reply: ClassVar[type] = Closed
    query: str


@dataclass(frozen=True)
class Shutdown(Request):
    op: ClassVar[str] = "shutdown"
    reply: ClassVar[type] = Empty


# -- the wire --------------------------------------------------------------------------------
def schema_to_wire(schema: pa.Schema) -> str:
    """An Arrow schema as a message field: its IPC serialization, base64."""
    return base64.b64encode(schema.serialize().to_pybytes()).decode()


def schema_from_wire(text: str) -> pa.Schema:
    """The Arrow schema of a message field (:func:`schema_to_wire`)."""
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


def encode_request(msg: Request) -> dict:
    """The header of ``msg``."""
    return {"v": PROTOCOL_VERSION, "op": msg.op, **msgspec.to_builtins(msg)}


def decode_request(header: dict) -> Request:
    """The typed request of a header (BadRequest: not one of ours)."""
    op = header.get("op")
    cls = _REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise BadRequest(f"unknown op {op!r}; known: {sorted(_REQUESTS)}")
    if header.get("v") != PROTOCOL_VERSION:
        raise BadRequest(f"'{op}' of protocol version {header.get('v')!r}: this side speaks "
                         f"version {PROTOCOL_VERSION} (a shim jar or engine of another "
                         "spark-stretch version?)")
    try:
        return msgspec.convert({k: v for k, v in header.items() if k not in ("v", "op")}, cls)
    except msgspec.ValidationError as e:
        raise BadRequest(f"'{op}': {e}") from None


def encode_reply(reply: Reply) -> dict:
    return {"ok": True, **msgspec.to_builtins(reply)}


def decode_reply(request: Request, header: dict):
    """The typed reply to ``request`` in a (successful) reply header."""
    try:
        return msgspec.convert({k: v for k, v in header.items() if k != "ok"}, request.reply)
    except msgspec.ValidationError as e:
        raise BadRequest(f"reply to '{request.op}': {e}") from None
