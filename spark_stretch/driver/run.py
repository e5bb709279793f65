"""A running stretch query on the driver: how it starts, watches its run, and ends.

Spark runs the query kind's input as a streaming query whose ``foreachBatch`` is the
:class:`~.pipeline.Pipeline` (Spark's ``ForeachBatchSink`` as the shim's ``StretchBatchSink``,
which adds the batches' figures, :mod:`.elastic`, to the query's progress); around it, this
module opens the host engine where Spark resumes
(:class:`~.recovery.Recovery`), plays Spark's no-data batch when a trigger of the query finds no
data (and before ``processAllAvailable`` returns) or a one-shot run ends, and releases the engine
(and the query's shared memory) when the run ends.
:class:`spark_stretch.StretchQuery` is the user's handle on it.

**Where a no-data batch is played.** Spark runs one for a stateful query when a trigger after a
batch finds no data and the last batch asks for it (the watermark moved); it evicts the last
windows. The ``foreachBatch`` query has no state, but its triggers are the same: a micro-batch's
execution context lives from the first trigger that looks for its data to the one that runs it,
and each trigger's start moves to its ``lastTriggerStartTimestamp`` (:func:`.jvm.trigger_state`).
So a trigger found no data after batch N-1 exactly when batch N's context has a previous trigger
start other than the start of N-1's. The driver plays that trigger's no-data batch (a *flush*,
the engine saying whether one is due) as soon as the watch thread sees it (every 0.2 s), or else
in ``foreachBatch`` N before N's rows reach the engine, so N's late rule and the evictions are
native Spark's whatever the timing; once per gap between batches (the watermark moves only with
data). Its rows go to Delta under ``<app>-idle`` with the last batch id as ``txnVersion``.
Nothing is played before a run's first batch (nor does Spark run one after a restart);
``availableNow``/``once`` runs have no idle trigger between batches, so their last no-data batch
is played when the run ends, before ``awaitTermination`` (or ``processAllAvailable``) returns.
``stop()`` runs none, as in Spark.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import uuid
from dataclasses import replace
from typing import Dict, Optional

from pyspark.sql.streaming import StreamingQuery

from ..protocol.layout import QueryLayout
from . import jvm, recovery
from .cluster import engine_hosts
from .elastic import ElasticRun
from .ingest import Ingest
from .metrics import QueryMetrics
from .metrics_table import MetricsTable
from .pipeline import Pipeline
from .recovery import Recovery
from .settings import read_settings
from .sink import SINK_FORMATS, Sink, arrow_schema

__all__ = ["QueryRun"]


class QueryRun:
    """One run of a stretch query (built by :meth:`start`)."""

    def __init__(self, kind, fmt: str, options: Dict[str, str], path: Optional[str],
                 table: Optional[str]):
        self.settings = read_settings(kind.session.conf)  # (a bad one: before anything)
        _check_hosts(kind)
        self._own_checkpoint = "checkpointLocation" not in options
        checkpoint = options.get("checkpointLocation") or tempfile.mkdtemp(prefix="stretch-ckpt-")
        self.layout = QueryLayout(checkpoint)
        try:
            self._build(kind, fmt, options, path, table)
        except BaseException:
            if getattr(self, "recovery", None) is not None:
                self.recovery.release()
            if self._own_checkpoint:
                shutil.rmtree(checkpoint, ignore_errors=True)
            raise

    def _build(self, kind, fmt: str, options: Dict[str, str], path: Optional[str],
               table: Optional[str]) -> None:
        spark, settings, checkpoint = kind.session, self.settings, self.layout.checkpoint
        self.recovery: Optional[Recovery] = None
        self.stretch_id, app_id = recovery.query_ids(self.layout)
        resume = recovery.last_committed(checkpoint)  # Spark resumes after its last commit
        self.kind = kind
        self.metrics = QueryMetrics()
        self.query: Optional[StreamingQuery] = None
        self._started = threading.Event()  # set once writer.start() returned (or failed)
        self._done = threading.Event()     # set once the final flush (if any) and release ran
        self.finish_error: Optional[BaseException] = None
        self.one_shot = False              # availableNow / once: flush when the run ends
        self.stopped = False
        schema = arrow_schema(kind.input_df().schema)
        spec = replace(kind.engine_spec(), input_schema=schema,
                       checkpoint=recovery.checkpointing(self.layout, settings),
                       state_memory=settings.state_memory)
        sink_options = {k: v for k, v in options.items() if k != "checkpointLocation"}
        self.sink = Sink(kind, fmt, sink_options, path, table, self.stretch_id, app_id,
                         settings.direct_write, lambda: self.recovery.engine, self.metrics)
        self.recovery = Recovery(self.stretch_id, spec, self.layout, settings, self.sink, kind,
                                 self.metrics, resume)
        ingest = Ingest(spark, self.stretch_id, lambda: self.recovery.engine,
                        self.recovery.opened, self._batch_plan, settings.columnar,
                        settings.read_files, schema, self.metrics)
        self._interval_ms: Optional[int] = None  # a processing-time trigger's
        self.table = (MetricsTable(spark, settings.metrics_table, self._ids)
                      if settings.metrics_table else None)
        self.elastic = ElasticRun(kind.elastic, kind.max_parallelism, self.metrics,
                                  lambda: self._interval_ms, self.table)
        self.pipeline = Pipeline(self.stretch_id, kind, self.recovery, ingest, self.sink,
                                 self.metrics, self._trigger_state, self.elastic)
        self._sink_key = f"{self.stretch_id}-{uuid.uuid4().hex[:8]}"
        self.recovery.open_in_background()

    @classmethod
    def start(cls, kind, fmt: str, options: Dict[str, str], path: Optional[str],
              table: Optional[str], trigger: Optional[dict], name: Optional[str]) -> "QueryRun":
        """Start ``kind`` as a streaming query writing to the sink (``writeStream``'s
        arguments; its output mode, append, is checked by the writer); the run, whose
        ``query`` is Spark's ``StreamingQuery``."""
        if fmt not in SINK_FORMATS:
            raise ValueError(f"format '{fmt}' is not supported as a stretchAggregate sink; use "
                             "delta (exactly once), parquet/json/csv/orc, console or noop")
        if path is None and table is None and fmt not in ("console", "noop"):
            raise ValueError(f"start() needs a path (or use toTable) for format '{fmt}'")
        run = cls(kind, fmt, options, path, table)
        # foreachBatch, with the batch's figures in Spark's progress (the sink's metrics)
        writer = (jvm.foreach_batch_with_metrics(kind.input_df(), run.pipeline.run_batch,
                                                 run.elastic.sink_figures, run._sink_key,
                                                 run.elastic.state_figures, kind.operator_name)
                  .option("checkpointLocation", run.layout.checkpoint))
        if trigger:
            writer = writer.trigger(**trigger)
        if name:
            writer = writer.queryName(name)
        run.one_shot = bool(trigger) and any(trigger.get(k) for k in ("availableNow", "once"))
        run.sink.start()
        try:
            run.query = writer.start()
        except Exception:
            run.release()
            raise
        finally:
            run._started.set()
        run._interval_ms = jvm.processing_interval_ms(run.query)
        threading.Thread(target=run._watch, name="stretch-query-watch", daemon=True).start()
        return run

    def _ids(self) -> dict:
        """The query's ids, for its rows of the metrics table."""
        q = self.query
        return {"stretch_id": self.stretch_id, "query_id": None if q is None else str(q.id),
                "run_id": None if q is None else str(q.runId),
                "query_name": None if q is None else q.name}

    def _batch_plan(self, batch_id: int):
        self._started.wait()  # foreachBatch may run before start() has returned the query
        return None if self.query is None else jvm.batch_plan(self.query, batch_id)

    def _trigger_state(self):
        self._started.wait()
        return None if self.query is None else jvm.trigger_state(self.query)

    # -- the run -----------------------------------------------------------------------------
    def _watch(self) -> None:
        """Flush when a trigger finds no data (continuous triggers) or at the end of a one-shot
        run; when the run ends, finish the batch in flight and release.

        Native Spark runs a no-data batch when the watermark moved (or, with processing-time
        timeouts, on every trigger) and no data is waiting; its evictions and timeouts are what
        a flush writes. Looked at every 0.2 s (the batch after an idle trigger plays it first
        if this has not). ``stop()`` runs no final batch, in Spark or here, but a batch Spark
        committed is finished (its output written) before the query ends.
        """
        q = self.query
        try:
            while q.isActive:
                try:
                    q.awaitTermination(0.2)  # returns at once when the run ends
                except Exception:
                    break  # the query failed: awaitTermination reports it to the user
                if self.one_shot or not q.isActive:
                    continue
                try:
                    self.pipeline.play_idle()
                except Exception as e:  # surfaced by awaitTermination / metrics
                    if q.isActive:
                        self.finish_error = e
            try:
                self.pipeline.settle()
            except Exception as e:
                self.finish_error = e
            if (self.one_shot and self.finish_error is None and q.exception() is None
                    and not self.stopped):
                try:
                    self.pipeline.flush(final=True)
                except Exception as e:
                    self.finish_error = e
        finally:
            self.release()
            self._done.set()

    def release(self) -> None:
        """Close the query on the engine and release it; remove a checkpoint of our own."""
        if self.recovery.released:
            return
        self.recovery.join(timeout=60)  # (normally done by now)
        self.pipeline.join(timeout=60)
        self.sink.join(timeout=60)
        self.recovery.release()
        if self.table is not None:
            self.table.close()
        _quietly(lambda: jvm.forget_batch_function(self.kind.session, self._sink_key))
        if self._own_checkpoint:
            shutil.rmtree(self.layout.checkpoint, ignore_errors=True)

    # -- asked by StretchQuery -------------------------------------------------------------------
    def stop(self) -> None:
        """Stop Spark's query, then release the engine (a batch in flight is finished first)."""
        self.stopped = True
        try:
            if self.query is not None:
                self.query.stop()
        finally:
            self._done.wait(60)
            self.release()

    def await_termination(self, timeout: Optional[float] = None):
        """Spark's ``awaitTermination``; when the run has ended, also wait for its last flush and
        raise what writing it raised."""
        result = self.query.awaitTermination(timeout)
        if not self.query.isActive:
            self._done.wait()
            if self.finish_error is not None:
                raise RuntimeError(f"stretch query {self.stretch_id}: writing the final windows "
                                   f"failed: {self.finish_error}") from self.finish_error
        return result

    def process_all_available(self) -> None:
        """Spark's ``processAllAvailable``, then the last batch's output written (pipelined) and
        the no-data batch Spark would have run before returning (its trigger without data came
        after the last batch); for an ``availableNow``/``once`` run, its end with its last
        no-data batch."""
        self.query.processAllAvailable()
        if self.one_shot:  # its last trigger found no data: the run ends (see _watch)
            self.await_termination()
            return
        self.pipeline.settle()
        if self.query.isActive:
            self.pipeline.play_idle(settle_s=1.0)

    def reconfigure(self, parallelism: Optional[int] = None, owner_map=None,
                    key_groups=None, host: Optional[str] = None) -> dict:
        """Change the parallelism and/or the owner map between two micro-batches (checked
        here: ``1 <= parallelism <= max_parallelism``; on several hosts, of ``host``'s
        instances or every host's), or move key groups between hosts."""
        if key_groups is not None:
            if (parallelism, owner_map, host) != (None, None, None):
                raise ValueError("reconfigure(key_groups=) moves key groups between hosts; "
                                 "change parallelism, owner_map or host in a call of its own")
            return self.pipeline.between(lambda: self.recovery.move_groups(key_groups))
        return self.pipeline.reconfigure(recovery.reconfiguration(
            self.stretch_id, parallelism, owner_map, self.kind.max_parallelism, host))

    def figures(self) -> dict:
        """The query's figures, with the engine's own (the last ones, also after the end)."""
        out = {**self.metrics.snapshot(), **self.recovery.figures()}
        if self.table is not None and self.table.error is not None:
            out["metrics_table_error"] = str(self.table.error)
        return out


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:
        pass


def _check_hosts(kind) -> None:
    """Built-in aggregations run on several hosts (elastic ones too); an engine operator and
    the drop-in on one."""
    hosts = engine_hosts(kind.session)
    spec_kind = kind.engine_spec().kind
    if hosts and spec_kind != "aggregate":
        raise NotImplementedError(
            f"executors on hosts {hosts}: a {spec_kind} query runs on one host so far (local, "
            "local-cluster or a one-host cluster); the built-in aggregations of "
            "stretchAggregate and stretch(df) run on several")
