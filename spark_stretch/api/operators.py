"""``stretchAggregate(agg=<engine operator>, others=...)``: the engine's own O+ and J+ operators.

Where ``agg`` names built-in aggregations (:mod:`.aggregate`), it may also be an engine operator: an
:class:`~spark_stretch.engine.operator.Operator` with numba ``f_MK``/``f_U``/``f_O``/``f_S`` (for
example :func:`spark_stretch.ops.passthrough`), or a join
(:func:`spark_stretch.ops.band_join`, :func:`spark_stretch.ops.join`). With ``I = 2`` the second
input stream is ``others=``. Both streams run in one Spark query: their rows are tagged with their
stream (``__stream``) and unioned (a narrow plan: no Exchange), so a micro-batch, its checkpoint,
its Delta version and its replay cover both, and the engine splits them into ESG sources 0 and 1.

Everything here reads schemas and analyzed plans on the driver; nothing runs a job.

Examples
--------
>>> from spark_stretch.ops import band_join
>>> left = (spark.readStream.schema("ts TIMESTAMP, x DOUBLE, y DOUBLE").parquet(l)
...         .withWatermark("ts", "5 seconds"))                             # doctest: +SKIP
>>> right = (spark.readStream.schema("ts TIMESTAMP, a DOUBLE, b DOUBLE").parquet(r)
...          .withWatermark("ts", "5 seconds"))                            # doctest: +SKIP
>>> pairs = left.stretchAggregate(agg=band_join(WS=1), window="10 seconds",
...                               others=right)                           # doctest: +SKIP
>>> pairs.schema.names                                                     # doctest: +SKIP
['l_x', 'l_y', 'l_ts', 'r_a', 'r_b', 'r_ts']
>>> q = pairs.writeStream.format("delta").option("checkpointLocation", ckpt).start(out)  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import dataclasses
import pickle
from dataclasses import dataclass
from typing import Optional

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from ..engine import JoinOperator
from ..engine.operator import Operator
from ..engine.store import PRED_BAND
from ..protocol.specs import OperatorSpec, StreamSpec
from .specs import check_sizes, event_time, parse_interval_us, parse_window
from .writer import StretchResult

__all__ = ["OperatorCall", "StretchOperatorAggregation", "build_operator_spec",
           "is_engine_operator"]

_INTEGRAL = (T.LongType, T.IntegerType, T.ShortType, T.ByteType)
_SPARK_TYPE = {"long": T.LongType(), "double": T.DoubleType(), "string": T.StringType(),
               "timestamp": T.TimestampType()}


def is_engine_operator(agg) -> bool:
    return isinstance(agg, (Operator, JoinOperator))


@dataclass
class OperatorCall:
    """A validated ``stretchAggregate(agg=<engine operator>)`` call: the operator (with the
    window of ``window=``) and the engine's spec.

    The spec's ``streams`` read, per input stream, columns ``(engine name, kind, input column)``
    with kind one of ``long``, ``double``, ``string`` (interned to int ids), ``timestamp``
    (microseconds), ``list`` (array of strings or integers); its ``output`` is ``(name, kind,
    engine column)`` per result column.
    """

    op: object
    spec: OperatorSpec

    def output_schema(self) -> T.StructType:
        fields = []
        for name, kind, _ in self.spec.output:
            if kind == "window":
                t = T.StructType([T.StructField("start", T.TimestampType()),
                                  T.StructField("end", T.TimestampType())])
            else:
                t = _SPARK_TYPE[kind]
            fields.append(T.StructField(name, t))
        return T.StructType(fields)


def _pickled(op) -> str:
    """``op`` pickled for the engine process, its compiled kernels left behind (the engine
    compiles its own)."""
    op = dataclasses.replace(op, _compiled=None) if isinstance(op, Operator) else \
        dataclasses.replace(op, _kernel=None)
    return base64.b64encode(pickle.dumps(op)).decode()


def _kind(dt, col: str, stream: str) -> str:
    if isinstance(dt, _INTEGRAL):
        return "long"
    if isinstance(dt, (T.DoubleType, T.FloatType)):
        return "double"
    if isinstance(dt, T.StringType):
        return "string"
    if isinstance(dt, (T.TimestampType, T.TimestampNTZType)):
        return "timestamp"
    if isinstance(dt, T.ArrayType) and isinstance(dt.elementType, (T.StringType, *_INTEGRAL)):
        return "list"
    raise ValueError(f"column '{col}' of input {stream} has type {dt.simpleString()}; an engine "
                     "operator reads integer, floating point, string, timestamp or "
                     "array<string|integer> columns")


def _stream(df: DataFrame, name: str, wanted: list, lists_ok: bool) -> StreamSpec:
    """Check one input stream: its watermark and the columns the operator reads."""
    ts, delay_ms = event_time(df, of=f" of input {name}")
    fields = {f.name: f.dataType for f in df.schema.fields}
    cols = []
    for col, dtype in wanted:
        if col == "ts" and ts != "ts":
            if "ts" in fields:
                raise ValueError(f"input {name} has a column 'ts' that is not its event time "
                                 f"('{ts}'); to the engine 'ts' is the event time: rename it")
            cols.append(["ts", "timestamp", ts])  # the operator reads the event time as 'ts'
            continue
        if col not in fields:
            raise ValueError(f"the operator reads column '{col}' of input {name}, which has "
                             f"columns {sorted(fields)}")
        kind = _kind(fields[col], col, name)
        if kind == "list" and (not lists_ok or dtype != "list"):
            raise ValueError(f"column '{col}' of input {name} is an array; the operator reads it "
                             f"as {dtype}")
        if dtype == "list" and kind != "list":
            raise ValueError(f"the operator reads column '{col}' of input {name} as a list; it "
                             f"has type {fields[col].simpleString()}")
        cols.append([col, kind, col])
    return StreamSpec(name=name, ts_column=ts, delay_ms=int(delay_ms),
                      columns=[tuple(c) for c in cols])


def _with_window(op, window, spark):
    """``op`` with the window of ``window=`` (interval strings), in microseconds."""
    if window is None:
        return op
    if isinstance(op, JoinOperator):
        if not isinstance(window, str):
            raise TypeError(f"window of a join is one interval (matches are less than it apart "
                            f"in event time), e.g. '10 seconds'; got {window!r}")
        return dataclasses.replace(op, WS=parse_interval_us(spark, window, "window"))
    if op.WA is None:
        raise ValueError(f"operator {op.name} keeps keyed state without windows (WA = WS = None); "
                         "leave window= out")
    size, slide = parse_window(spark, window)
    return dataclasses.replace(op, WS=size, WA=slide)


def build_operator_spec(df: DataFrame, others, op, window, keys, parallelism: int,
                        max_parallelism: int, buckets: int) -> OperatorCall:
    """Check ``stretchAggregate(agg=op, others=...)`` against its inputs (or raise)."""
    inputs = [df] + ([others] if others is not None else [])
    for i, d in enumerate(inputs):
        what = "others" if i else "stretchAggregate"
        if not isinstance(d, DataFrame):
            raise TypeError(f"{what} needs a DataFrame, got {type(d).__name__}")
        if not d.isStreaming:
            raise ValueError(f"{what} needs a streaming DataFrame (spark.readStream...)")
    check_sizes(parallelism, max_parallelism, buckets)
    if keys is not None:
        raise ValueError(f"keys= does not apply to the engine operator {op.name}: its f_MK makes "
                         "the keys; leave keys= out")
    if isinstance(op, Operator) and op.builtin_ip is not None:
        raise ValueError(f"agg={op.name} is a built-in aggregation operator; give it by name "
                         "instead (agg='count', agg=['sum(x)', 'max(x)'])")
    if op.I != len(inputs):
        raise ValueError(
            f"operator {op.name} has I={op.I} input streams; pass the second with others="
            if op.I == 2 else
            f"operator {op.name} has one input stream; others= is for operators with I = 2")
    spark = df.sparkSession
    op = _with_window(op, window, spark)
    names = ["df"] if len(inputs) == 1 else ["df (stream 0)", "others (stream 1)"]
    if isinstance(op, JoinOperator):
        wanted = [[(c, "float64") for c in op.left], [(c, "float64") for c in op.right]]
    else:
        wanted = [list(op.columns[s]) for s in range(op.I)]
    streams = [_stream(d, n, w, lists_ok=not isinstance(op, JoinOperator))
               for d, n, w in zip(inputs, names, wanted)]

    if isinstance(op, JoinOperator):
        output = []
        for side, stream, cols in (("l", streams[0], op.left), ("r", streams[1], op.right)):
            kinds = {c[0]: c[1] for c in stream.columns}
            for c in cols:
                output.append((f"{side}_{c}", kinds[c], f"{side}_{c}"))
            ts = stream.ts_column
            if ts not in cols and "ts" not in cols:  # each side's event time, unless read already
                output.append((f"{side}_{ts}", "timestamp", f"{side}___ts"))
        window_us = None
    else:
        output = [("window", "window", "window")] if op.WA is not None else []
        output += [("key", "long", "key"), ("ts", "timestamp", "ts")]
        for n, k in op.S:
            if n in ("window", "key", "ts"):
                raise ValueError(f"operator {op.name} names an output column '{n}', which the "
                                 "result already has (window, key, ts); rename it in S")
            output.append((n, "long" if k == "i" else "double", n))
        window_us = op.WS
    seen = [o[0] for o in output]
    dup = sorted({n for n in seen if seen.count(n) > 1})
    if dup:
        raise ValueError(f"the result would have the columns {dup} twice; rename the input columns")
    policy = spark.conf.get("spark.sql.streaming.multipleWatermarkPolicy", "min").lower()
    return OperatorCall(op, OperatorSpec(
        operator=_pickled(op), streams=streams, output=output, window_us=window_us,
        parallelism=parallelism, max_parallelism=max_parallelism, buckets=buckets,
        watermark_policy=policy))


class StretchOperatorAggregation(StretchResult):
    """``stretchAggregate`` with an engine operator: write it with ``.writeStream``.

    The result has, for a join, the left (stream 0) columns the join reads as ``l_<c>`` and the
    right ones as ``r_<c>``, each side's event time included, with the input's types; for an O+
    operator, ``window`` (windowed operators), ``key``, ``ts`` and the operator's ``S`` columns.
    """

    def __init__(self, df: DataFrame, others: Optional[DataFrame], call: OperatorCall):
        super().__init__(df)
        self._others = others
        self.call = call
        self.spec = call.spec

    @property
    def schema(self) -> T.StructType:
        return self.call.output_schema()

    def engine_spec(self) -> OperatorSpec:
        return self.spec

    def input_df(self) -> DataFrame:
        parts = []
        for s, (d, st) in enumerate(zip([self._df, self._others], self.spec.streams)):
            cols = [F.lit(s).alias("__stream"), d[st.ts_column].alias("__ts")]
            # 'ts' is the event time (__ts) to the engine; every other column goes by its name.
            cols += [d[c].alias(f"__s{s}_{c}") for name, _, c in st.columns if name != "ts"]
            parts.append(d.select(*cols))
        if len(parts) == 1:
            return parts[0]
        return parts[0].unionByName(parts[1], allowMissingColumns=True)

    def native(self) -> DataFrame:
        """The native Spark stream-stream join with the same rows as a band join (append mode).

        Spark's stream-stream join needs an equality predicate, which a band join has not: the
        native query joins on grid cells of the band's size (each left row is exploded to its
        3 x 3 neighbouring cells, so every matching pair meets in exactly one cell) and then
        applies the band and the time range. Only :func:`spark_stretch.ops.band_join` has one
        here; other operators raise.
        """
        op = self.call.op
        if not (isinstance(op, JoinOperator) and op.pred == PRED_BAND):
            raise NotImplementedError(f"no native Spark equivalent is known for {op.name}")
        ls, rs = self.spec.streams
        lt, rt = ls.ts_column, rs.ts_column
        (x, y), (a, b) = op.left, op.right
        dx, dy = op.fp
        cx, cy = (dx if dx > 0 else 1.0), (dy if dy > 0 else 1.0)
        near = F.array(*[F.struct(F.lit(i).alias("i"), F.lit(j).alias("j"))
                         for i in (-1, 0, 1) for j in (-1, 0, 1)])
        left = (self._df.withColumn("_n", F.explode(near))
                .withColumn("_cx", F.floor(F.col(x) / cx) + F.col("_n.i"))
                .withColumn("_cy", F.floor(F.col(y) / cy) + F.col("_n.j")).alias("_l"))
        right = (self._others.withColumn("_cx", F.floor(F.col(a) / cx))
                 .withColumn("_cy", F.floor(F.col(b) / cy)).alias("_r"))
        ws = f"INTERVAL {op.WS} MICROSECONDS"
        cond = F.expr(f"_l._cx = _r._cx AND _l._cy = _r._cy "
                      f"AND abs(_l.`{x}` - _r.`{a}`) <= {dx!r} AND abs(_l.`{y}` - _r.`{b}`) <= {dy!r} "
                      f"AND _l.`{lt}` > _r.`{rt}` - {ws} AND _l.`{lt}` < _r.`{rt}` + {ws}")
        schema = self.schema
        cols = []
        for side, names, ts in (("l", op.left, lt), ("r", op.right, rt)):
            for c in (*names, ts):
                name = f"{side}_{c}"
                if name in schema.names and name not in [n for n, _ in cols]:
                    src = ts if c == "ts" else c
                    cols.append((name, F.col(f"_{side}.`{src}`").cast(schema[name].dataType)))
        return left.join(right, cond).select(*[c.alias(n) for n, c in cols])
