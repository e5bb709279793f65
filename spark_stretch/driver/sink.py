"""Where a query's output goes: the engine appends to Delta itself, or Spark writes it.

A path-based Delta sink is appended to by the host engine (``host/delta.py``: one Delta commit
from the process that holds the rows, with the same ``txn`` action Spark's writer adds for
``txnAppId``/``txnVersion``) unless ``spark.stretch.delta.directWrite=false``; otherwise, and
whenever deltalake cannot write the table, the executors read the rows back from the engine
(``format("stretch")``) and Spark writes them, Delta idempotently per batch.

- **The table**: one that does not exist yet is created empty when the query starts, in the
  background (the first append waits for it): by the engine (:func:`spark_stretch.host.delta.create`:
  protocol 1/2, no properties, every column nullable, as Spark's writer makes it), unless the
  session sets defaults for new tables (``spark.databricks.delta.properties.defaults.*``,
  ``...protocol.*``), a column name needs column mapping (``sum(x)``) or a column's type is
  outside the plain ones (decimals, ``timestamp_ntz``, maps, ...): then Spark creates it. The
  engine casts its rows to the table's own schema (types must agree up to string sizes and
  timestamp units). A table Spark writes is made by the first batch, as Spark's Delta sink
  does, with no rows if that batch has none (:meth:`Sink.emit_empty`).
- **Spark writes instead** when the sink is a table name or has writer options (``mergeSchema``,
  ``partitionBy``, ...), ``spark.stretch.delta.directWrite`` is ``false``, or deltalake cannot
  open or write the table (an object store without credentials, a table feature it lacks, a
  schema mismatch): ``metrics()["direct_write_off"]`` says why, once, and Spark writes the rest of
  the run. ``metrics()["direct_writes"]`` counts the engine's commits. A table mixes commits of
  both writers freely: the ``txn`` action is the same.
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable, Dict, Optional

import pyarrow as pa
from pyspark.sql import DataFrame

from ..protocol import messages as M
from . import jvm
from .metrics import QueryMetrics

__all__ = ["QuerySink", "Sink", "SINK_FORMATS", "arrow_schema"]

IDEMPOTENT = {"delta"}
FILE_FORMATS = {"parquet", "json", "csv", "orc"}
SINK_FORMATS = IDEMPOTENT | FILE_FORMATS | {"console", "noop"}
# Session settings that shape a new Delta table (Delta's DeltaConfigs and protocol defaults).
_DELTA_TABLE_DEFAULTS = ("spark.databricks.delta.properties.defaults.",
                         "spark.databricks.delta.protocol.")


_WINDOW_MARKERS = ("spark.timeWindow", "spark.sessionWindow")
_IDLE = "-idle"  # the app id suffix of a no-data batch's rows


def arrow_schema(schema, metadata: bool = False) -> Optional[str]:
    """A Spark schema as a serialized Arrow schema (base64), or None if Arrow has no such type.
    ``metadata``: with a window column's marker (``spark.timeWindow`` or
    ``spark.sessionWindow``, which ``window_time`` looks for) as its Arrow field metadata, which
    a Delta table made from it keeps (as the string "true": deltalake writes strings, so other
    metadata, such as a watermark's delay that Spark reads as a long, is left out)."""
    from pyspark.sql.pandas.types import to_arrow_schema

    try:
        arrow = to_arrow_schema(schema, timezone="UTC")
    except Exception:
        return None
    if metadata:
        marks = [{k: "true" for k in _WINDOW_MARKERS if s.metadata.get(k)} for s in schema.fields]
        arrow = pa.schema([f.with_metadata(m) if m else f for f, m in zip(arrow, marks)])
    return M.schema_to_wire(arrow)


class QuerySink(ABC):
    """What the pipeline and the recovery ask of a query's output: one subclass per way the
    output is written (:class:`Sink`: the engine or Spark's writer, batch by batch; the
    in-plan run's ``_NoSink``: Spark's own sink, in the plan)."""

    #: A batch written twice lands once (a path-based Delta sink's ``txn``).
    idempotent_path: bool = False

    @abstractmethod
    def start(self) -> None:
        """Called once when the query starts, before its first batch."""

    @abstractmethod
    def join(self, timeout: Optional[float] = None) -> None:
        """Called once when the query stops: wait for what :meth:`start` began."""

    @abstractmethod
    def emit(self, stream: str, rows: int, batch_id: int,
             app_suffix: str = "") -> Optional[DataFrame]:
        """The ``rows`` the engine offers on ``stream``, as batch ``batch_id``."""

    @abstractmethod
    def emit_empty(self, batch_id: int) -> None:
        """Batch ``batch_id`` had no rows."""

    @abstractmethod
    def emit_flush(self, stream: str, rows: int, batch: int) -> Optional[DataFrame]:
        """The rows of the no-data batch after ``batch`` (the run's end)."""

    @abstractmethod
    def holds_flush(self, batch: int) -> bool:
        """Whether the output already has the no-data batch after ``batch``."""


class Sink(QuerySink):
    """The sink of one query.

    Parameters
    ----------
    kind : QueryKind
        The query (its output schema and session).
    fmt, options, path, table
        As given to ``writeStream`` (``options`` without ``checkpointLocation``).
    app_id : str
        The query's Delta app id (kept in its checkpoint).
    direct : bool
        ``spark.stretch.delta.directWrite``.
    engine : callable
        The query's current host engine (it changes when one is restarted).
    """

    def __init__(self, kind, fmt: str, options: Dict[str, str], path: Optional[str],
                 table: Optional[str], qid: str, app_id: str, direct: bool,
                 engine: Callable, metrics: QueryMetrics):
        self._kind = kind
        self._spark = kind.session
        self.format = fmt
        self._options = options
        self.path, self.table = path, table
        self._qid, self._app_id = qid, app_id
        self._engine = engine
        self._metrics = metrics
        # Writer options (mergeSchema, partitionBy, ...) are Spark's to apply: Spark writes then.
        self.direct = (direct and fmt == "delta" and bool(path) and not table
                       and not set(options) - {"path"})
        self._table_ready: Optional[threading.Thread] = None
        self._written = False  # a batch's rows went to the sink in this run

    @property
    def idempotent_path(self) -> bool:
        """A path-based Delta sink: a batch written twice lands once (``txn``)."""
        return self.format in IDEMPOTENT and bool(self.path)

    def start(self) -> None:
        """A Delta table that does not exist yet is made, empty, while the first batches run;
        the engine's first append waits for it."""
        if self.direct and not (Path(self.path) / "_delta_log").is_dir():
            self._table_ready = threading.Thread(target=self._create_table_quietly,
                                                 name="stretch-create-table", daemon=True)
            self._table_ready.start()

    def join(self, timeout: Optional[float] = None) -> None:
        if self._table_ready is not None:
            self._table_ready.join(timeout)

    def emit(self, stream: str, rows: int, batch_id: int,
             app_suffix: str = "") -> Optional[DataFrame]:
        """Write the ``rows`` the engine offers on ``stream`` to the sink as batch ``batch_id``;
        the DataFrame Spark wrote, or None (the engine wrote them)."""
        self.join()
        if self.direct:
            req = M.WriteDelta(query=self._qid, stream=stream, path=self.path,
                               app_id=self._app_id + app_suffix, version=batch_id)
            reply = self._engine().call(req)
            if reply.permanent is False:  # no table yet: made empty here, then the engine
                self._create_table()      # appends (not Spark's slow path)
                reply = self._engine().call(req)
            if reply.unsupported is None:
                self._metrics.add("direct_writes")
                return None
            if reply.permanent:
                self.direct = False
                self._metrics.set("direct_write_off", reply.unsupported)
        out = self._read_output(stream, rows)
        self._write(out, batch_id, app_suffix)
        self._written = True
        return out

    def emit_empty(self, batch_id: int) -> None:
        """A batch with no rows: nothing to write, but Spark's Delta sink commits a first batch
        even when it is empty, so the table exists from then on (empty, with the query's
        columns, made with the writer's options). A Delta table Spark writes and that does not
        exist yet is made here the same way, once per run, until a batch has rows (a table
        the engine writes was made when the query started)."""
        if self._written or self.direct or self.format not in IDEMPOTENT:
            return
        self._written = True
        if (self._spark.catalog.tableExists(self.table) if self.table
                else (Path(self.path) / "_delta_log").is_dir()):
            return  # (a path this host cannot list, an object store: one empty commit)
        empty = self._spark.createDataFrame(self._spark.sparkContext.emptyRDD(),
                                            self._kind.schema)
        self._write(empty, batch_id)

    def emit_flush(self, stream: str, rows: int, batch: int) -> Optional[DataFrame]:
        """Write the rows of the no-data batch after ``batch``, as :meth:`emit`, under the app
        id ``<app>-idle`` with ``batch`` as its version (a replayed one is a no-op in the
        table)."""
        return self.emit(stream, rows, batch, app_suffix=_IDLE)

    def holds_flush(self, batch: int) -> bool:
        """Whether the Delta table has the no-data batch after ``batch`` (its ``txn``
        action): the app's last version is that batch itself (a later one is that of a later
        flush, which this state has not had)."""
        if not self.idempotent_path:
            return False
        app, version = self._app_id + _IDLE, batch
        try:  # the table's snapshot: its checkpoints too, where old commit files may be gone
            from deltalake import DeltaTable
            from deltalake.exceptions import TableNotFoundError

            try:
                done = DeltaTable(self.path).transaction_version(app)
            except TableNotFoundError:
                return False
            return done is not None and int(done) == version
        except Exception:  # (a store deltalake cannot open: read the commit files)
            pass
        for f in sorted((Path(self.path) / "_delta_log").glob("*.json"), reverse=True):
            for line in f.read_text().splitlines():
                txn = json.loads(line).get("txn")
                if txn and txn.get("appId") == app:
                    return int(txn["version"]) == version
        return False

    def _create_table_quietly(self) -> None:
        try:
            self._create_table()
        except Exception:
            pass  # the first append then finds no table and makes it itself, raising the error

    def _create_table(self) -> None:
        """Create the sink's Delta table, empty, with the output schema, as Spark's writer would
        for the first batch: by the engine (no Spark job, which costs about a core-second at the
        start of every query) unless the session sets defaults for new tables
        (``spark.databricks.delta.properties.defaults.*``: properties, protocol, features) or
        the schema has types deltalake makes differently; then by Spark."""
        if not any(k.startswith(_DELTA_TABLE_DEFAULTS) for k in self._spark.conf.getAll):
            schema = arrow_schema(self._kind.schema, metadata=True)
            if schema is not None:
                reply = self._engine().call(M.CreateDelta(path=self.path, schema=schema))
                if reply.unsupported is None:
                    return
        empty = self._spark.createDataFrame(self._spark.sparkContext.emptyRDD(),
                                            self._kind.schema)
        empty.write.format("delta").mode("append").save(self.path)

    def _read_output(self, stream: str, rows: int) -> DataFrame:
        """The rows the engine offers on ``stream``, read by the executors of its host: large
        outputs in up to ``defaultParallelism`` slices, so every core writes the sink."""
        splits = jvm.splits_for(self._spark, rows)
        return (self._spark.read.format("stretch").schema(self._kind.schema)
                .options(**self._engine().data_options()).option("stream", stream)
                .option("splits", splits).load())

    def _write(self, out: DataFrame, batch_id: int, app_suffix: str = "") -> None:
        fmt = self.format
        if fmt == "console":
            out.show(truncate=False)
            return
        w = out.write.format(fmt).mode("append").options(**self._options)
        if fmt in IDEMPOTENT:  # a replayed batch is a no-op in the table
            w = w.option("txnAppId", self._app_id + app_suffix).option("txnVersion", batch_id)
        if self.table:
            w.saveAsTable(self.table)
        elif fmt == "noop":
            w.save()
        else:
            w.save(self.path)
