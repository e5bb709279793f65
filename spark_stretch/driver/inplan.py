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

from ..protocol.specs import AggregateSpec
from . import jvm
from .planrun import PlanRun
from .policy import Policy
from .settings import read_settings

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
            remove = jvm.on_query_end(spark, _ended)
            # A query that ends while Python exits would call back into a gone interpreter.
            atexit.register(_quietly, remove)
    return h


def open_at_start(spark: SparkSession, agg_id: str, query, mode: str,
                  delta: Optional[dict] = None) -> None:
    """Open the engine's query of the stretch aggregation ``agg_id`` as Spark's ``query``
    (written with output mode ``mode``; to the Delta table ``delta``, ``{"path", "schema"}``,
    by the engine itself) starts, beside Spark's planning of its first micro-batch, which would
    open it otherwise."""
    handler = handler_for(spark)
    spec = handler.spec(agg_id)
    key = (str(query.runId), agg_id)
    plans = jvm.ShimPlans(spark)
    if len(plans.marker_ids(query)) != 1:  # (each one's files by its Spark operator id, which
        return                              # its first batch tells)
    schema = plans.input_schema(agg_id)
    with _LOCK:
        if key in _RUNS:  # (its first batch came first)
            return
        run = _RUNS[key] = PlanRun(spark, agg_id, replace(spec, output_mode=mode),
                                   jvm.checkpoint_root(query), schema, delta,
                                   handler.policy(agg_id))
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


def _ended(run_id: str) -> None:
    """Release the runs' engines of a Spark query run that ended (stopped, failed or
    finished)."""
    with _LOCK:  # kept (released) for their figures: control(q).metrics() after the end
        runs = [r for (rid, _), r in _RUNS.items() if rid == run_id]
    for run in runs:
        run.release()


class BatchHandler:
    """The shim's ``StretchBatchHandler``: one per session, for every stretch aggregation in it."""

    def __init__(self, spark: SparkSession):
        self._spark = spark
        self._specs: Dict[str, AggregateSpec] = {}
        self._policies: Dict[str, Optional[Policy]] = {}
        self._regrouped = set()  # (with a distinct aggregate: no update mode)

    def add(self, agg_id: str, spec: AggregateSpec, policy: Optional[Policy] = None,
            regroup: bool = False) -> None:
        self._specs[agg_id] = spec
        self._policies[agg_id] = policy
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

    def policy(self, agg_id: str) -> Optional[Policy]:
        """The aggregation's elastic policy (``stretch(df, elastic=)``), or None."""
        return self._policies.get(agg_id)

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
                        json.loads(sink) if sink else None, self.policy(agg_id),
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
