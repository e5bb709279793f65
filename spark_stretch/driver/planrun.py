"""One run of a streaming query with a stretch aggregation in its plan (:class:`PlanRun`): the
engine query of one stretch aggregation, fed by the shim's exec batch by batch
(:mod:`.inplan`'s handler), with the recovery, ingest and (into Delta) pipeline of
``stretchAggregate``.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from typing import Optional

from pyspark.sql import SparkSession
from pyspark.sql.types import StructType

from ..protocol import messages as M
from ..protocol.layout import QueryLayout
from ..protocol.specs import AggregateSpec
from . import jvm, recovery
from .elastic import ElasticRun
from .ingest import Ingest
from .metrics import QueryMetrics
from .pipeline import Pipeline
from .policy import Policy
from .recovery import Recovery
from .settings import read_settings
from .sink import Sink, arrow_schema

__all__ = ["PlanRun"]


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

    def __init__(self, spark: SparkSession, max_parallelism: int, schema=None):
        self.session = spark
        self.max_parallelism = max_parallelism  # (an elastic policy's decisions are checked)
        self.schema = schema   # the aggregation's rows (a Spark StructType), for a new table

    def flush_time(self, query, at_ms=None):
        return None

    def kept_flush_time(self, query, batch: int, seq: int):
        return None


class PlanRun:
    """One run of a streaming query with a stretch aggregation in its plan (``schema``: its
    engine input's, a Spark StructType; ``policy``: its elastic policy, or None)."""

    def __init__(self, spark: SparkSession, agg_id: str, spec: AggregateSpec, checkpoint: str,
                 schema: StructType, delta: Optional[dict] = None,
                 policy: Optional[Policy] = None, operator: Optional[int] = None):
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
        self.elastic = ElasticRun(policy, spec.max_parallelism, self.metrics)
        self._plan = None
        engine = lambda: self.recovery.engine  # noqa: E731
        if delta is not None:
            kind = _Kind(spark, spec.max_parallelism,
                         StructType.fromJson(json.loads(delta["schema"])))
            self._sink = Sink(kind, "delta", {}, delta["path"], None, qid, app_id, True, engine,
                              self.metrics)
        else:
            kind, self._sink = _Kind(spark, spec.max_parallelism), _NoSink()
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
            # (the policy's decisions after the last batch, which is done: before this one's
            # input reaches the engine)
            self.recovery.with_engine("a reconfiguration", self._decided)
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

    def _decided(self) -> None:
        """Apply the elastic policy's decisions after the last batch: key groups moved
        between hosts, then epoch switches (as a pipelined query's, :mod:`.pipeline`)."""
        for d in self.elastic.pending(moves=True):
            self.elastic.switched(self.recovery.move_groups(moves=d.key_groups, cause=d.cause))
        for d in self.elastic.pending():
            msg = recovery.reconfiguration(self.qid, d.parallelism, d.owner_map,
                                           self.spec.max_parallelism, d.host)
            recovery.check_host(self.recovery.engine, d.host)
            t0 = time.perf_counter()
            reply = self.recovery.engine.call(replace(msg, persist=False))
            self.elastic.switched(self.recovery.reconfigured(msg, reply, t0, d.cause))

    def _step(self, df, batch_id: int, watermark_ms: Optional[int]) -> M.StepResult:
        self._ingest(df, batch_id)
        eng = self.recovery.engine
        eng.call(M.Submit(query=self.qid, batch=batch_id, watermark_ms=watermark_ms))
        return eng.call(M.Result(query=self.qid, batch=batch_id))

    def reconfigure(self, parallelism: Optional[int] = None, owner_map=None,
                    key_groups=None, host: Optional[str] = None) -> dict:
        """Switch the engine's epoch between two micro-batches (``1 <= parallelism <=
        max_parallelism``; on several hosts, of ``host``'s instances or every host's), or move
        key groups between hosts (``key_groups``)."""
        recovery.check_host(self.recovery.engine, host)
        if key_groups is not None:
            if self._pipeline is not None:
                return self._pipeline.between(lambda: self.recovery.move_groups(key_groups))
            with self._lock:
                rec = self.recovery.move_groups(key_groups)
                self.elastic.switched(rec)
                return rec
        msg = recovery.reconfiguration(self.qid, parallelism, owner_map,
                                       self.spec.max_parallelism, host)
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
