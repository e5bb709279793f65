"""``groupBy(k).stretchApplyInPandasWithState(func, ...)``: the drop-in for
``applyInPandasWithState`` (``groupBy(k).stretchAggregate(func, ...)``, its alias, is the same
method).

Same arguments, same function, same ``GroupState`` (pyspark's own class), same rows; the state
lives in each engine host's state store (LMDB on local disk, by bucket) and the function runs in
the engine's instance processes, so the query can be rescaled between two micro-batches without
a restart, a shuffle or a state copy (``query.reconfigure(parallelism=k)``); on executors of
several hosts, key groups move between hosts (``query.reconfigure(key_groups=...)``).
"""

from __future__ import annotations

import base64
import re
import uuid
from dataclasses import replace
from typing import List, Optional, Union

from pyspark.sql import DataFrame
from pyspark.sql.group import GroupedData
from pyspark.sql.streaming.state import GroupState, GroupStateTimeout
from pyspark.sql.types import StructType

from ..driver import jvm
from ..driver.cluster import engine_hosts
from ..driver.inplan import Marked, handler_for
from ..driver.policy import as_policy
from ..driver.settings import read_settings
from ..protocol.specs import GroupedSpec
from .frame import StretchFrame
from .specs import find_watermark

__all__ = ["StretchGroupedAggregation", "stretch_apply_in_pandas_with_state", "GroupState",
           "GroupStateTimeout", "task_attempts", "watermark_of", "check_key_groups"]

_DELAY_KEY = "spark.watermarkDelayMs"  # EventTimeWatermark.delayKey: marks the event-time column


def _runner_conf(spark) -> dict:
    """The settings pyspark's worker reads for applyInPandasWithState (worker.py RunnerConf)."""
    c = spark.conf

    def flag(key, default):
        return str(c.get(key, default)).lower() == "true"

    return {
        "timezone": c.get("spark.sql.session.timeZone"),
        "safecheck": flag("spark.sql.execution.pandas.convertToArrowArraySafely", "false"),
        "assign_cols_by_name": flag(
            "spark.sql.legacy.execution.pandas.groupedMap.assignColumnsByName", "true"),
        "prefer_int_ext_dtype": flag(
            "spark.sql.execution.pythonUDF.pandas.preferIntExtensionDtype", "false"),
        "int_to_decimal_coercion_enabled": flag(
            "spark.sql.execution.pythonUDF.pandas.intToDecimalCoercionEnabled", "false"),
        "arrow_max_records_per_batch": int(
            c.get("spark.sql.execution.arrow.maxRecordsPerBatch", "10000")),
    }


def _grouping_columns(native: DataFrame, df: DataFrame) -> List[str]:
    """The grouping attributes of the native plan's ``FlatMapGroupsInPandasWithState``."""
    names = jvm.grouping_columns(native, "FlatMapGroupsInPandasWithState")
    if names is None:
        raise RuntimeError("no FlatMapGroupsInPandasWithState in the native plan (pyspark "
                           "changed?)")
    missing = [n for n in names if n not in df.columns]
    if missing:
        raise NotImplementedError(
            f"groupBy(...).stretchApplyInPandasWithState groups by columns of the DataFrame; "
            f"{missing} are expressions. Add them as columns first, e.g. "
            f"df.withColumn('k', expr).groupBy('k')")
    return names


def stretch_apply_in_pandas_with_state(
        gd: GroupedData, func, outputStructType: Union[StructType, str],
        stateStructType: Union[StructType, str], outputMode: str, timeoutConf: str, *,
        parallelism: Optional[int] = None, max_parallelism: Optional[int] = None,
        buckets: int = 256, elastic=None) -> "StretchGroupedAggregation":
    """
    Applies the given function to each group of data, while maintaining a user-defined per-group
    state, on the host's shared-state engine: the drop-in replacement for
    :meth:`pyspark.sql.GroupedData.applyInPandasWithState` (replace the method name, nothing else).

    Called as ``df.groupBy(...).stretchApplyInPandasWithState(func, ...)``;
    ``df.groupBy(...).stretchAggregate(func, ...)`` is an alias of it (the same method).

    For a streaming :class:`DataFrame`, the function is invoked first for all input groups and
    then for all timed out states where the input data is set to be empty. Updates to each
    group's state are saved across invocations, in the host engine's state store (not in
    Spark's), and checkpointed with the query.

    The function takes ``(key, Iterator[pandas.DataFrame], state)`` and returns an
    ``Iterator[pandas.DataFrame]``. The grouping key(s) are passed as a tuple of numpy data
    types; the state is pyspark's :class:`pyspark.sql.streaming.state.GroupState`, so the same
    calls work and the same misuse raises the same exceptions as under native Spark. Each
    ``pandas.DataFrame`` has all the columns of the grouped DataFrame, converted as pyspark
    converts them (session time zone, same dtypes).

    Parameters
    ----------
    func : function
        A Python native function to be called on every group. It should take parameters
        (key, Iterator[`pandas.DataFrame`], state) and return Iterator[`pandas.DataFrame`].
    outputStructType : :class:`pyspark.sql.types.DataType` or str
        The type of the output records, a :class:`StructType` or a DDL-formatted string.
    stateStructType : :class:`pyspark.sql.types.DataType` or str
        The type of the user-defined state, a :class:`StructType` or a DDL-formatted string.
    outputMode : str
        The output mode of the function, ``"Update"`` or ``"Append"``; the query's
        ``writeStream.outputMode`` must match it, as for the native operator.
    timeoutConf : str
        A :class:`pyspark.sql.streaming.state.GroupStateTimeout` value: ``NoTimeout``,
        ``ProcessingTimeTimeout`` or ``EventTimeTimeout`` (which needs ``withWatermark``).
    parallelism : int, optional
        Instance processes running the function at the start (default: the default parallelism
        of the Spark context, e.g. 2 on ``local[2]``).
    max_parallelism : int, optional
        Instance processes started with the query (default: ``parallelism``);
        ``query.reconfigure(parallelism=k)`` moves between 1 and this many without a restart.
    buckets : int
        State buckets; ownership moves between instances bucket by bucket. Keep it the same
        across restarts from one checkpoint.
    elastic : bool or Policy, optional
        Reconfigure the running query by itself, as ``df.stretchAggregate(elastic=...)`` does:
        ``True``, an :class:`spark_stretch.ElasticPolicy` or a :class:`spark_stretch.Policy`.
        An instance's utilization is its function's time in the batch; its load, the rows of
        the buckets it owns.

    Returns
    -------
    StretchGroupedAggregation
        A streaming DataFrame: transform it and write it with ``.writeStream`` like any other.
        Written unchanged, the query is Spark's own ``StreamingQuery`` with ``reconfigure`` and
        ``metrics``; for a transformed result, :func:`spark_stretch.control` gives them.

    Examples
    --------
    A running count per user over a stream of tweet files, on two instance processes, then
    on one (the state stays where it is):

    >>> import tempfile
    >>> import pandas as pd
    >>> import spark_stretch
    >>> from pyspark.sql.streaming.state import GroupStateTimeout
    >>> from spark_stretch.testing import tweet_source, write_tweets
    >>> def count_fn(key, pdf_iter, state):
    ...     total = state.get[0] if state.exists else 0
    ...     for pdf in pdf_iter:
    ...         total += len(pdf)
    ...     state.update((total,))
    ...     yield pd.DataFrame({"user": [key[0]], "count": [total]})
    ...
    >>> spark = spark_stretch.session()                                  # doctest: +SKIP
    >>> work = tempfile.mkdtemp()                                        # doctest: +SKIP
    >>> src = write_tweets(f"{work}/src", 1000, files=2, users=10)      # doctest: +SKIP
    >>> counts = (tweet_source(spark, src).groupBy("user")               # doctest: +SKIP
    ...           .stretchApplyInPandasWithState(
    ...               count_fn, outputStructType="user string, count long",
    ...               stateStructType="count long", outputMode="Update",
    ...               timeoutConf=GroupStateTimeout.NoTimeout, parallelism=2))
    >>> q = (counts.writeStream.outputMode("update").format("memory")    # doctest: +SKIP
    ...      .queryName("counts").option("checkpointLocation", f"{work}/ckpt").start())
    >>> q.processAllAvailable()                                          # doctest: +SKIP
    >>> q.reconfigure(parallelism=1)["parallelism"]    # online, no restart  # doctest: +SKIP
    1
    >>> spark.sql("SELECT sum(n) FROM (SELECT max(count) AS n FROM counts GROUP BY user)"
    ...           ).first()[0]                                           # doctest: +SKIP
    1000
    >>> q.stop()                                                         # doctest: +SKIP

    Notes
    -----
    - Semantics are those of Spark 4.2's ``FlatMapGroupsInPandasWithStateExec``: with
      ``EventTimeTimeout`` rows at or before the previous batch's watermark are dropped; keys
      time out when their timeout timestamp is set and earlier than the batch's event-time
      watermark (``EventTimeTimeout``) or the batch timestamp (``ProcessingTimeTimeout``, the one
      Spark recorded in the offset log); the old timeout is not passed into a call, and is kept
      unless the call updates or removes the state or sets a new timeout.
    - A key's rows arrive in DataFrames of at most ``spark.sql.execution.arrow.maxRecordsPerBatch``
      rows; where a long group is cut may differ from native Spark (the function should not
      depend on it, as the pyspark documentation says).
    - Spark runs a no-data micro-batch to fire timeouts when the watermark moved (event time) or
      on every trigger (processing time) where a trigger finds no new data; a ``foreachBatch``
      query gets none, so the driver plays it after such a trigger of its own query (before the
      next batch's rows, and before ``processAllAvailable`` returns; for processing time on
      every trigger without data, so keys time out while the stream is idle) and when an
      ``availableNow``/``once`` run ends (native Spark's ``availableNow`` never ends with
      ``ProcessingTimeTimeout``). Timeouts written to Delta are written once, across restarts.
      ``spark.stretch.testClockMs=<start>[+<step>]`` makes batch ``N``'s timestamp
      ``start + N * step`` (tests).
    - The grouping columns must be columns of the DataFrame (not expressions).
    - ``stretchAggregate`` is this method under the name it had first; both spellings stay. The
      ``DataFrame`` method of that name (``df.stretchAggregate(keys=..., window=..., agg=...)``)
      is a different one: the built-in windowed aggregations.
    - An instance process that dies during a micro-batch is started again and runs its share of
      the batch again, on the state as the previous batch left it, at most
      ``spark.stretch.instanceMaxFailures`` (4) times; a function that raises fails the batch
      with its traceback, at once on a local master, after ``spark.task.maxFailures`` attempts
      on others (as Spark runs a failing task).

    See Also
    --------
    pyspark.sql.GroupedData.applyInPandasWithState : the native operator (same arguments, same
        rows).
    spark_stretch.control : ``reconfigure`` and ``metrics`` of a query over a transformed result.
    spark_stretch.stretch_aggregate : ``df.stretchAggregate(keys=..., window=..., agg=...)``, the
        built-in windowed aggregations.
    """
    from pyspark import cloudpickle

    df = gd._df
    if not df.isStreaming:
        raise ValueError("groupBy(...).stretchApplyInPandasWithState needs a streaming "
                         "DataFrame (spark.readStream...); use applyInPandasWithState for batch "
                         "data")
    # The native operator over the same input: Spark checks the arguments exactly as for
    # applyInPandasWithState (and it is the reference the tests compare with).
    native = gd.applyInPandasWithState(func, outputStructType, stateStructType, outputMode,
                                       timeoutConf)
    spark = df.sparkSession
    if isinstance(outputStructType, str):
        outputStructType = spark._parse_ddl(outputStructType)
    if isinstance(stateStructType, str):
        stateStructType = spark._parse_ddl(stateStructType)
    keys = _grouping_columns(native, df)
    present, ts_column, delay = watermark_of(df)
    default = spark.sparkContext.defaultParallelism
    m = int(parallelism or default)
    n = int(max_parallelism or m)
    if not 1 <= m <= n:
        raise ValueError(f"parallelism={m} and max_parallelism={n}: need 1 <= parallelism <= "
                         "max_parallelism")
    if not isinstance(buckets, int) or buckets < n:
        raise ValueError(f"buckets={buckets!r}: must be an int >= max_parallelism ({n})")
    check_key_groups(spark, buckets)
    spec = GroupedSpec(
        key_columns=keys, columns=list(df.columns), out_schema=outputStructType.json(),
        state_schema=stateStructType.json(), output_mode=outputMode, timeout_conf=timeoutConf,
        ts_column=ts_column, delay_ms=int(delay), watermark_present=present,
        runner_conf=_runner_conf(spark), parallelism=m, max_parallelism=n, buckets=buckets,
        func=base64.b64encode(cloudpickle.dumps(func)).decode())
    agg_id = uuid.uuid4().hex
    handler_for(spark).add(agg_id, Marked(spec, as_policy(elastic, n), _settle(spark)))
    out = jvm.ShimPlans(spark).mark_grouped(native, df, agg_id, StretchGroupedAggregation)
    out._stretch_native = native
    return out._stretch_init(spec, agg_id, ("append", "update"))


def watermark_of(df: DataFrame):
    """``(present, ts_column, delay_ms)``: whether ``df`` has a watermark, on which column, with
    which delay (None, 0 without one)."""
    present = any(_DELAY_KEY in (f.metadata or {}) for f in df.schema.fields)
    return (present, *(find_watermark(df) if present else (None, 0)))


def check_key_groups(spark, buckets: int) -> None:
    """On several hosts a key group is a set of buckets: ``buckets`` a multiple of
    ``spark.stretch.keyGroups`` (else a ValueError naming both)."""
    groups = read_settings(spark.conf).key_groups
    if engine_hosts(spark) and buckets % groups:
        raise ValueError(f"buckets={buckets}: on several hosts it must be a multiple of "
                         f"spark.stretch.keyGroups ({groups}): a key group is a set of buckets")


def _settle(spark):
    """The spec a run opens with: an instance that dies is retried
    ``spark.stretch.instanceMaxFailures`` times, a function that raises as many times as Spark
    runs a failing task on this master."""
    def settle(spec: GroupedSpec, settings) -> GroupedSpec:
        sc = spark.sparkContext
        return replace(spec, instance_max_failures=settings.instance_max_failures,
                       function_attempts=task_attempts(
                           sc.master, sc.getConf().get("spark.task.maxFailures", "4")))
    return settle


class StretchGroupedAggregation(StretchFrame):
    """The result of ``groupBy(...).stretchApplyInPandasWithState(func, ...)``: a streaming
    DataFrame with the rows of ``applyInPandasWithState`` (``isStreaming`` is True; select,
    filter, join and write it with any sink), whose function runs on the host engine."""

    def native(self) -> DataFrame:
        """The native ``applyInPandasWithState`` DataFrame over the same input (for comparison)."""
        return self._stretch_native

    @property
    def spec(self) -> GroupedSpec:
        """The engine's spec of the drop-in."""
        return self._stretch_spec


def task_attempts(master: str, max_failures="4") -> int:
    """How many times Spark runs a task that fails on ``master`` (``SparkContext``'s
    ``createTaskScheduler``): once in local mode (``local``, ``local[N]``, ``local[*]``), ``F``
    times for ``local[N, F]``, ``spark.task.maxFailures`` (``max_failures``) times otherwise.

    Examples
    --------
    >>> task_attempts("local[2]"), task_attempts("local[*, 3]")
    (1, 3)
    >>> task_attempts("local-cluster[2,1,1024]"), task_attempts("spark://h:7077", "8")
    (4, 8)
    """
    if master == "local" or re.fullmatch(r"local\[([0-9]+|\*)\]", master):
        return 1
    m = re.fullmatch(r"local\[([0-9]+|\*)\s*,\s*([0-9]+)\]", master)
    if m:
        return int(m.group(2))
    return int(max_failures)
