"""``stretch(df)`` of aggregations with exact distinct aggregates (``count_distinct``, ...), which
native Spark refuses on streams: the oracle is a batch query over the same input (in append
mode, less the rows the watermark made late, for the windows it closed; in complete mode, over
the rows so far), with late rows, nulls, duplicates, -0.0/0.0 and NaN."""

from __future__ import annotations

import re

import pytest
from chispa import assert_df_equality
from pyspark.errors import AnalysisException
from pyspark.sql import functions as F

import spark_stretch
from spark_stretch import FallbackWarning

from .test_native_spelling import _per_batch

SCHEMA = "k string, d string, v int, f double, p decimal(8,2), ts timestamp"
DELAY_S = 10
FLOATS = [-0.0, 0.0, float("nan"), 1.5, 2.5, None]


def _files(spark):
    """Four files of 240 rows, in event-time order but for stragglers; the last one's first 30
    rows are late (every window of theirs ended by the previous batch's watermark)."""
    out = []
    for i in range(4):
        ids = F.col("id")
        t = F.lit(i * 30) + ids % 240 / 8 - F.when(ids % 17 == 0, 12).otherwise(0)
        if i == 3:
            t = F.when(ids % 240 < 30, ids % 13).otherwise(t)  # (late: 0-12 s)
        out.append(spark.range(i * 240, (i + 1) * 240).select(
            F.element_at(F.array(F.lit("a"), F.lit("b"), F.lit(None)), (ids % 3 + 1).cast("int"))
            .alias("k"),
            F.when(ids % 5 == 0, "x").otherwise("y").alias("d"),
            F.when(ids % 7 == 0, None).otherwise(ids * 7919 % 23).cast("int").alias("v"),
            F.element_at(F.array(*[F.lit(x) for x in FLOATS]),
                         (ids % len(FLOATS) + 1).cast("int")).alias("f"),
            (ids % 9 / 4).cast("decimal(8,2)").alias("p"),
            F.timestamp_seconds(t).alias("ts")))
    return out


@pytest.fixture
def distinct_src(spark, tmp_path):
    src = tmp_path / "distinct"
    for i, df in enumerate(_files(spark)):
        df.coalesce(1).write.parquet(str(src / f"part={i}"))
    return src


def _stream(spark, src):
    return (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1)
            .option("recursiveFileLookup", "true").parquet(str(src))
            .withWatermark("ts", f"{DELAY_S} seconds"))


def _watermarks(spark, src):
    """Spark's watermark (s) of each batch i (one file each), and after the last: the largest
    event time of the files before, minus the delay (0 before any)."""
    tops = [r["top"] / 1e6 for r in spark.read.parquet(str(src)).groupBy("part")
            .agg(F.max(F.unix_micros("ts")).alias("top")).orderBy("part").collect()]
    return [max(0.0, max(tops[:i]) - DELAY_S) if i else 0.0 for i in range(len(tops) + 1)]


def _aggregate(df, window, keys):
    """The two aggregations under test, by parameter (``keys`` the grouping columns)."""
    grouped = df.groupBy(window, *keys)
    if keys:
        return grouped.agg(
            F.count_distinct("v").alias("cd"), F.sum_distinct("v").alias("sd"),
            (F.count_distinct("v") / F.count("*")).alias("share"), F.count("*").alias("n"),
            F.count("v").alias("nv"), F.sum("v").alias("s"), F.avg("v").alias("a"),
            F.min("v").alias("mn"), F.max("ts").alias("last"), F.stddev("v").alias("sdev"),
            F.count_if(F.col("v") > 3).alias("big"), F.sum("p").alias("ps"))
    return grouped.agg(F.countDistinct("v", "f").alias("pairs"),
                       F.count_distinct(F.col("v"), F.col("f")).alias("again"),
                       F.max("v").alias("mv"), F.count("*").alias("n"))


def _rounded(df):
    """Doubles to 9 significant digits (the engine's stddev comes from sums)."""
    return df.select(*[F.round(c, 9).alias(c) if t == "double" else F.col(c)
                       for c, t in df.dtypes])


@pytest.mark.parametrize("window, mode, keys", [
    (lambda: F.window("ts", "20 seconds"), "append", ("k", "d")),
    pytest.param(lambda: F.window("ts", "20 seconds", "10 seconds"), "complete", (),
                 marks=pytest.mark.soak)],
    ids=["tumbling-append-keys", "sliding-complete-window-alone"])
def test_exact_distinct_aggregates_equal_a_batch_query(spark, distinct_src, tmp_path, window,
                                                       mode, keys):
    got, q = _per_batch(spark_stretch.stretch(_aggregate(_stream(spark, distinct_src),
                                                         window(), keys)),
                        tmp_path, "st", mode)
    rows = spark.read.parquet(str(distinct_src))
    if mode == "append":
        # the rows the streaming query keeps: a row updates the windows that end after the
        # watermark of the batch before its own (Spark's late rule); the windows the last
        # watermark closed
        marks = _watermarks(spark, distinct_src)  # (batch N drops by the watermark of N-1)
        late_below = F.element_at(F.array(*[F.lit(m) for m in [0.0] + marks]), F.col("part") + 1)
        kept = (rows.select("*", window().alias("window"))  # (a row per window of it)
                .where(F.unix_micros("window.end") / 1e6 > late_below))
        assert rows.count() - kept.count() >= 30  # (the late rows)
        want = (_aggregate(kept, F.col("window"), keys)
                .where(F.unix_micros("window.end") / 1e6 <= marks[-1]))
        got_rows = [r for b in sorted(got) for r in got[b]]
        assert_df_equality(_rounded(spark.createDataFrame(got_rows, want.schema)),
                           _rounded(want), ignore_row_order=True, ignore_nullable=True)
        assert len(got_rows) >= 10
    else:  # complete: every batch's table is the batch query over the rows so far
        assert sorted(got) == [0, 1, 2, 3]
        for b, batch_rows in got.items():
            want = _aggregate(rows.where(F.col("part") <= b), window(), keys)
            assert_df_equality(_rounded(spark.createDataFrame(batch_rows, want.schema)),
                               _rounded(want), ignore_row_order=True, ignore_nullable=True)
    exact = [r for b in got.values() for r in b]
    assert any((r["cd"] if keys else r["pairs"]) not in (None, 0, 1) for r in exact)
    assert spark_stretch.control(q).metrics()["engine"]["input_rows"] == 960


def test_distinct_aggregates_in_update_mode_run_natively_with_the_reason(spark, distinct_src):
    # update mode would need every sub-row of each window a batch changed: a fallback, and then
    # Spark's own error (Spark runs no distinct aggregate on a stream)
    out = spark_stretch.stretch(_aggregate(_stream(spark, distinct_src),
                                           F.window("ts", "20 seconds"), ("k",)))
    with pytest.warns(FallbackWarning, match="distinct aggregate in update mode"):
        with pytest.raises(AnalysisException, match="(?i)distinct aggregations are not supported"):
            out.writeStream.format("memory").queryName("cd_upd").outputMode("update").start()


@pytest.mark.parametrize("agg, reason", [
    (lambda: F.count_distinct("v") + F.count_distinct("d"), "distinct aggregates over different"),
    (lambda: F.count_distinct("v") + F.first("v"), "first(v) beside the distinct aggregate"),
    (lambda: F.collect_set("v").getItem(0), "collect_set"),
], ids=["two-column-sets", "first-beside", "collect_set"])
def test_what_distinct_aggregates_cannot_run_with_is_named(spark, distinct_src, agg, reason):
    spark.conf.set("spark.stretch.fallback", "false")
    try:
        with pytest.raises(ValueError, match=re.escape(reason)):
            spark_stretch.stretch(_stream(spark, distinct_src)
                                  .groupBy(F.window("ts", "20 seconds"), "k").agg(agg()))
        with pytest.raises(ValueError, match="over session windows"):
            spark_stretch.stretch(_stream(spark, distinct_src)
                                  .groupBy(F.session_window("ts", "5 seconds"), "k")
                                  .agg(F.count_distinct("v")))
    finally:
        spark.conf.unset("spark.stretch.fallback")
