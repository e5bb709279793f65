"""``spark_stretch.stretch(df)`` and ``df.groupBy(...).stretchAgg(...)``: a query as Spark users
write it, run on the host engine, and a real streaming DataFrame back.

The aggregation stays in Spark's plan: the shim marks it (``StretchPlans``), Spark plans and runs
the query with its own sink, trigger and checkpoint, and in each micro-batch the engine takes the
batch's input in place of Spark's state store (:mod:`spark_stretch.driver.inplan`). What the
engine cannot run yet runs natively, with a :class:`FallbackWarning` naming the reason.
"""

from __future__ import annotations

import re
import uuid
from typing import Optional

from pyspark.sql import DataFrame, GroupedData, SparkSession
from pyspark.sql.streaming import StreamingQuery

from ..driver import jvm
from ..driver.inplan import FallbackWarning, Marked, aggregations_of, fall_back, handler_for
from ..driver.policy import as_policy
from ..protocol.specs import AggregateSpec
from .frame import StretchControl, StretchFrame
from .specs import check_sizes, parse_interval_us
from .transform import stretch_transform

__all__ = ["FallbackWarning", "StretchControl", "control", "stretch", "stretch_agg"]


def stretch(df: DataFrame, *, parallelism: int = 1, max_parallelism: int = 4,
            buckets: int = 4096, elastic=None) -> DataFrame:
    """The streaming aggregation ``df`` (as written for Spark) running on the host's VSN engine.

    ``df`` is ``groupBy(window(ts, size[, slide]), *keys).agg(*aggregates)`` over a stream with
    ``withWatermark`` on ``ts``, optionally over ``select(explode(array).alias(k), ...)``,
    filters and projections. The result is a streaming DataFrame with exactly ``df``'s rows:
    select, filter, join and write it with any ``writeStream`` sink.

    Parameters
    ----------
    df : DataFrame
        A streaming aggregation, as written for native Spark.
    parallelism : int
        Instances updating state at the start (m).
    max_parallelism : int
        Instances created (n); ``control(q).reconfigure`` moves between 1 and n while running.
    buckets : int
        State buckets (B).
    elastic : bool or Policy, optional
        Reconfigure the running query by itself, as ``stretchAggregate(elastic=...)`` does:
        ``True`` for :class:`~spark_stretch.ElasticPolicy` ``()``, an ``ElasticPolicy(...)``, or
        a :class:`~spark_stretch.Policy` of your own (checked now: a bad one is an error
        naming the argument). Its decisions are in ``control(q).metrics()["reconfigurations"]``.

    Returns
    -------
    DataFrame
        ``df`` with its aggregation on the engine (``isStreaming`` is True; a
        :class:`~spark_stretch.api.frame.StretchFrame`, a ``pyspark.sql.DataFrame``), or ``df`` itself
        with a :class:`FallbackWarning` naming the reason when the engine cannot run it
        (an error instead when ``spark.stretch.fallback=false``).

    Examples
    --------
    >>> import spark_stretch
    >>> from pyspark.sql import functions as F
    >>> counts = spark_stretch.stretch(                                    # doctest: +SKIP
    ...     events.withWatermark("ts", "10 seconds")
    ...     .groupBy(F.window("ts", "1 minute"), "country", "device")
    ...     .agg(F.sum("x").alias("s"), F.count("*").alias("n")))
    >>> q = counts.where("n > 1").writeStream.format("memory").queryName("c").start()  # doctest: +SKIP
    >>> spark_stretch.control(q).reconfigure(parallelism=2)              # doctest: +SKIP

    Notes
    -----
    Runs on the engine so far: tumbling and sliding ``window`` (start offset 0) and
    ``session_window`` (a static or a per-row gap), with any number of grouping columns of
    any type (nulls grouped as Spark groups them; an exploded array column as the only key is
    never expanded); ``count``, ``count_if``, ``sum``, ``avg``, ``min``, ``max`` (also of
    strings), ``stddev``/``variance`` (samp and pop) over integral and floating-point expressions,
    ``first``/``last``, ``max_by``/``min_by`` (ordered by a number, boolean, date,
    timestamp, decimal of up to 18 digits or string, exactly in Spark's order), ``approx_count_distinct``
    (Spark's own estimate, rsd >= 0.0022), and expressions over these aggregates; append,
    update and complete output modes (sessions: append and complete, as Spark). Exact
    distinct aggregates (``count_distinct``, ``sum_distinct``, ...; over one column set,
    beside counts, sums, min, max and what is made of them) in append and complete mode.
    Anything else (other aggregate functions, ...) runs natively, with a
    :class:`~spark_stretch.FallbackWarning` naming the reason.

    ``df`` may also be ``groupBy(...).transformWithStateInPandas(processor, ...)`` (or the
    row-based ``transformWithState``) as written for Spark: the processor runs in the engine's
    instance processes with its state in the host's store (value, list and map state, timers,
    an ``initialState``, state TTL) (:mod:`spark_stretch.api.transform`, docs/transform.md);
    or ``groupBy(...).applyInPandasWithState(func, ...)``: the drop-in
    (:func:`~spark_stretch.api.grouped.stretch_apply_in_pandas_with_state`) with the plan's
    function and arguments.

    ``df`` may aggregate the windows of another ``stretch`` result
    (``groupBy(window(window_time("window"), ...), ...)``), and a query may hold several
    stretch aggregations (a ``union`` of two): each runs as its own engine query.

    Written unchanged to a Delta path (``.writeStream.format("delta").start(path)``, append),
    the engine appends each batch's rows to the table itself, exactly once per batch (the
    shim's ``StretchDeltaSink`` in place of Delta's, see :mod:`spark_stretch.api.frame`); the
    returned query's ``awaitTermination``/``processAllAvailable`` also wait for the engine's
    last append. Any other use goes through Spark's sink.
    """
    if not isinstance(df, DataFrame):
        raise TypeError(f"stretch() takes a DataFrame, got {type(df).__name__}")
    check_sizes(parallelism, max_parallelism, buckets)
    policy = as_policy(elastic, max_parallelism)
    spark = df.sparkSession
    plans = jvm.ShimPlans(spark)
    tws = stretch_transform(df, parallelism, max_parallelism, buckets, policy)
    if tws is not None:  # (groupBy(...).transformWithStateInPandas(...))
        return tws
    agg_id = uuid.uuid4().hex
    got = plans.analyze(df, agg_id)
    reason = None if got["ok"] else got["reason"]
    spec = None
    if reason is None:
        spec, reason = _spec(spark, got["spec"], parallelism, max_parallelism, buckets)
    if reason is not None:
        fall_back(spark, reason, stacklevel=2)
        return df
    handler_for(spark).add(agg_id, Marked(spec, policy), bool(got["spec"].get("regroup")))
    return plans.mark(df, agg_id, StretchFrame)._stretch_init(
        spec, agg_id, ("append",) if spec.finish is not None else ())


def _spec(spark, got: dict, parallelism: int, max_parallelism: int, buckets: int):
    """The engine's spec from the shim's translation, or the reason it cannot be."""
    window = got["window"]
    if got.get("session_end"):  # session windows: each row's end is an input column
        size = slide = 0
    else:
        size = parse_interval_us(spark, window[0], "window size")
        slide = parse_interval_us(spark, window[1], "window slide") if len(window) > 1 else size
    if len(window) > 2 and not re.fullmatch(r"\s*0+(\.0*)?\s*[a-z]*\s*", window[2].lower()):
        return None, f"window start offset '{window[2]}' (only 0 is on the engine yet)"
    if slide > size:
        return None, "window slide longer than its size"
    spec = AggregateSpec(
        ts_column=got["ts_column"], delay_ms=int(got["delay_ms"]), key_kind=got["key_kind"],
        key_column=got["key_column"], key_type=got["key_type"],
        key_nullable=bool(got.get("key_nullable", False)), window_us=size, slide_us=slide,
        aggs=[tuple(a) for a in got["aggs"]], value_types=got["value_types"],
        drop_null_ts=True, finish=got.get("finish"), session_end=got.get("session_end"),
        prepare=got.get("prepare"), parallelism=parallelism, max_parallelism=max_parallelism,
        buckets=buckets)
    if spec.output_names() != got["output_names"]:
        raise AssertionError(f"engine output names {spec.output_names()} != the shim's "
                             f"{got['output_names']}")
    return spec, None


def stretch_agg(self: GroupedData, *exprs, **kwargs) -> DataFrame:
    """``df.groupBy(...).stretchAgg(*exprs)``: ``stretch(df.groupBy(...).agg(*exprs))``.

    Examples
    --------
    >>> counts = (events.withWatermark("ts", "10 seconds")                 # doctest: +SKIP
    ...           .groupBy(F.window("ts", "1 minute"), "country").stretchAgg(F.count("*")))
    """
    return stretch(self.agg(*exprs), **kwargs)


def control(query: StreamingQuery) -> Optional[StretchControl]:
    """The stretch handle of ``query`` (from ``writeStream.start()``), or None if its plan has
    no stretch aggregation (with several: see :class:`StretchControl`).

    Examples
    --------
    >>> q = spark_stretch.stretch(agg).writeStream.format("memory").queryName("t").start()  # doctest: +SKIP
    >>> spark_stretch.control(q).reconfigure(parallelism=2)["parallelism"]  # doctest: +SKIP
    2
    """
    if not isinstance(query, StreamingQuery):
        raise TypeError(f"control() takes a StreamingQuery, got {type(query).__name__}")
    ids = getattr(query, "_stretch_ids", None) or aggregations_of(
        SparkSession.getActiveSession(), query)
    return StretchControl(query, ids) if ids else None
