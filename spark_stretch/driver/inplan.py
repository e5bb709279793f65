"""A stretch aggregation inside Spark's plan: the driver's side of the shim's ``StretchExec``.

``spark_stretch.stretch(df)`` marks a native aggregation in Spark's plan (the shim's
``StretchPlans``); Spark then runs the query as usual, with its own sink, trigger, checkpoint,
watermark and no-data batches. In each micro-batch the shim's ``StretchExec`` calls
:class:`BatchHandler` (a py4j callback, as ``foreachBatch`` is) with the batch's input: it is
ingested on the host engine (:mod:`.ingest`: files, columnar or rows), the engine steps it and
offers its output, and the answer tells the exec where to read it. The engine's state follows
Spark's commit log exactly as for ``stretchAggregate`` (:mod:`.recovery`: checkpoints and the
input log under ``<checkpointLocation>/stretch/``); the output goes through Spark's sink, so
its exactly-once guarantee is the sink's own.

A query may have several stretch aggregations (a union of two, one over another's windows):
each is its own engine query, a :class:`PlanRun` per (Spark run id, aggregation id), with its
files under ``<checkpointLocation>/stretch/operators/<Spark state operator id>/`` (a query with
one keeps them in ``stretch/`` itself), and Spark's own watermark for each batch.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from pyspark.sql import SparkSession
from pyspark.sql.streaming.listener import StreamingQueryListener
from pyspark.sql.types import StructType

from ..protocol import messages as M
from ..protocol.layout import QueryLayout
from ..protocol.specs import AggregateSpec
from . import jvm, recovery
from .elastic import ElasticRun
from .ingest import Ingest
from .metrics import QueryMetrics
from .pipeline import Pipeline
from .recovery import Recovery
from .settings import read_settings
from .sink import Sink, arrow_schema

__all__ = ["DISTINCT_UPDATE", "FallbackWarning", "BatchHandler", "PlanRun", "fall_back",
           "handler_for", "open_at_start", "run_of", "aggregations_of"]


#: Why an aggregation with a distinct aggregate does not run in update mode on the engine.
DISTINCT_UPDATE = ("a distinct aggregate in update mode (each batch would need every sub-row "
                   "of each window it changed, one per distinct value)")


class FallbackWarning(UserWarning):
    """A stretch aggregation runs natively: the engine cannot run it yet (the message says why)."""


def fall_back(spark: SparkSession, reason: str, stacklevel: int = 1) -> None:
    """A stretch aggregation runs natively for ``reason``: a :class:`FallbackWarning` naming it
    (``stacklevel`` as for ``warnings.warn``, counted from the caller), or a ``ValueError``
    when ``spark.stretch.fallback=false``."""
    if not read_settings(spark.conf).fallback:
        raise ValueError(f"stretch: {reason} (spark.stretch.fallback=false)")
    warnings.warn(f"stretch: {reason}; Spark runs this aggregation", FallbackWarning,
                  stacklevel=stacklevel + 1)


_LOCK = threading.Lock()
_HANDLERS: Dict[int, "BatchHandler"] = {}   # per JVM session
_RUNS: Dict[Tuple[str, str], "PlanRun"] = {}  # per (Spark run id, aggregation id)


def handler_for(spark: SparkSession) -> "BatchHandler":
    """The session's batch handler (made, and the shim's strategy installed, once)."""
    key = jvm.session_key(spark)
    with _LOCK:
        h = _HANDLERS.get(key)
        if h is None:
            h = _HANDLERS[key] = BatchHandler(spark)
            plans = jvm.ShimPlans(spark)
            plans.install()
            ends = _Ends()
            spark.streams.addListener(ends)
            # A query that ends while Python exits would call back into a gone interpreter.
            atexit.register(_quietly, lambda: spark.streams.removeListener(ends))
    return h


def open_at_start(spark: SparkSession, agg_id: str, query, mode: str,
                  delta: Optional[dict] = None) -> None:
    """Open the engine's query of the stretch aggregation ``agg_id`` as Spark's ``query``
    (written with output mode ``mode``; to the Delta table ``delta``, ``{"path", "schema"}``,
    by the engine itself) starts, beside Spark's planning of its first micro-batch, which would
    open it otherwise."""
    spec = handler_for(spark).spec(agg_id)
    key = (str(query.runId), agg_id)
    plans = jvm.ShimPlans(spark)
    if len(plans.marker_ids(query)) != 1:  # (each one's files by its Spark operator id, which
        return                              # its first batch tells)
    schema = plans.input_schema(agg_id)
    with _LOCK:
        if key in _RUNS:  # (its first batch came first)
            return
        run = _RUNS[key] = PlanRun(spark, agg_id, replace(spec, output_mode=mode),
                                   jvm.checkpoint_root(query), schema, delta)
    if not query.isActive:  # ended before the run was known: nothing else releases it
        run.release()


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:
        pass


def run_of(run_id: str, agg_id: str, wait: float = 0.0) -> Optional["PlanRun"]:
    """The run of the stretch aggregation ``agg_id`` in a Spark query run (it exists from its
    first micro-batch)."""
    deadline = time.monotonic() + wait
    while True:
        run = _RUNS.get((run_id, agg_id))
        if run is not None or time.monotonic() >= deadline:
            return run
        time.sleep(0.05)


def aggregations_of(spark: SparkSession, query) -> List[str]:
    """The stretch aggregations of a running ``StreamingQuery``'s plan, in the plan's order (the
    outer one of two chained first)."""
    return jvm.ShimPlans(spark).marker_ids(query)


class _Ends(StreamingQueryListener):
    """Releases a run's engine when Spark's query ends (stopped, failed or finished)."""

    def onQueryStarted(self, event) -> None:
        pass

    def onQueryProgress(self, event) -> None:
        pass

    def onQueryIdle(self, event) -> None:
        pass

    def onQueryTerminated(self, event) -> None:
        with _LOCK:  # kept (released) for their figures: control(q).metrics() after the end
            runs = [r for (run_id, _), r in _RUNS.items() if run_id == str(event.runId)]
        for run in runs:
            run.release()


class BatchHandler:
    """The shim's ``StretchBatchHandler``: one per session, for every stretch aggregation in it."""

    def __init__(self, spark: SparkSession):
        self._spark = spark
        self._specs: Dict[str, AggregateSpec] = {}
        self._regrouped = set()  # (with a distinct aggregate: no update mode)

    def add(self, agg_id: str, spec: AggregateSpec, regroup: bool = False) -> None:
        self._specs[agg_id] = spec
        if regroup:
            self._regrouped.add(agg_id)
        jvm.ShimPlans(self._spark).register(agg_id, self)

    def check_mode(self, agg_id: str, mode: str) -> None:
        """Refuse an output mode the engine cannot run ``agg_id`` in: update mode with a
        distinct aggregate (:data:`DISTINCT_UPDATE`)."""
        if mode.lower() == "update" and agg_id in self._regrouped:
            raise ValueError(f"stretch: {DISTINCT_UPDATE}; Spark refuses distinct aggregates "
                             "on streams in every output mode")

    def spec(self, agg_id: str) -> AggregateSpec:
        return self._specs[agg_id]

    def onBatch(self, agg_id, batch_id, mode, state_dir, run_id, jdf, jplan,  # noqa: N802
                sink, operator_id, watermark_ms) -> str:
        """Micro-batch ``batch_id`` of run ``run_id``: the answer the exec reads (JSON).
        ``sink``: "" (the exec reads the output), or the Delta table the engine appends to;
        ``operator_id``: the Spark state operator of the aggregation's chain (its files' place
        when the query has several), ``watermark_ms``: Spark's watermark for the batch (-1:
        none)."""
        key = (run_id, agg_id)
        with _LOCK:
            run = _RUNS.get(key)
        if run is None:
            self.check_mode(agg_id, mode)
            several = len(self._aggregations(run_id)) > 1
            with _LOCK:
                run = _RUNS.get(key)
                if run is None:
                    spec = replace(self._specs[agg_id], output_mode=mode.lower())
                    run = _RUNS[key] = PlanRun(
                        self._spark, agg_id, spec, str(Path(state_dir).parent),
                        jvm.dataframe(jdf, self._spark).schema,
                        json.loads(sink) if sink else None,
                        int(operator_id) if several else None)
        wm = int(watermark_ms)
        return json.dumps(run.batch(int(batch_id), jdf, jplan, wm if wm >= 0 else None))

    def _aggregations(self, run_id: str) -> List[str]:
        """The stretch aggregations of the active query run ``run_id``."""
        for q in self._spark.streams.active:
            if str(q.runId) == run_id:
                return aggregations_of(self._spark, q)
        raise RuntimeError(f"stretch: no active streaming query has run id {run_id}")

    class Java:
        implements = ["org.apache.spark.sql.stretch.StretchBatchHandler"]


class _NoSink:
    """Spark's sink writes the output: batches the engine redoes after a restart were written."""

    idempotent_path = False

    def start(self) -> None:
        pass

    def emit(self, *args, **kwargs):
        return None

    def holds_flush(self, batch: int, seq: int = 0, serial: int = 0) -> bool:
        return False

    def join(self, timeout=None) -> None:
        pass


class _Kind:
    """What the recovery, pipeline and sink ask of a query kind (Spark runs the no-data
    batches here: no flush of the engine's own)."""

    pipelined = True

    def __init__(self, spark: SparkSession, schema=None):
        self.session = spark
        self.schema = schema   # the aggregation's rows (a Spark StructType), for a new table

    def flush_time(self, query, at_ms=None):
        return None

    def kept_flush_time(self, query, batch: int, seq: int):
        return None


class PlanRun:
    """One run of a streaming query with a stretch aggregation in its plan (``schema``: its
    engine input's, a Spark StructType)."""

    def __init__(self, spark: SparkSession, agg_id: str, spec: AggregateSpec, checkpoint: str,
                 schema: StructType, delta: Optional[dict] = None,
                 operator: Optional[int] = None):
        self.agg_id = agg_id
        self._spark = spark
        settings = read_settings(spark.conf)
        self.layout = QueryLayout(checkpoint, operator)
        qid, app_id = recovery.query_ids(self.layout)
        self.qid = qid
        schema = arrow_schema(schema)
        # The engine's own rows for the exec to project, or (appending to Delta itself) the
        # aggregation's rows.
        spec = replace(spec, input_schema=schema, finish=spec.finish if delta else None,
                       checkpoint=recovery.checkpointing(self.layout, settings))
        self.spec = spec
        self.metrics = QueryMetrics()
        self.elastic = ElasticRun(None, spec.max_parallelism, self.metrics)  # (figures only)
        self._plan = None
        engine = lambda: self.recovery.engine  # noqa: E731
        if delta is not None:
            kind = _Kind(spark, StructType.fromJson(json.loads(delta["schema"])))
            self._sink = Sink(kind, "delta", {}, delta["path"], None, qid, app_id, True, engine,
                              self.metrics)
        else:
            kind, self._sink = _Kind(spark), _NoSink()
        self.recovery = Recovery(qid, spec, self.layout, settings, self._sink, kind,
                                 self.metrics, recovery.last_committed(checkpoint))
        self._ingest = Ingest(spark, qid, engine, self.recovery.opened,
                              lambda batch_id: self._plan, settings.columnar,
                              settings.read_files, schema, self.metrics)
        # Appending to Delta itself, the engine steps and writes a batch while Spark commits it
        # and plans the next (the pipeline of stretchAggregate; the engine logs the batch's
        # input before Spark may commit it).
        # (Spark runs this query's no-data batches itself: no trigger state to watch)
        self._pipeline = (Pipeline(qid, kind, self.recovery, self._ingest, self._sink,
                                   self.metrics, lambda: None, self.elastic)
                          if delta is not None else None)
        self._lock = threading.Lock()
        self._last: Optional[tuple] = None  # (batch id, answer): a batch's plan run twice
        if delta is not None:
            self._sink.start()
            # (the engine's appends: the sink is the shim's, its progress carries the figures)
            jvm.register_aggregation_figures(spark, agg_id, self.elastic.sink_figures)
        self.recovery.open_in_background()

    def batch(self, batch_id: int, jdf, jplan, watermark_ms: Optional[int] = None) -> dict:
        """Ingest and step micro-batch ``batch_id`` (``watermark_ms``: Spark's, which the
        engine takes); where its output is offered."""
        with self._lock:
            if self._last is not None and self._last[0] == batch_id:
                return self._last[1]  # the sink ran the batch's plan again: the same rows
            df = jvm.dataframe(jdf, self._spark)
            self._plan = jplan
            if self._pipeline is not None:
                self._pipeline.run_batch(df, batch_id, watermark_ms)
                # (the engine's latest finished batch: this one is still in flight)
                self._last = (batch_id, {"rows": 0, "direct": True,
                                         "state": self.elastic.state_figures()})
                return self._last[1]
            self.recovery.realign(batch_id - 1 if batch_id > 0 else None)
            self.elastic.started(batch_id)
            t0 = time.perf_counter()
            reply = self.recovery.with_engine(f"batch {batch_id}",
                                              lambda: self._step(df, batch_id, watermark_ms),
                                              opened=False)
            self.recovery.last_done = batch_id
            eng = self.recovery.engine
            opts = eng.data_options()
            answer = {"endpoint": opts["endpoints"], "stream": reply.stream, "rows": reply.rows,
                      "splits": jvm.splits_for(self._spark, reply.rows),
                      **({"secret": opts["secret"]} if "secret" in opts else {})}
            figures = {k: v for k, v in reply.metrics.items() if k != "elastic"}
            self.metrics.record_batch({"batch": batch_id, "step_s": time.perf_counter() - t0,
                                       "rows_out": reply.rows, **figures}, reply.rows, [])
            if "elastic" in reply.metrics:  # (its rows go to Spark's sink now)
                self.elastic.batch_done(batch_id, reply.metrics["elastic"], time.time())
            answer["state"] = self.elastic.state_figures()  # (Spark's state operator's figures)
            self._last = (batch_id, answer)
            return answer

    def _step(self, df, batch_id: int, watermark_ms: Optional[int]) -> M.StepResult:
        self._ingest(df, batch_id)
        eng = self.recovery.engine
        eng.call(M.Submit(query=self.qid, batch=batch_id, watermark_ms=watermark_ms))
        return eng.call(M.Result(query=self.qid, batch=batch_id))

    def reconfigure(self, parallelism: Optional[int] = None, owner_map=None,
                    key_groups=None) -> dict:
        """Switch the engine's epoch between two micro-batches (``1 <= parallelism <=
        max_parallelism``), or move key groups between hosts (``key_groups``)."""
        if key_groups is not None:
            if self._pipeline is not None:
                return self._pipeline.between(lambda: self.recovery.move_groups(key_groups))
            with self._lock:
                return self.recovery.move_groups(key_groups)
        msg = recovery.reconfiguration(self.qid, parallelism, owner_map, self.spec.max_parallelism)
        if self._pipeline is not None:
            return self._pipeline.reconfigure(msg)
        t0 = time.perf_counter()
        with self._lock:
            reply = self.recovery.with_engine("a reconfiguration",
                                              lambda: self.recovery.engine.call(msg))
            rec = self.recovery.reconfigured(msg, reply, t0)
            self.elastic.switched(rec)
            return rec

    def settle(self) -> None:
        """Wait until the last batch is written (the engine appends to Delta after Spark has
        committed it); raise what writing it raised."""
        if self._pipeline is not None:
            self._pipeline.wait()

    def figures(self) -> dict:
        """The run's figures, with the engine's own (the last ones, also after the end)."""
        return {**self.metrics.snapshot(), **self.recovery.figures()}

    def release(self) -> None:
        """Close the query on the engine and release it (Spark's query ended)."""
        self.recovery.join(timeout=60)
        if self._pipeline is not None:
            self._pipeline.join(timeout=60)
            self._sink.join(timeout=60)
        with self._lock:
            self.recovery.release()
