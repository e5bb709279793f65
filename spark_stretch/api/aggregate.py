"""``df.stretchAggregate(...)``: windowed, multi-key aggregation on the host's VSN engine.

The rows are exactly those of the native ``groupBy(window(ts, size, slide), key).agg(...)``
(after ``explode`` for array keys) in append mode with the same watermark; the query runs on the
driver's machinery (:mod:`spark_stretch.driver`) and the host engine
(:mod:`spark_stretch.host`), and is rescaled while it runs (``StretchQuery.reconfigure``).
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql.types import StructType

from ..driver.policy import as_policy
from ..protocol.specs import AggregateSpec
from .native import native_equivalent
from .operators import StretchOperatorAggregation, build_operator_spec, is_engine_operator
from .specs import build_spec, output_schema
from .writer import StretchResult

__all__ = ["StretchAggregation", "stretch_aggregate"]


def stretch_aggregate(df: DataFrame, keys=None, window=None, agg="count", *, others=None,
                      parallelism: int = 1, max_parallelism: int = 4,
                      buckets: int = 4096, elastic=None) -> "StretchAggregation":
    """Windowed aggregation per key on the host's shared-state (VSN) engine.

    The rows are those of the native ``groupBy(window(ts, size, slide), key).agg(...)`` (after
    ``explode`` for array keys) in append mode, with the input's watermark.

    Parameters
    ----------
    keys : str, Column or :func:`spark_stretch.pairs`
        A scalar key column (string or integer), an array column (every element is a key of the
        row: multi-key), or an engine key function such as ``pairs("words", distance=3)``.
    window : str or (str, str)
        Window size, or ``(size, slide)``, as for ``pyspark.sql.functions.window``.
    agg : str, list, dict or engine operator
        ``"count"``, a list like ``["count", "sum(x)", "max(x)", "mean(x)"]``, or ``{"x": "sum"}``.
        Columns are named as Spark names them: ``count``, ``sum(x)``, ``avg(x)``, ... Or one of
        the engine's operators: a join (:func:`spark_stretch.ops.band_join`,
        :func:`spark_stretch.ops.join` with a numba predicate) or an O+ operator with numba
        ``f_MK``/``f_U``/``f_O``/``f_S`` (:class:`spark_stretch.ops.Operator`, e.g.
        :func:`spark_stretch.ops.passthrough`); see :mod:`spark_stretch.api.operators` for the
        result's columns. Its keys come from its ``f_MK`` (no ``keys=``); ``window=`` sets its
        window, else its ``WS``/``WA`` are in microseconds.
    others : DataFrame, optional
        The second input stream (stream 1) of an operator with ``I = 2`` (joins, pass-through),
        with its own ``withWatermark``. Both streams run in one query; the watermark is Spark's
        global one (the min of the two, or per ``spark.sql.streaming.multipleWatermarkPolicy``).
    parallelism : int
        Instances updating state at the start (m).
    max_parallelism : int
        Instances created (n); ``reconfigure`` moves between 1 and n without a restart.
    buckets : int
        State buckets (B); ownership moves between instances bucket by bucket.
    elastic : bool or Policy, optional
        Reconfigure the running query by itself: ``True`` for
        :class:`spark_stretch.ElasticPolicy`'s defaults (scale out above 90% utilization, in
        below 45%, aiming at 70%, between 1 and ``max_parallelism``; rebalance buckets when the
        busiest instance carries more than 1.2x the mean load), an ``ElasticPolicy(...)`` with
        other thresholds, or a :class:`spark_stretch.Policy` of your own. Checked here;
        ``reconfigure`` still works beside it.

    Returns
    -------
    StretchAggregation
        Use ``.writeStream`` like a DataFrame's.

    Examples
    --------
    >>> import spark_stretch
    >>> from pyspark.sql import functions as F
    >>> counts = (spark.readStream.format("delta").load(src)          # doctest: +SKIP
    ...           .withWatermark("ts", "10 seconds")
    ...           .stretchAggregate(keys=F.col("words"), window=("120 seconds", "60 seconds"),
    ...                             agg="count", parallelism=1, max_parallelism=4))
    >>> q = counts.writeStream.format("delta").option("checkpointLocation", ckpt).start(out)  # doctest: +SKIP
    >>> q.reconfigure(parallelism=2)   # online: no restart, no shuffle, no state moved  # doctest: +SKIP
    >>> elastic = words.stretchAggregate(keys="words", window="60 seconds",        # doctest: +SKIP
    ...                                  max_parallelism=2, elastic=True)
    >>> q = elastic.writeStream.option("checkpointLocation", ckpt2).start(out2)  # doctest: +SKIP
    >>> [r["cause"] for r in q.metrics()["reconfigurations"]]              # doctest: +SKIP
    ['scale_out', 'scale_in']

    Notes
    -----
    Errors in the arguments (unknown column or aggregation, wrong key type, no watermark) are
    raised here, before any query starts. Delta accepts names like ``sum(x)`` only with column
    mapping (as for the native query): set
    ``spark.databricks.delta.properties.defaults.columnMapping.mode=name`` for new tables. A null key is an error at run time (Spark would make a
    null group); filter nulls first.
    """
    if is_engine_operator(agg):
        spec = build_operator_spec(df, others, agg, window, keys, parallelism, max_parallelism,
                                   buckets)
        kind = StretchOperatorAggregation(df, others, spec)
    else:
        if others is not None:
            raise ValueError("others= is the second input stream of an engine operator with "
                             "I = 2 (agg=spark_stretch.ops.band_join(...), passthrough(...)); "
                             "built-in aggregations read one stream")
        kind = StretchAggregation(df, build_spec(df, keys, window, agg, parallelism,
                                                 max_parallelism, buckets))
    kind.elastic = as_policy(elastic, kind.max_parallelism)
    return kind


class StretchAggregation(StretchResult):
    """The result of ``stretchAggregate`` with built-in aggregations: write it with
    ``.writeStream``. The other query kinds are
    :class:`spark_stretch.api.operators.StretchOperatorAggregation` (an engine operator) and
    :class:`spark_stretch.api.grouped.StretchGroupedAggregation` (the drop-in).
    """

    def __init__(self, df: DataFrame, spec: AggregateSpec):
        super().__init__(df)
        self.spec = spec

    @property
    def schema(self) -> StructType:
        """Output schema: ``window``, ``key`` and one column per aggregation."""
        return output_schema(self.spec)

    def native(self) -> DataFrame:
        """The equivalent native Spark query (same rows in append mode), e.g. for comparison."""
        return native_equivalent(self._df, self.spec)

    def engine_spec(self) -> AggregateSpec:
        return self.spec

    def input_df(self) -> DataFrame:
        """What each micro-batch hands to the engine: the columns it reads, nothing else."""
        spec = self.spec
        return self._df.select(spec.ts_column, spec.key_column, *spec.value_columns)
