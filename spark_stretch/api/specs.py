"""What ``stretchAggregate`` was asked to do, checked against the input before any query starts.

Everything here reads the DataFrame's schema and analyzed plan on the driver; nothing runs a job.
The result is the engine's spec (:class:`spark_stretch.protocol.specs.AggregateSpec`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from pyspark.sql import Column, DataFrame
from pyspark.sql import types as T

from ..driver import jvm
from ..protocol.specs import AggregateSpec

__all__ = ["pairs", "Pairs", "build_spec", "output_schema", "event_time", "find_watermark",
           "parse_window", "check_sizes"]

AGGS = {"count", "sum", "min", "max", "mean", "avg"}
_AGG_RE = re.compile(r"^\s*(\w+)\s*\(\s*([^()]*?)\s*\)\s*$")
_KEY_TYPES = (T.StringType, T.LongType, T.IntegerType, T.ShortType, T.ByteType)


@dataclass(frozen=True)
class Pairs:
    """Engine key function f_MK: ordered word pairs ``(words[i], words[j])``, ``0 < j - i <= distance``.

    Computed inside the engine from the stored tuple, so a tuple with many pairs is never expanded
    in Spark. ``distance=None`` means every pair of the array.
    """

    column: str
    distance: Optional[int] = None


def pairs(column: str, distance: Optional[int] = None) -> Pairs:
    """Key function for pair count: every ordered pair of elements of ``column`` within ``distance``.

    Parameters
    ----------
    column : str
        An array<string> column (e.g. a tweet's words).
    distance : int, optional
        Largest ``j - i``; ``None`` for all pairs.

    Examples
    --------
    >>> from spark_stretch import pairs
    >>> pairs("words", distance=3)
    Pairs(column='words', distance=3)
    """
    if not isinstance(column, str):
        raise TypeError(f"pairs() needs a column name, got {type(column).__name__}")
    if distance is not None and (not isinstance(distance, int) or isinstance(distance, bool)
                                 or distance < 1):
        raise ValueError(f"pairs() distance must be a positive int or None, got {distance!r}")
    return Pairs(column, distance)


def output_schema(spec: AggregateSpec) -> T.StructType:
    """The output schema of built-in aggregations: ``window``, ``key``, one column per
    aggregation, with Spark's types (long counts, double averages)."""
    key_elem = T.StringType() if spec.key_type == "string" else T.LongType()
    key = (T.StructType([T.StructField("_1", key_elem), T.StructField("_2", key_elem)])
           if spec.key_kind == "pairs" else key_elem)
    fields = [
        T.StructField("window", T.StructType([
            T.StructField("start", T.TimestampType()), T.StructField("end", T.TimestampType())])),
        T.StructField("key", key),
    ]
    for (fn, col), name in zip(spec.aggs, spec.output_names()):
        if fn == "count":
            t = T.LongType()
        elif fn in ("mean", "avg"):
            t = T.DoubleType()
        else:
            t = T.LongType() if spec.value_types[col] == "long" else T.DoubleType()
        fields.append(T.StructField(name, t))
    return T.StructType(fields)


def find_watermark(df: DataFrame) -> Tuple[str, int]:
    """The event-time column and delay (ms) of the ``withWatermark`` in ``df``'s plan."""
    found = jvm.watermarks(df)
    if not found:
        raise ValueError(
            "stretchAggregate needs an event-time watermark: call "
            "df.withWatermark('<timestamp column>', '<delay>') before stretchAggregate")
    if len({f[0] for f in found}) > 1:
        raise ValueError(f"stretchAggregate supports one watermark column, found {found}")
    # Several withWatermark on one column: Spark keeps the min-delay policy's outcome per batch;
    # the outermost call is the one that applies to this stream.
    return found[0]


def event_time(df: DataFrame, of: str = "") -> Tuple[str, int]:
    """:func:`find_watermark`, checking that the column is a timestamp (``of``: which input, for
    the error)."""
    ts, delay_ms = find_watermark(df)
    t = df.schema[ts].dataType if ts in df.schema.names else None
    if not isinstance(t, (T.TimestampType, T.TimestampNTZType)):
        raise ValueError(f"watermark column '{ts}'{of} has type {t}; it must be a timestamp")
    return ts, delay_ms


def parse_interval_us(spark, text: str, what: str) -> int:
    """An interval string (``'10 seconds'``) in microseconds, with Spark's own parser."""
    return jvm.interval_us(spark, text, what)


def parse_window(spark, window) -> Tuple[int, int]:
    """``window=`` (``'60 seconds'`` or ``(size, slide)``) as (size, slide) in microseconds."""
    if isinstance(window, str):
        size = slide = parse_interval_us(spark, window, "window")
    elif isinstance(window, (tuple, list)) and len(window) == 2:
        size = parse_interval_us(spark, window[0], "window size")
        slide = parse_interval_us(spark, window[1], "window slide")
    else:
        raise TypeError(f"window must be '60 seconds' or ('120 seconds', '60 seconds'), got {window!r}")
    if slide > size:
        raise ValueError(f"window slide {window[1]} is longer than its size {window[0]}")
    return size, slide


def _column_name(keys) -> str:
    if isinstance(keys, str):
        return keys
    if isinstance(keys, Column):
        name = jvm.column_text(keys)
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"keys must be a column reference (F.col('words')), got the expression "
                             f"{name}; add it with withColumn first")
        return name
    raise TypeError(f"keys must be a column name, F.col(...) or spark_stretch.pairs(...), "
                    f"got {type(keys).__name__}")


def _parse_aggs(agg) -> List[Tuple[str, Optional[str]]]:
    items: Sequence
    if isinstance(agg, str):
        items = [agg]
    elif isinstance(agg, dict):
        items = [f"{fn}({col})" for col, fn in agg.items()]
    elif isinstance(agg, (list, tuple)) and agg:
        items = list(agg)
    else:
        raise TypeError(f"agg must be 'count', a list like ['count', 'sum(x)'] or a dict "
                        f"{{'x': 'sum'}}, got {agg!r}")
    out = []
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"agg entries must be strings like 'sum(x)', got {item!r}")
        m = _AGG_RE.match(item)
        fn, col = (m.group(1).lower(), m.group(2) or None) if m else (item.strip().lower(), None)
        if fn == "avg":
            fn = "mean"
        if fn not in AGGS:
            raise ValueError(f"unknown aggregation '{item}' in agg; stretchAggregate supports "
                             f"count, sum(col), min(col), max(col), mean(col)/avg(col)")
        if fn == "count":
            if col not in (None, "*", "1"):
                raise ValueError(f"agg '{item}': count counts rows; use 'count'")
            col = None
        elif col is None:
            raise ValueError(f"agg '{item}': {fn} needs a column, e.g. '{fn}(x)'")
        out.append((fn, col))
    return out


def check_sizes(parallelism, max_parallelism, buckets) -> None:
    """The instance and bucket counts of a ``stretchAggregate`` call (or raise)."""
    for name, v in (("parallelism", parallelism), ("max_parallelism", max_parallelism),
                    ("buckets", buckets)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if parallelism > max_parallelism:
        raise ValueError(f"parallelism={parallelism} > max_parallelism={max_parallelism}: "
                         "the initial parallelism must not exceed the maximum")
    if buckets < max_parallelism:
        raise ValueError(f"buckets={buckets} < max_parallelism={max_parallelism}")


def build_spec(df: DataFrame, keys, window, agg, parallelism: int, max_parallelism: int,
               buckets: int = 4096) -> AggregateSpec:
    """Check a ``stretchAggregate`` call against ``df`` and return its spec (or raise)."""
    if not isinstance(df, DataFrame):
        raise TypeError(f"stretchAggregate works on a DataFrame, got {type(df).__name__}")
    if not df.isStreaming:
        raise ValueError("stretchAggregate needs a streaming DataFrame (spark.readStream...)")
    check_sizes(parallelism, max_parallelism, buckets)
    ts, delay_ms = event_time(df)
    fields = {f.name: f.dataType for f in df.schema.fields}

    if isinstance(keys, Pairs):
        kind, col, distance = "pairs", keys.column, keys.distance
    else:
        kind, col, distance = None, _column_name(keys), None
    if col not in fields:
        raise ValueError(f"keys column '{col}' is not in the input; columns: {sorted(fields)}")
    dt = fields[col]
    if isinstance(dt, T.ArrayType):
        elem = dt.elementType
        kind = kind or "array"
    else:
        if kind == "pairs":
            raise ValueError(f"keys column '{col}' has type {dt.simpleString()}; pairs() needs an "
                             "array column")
        elem, kind = dt, "scalar"
    if not isinstance(elem, _KEY_TYPES):
        raise ValueError(
            f"keys column '{col}' has type {dt.simpleString()}; stretchAggregate needs a string or "
            "integer key column, or an array of them")
    key_type = "string" if isinstance(elem, T.StringType) else "long"

    if window is None:
        raise ValueError("window is required: a size like '60 seconds' or (size, slide)")
    size, slide = parse_window(df.sparkSession, window)

    aggs = _parse_aggs(agg)
    value_types = {}
    for fn, c in aggs:
        if c is None:
            continue
        if c not in fields:
            raise ValueError(f"agg column '{c}' is not in the input; columns: {sorted(fields)}")
        t = fields[c]
        if isinstance(t, (T.LongType, T.IntegerType, T.ShortType, T.ByteType)):
            value_types[c] = "long"
        elif isinstance(t, (T.DoubleType, T.FloatType)):
            value_types[c] = "double"
        else:
            raise ValueError(f"agg column '{c}' has type {t.simpleString()}; {fn} needs a numeric "
                             "(integer or floating point) column")
    return AggregateSpec(ts_column=ts, delay_ms=delay_ms, key_kind=kind, key_column=col,
                         key_type=key_type, distance=distance, window_us=size, slide_us=slide,
                         aggs=aggs, value_types=value_types, parallelism=parallelism,
                         max_parallelism=max_parallelism, buckets=buckets)
