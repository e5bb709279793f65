"""A stretch operator inside Spark's plan: the driver's side of the shim's ``StretchExec``.

``spark_stretch.stretch(df)`` marks a native aggregation in Spark's plan, and the
``applyInPandasWithState`` drop-in marks Spark's own ``applyInPandasWithState`` (the shim's
``StretchPlans``); Spark then runs the query as usual, with its own sink, trigger, checkpoint,
watermark and no-data batches. In each micro-batch the shim's ``StretchExec`` calls
:class:`BatchHandler` (a py4j callback, as ``foreachBatch`` is) with the batch's input, which
the run of its query (:class:`~.planrun.PlanRun`) ingests on the host engine (:mod:`.ingest`:
files, columnar or rows); the engine steps it and offers its output, and the answer tells the
exec where to read it. The engine's state follows Spark's commit log as for
``stretchAggregate`` (:mod:`.recovery`: checkpoints and the input log under
``<checkpointLocation>/stretch/``); the output goes through Spark's sink, so its exactly-once
guarantee is the sink's own.

A query may have several stretch aggregations (a union of two, one over another's windows):
each is its own engine query, a :class:`~.planrun.PlanRun` per (Spark run id, aggregation id),
with its files under ``<checkpointLocation>/stretch/operators/<Spark state operator id>/`` (a
query with one keeps them in ``stretch/`` itself), and Spark's own watermark for each batch.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from pyspark.sql import SparkSession

from ..protocol.layout import QueryLayout
from . import jvm
from .planrun import Marked, PlanRun
from .settings import read_settings

__all__ = ["DISTINCT_UPDATE", "FallbackWarning", "BatchHandler", "Marked", "PlanRun",
           "fall_back", "handler_for", "open_at_start", "run_of", "aggregations_of"]


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
    warnings.warn(f"stretch: {reason}; Spark runs this query as it is", FallbackWarning,
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
                  delta: Optional[dict] = None, several: bool = False) -> None:
    """Open the engine's query of the stretch operator ``agg_id`` as Spark's ``query``
    (written with output mode ``mode``; to the Delta table ``delta``, ``{"path", "schema"}``,
    by the engine itself) starts, beside Spark's planning of its first micro-batch, which would
    open it otherwise; not for a query with ``several`` stretch operators."""
    if several:  # (each one's files by its Spark operator id, which its first batch tells)
        return
    marked = handler_for(spark).marked(agg_id)
    key = (str(query.runId), agg_id)
    plans = jvm.ShimPlans(spark)
    schema = plans.input_schema(agg_id)
    with _LOCK:
        if key in _RUNS:  # (its first batch came first)
            return
        run = _RUNS[key] = _new_run(spark, agg_id, marked, mode, jvm.checkpoint_root(query),
                                    schema, delta, query)
    if not query.isActive:  # ended before the run was known: nothing else releases it
        run.release()


def _new_run(spark, agg_id, marked, mode, checkpoint: str, schema, delta, query=None,
             operator: Optional[int] = None) -> PlanRun:
    """A new run of the operator at ``checkpoint`` (its files by ``operator``'s, when given:
    under ``_LOCK``). Spark runs one run of a query at a time, so an earlier run of it has
    ended: it is released first if Spark's end of it has not been heard of yet (a query
    restarted at once after it failed), for the new run to open the query on the engine
    afresh."""
    root = QueryLayout(checkpoint, operator).root
    for old in list(_RUNS.values()):
        if old.layout.root == root:
            old.release()
    return PlanRun(spark, agg_id, marked, mode, checkpoint, schema, delta, query, operator)


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


def aggregations_of(spark: SparkSession, query, wait_s: float = 60.0) -> List[str]:
    """The stretch aggregations of a running ``StreamingQuery``'s plan, in the plan's order (the
    outer one of two chained first). Spark makes that plan on the query's own thread, which may
    not have done so yet: it is waited for (``wait_s``), while the query is active."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return jvm.ShimPlans(spark).marker_ids(query)
        except Exception as e:
            if not jvm.plan_not_made(e) or time.monotonic() > deadline or not query.isActive:
                raise
            time.sleep(0.05)


def _ended(run_id: str) -> None:
    """Release the runs' engines of a Spark query run that ended (stopped, failed or
    finished)."""
    with _LOCK:  # kept (released) for their figures: control(q).metrics() after the end
        runs = [r for (rid, _), r in _RUNS.items() if rid == run_id]
    for run in runs:
        run.release()


class BatchHandler:
    """The shim's ``StretchBatchHandler``: one per session, for every stretch operator in it."""

    def __init__(self, spark: SparkSession):
        self._spark = spark
        self._marked: Dict[str, Marked] = {}
        self._regrouped = set()  # (with a distinct aggregate: no update mode)

    def add(self, agg_id: str, marked: Marked, regroup: bool = False) -> None:
        self._marked[agg_id] = marked
        if regroup:
            self._regrouped.add(agg_id)
        jvm.ShimPlans(self._spark).register(agg_id, self)

    def check_mode(self, agg_id: str, mode: str) -> None:
        """Refuse an output mode the engine cannot run ``agg_id`` in: update mode with a
        distinct aggregate (:data:`DISTINCT_UPDATE`)."""
        if mode.lower() == "update" and agg_id in self._regrouped:
            raise ValueError(f"stretch: {DISTINCT_UPDATE}; Spark refuses distinct aggregates "
                             "on streams in every output mode")

    def marked(self, agg_id: str) -> Marked:
        return self._marked[agg_id]

    def onBatch(self, agg_id, batch_id, mode, state_dir, run_id, jdf, jplan,  # noqa: N802
                sink, batch) -> str:
        """Micro-batch ``batch_id`` of run ``run_id``: the answer the exec reads (JSON).
        ``sink``: "" (the exec reads the output), or the Delta table the engine appends to;
        ``batch``: what Spark gave the batch's state operator (JSON: its ``operator_id``, the
        place of the operator's files when the query has several; its watermarks)."""
        key = (run_id, agg_id)
        info = json.loads(batch) if batch else {}
        with _LOCK:
            run = _RUNS.get(key)
        if run is None:
            self.check_mode(agg_id, mode)
            several = len(self._aggregations(run_id)) > 1
            with _LOCK:
                run = _RUNS.get(key)
                if run is None:
                    run = _RUNS[key] = _new_run(
                        self._spark, agg_id, self._marked[agg_id], mode,
                        str(Path(state_dir).parent), jvm.dataframe(jdf, self._spark).schema,
                        json.loads(sink) if sink else None, None,
                        int(info["operator_id"]) if several else None)
        return json.dumps(run.batch(int(batch_id), jdf, jplan, info))

    def cancel(self, agg_id, run_id, batch_id) -> None:
        """Spark stops the query while micro-batch ``batch_id`` of run ``run_id`` waits in
        :meth:`onBatch`: give its step up (:meth:`PlanRun.cancel`)."""
        with _LOCK:
            run = _RUNS.get((run_id, agg_id))
        if run is not None:
            run.cancel(int(batch_id))

    def _aggregations(self, run_id: str) -> List[str]:
        """The stretch operators of the active query run ``run_id``."""
        for q in self._spark.streams.active:
            if str(q.runId) == run_id:
                return aggregations_of(self._spark, q)
        raise RuntimeError(f"stretch: no active streaming query has run id {run_id}")

    class Java:
        implements = ["org.apache.spark.sql.stretch.StretchBatchHandler"]
