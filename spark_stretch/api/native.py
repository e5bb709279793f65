"""The native Spark query that ``stretchAggregate`` is equivalent to.

Used as the oracle in tests and as the baseline in benchmarks, and handy when migrating: the rows
of ``native_equivalent(df, spec)`` in append mode are, by contract, the rows stretch produces.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from ..protocol.specs import AggregateSpec

__all__ = ["native_equivalent", "key_expression"]


def key_expression(spec: AggregateSpec) -> Column:
    """The per-row key Spark must explode: the column, its elements, or its word pairs."""
    c = spec.key_column
    if spec.key_kind == "scalar":
        return F.col(c)
    if spec.key_kind == "array":
        return F.explode(F.col(c))
    reach = f"i + {spec.distance}" if spec.distance else f"i + size(`{c}`)"
    return F.explode(F.expr(
        f"flatten(transform(sequence(0, size(`{c}`) - 1), i -> "
        f"transform(filter(sequence(i + 1, {reach}), j -> j < size(`{c}`)), "
        f"j -> named_struct('_1', `{c}`[i], '_2', `{c}`[j]))))"))


def _agg_columns(spec: AggregateSpec):
    cols = []
    for (fn, col), name in zip(spec.aggs, spec.output_names()):
        expr = {"count": lambda: F.count(F.lit(1)), "sum": lambda: F.sum(col),
                "min": lambda: F.min(col), "max": lambda: F.max(col),
                "mean": lambda: F.avg(col)}[fn]()
        cols.append(expr.alias(name))
    return cols


def native_equivalent(df: DataFrame, spec: AggregateSpec) -> DataFrame:
    """``groupBy(window(ts, size, slide), key).agg(...)`` after exploding multi-key tuples.

    ``df`` must carry the same watermark as the stretch query (it is the same input DataFrame).
    """
    size, slide = f"{spec.window_us} microseconds", f"{spec.slide_us} microseconds"
    keyed = df.select(F.col(spec.ts_column), key_expression(spec).alias("key"),
                      *[F.col(c) for c in spec.value_columns])
    return (keyed.groupBy(F.window(spec.ts_column, size, slide).alias("window"), "key")
            .agg(*_agg_columns(spec)))
