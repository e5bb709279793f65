"""How a micro-batch's input reaches the host engine, by the cheapest of three paths.

When the batch's executed plan is a columnar scan (Parquet, Delta) under only column pruning and
the watermark:

- **files**: a scan reading plain Parquet files (a Parquet source, or a Delta source without
  column mapping or deletion vectors) has its files read by the engine itself: no Spark job, as
  Spark would only read them and hand the rows over; the scan's row count and the watermark's
  event-time statistics are recorded as if the rows had flowed
  (``spark.stretch.ingest.files=false`` turns it off);
- **columnar**: the scan's column batches go to the engine as Arrow columns (the shim's
  ``StretchIngest``; ``spark.stretch.ingest.columnar=false`` turns both off);

else **rows**: the rows ``foreachBatch`` hands over, through ``format("stretch")``. No path has
an Exchange. A batch whose input is an empty local relation (Spark's no-data batch of a
stateful query) sends nothing: the engine steps it with no rows.

Which plans qualify is the shim's decision, per batch (``StretchIngest.parquetFiles``: plain
Parquet under only attribute projections and watermarks, no partition columns, filters or
buckets, Spark's defaults for corrupt and missing files; a Delta file with a deletion vector
sends that batch through Spark's scan; docs/shim.md). The engine then checks each file as Spark
would read it (:mod:`spark_stretch.host.parquet`); a file it declines turns the files path off
for the rest of the run, with the reason in ``metrics()["files_off"]``. The files path is off
for a kind that is not pipelined (the drop-in: its function sees Spark's row order), and the
columnar path on several hosts, where Spark routes each row to the hosts of its keys
(:mod:`.routing`). Tests run every path against native Spark with Spark's per-batch statistics
(``numInputRows``, the watermark) equal; the speed of each: BENCHMARKS.md, "Ingest path".
"""

from __future__ import annotations

from typing import Callable, Optional

from pyspark.sql import DataFrame

from ..protocol import messages as M
from . import jvm
from .engine import EngineDiedError
from .metrics import QueryMetrics
from .routing import ROUTE

__all__ = ["Ingest"]


class Ingest:
    """The ingest of one query's micro-batches.

    Parameters
    ----------
    qid : str
        The query's id on the engine (its input streams are ``<qid>:in:<N>``).
    engine : callable
        The query's current host engine.
    opened : callable
        Waits until the query is open on the engine (raising what opening it raised).
    batch_plan : callable
        ``batch_plan(batch_id)``: the executed plan of the micro-batch, or None.
    columnar, read_files : bool
        ``spark.stretch.ingest.columnar`` and ``spark.stretch.ingest.files``.
    input_schema : str, optional
        The input's Arrow schema (``schema_to_wire``): files are read to it. None (a kind that is
        not pipelined, whose functions see Spark's row order): the files path is off.
    """

    def __init__(self, spark, qid: str, engine: Callable, opened: Callable,
                 batch_plan: Callable, columnar: bool, read_files: bool,
                 input_schema: Optional[str], metrics: QueryMetrics):
        self._shim = jvm.ShimIngest(spark)
        self._qid = qid
        self._engine = engine
        self._opened = opened
        self._batch_plan = batch_plan
        self._columnar = columnar
        self._read_files = read_files and columnar and input_schema is not None
        self._schema = input_schema
        self._metrics = metrics

    def __call__(self, batch_df: DataFrame, batch_id: int, empty: bool = False):
        """Write the batch to the engine, then wait for the query's open (an error of the open
        comes first). Returns what ran (a physical plan, or the DataFrame written), for the
        plans kept in the metrics; nothing for a batch known to be ``empty`` (Spark's no-data
        batch inside its plan: no Spark job to write no rows)."""
        if empty:
            self._opened()
            return self._count("none", None)
        try:
            ran = self._ingest(batch_df, batch_id)
        except Exception:
            self._opened()  # (the engine refused the rows because the open failed: say why)
            raise
        self._opened()
        return ran

    def _ingest(self, batch_df: DataFrame, batch_id: int):
        eng = self._engine()
        stream = f"{self._qid}:in:{batch_id}"
        try:
            # The engine takes rows once it listens, maybe before the query is open on it (the
            # first batch runs while the engine imports numba); its commit waits for the open.
            eng.wait_ready()
            plan = self._batch_plan(batch_id) if self._columnar else None
            if plan is not None and self._read_files and self._files(plan, batch_id):
                return self._count("files", plan)
            if (plan is not None and not eng.routed
                    and self._shim.ingest(plan, eng.endpoint, stream) >= 0):
                return self._count("columnar", plan)
            options = dict(eng.data_options(), stream=stream)
            if eng.routed:  # (each row to the hosts of its keys: driver/routing.py)
                self._opened()
                batch_df = eng.route(batch_df, self._qid)
                options["route"] = ROUTE
            batch_df.write.format("stretch").mode("append").options(**options).save()
            return self._count("rows", batch_df)
        except Exception as e:
            if not eng.alive():  # say what really happened, not just "socket refused"
                raise EngineDiedError(
                    eng.death(f"before batch {batch_id} could be ingested")) from e
            raise

    def _files(self, plan, batch_id: int) -> bool:
        """Have the engine read the batch's Parquet files; False if Spark must read them (then
        for the rest of the run, with the reason in ``metrics()["files_off"]``)."""
        shim = self._shim
        files = shim.parquet_files(plan)
        if files is None:
            return False
        if not files:  # (no row: a no-data batch's input; the engine steps the batch without)
            return True
        watermarks = shim.watermark_columns(plan)
        self._opened()  # (the engine reads them into the query's pending input)
        reply = self._engine().call(M.IngestFiles(
            query=self._qid, batch=batch_id, files=files, columns=shim.column_names(plan),
            schema=self._schema, watermarks=watermarks))
        if reply.unsupported is not None:
            self._read_files = False
            self._metrics.set("files_off", reply.unsupported)
            return False
        shim.record_read(plan, reply.rows)
        for i, (top, low, avg, n) in enumerate(reply.event_times):
            shim.record_event_times(plan, i, top, low, avg, n)
        return True

    def _count(self, path: str, ran):
        self._metrics.count("ingest", path)
        return ran

