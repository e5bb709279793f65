"""Every call from Python into Spark's JVM internals (py4j), in one place.

Spark's public Python API says nothing of a micro-batch's executed plan, a watermark's delay or
the executors' hosts; these functions ask the JVM, each for one thing, and the rest of
spark-stretch calls them instead of touching ``_jvm``, ``_jdf`` or ``_jsq`` (a test holds every
other module to that). :class:`ShimIngest` wraps the shim's ``StretchIngest`` object, one
method per JVM method.
"""

from __future__ import annotations

import json
from typing import List, Optional, Set, Tuple

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql.types import StructType

__all__ = ["executor_hosts", "launch_engines", "batch_plan", "trigger_state", "plan_string",
           "foreach_batch_with_metrics", "forget_batch_function", "processing_interval_ms",
           "register_aggregation_figures", "watermarks", "interval_us", "ShimPlans",
           "dataframe", "requery", "plan_not_made", "splits_for", "session_key", "on_query_end",
           "column_text", "grouping_columns", "ShimIngest"]


def executor_hosts(spark: SparkSession, driver: bool = True) -> Set[str]:
    """The hosts of the application's executors (and of the driver's block manager, unless
    ``driver=False``)."""
    sc = spark.sparkContext._jsc.sc()
    status = sc.getExecutorMemoryStatus()
    mine = sc.env().blockManager().blockManagerId()
    own = f"{mine.host()}:{mine.port()}"
    it = status.keysIterator()
    hosts = set()
    while it.hasNext():
        key = it.next()
        if driver or key != own:
            hosts.add(key.rsplit(":", 1)[0])
    return hosts


def launch_engines(spark: SparkSession, hosts: List[str], command: List[str], secret: str,
                   base_dir: str, lease_s: float, timeout_ms: int) -> List[str]:
    """Start (or find) the application's host engine on each of ``hosts``, from executors there
    (the shim's ``StretchHosts.launch``): per host, ``host|socket|tcp://address:port|pid``."""
    sc = spark.sparkContext
    gw = sc._gateway
    jhosts = gw.new_array(gw.jvm.java.lang.String, len(hosts))
    for i, h in enumerate(hosts):
        jhosts[i] = h
    jcmd = gw.new_array(gw.jvm.java.lang.String, len(command))
    for i, c in enumerate(command):
        jcmd[i] = c
    return list(sc._jvm.org.apache.spark.sql.stretch.StretchHosts.launch(
        sc._jsc.sc(), jhosts, jcmd, secret, base_dir, float(lease_s), int(timeout_ms)))


def batch_plan(query, batch_id: int):
    """The executed plan of micro-batch ``batch_id`` of a running ``StreamingQuery`` (Spark's
    ``IncrementalExecution`` of it, which ``foreachBatch`` wraps as rows), or None."""
    ex = query._jsq.streamingQuery().lastExecution()
    if ex is None or ex.currentBatchId() != batch_id:
        return None
    return ex.executedPlan()


def trigger_state(query) -> Optional[Tuple[int, int, int, bool]]:
    """Spark's latest trigger of a running micro-batch ``StreamingQuery``: ``(batch, start,
    before, idle)``, the batch id it is for, its start (ms), the start of the trigger before it
    for the same batch id (or, if there was none, of the one that ran the batch before), and
    whether it is over without a batch (it found no data). None before the first trigger.

    Spark keeps a micro-batch's execution context from the trigger that looks for its data to
    the one that runs it, and each trigger's start moves to ``lastTriggerStartTimestamp``:
    ``before`` is not the start of the previous batch's trigger exactly when a trigger found
    no data in between (where a stateful query runs its no-data batch).
    """
    ctx = query._jsq.streamingQuery().getLatestExecutionContext()
    if ctx is None:
        return None
    start = ctx.currentTriggerStartTimestamp()
    over = not ctx.currentStatus().isTriggerActive()
    idle = over and not ctx.isCurrentBatchConstructed()
    before, batch = ctx.lastTriggerStartTimestamp(), ctx.batchId()
    if start < 0 or ctx.currentTriggerStartTimestamp() != start:
        return None  # none yet, or another trigger began while these were read
    return int(batch), int(start), int(before), bool(idle)


class _SinkMetrics:
    """The shim's ``StretchSinkMetrics`` (py4j callback): ``figures()``, a dict of the query's
    figures, as the JSON object of strings its progress's sink metrics are; ``state()``, a
    dict of its state operator's figures (``StateOperatorProgress``'s fields), as JSON."""

    def __init__(self, figures, state=None):
        self._figures = figures
        self._state = state

    def metrics(self) -> str:
        try:
            return json.dumps({k: str(v) for k, v in self._figures().items()})
        except Exception:  # (no figures this time: a progress update must not fail the query)
            return "{}"

    def state(self) -> str:
        try:
            return json.dumps(self._state() if self._state is not None else {})
        except Exception:  # (as above)
            return "{}"

    class Java:
        implements = ["org.apache.spark.sql.stretch.StretchSinkMetrics"]


def foreach_batch_with_metrics(df: DataFrame, func, figures, key: str, state=None,
                               operator: str = "stretchAggregate"):
    """``df.writeStream.foreachBatch(func)``, run by Spark's own ``ForeachBatchSink`` as the
    shim's ``StretchBatchSink``, which adds ``figures()`` (a dict) to each progress update as
    the sink's custom metrics (``progress.sink.metrics``) and ``state()`` (a dict of
    ``StateOperatorProgress`` fields) as its state operator ``operator``
    (``progress.stateOperators``: the shim's ``StretchStateExec``, a pass-through node over
    ``df``'s plan). ``key`` names the registration (one per query:
    :func:`forget_batch_function` drops it). The writer, to configure and start."""
    from pyspark.java_gateway import ensure_callback_server_started
    from pyspark.sql.utils import ForeachBatchFunction

    spark = df.sparkSession
    gw = spark.sparkContext._gateway
    shim = spark.sparkContext._jvm.org.apache.spark.sql.stretch
    shim.StretchBatchSink.register(key, ForeachBatchFunction(spark, func),
                                   _SinkMetrics(figures, state), df.schema.json())
    ensure_callback_server_started(gw)
    marked = DataFrame(shim.StretchState.mark(df._jdf, key, operator), spark)
    return (marked.writeStream.format("org.apache.spark.sql.stretch.StretchBatchSinkProvider")
            .option("stretch.sink", key))


def forget_batch_function(spark: SparkSession, key: str) -> None:
    """Drop what :func:`foreach_batch_with_metrics` registered as ``key``."""
    spark.sparkContext._jvm.org.apache.spark.sql.stretch.StretchBatchSink.unregister(key)


def register_aggregation_figures(spark: SparkSession, agg_id: str, figures) -> None:
    """``figures()`` (a dict) as the sink's custom metrics of the shim's ``StretchDeltaSink``
    when it appends the stretch aggregation ``agg_id``'s rows (``stretch(df)`` to Delta)."""
    from pyspark.java_gateway import ensure_callback_server_started

    ensure_callback_server_started(spark.sparkContext._gateway)
    spark.sparkContext._jvm.org.apache.spark.sql.stretch.StretchBatchSink.registerFigures(
        agg_id, _SinkMetrics(figures))


class _QueryEnds:
    """Spark's ``PythonStreamingQueryListener`` (py4j callback) that hands Python a query's end
    only. (pyspark's ``StreamingQueryListener`` converts every progress event to Python field by
    field, about 450 py4j calls and 0.1-0.2 s of both processes' time a micro-batch, whether
    the listener looks at it or not.)"""

    def __init__(self, ended):
        self._ended = ended

    def onQueryStarted(self, event) -> None:  # noqa: N802
        pass

    def onQueryProgress(self, event) -> None:  # noqa: N802
        pass

    def onQueryIdle(self, event) -> None:  # noqa: N802
        pass

    def onQueryTerminated(self, event) -> None:  # noqa: N802
        self._ended(str(event.runId().toString()))

    class Java:
        implements = ["org.apache.spark.sql.streaming.PythonStreamingQueryListener"]


def on_query_end(spark: SparkSession, ended):
    """Call ``ended(run_id)`` when a streaming query of ``spark`` ends (stopped, failed or
    finished); returns the function that stops it."""
    from pyspark.java_gateway import ensure_callback_server_started

    ensure_callback_server_started(spark.sparkContext._gateway)
    listener = spark.sparkContext._jvm.org.apache.spark.sql.streaming \
        .PythonStreamingQueryListenerWrapper(_QueryEnds(ended))
    streams = spark._jsparkSession.streams()
    streams.addListener(listener)
    return lambda: streams.removeListener(listener)


def processing_interval_ms(query) -> Optional[int]:
    """The interval (ms) of a running ``StreamingQuery``'s processing-time trigger, or None
    (another trigger, or an interval of 0: batches back to back)."""
    trigger = query._jsq.streamingQuery().trigger()
    if trigger.getClass().getSimpleName() != "ProcessingTimeTrigger":
        return None
    ms = int(trigger.intervalMs())
    return ms if ms > 0 else None


def plan_string(ran) -> str:
    """The physical plan of a DataFrame that ran, or of a plan: as Spark prints it."""
    if isinstance(ran, DataFrame):
        return ran._jdf.queryExecution().executedPlan().toString()
    return ran.toString()


def _nodes(df: DataFrame):
    """The nodes of ``df``'s analyzed logical plan, depth first."""
    stack = [df._jdf.queryExecution().analyzed()]
    while stack:
        node = stack.pop()
        yield node
        children = node.children()
        stack.extend(children.apply(i) for i in range(children.size()))


def watermarks(df: DataFrame) -> List[Tuple[str, int]]:
    """The ``(event-time column, delay ms)`` of each ``withWatermark`` in ``df``'s plan, the
    outermost first."""
    jvm = df.sparkSession._jvm
    ewm = jvm.org.apache.spark.sql.catalyst.plans.logical.EventTimeWatermark
    return [(node.eventTime().name(), int(ewm.getDelayMs(node.delay())))
            for node in _nodes(df) if node.nodeName() == "EventTimeWatermark"]


def interval_us(spark: SparkSession, text: str, what: str) -> int:
    """An interval string (``'10 seconds'``) in microseconds, with Spark's own parser; a
    ValueError naming ``what`` if it is not a positive, fixed-length interval."""
    from py4j.java_gateway import get_field

    jvm = spark._jvm
    if not isinstance(text, str):
        raise TypeError(f"{what} must be an interval string like '60 seconds', got {text!r}")
    try:
        interval = jvm.org.apache.spark.sql.catalyst.util.IntervalUtils.stringToInterval(
            jvm.org.apache.spark.unsafe.types.UTF8String.fromString(text))
    except Exception as e:  # py4j error: keep Spark's reason short
        raise ValueError(f"{what} '{text}' is not an interval: {str(e).splitlines()[0]}") from None
    if get_field(interval, "months") != 0:
        raise ValueError(f"{what} '{text}' must not use months or years (not a fixed length)")
    us = int(get_field(interval, "days")) * 86_400_000_000 + int(get_field(interval, "microseconds"))
    if us <= 0:
        raise ValueError(f"{what} '{text}' must be positive")
    return us


def column_text(col: Column) -> str:
    """The expression of ``col`` as Spark prints it (``words`` for ``F.col('words')``)."""
    return col._jc.toString()


def grouping_columns(df: DataFrame, operator: str) -> Optional[List[str]]:
    """The grouping attributes of the first ``operator`` node (e.g.
    ``FlatMapGroupsInPandasWithState``) of ``df``'s plan, or None if it has none."""
    for node in _nodes(df):
        if node.nodeName() == operator:
            attrs = node.groupingAttributes()
            return [attrs.apply(i).name() for i in range(attrs.size())]
    return None


class ShimIngest:
    """The shim's ``org.apache.spark.sql.stretch.StretchIngest`` (jvm_shim/), one method each.

    Examples
    --------
    >>> ingest = ShimIngest(spark)                       # doctest: +SKIP
    >>> ingest.parquet_files(plan)                        # doctest: +SKIP
    ['file:/data/tweets-000003.parquet']
    """

    def __init__(self, spark: SparkSession):
        self._j = spark.sparkContext._jvm.org.apache.spark.sql.stretch.StretchIngest

    def ingest(self, plan, endpoint: str, stream: str) -> int:
        """Write a columnar scan's batches to the engine; -1 if the plan is not one."""
        return int(self._j.ingest(plan, endpoint, stream))

    def parquet_files(self, plan) -> Optional[List[str]]:
        """The files of a plain Parquet scan the engine may read itself, or None."""
        files = self._j.parquetFiles(plan)
        return None if files is None else list(files)

    def watermark_columns(self, plan) -> List[str]:
        return list(self._j.watermarkColumns(plan))

    def column_names(self, plan) -> List[str]:
        return list(self._j.columnNames(plan))

    def record_read(self, plan, rows: int) -> None:
        """The scan's ``numOutputRows`` (Spark's ``numInputRows``), as if the rows flowed."""
        self._j.recordRead(plan, int(rows))

    def record_event_times(self, plan, i: int, top: int, low: int, avg: float, n: int) -> None:
        """Watermark ``i``'s event-time statistics, as ``EventTimeWatermarkExec`` would add."""
        self._j.recordEventTimes(plan, i, int(top), int(low), float(avg), int(n))


class ShimPlans:
    """The shim's ``org.apache.spark.sql.stretch.StretchPlans`` (jvm_shim/.../StretchPlans.scala):
    a native aggregation read for the engine and marked in Spark's plan, one method each.

    Examples
    --------
    >>> plans = ShimPlans(spark)                          # doctest: +SKIP
    >>> plans.analyze(df, "a1")["ok"]                     # doctest: +SKIP
    True
    """

    def __init__(self, spark: SparkSession):
        self._spark = spark
        self._j = spark.sparkContext._jvm.org.apache.spark.sql.stretch.StretchPlans

    def install(self) -> None:
        """Have the session plan stretch markers (once per session)."""
        self._j.install(self._spark._jsparkSession)

    def analyze(self, df: DataFrame, agg_id: str) -> dict:
        """``{"ok": True, "spec": {...}}`` (the translation kept as ``agg_id``) or
        ``{"ok": False, "reason": ...}``."""
        return json.loads(self._j.analyze(df._jdf, agg_id))

    def mark(self, df: DataFrame, agg_id: str, cls=DataFrame) -> DataFrame:
        """``df`` with the stretch marker over its aggregation (a ``cls``, a DataFrame class)."""
        return cls(self._j.mark(df._jdf, agg_id), df.sparkSession)

    def mark_grouped(self, native: DataFrame, df: DataFrame, agg_id: str, cls=DataFrame):
        """``native`` (``df.groupBy(...).applyInPandasWithState(...)``) with the stretch marker
        over it, its input ``df`` the engine's (a ``cls``, a DataFrame class)."""
        return cls(self._j.markGrouped(native._jdf, df._jdf, agg_id), df.sparkSession)

    def transform_info(self, df: DataFrame) -> dict:
        """``df`` read as a transformWithState (``StretchPlans.transformInfo``)."""
        return json.loads(self._j.transformInfo(df._jdf))

    def transform_input(self, df: DataFrame, initial: bool = False) -> DataFrame:
        """The DataFrame ``df``'s transformWithState groups (``initial``: its initialState)."""
        j = self._j.transformInitial if initial else self._j.transformInput
        return DataFrame(j(df._jdf), df.sparkSession)

    def mark_transform(self, df: DataFrame, data: DataFrame, agg_id: str, cls) -> DataFrame:
        """``df`` (a transformWithState over ``data``) with the marker over Spark's node."""
        return cls(self._j.markTransform(df._jdf, data._jdf, agg_id), df.sparkSession)

    def register(self, agg_id: str, handler) -> None:
        """The py4j callback (``StretchBatchHandler``) that runs ``agg_id``'s micro-batches."""
        from pyspark.java_gateway import ensure_callback_server_started

        ensure_callback_server_started(self._spark.sparkContext._gateway)
        self._j.register(agg_id, handler)

    def input_schema(self, agg_id: str) -> StructType:
        """The schema of ``agg_id``'s engine input, as its micro-batches have it."""
        return StructType.fromJson(json.loads(self._j.inputSchema(agg_id)))

    def check_native(self, agg_id: str, mode: str) -> None:
        """Spark's own error if it refuses aggregation ``agg_id`` streaming in ``mode``."""
        self._j.checkNative(agg_id, mode)

    def frame_marker_ids(self, df: DataFrame) -> List[str]:
        """The stretch aggregations of a DataFrame's plan, in its order."""
        return list(self._j.markerIds(df._jdf.queryExecution().logical()))

    def marker_ids(self, query) -> List[str]:
        """The stretch aggregations of a running ``StreamingQuery``'s plan, in its order (a
        Py4JJavaError until the query's thread has made that plan)."""
        return list(self._j.markerIds(query._jsq.streamingQuery().logicalPlan()))


def plan_not_made(error: BaseException) -> bool:
    """Whether ``error`` is Spark's refusal of a started query's plan not made yet (its thread
    makes it)."""
    return "must be initialized in QueryExecutionThread" in str(error)


def requery(query, cls):
    """The running ``StreamingQuery`` ``query`` as a ``cls`` (a StreamingQuery subclass)."""
    return cls(query._jsq)


def checkpoint_root(query) -> str:
    """The checkpoint location of a running ``StreamingQuery``, as Spark resolved it (the parent
    of its stateful operators' ``state`` directory)."""
    return str(query._jsq.streamingQuery().resolvedCheckpointRoot())


def dataframe(jdf, spark: SparkSession) -> DataFrame:
    """A JVM Dataset (handed over by the shim) as a DataFrame of ``spark``."""
    return DataFrame(jdf, spark)


def session_key(spark: SparkSession) -> int:
    """An id of the JVM session behind ``spark`` (Python wrappers of one session share it)."""
    return int(spark._jsparkSession.hashCode())


def splits_for(spark: SparkSession, rows: int, per_split: int = 50_000) -> int:
    """Read partitions for ``rows`` output rows: one per ``per_split`` (below it one task reads,
    and writes, the batch), at most the cores, so every core writes a large output."""
    return max(1, min(spark.sparkContext.defaultParallelism, rows // per_split))
