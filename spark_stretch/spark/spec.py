"""What ``stretchAggregate`` was asked to do, checked against the input before any query starts.

Everything here reads the DataFrame's schema and analyzed plan on the driver; nothing runs a job.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from pyspark.sql import Column, DataFrame
from pyspark.sql import types as T

__all__ = ["AggregationSpec", "pairs", "Pairs", "build_spec"]

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


@dataclass
class AggregationSpec:
    """A validated ``stretchAggregate`` call."""

    ts_column: str
    delay_ms: int
    key_kind: str                 # "scalar" | "array" | "pairs"
    key_column: str
    key_type: str                 # "string" | "long"
    distance: Optional[int]
    window_us: int
    slide_us: int
    aggs: List[Tuple[str, Optional[str]]]       # (fn, column) with fn in count/sum/min/max/mean
    value_types: dict = field(default_factory=dict)  # column -> "long" | "double"
    parallelism: int = 1
    max_parallelism: int = 4
    buckets: int = 4096

    @property
    def value_columns(self) -> List[str]:
        return sorted({c for _, c in self.aggs if c is not None})

    def output_names(self) -> List[str]:
        """Spark's names for the aggregations: ``count``, ``sum(x)``, ``avg(x)``, ..."""
        names = []
        for fn, col in self.aggs:
            names.append("count" if fn == "count" else f"{'avg' if fn == 'mean' else fn}({col})")
        return names

    def output_schema(self) -> T.StructType:
        key_elem = T.StringType() if self.key_type == "string" else T.LongType()
        key = (T.StructType([T.StructField("_1", key_elem), T.StructField("_2", key_elem)])
               if self.key_kind == "pairs" else key_elem)
        fields = [
            T.StructField("window", T.StructType([
                T.StructField("start", T.TimestampType()), T.StructField("end", T.TimestampType())])),
            T.StructField("key", key),
        ]
        for (fn, col), name in zip(self.aggs, self.output_names()):
            if fn == "count":
                t = T.LongType()
            elif fn in ("mean", "avg"):
                t = T.DoubleType()
            else:
                t = T.LongType() if self.value_types[col] == "long" else T.DoubleType()
            fields.append(T.StructField(name, t))
        return T.StructType(fields)


def find_watermark(df: DataFrame) -> Tuple[str, int]:
    """The event-time column and delay (ms) of the ``withWatermark`` in ``df``'s plan."""
    jvm = df.sparkSession._jvm
    stack = [df._jdf.queryExecution().analyzed()]
    found = []
    while stack:
        node = stack.pop()
        if node.nodeName() == "EventTimeWatermark":
            delay = jvm.org.apache.spark.sql.catalyst.plans.logical.EventTimeWatermark.getDelayMs(
                node.delay())
            found.append((node.eventTime().name(), int(delay)))
        children = node.children()
        stack.extend(children.apply(i) for i in range(children.size()))
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
    jvm = spark._jvm
    if not isinstance(text, str):
        raise TypeError(f"{what} must be an interval string like '60 seconds', got {text!r}")
    try:
        interval = jvm.org.apache.spark.sql.catalyst.util.IntervalUtils.stringToInterval(
            jvm.org.apache.spark.unsafe.types.UTF8String.fromString(text))
    except Exception as e:  # py4j error: keep Spark's reason short
        raise ValueError(f"{what} '{text}' is not an interval: {str(e).splitlines()[0]}") from None
    from py4j.java_gateway import get_field

    if get_field(interval, "months") != 0:
        raise ValueError(f"{what} '{text}' must not use months or years (not a fixed length)")
    us = int(get_field(interval, "days")) * 86_400_000_000 + int(get_field(interval, "microseconds"))
    if us <= 0:
        raise ValueError(f"{what} '{text}' must be positive")
    return us


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
        name = keys._jc.toString()
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
               buckets: int = 4096) -> AggregationSpec:
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
    return AggregationSpec(ts, delay_ms, kind, col, key_type, distance, size, slide, aggs,
                           value_types, parallelism, max_parallelism, buckets)
