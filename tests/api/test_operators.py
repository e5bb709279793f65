"""stretchAggregate with the engine's own operators: a band join and pass-through over two streams
(``others=``), and a user numba O+ operator, each checked against native Spark or batch SQL."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from chispa import assert_df_equality
from numba import njit
from pyspark.sql import functions as F

from spark_stretch.ops import Operator, band_join, passthrough
from spark_stretch.host.faults import ENV
from spark_stretch.testing import write_points

POINTS = "ts TIMESTAMP, {} {}, {} {}"
SENTINEL_S = 100_000  # a last file far ahead in event time: the watermark passes all real rows


def _stream(spark, folder, cols, delay="5 seconds"):
    return (spark.readStream.schema(cols).option("maxFilesPerTrigger", 1).parquet(str(folder))
            .withWatermark("ts", delay))


def _points(folder, n, files, seed, columns, integer, late=0.0, sentinel_at=None, **kw):
    write_points(folder, n, files=files, rate=20.0, seed=seed, columns=columns, integer=integer,
                 jitter_s=3.0, late_fraction=late, late_by_s=30, **kw)
    if sentinel_at is not None:  # far from every real point in space too: it matches nothing
        write_points(folder, 1, files=1, first_file=files, start_s=SENTINEL_S, seed=seed,
                     columns=columns, integer=integer, span=1.0, **kw)


def _run(agg, out, checkpoint, wait_and_reconfigure=()):
    q = (agg.writeStream.format("delta").option("checkpointLocation", str(checkpoint))
         .trigger(availableNow=True).start(str(out)))
    recs = []
    for after, change in wait_and_reconfigure:
        from tests.api.test_rescale import _wait_batches
        _wait_batches(q, after)
        recs.append(q.reconfigure(**change))
    q.awaitTermination()
    assert q.exception() is None
    return q, recs


@pytest.fixture(scope="module")
def band(spark, tmp_path_factory):
    """Two point streams (5 batches, the last a sentinel), and Spark's join of them (the oracle)."""
    tmp = tmp_path_factory.mktemp("band")
    # 5% of each stream 30 s late (dropped by both), 3 s disorder; x, y doubles, a, b bigints.
    _points(tmp / "l", 1200, 4, 1, ("x", "y"), False, late=0.05, sentinel_at=True)
    _points(tmp / "r", 1200, 4, 2, ("a", "b"), True, late=0.05, sentinel_at=True)
    # The sentinels must not match each other: move the right one far away.
    f = sorted((tmp / "r").glob("*.parquet"))[-1]
    pq.write_table(pq.read_table(f).set_column(1, "a", pa.array([10 ** 6])), f)

    def join(**kw):
        left = _stream(spark, tmp / "l", POINTS.format("x", "DOUBLE", "y", "DOUBLE"))
        right = _stream(spark, tmp / "r", POINTS.format("a", "BIGINT", "b", "BIGINT"), "8 seconds")
        return left.stretchAggregate(agg=band_join(WS=1, shares=4), window="10 seconds",
                                     others=right, max_parallelism=2, buckets=16, **kw)

    native = (join().native().writeStream.format("delta")
              .option("checkpointLocation", str(tmp / "nc")).trigger(availableNow=True)
              .start(str(tmp / "n")))
    native.awaitTermination()
    want = spark.read.format("delta").load(str(tmp / "n"))
    assert want.count() > 1000
    return join, want


def test_band_join_of_two_streams_equals_native_stream_stream_join(spark, band, tmp_path):
    join, want = band
    agg = join(parallelism=1)
    assert agg.schema.simpleString() == ("struct<l_x:double,l_y:double,l_ts:timestamp,"
                                         "r_a:bigint,r_b:bigint,r_ts:timestamp>")
    q, recs = _run(agg, tmp_path / "o", tmp_path / "c",
                   [(2, dict(parallelism=2)), (3, dict(parallelism=1))])
    m = q.metrics()
    assert m["batches"] == 5 and [r["parallelism"] for r in recs] == [2, 1]
    assert all(0 < r["switch_ms"] < 1000 for r in m["reconfigurations"])
    assert m["engine"]["late_rows"] > 0
    assert not any("Exchange" in p for p in m["plans"]), m["plans"]
    got = spark.read.format("delta").load(str(tmp_path / "o"))
    assert_df_equality(got, want, ignore_row_order=True, ignore_nullable=True, ignore_metadata=True)


def test_band_join_engine_killed_mid_batch_is_restarted_exactly(spark, band, tmp_path,
                                                                 monkeypatch):
    # kill -9 after batch 2's rows of both streams entered the engine: it restarts from the
    # checkpoint of batch 0 (join stores, both streams' watermarks; the default interval is 10
    # batches), steps batch 1 again from the input log, and batch 2 runs again.
    join, want = band
    monkeypatch.setenv(ENV, f"kill@step:2:{tmp_path / 'fired'}")
    q, _ = _run(join(parallelism=2), tmp_path / "o", tmp_path / "c")
    assert (tmp_path / "fired").exists(), "the fault did not fire"
    restarts = q.metrics()["engine_restarts"]
    assert len(restarts) == 1 and restarts[0]["resumed_from"] == 0, restarts
    got = spark.read.format("delta").load(str(tmp_path / "o"))
    assert_df_equality(got, want, ignore_row_order=True, ignore_nullable=True, ignore_metadata=True)


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_passthrough_of_two_streams_equals_batch_union(spark, tmp_path):
    # Operator 15 (Q2): stream 0 (a: bigint), stream 1 (b, c: double); every tuple out K times.
    _points(tmp_path / "s0", 400, 3, 3, ("a",), True, sentinel_at=True)
    _points(tmp_path / "s1", 300, 3, 4, ("b", "c"), False, sentinel_at=True)
    s0 = _stream(spark, tmp_path / "s0", "ts TIMESTAMP, a BIGINT")
    s1 = _stream(spark, tmp_path / "s1", "ts TIMESTAMP, b DOUBLE, c DOUBLE")
    K = 3
    agg = s0.stretchAggregate(agg=passthrough(K=K), others=s1, parallelism=2, max_parallelism=2)
    assert agg.schema.names == ["key", "ts", "src", "a", "b", "c"]
    _run(agg, tmp_path / "o", tmp_path / "c")
    got = spark.read.format("delta").load(str(tmp_path / "o"))
    # Oracle: batch SQL over the same files, rows whose event time the final watermark passed.
    b0 = spark.read.parquet(str(tmp_path / "s0")).selectExpr(
        "ts", "0L AS src", "a", "0.0D AS b", "0.0D AS c")
    b1 = spark.read.parquet(str(tmp_path / "s1")).selectExpr(
        "ts", "1L AS src", "0L AS a", "b", "c")
    want = (b0.unionByName(b1).where(F.col("ts") < F.lit(SENTINEL_S).cast("timestamp"))
            .crossJoin(spark.range(K).withColumnRenamed("id", "key"))
            .select("key", "ts", "src", "a", "b", "c"))
    assert want.count() == K * 700
    assert_df_equality(got, want, ignore_row_order=True, ignore_nullable=True, ignore_metadata=True)


def _sum_of_squares():
    """A user O+ operator: per key ``k`` and window, the count and the sum of ``v * v``."""

    @njit(nogil=True)
    def f_mk(cols, row, keys_out):
        keys_out[0] = cols[0][row]
        return 1

    @njit(nogil=True)
    def f_update(acc_i, acc_f, cols, row, key, out_i, out_f):
        v = cols[1][row]
        acc_i[0] += 1
        acc_f[0] += v * v
        return 0

    @njit(nogil=True)
    def f_output(acc_i, acc_f, key, l, out_i, out_f):
        out_i[0, 0] = acc_i[0]
        out_f[0, 0] = acc_f[0]
        return 1

    return Operator(WA=1, WS=1, I=1, f_MK=(f_mk,), f_U=(f_update,), f_O=f_output,
                    S=(("n", "i"), ("sumsq", "f")),
                    columns=((("k", "int64"), ("v", "float64")),), name="sum_of_squares")


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_user_numba_operator_equals_native_window_aggregation(spark, tmp_path):
    _points(tmp_path / "in", 3000, 4, 5, ("k", "v"), True, late=0.05, span=50.0)
    df = _stream(spark, tmp_path / "in", POINTS.format("k", "BIGINT", "v", "BIGINT"))
    agg = df.stretchAggregate(agg=_sum_of_squares(), window=("20 seconds", "10 seconds"),
                              parallelism=2, max_parallelism=2)
    assert agg.schema.names == ["window", "key", "ts", "n", "sumsq"]
    _run(agg, tmp_path / "o", tmp_path / "c")
    got = spark.read.format("delta").load(str(tmp_path / "o"))
    native = (df.groupBy(F.window("ts", "20 seconds", "10 seconds").alias("window"),
                         F.col("k").alias("key"))
              .agg(F.count(F.lit(1)).alias("n"),
                   F.sum(F.col("v") * F.col("v")).cast("double").alias("sumsq"))
              .select("window", "key", F.col("window.end").alias("ts"), "n", "sumsq"))
    q = (native.writeStream.format("delta").option("checkpointLocation", str(tmp_path / "nc"))
         .trigger(availableNow=True).start(str(tmp_path / "n")))
    q.awaitTermination()
    want = spark.read.format("delta").load(str(tmp_path / "n"))
    assert want.count() > 500
    assert_df_equality(got, want, ignore_row_order=True, ignore_nullable=True, ignore_metadata=True)


# ---- bad calls: clear errors before any query starts -------------------------------------------
@pytest.fixture
def two(spark, tmp_path):
    for d in ("l", "r"):
        (tmp_path / d).mkdir()
    left = spark.readStream.schema("ts TIMESTAMP, x DOUBLE, y DOUBLE, w ARRAY<STRING>").parquet(
        str(tmp_path / "l")).withWatermark("ts", "5 seconds")
    raw = spark.readStream.schema("ts TIMESTAMP, a BIGINT, c STRING").parquet(str(tmp_path / "r"))
    return left, raw.withWatermark("ts", "5 seconds"), raw


@pytest.mark.parametrize("call,error,needle", [
    (lambda l, r, raw: l.stretchAggregate(keys="x", window="1 minute", others=r), ValueError,
     "others= is the second input stream of an engine operator with I = 2"),
    (lambda l, r, raw: l.stretchAggregate(agg=band_join(WS=10)), ValueError,
     "has I=2 input streams; pass the second with others="),
    (lambda l, r, raw: l.stretchAggregate(agg=band_join(WS=10), others=r), ValueError,
     r"reads column 'b' of input others \(stream 1\), which has columns \['a', 'c', 'ts'\]"),
    (lambda l, r, raw: l.stretchAggregate(agg=band_join(WS=10, left=("x", "w"), right=("a", "c")),
                                     others=r), ValueError,
     "column 'w' of input df \\(stream 0\\) is an array"),
    (lambda l, r, raw: l.stretchAggregate(agg=band_join(WS=10, right=("a", "a")), others=raw),
     ValueError, "needs an event-time watermark"),
    (lambda l, r, raw: l.stretchAggregate(keys="x", agg=passthrough(), others=r), ValueError,
     "keys= does not apply to the engine operator"),
    (lambda l, r, raw: l.stretchAggregate(agg=band_join(WS=10, right=("a", "c")), others=r,
                                     window=("10 seconds", "5 seconds")), TypeError,
     "window of a join is one interval"),
    (lambda l, r, raw: l.stretchAggregate(agg=passthrough(), others=r, window="10 seconds"), ValueError,
     "keeps keyed state without windows"),
    (lambda l, r, raw: l.stretchAggregate(agg=_sum_of_squares()), ValueError,
     r"reads column 'k' of input df"),
    (lambda l, r, raw: l.stretchAggregate(agg=_sum_of_squares(), others=r), ValueError,
     "has one input stream; others= is for operators with I = 2"),
])
def test_bad_operator_calls(two, call, error, needle):
    with pytest.raises(error, match=needle):
        call(*two)


def test_builtin_aggregation_operator_is_refused_with_its_name(two):
    from spark_stretch.ops import count

    with pytest.raises(ValueError, match="built-in aggregation operator; give it by name"):
        two[0].stretchAggregate(agg=count(key="x", WS=10))
