"""One run of a streaming query with a stretch operator inside Spark's plan (the shim's
``StretchExec``): its engine, recovery, ingest, pipeline and figures.

The exec calls the session's handler (:mod:`.inplan`) once per micro-batch; the handler hands
the batch to the run of its query (:class:`PlanRun`), which ingests it on the host engine, has
the engine step it (an aggregation of ``stretch(df)``, or the ``applyInPandasWithState``
drop-in's function) and answers where the output is offered, for the exec to read back; or,
when the shim's ``StretchDeltaSink`` writes the query's rows, has the engine append them to
the Delta table itself. Spark runs the query: its trigger, sink, checkpoint, watermark and
no-data batches are Spark's own; the engine's state follows Spark's commit log
(:mod:`.recovery`: checkpoints and the input log under ``<checkpointLocation>/stretch/``).

A query may have several stretch aggregations (a union of two, one over another's windows):
each is its own engine query, a run per (Spark run id, aggregation id), with its files under
``<checkpointLocation>/stretch/operators/<Spark state operator id>/`` (a query with one keeps
them in ``stretch/`` itself), and Spark's own watermark for each batch.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, replace
from typing import Callable, Optional

from pyspark.sql import SparkSession
from pyspark.sql.types import StructType

from ..protocol import messages as M
from ..protocol.layout import QueryLayout
from ..protocol.specs import QuerySpec
from . import jvm, recovery
from .elastic import ElasticRun
from .ingest import Ingest
from .metrics import QueryMetrics
from .metrics_table import MetricsTable
from .pipeline import Pipeline
from .policy import Policy
from .recovery import Recovery
from .settings import read_settings
from .sink import QuerySink, Sink, arrow_schema

__all__ = ["Marked", "PlanRun"]


@dataclass
class Marked:
    """What a marked DataFrame registers for its runs: the engine's ``spec``, an elastic
    ``policy`` (or None), and ``settle(spec, settings)``, the spec a run opens with under the
    session's settings (a :class:`~.settings.QuerySettings`, read when the run starts)."""

    spec: QuerySpec
    policy: Optional[Policy] = None
    settle: Optional[Callable] = None


class _NoSink(QuerySink):
    """Spark's sink writes the output: batches the engine redoes after a restart were written."""

    def start(self) -> None:
        pass

    def join(self, timeout=None) -> None:
        pass

    def emit(self, stream, rows, batch_id, app_suffix=""):
        return None

    def emit_empty(self, batch_id: int) -> None:
        pass

    def emit_flush(self, stream, rows, batch):
        return None

    def holds_flush(self, batch: int) -> bool:
        return False


class _Kind:
    """What the recovery, pipeline and sink ask of a query kind (Spark runs the no-data
    batches here: no flush of the engine's own)."""

    def __init__(self, spark: SparkSession, max_parallelism: int, schema=None,
                 pipelined: bool = True, test_clock: str = ""):
        self.session = spark
        self.max_parallelism = max_parallelism
        self.schema = schema   # the query's rows (a Spark StructType), for a new Delta table
        self.pipelined = pipelined
        self._clock = test_clock

    def batch_time(self, query, batch_id: int, info: Optional[dict] = None) -> Optional[int]:
        """Spark's time of the batch (``spark.stretch.testClockMs=<start>[+<step>]``: ``start
        + batch_id * step``, for tests)."""
        if self._clock:
            start, _, step = self._clock.partition("+")
            return int(start) + batch_id * int(step or 0)
        return (info or {}).get("batch_ts_ms")


class PlanRun:
    """One run of a streaming query with the stretch operator ``agg_id`` in its plan, written
    in output mode ``mode`` (``schema``: the engine's input, a Spark StructType; ``delta``:
    ``{"path", "schema"}`` of the Delta table the engine appends to itself, or None;
    ``query``: Spark's query, when known; ``operator``: the Spark state operator of the
    operator's chain, for its files, when the query has several stretch operators)."""

    def __init__(self, spark: SparkSession, agg_id: str, marked: Marked, mode: str,
                 checkpoint: str, schema: StructType, delta: Optional[dict] = None,
                 query=None, operator: Optional[int] = None):
        self.agg_id = agg_id
        self._spark = spark
        self.query = query
        settings = read_settings(spark.conf)
        self.layout = QueryLayout(checkpoint, operator)
        qid, app_id = recovery.query_ids(self.layout)
        self.qid = qid
        spec = marked.spec
        # The drop-in keeps Spark's row order (its function sees it): no files path, no log.
        pipelined = spec.kind != "grouped"
        wire = arrow_schema(schema) if pipelined else None
        if spec.kind == "aggregate":  # the engine's own rows for the exec to project, or
            # (appending to Delta itself) the aggregation's rows
            spec = replace(spec, output_mode=mode.lower(),
                           finish=spec.finish if delta else None)
        if marked.settle is not None:
            spec = marked.settle(spec, settings)
        spec = replace(spec, input_schema=wire,
                       checkpoint=recovery.checkpointing(self.layout, settings),
                       state_memory=settings.state_memory)
        self.spec = spec
        self.metrics = QueryMetrics()
        self._interval_ms = None if query is None else jvm.processing_interval_ms(query)
        self.table = (MetricsTable(spark, settings.metrics_table, self._ids)
                      if settings.metrics_table else None)
        self.elastic = ElasticRun(marked.policy, spec.max_parallelism, self.metrics,
                                  lambda: self._interval_ms, self.table)
        self._plan = None
        engine = lambda: self.recovery.engine  # noqa: E731
        kind = _Kind(spark, spec.max_parallelism,
                     StructType.fromJson(json.loads(delta["schema"])) if delta else None,
                     pipelined, settings.test_clock)
        self._sink = (Sink(kind, "delta", {}, delta["path"], None, qid, app_id, True, engine,
                           self.metrics) if delta is not None else _NoSink())
        self.recovery = Recovery(qid, spec, self.layout, settings, self._sink, kind,
                                 self.metrics, recovery.last_committed(checkpoint))
        self._ingest = Ingest(spark, qid, engine, self.recovery.opened,
                              lambda batch_id: self._plan, settings.columnar,
                              settings.read_files, wire, self.metrics)
        # Appending to Delta itself, a pipelined kind steps and writes a batch while Spark
        # commits it and plans the next (the engine logs the batch's input before Spark may
        # commit it); the drop-in steps, appends and checkpoints it before Spark commits it.
        # (Spark runs this query's no-data batches itself: no trigger state to watch)
        self._pipeline = Pipeline(qid, kind, self.recovery, self._ingest, self._sink,
                                  self.metrics, lambda: None, self.elastic)
        self._lock = threading.Lock()
        self._last: Optional[tuple] = None  # (batch id, answer): a batch's plan run twice
        if delta is not None:
            self._sink.start()
            # (the engine's appends: the sink is the shim's, its progress carries the figures)
            jvm.register_aggregation_figures(spark, agg_id, self.elastic.sink_figures)
        self.recovery.open_in_background()

    def _ids(self) -> dict:
        """The query's ids, for its rows of the metrics table."""
        q = self.query
        return {"stretch_id": self.qid, "query_id": None if q is None else str(q.id),
                "run_id": None if q is None else str(q.runId),
                "query_name": None if q is None else q.name}

    def batch(self, batch_id: int, jdf, jplan, info: dict) -> dict:
        """Ingest and step micro-batch ``batch_id`` (``info``: what Spark gave the batch's
        state operator); where its output is offered."""
        with self._lock:
            if self._last is not None and self._last[0] == batch_id:
                return self._last[1]  # the sink ran the batch's plan again: the same rows
            if self.query is None and info.get("query_id"):
                self.query = self._spark.streams.get(info["query_id"])
                if self.query is not None:
                    self._interval_ms = jvm.processing_interval_ms(self.query)
            df = jvm.dataframe(jdf, self._spark)
            self._plan = jplan
            if isinstance(self._sink, Sink):  # the engine appends the rows to Delta itself
                self._pipeline.run_batch(df, batch_id, info)
                answer = {"rows": 0, "direct": True}
            else:
                reply = self._pipeline.run_now(df, batch_id, info)
                opts = self.recovery.engine.data_options()
                answer = {"endpoint": opts["endpoints"], "stream": reply.stream,
                          "rows": reply.rows, "splits": jvm.splits_for(self._spark, reply.rows),
                          **({"secret": opts["secret"]} if "secret" in opts else {})}
            # (Spark's state operator's figures: the engine's latest finished batch)
            answer["state"] = self.elastic.state_figures()
            self._last = (batch_id, answer)
            return answer

    def cancel(self, batch_id: int) -> None:
        """Spark is stopping the query while micro-batch ``batch_id`` runs (its thread, waiting
        in :meth:`batch`, was interrupted): the step is given up on the engines, so the stop
        does not wait for it to end. Best effort, not under the batch's lock; a restart redoes
        the batch from the checkpoint."""
        try:
            self.recovery.engine.call(M.Cancel(query=self.qid, batch=int(batch_id)), timeout=10)
        except Exception:
            pass  # (the engine is gone, or the step ended meanwhile)

    def reconfigure(self, parallelism: Optional[int] = None, owner_map=None,
                    key_groups=None, host: Optional[str] = None) -> dict:
        """Switch the engine's epoch between two micro-batches (``1 <= parallelism <=
        max_parallelism``; on several hosts, of ``host``'s instances or every host's), or move
        key groups between hosts (``key_groups``)."""
        recovery.check_host(self.recovery.engine, host)
        if key_groups is not None:
            return self._pipeline.between(lambda: self.recovery.move_groups(key_groups))
        return self._pipeline.reconfigure(recovery.reconfiguration(
            self.qid, parallelism, owner_map, self.spec.max_parallelism, host))

    def settle(self) -> None:
        """Wait until the last batch is written (the engine appends to Delta after Spark has
        committed it); raise what writing it raised."""
        self._pipeline.wait()

    def figures(self) -> dict:
        """The run's figures, with the engine's own (the last ones, also after the end)."""
        out = {**self.metrics.snapshot(), **self.recovery.figures()}
        if self.table is not None and self.table.error is not None:
            out["metrics_table_error"] = str(self.table.error)
        return out

    def release(self) -> None:
        """Close the query on the engine and release it (Spark's query ended); a second call
        returns once the first has released it."""
        self.recovery.join(timeout=60)
        self._pipeline.join(timeout=60)
        self._sink.join(timeout=60)
        with self._lock:
            self.recovery.release()
            if self.table is not None:
                self.table.close()  # (again: nothing waits, it returns at once)
