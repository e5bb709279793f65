"""stretchAggregate end to end into Delta, checked against native Spark and batch SQL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chispa import assert_df_equality
from pyspark.sql import functions as F

import spark_stretch
from spark_stretch.testing import publish, run_native, run_stretch, write_tweets
from spark_stretch.testing import tweet_source as source


@pytest.fixture
def tweets(tmp_path):
    # 4 files = 4 micro-batches; 3% of tweets 5 minutes late (dropped by both), 2 s disorder.
    return write_tweets(tmp_path / "src", 6000, files=4, rate=20.0, vocab=300,
                        late_fraction=0.03, late_by_s=300, jitter_s=5.0, seed=7)


def _check(spark, agg, tmp_path, approx=False):
    got = run_stretch(spark, agg, tmp_path / "stretch")
    want = run_native(spark, agg, tmp_path / "native")
    assert want.count() > 0
    if approx:  # sums of doubles: Spark adds in partition order, the engine in its own
        doubles = [f.name for f in got.schema.fields if f.dataType.typeName() == "double"]

        def rounded(df):
            for c in doubles:
                df = df.withColumn(c, F.round(F.col(f"`{c}`"), 9))
            return df
        got, want = rounded(got), rounded(want)
    assert_df_equality(got, want, ignore_row_order=True, ignore_nullable=True,
                       ignore_metadata=True, ignore_column_order=True)
    return got


@pytest.mark.slow  # (for time: the default run stays under 20 minutes; CI runs -m slow)
def test_wordcount_sliding_with_late_data_equals_native(spark, tweets, tmp_path):
    agg = source(spark, tweets).stretchAggregate(
        keys=F.col("words"), window=("120 seconds", "60 seconds"), agg="count")
    _check(spark, agg, tmp_path)


@pytest.mark.slow  # (for time: the default run stays under 20 minutes; CI runs -m slow)
def test_paircount_equals_native(spark, tweets, tmp_path):
    agg = source(spark, tweets).stretchAggregate(
        keys=spark_stretch.pairs("words", distance=3), window="60 seconds", agg="count",
        parallelism=2, max_parallelism=2)
    got = _check(spark, agg, tmp_path)
    assert dict(got.dtypes)["key"] == "struct<_1:string,_2:string>"


@pytest.fixture
def delta_column_mapping(spark):
    # Spark names aggregations 'sum(len)'; Delta takes such names only with column mapping.
    key = "spark.databricks.delta.properties.defaults.columnMapping.mode"
    spark.conf.set(key, "name")
    yield
    spark.conf.unset(key)


def test_scalar_key_sum_min_max_mean_equals_native(spark, tweets, tmp_path, delta_column_mapping):
    agg = source(spark, tweets).stretchAggregate(
        keys="user", window="30 seconds", agg=["count", "sum(len)", "min(len)", "max(len)", "mean(len)"])
    _check(spark, agg, tmp_path, approx=True)


def test_windows_closed_by_the_watermark_equal_batch_sql(spark, tmp_path):
    src = write_tweets(tmp_path / "src", 4000, files=4, rate=20.0, vocab=200, jitter_s=0.0, seed=3)
    agg = source(spark, src).stretchAggregate(keys="words", window="60 seconds", agg="count")
    got = run_stretch(spark, agg, tmp_path / "out")
    # No late data here: every window the final watermark closed holds all of its rows.
    wm_us = (spark.read.parquet(str(src)).agg(F.max("ts")).first()[0].timestamp() - 10) * 1e6
    spark.read.parquet(str(src)).createOrReplaceTempView("tweets")
    want = spark.sql("""
        SELECT window(ts, '60 seconds') AS window, key, count(1) AS count
        FROM tweets LATERAL VIEW explode(words) w AS key
        GROUP BY window(ts, '60 seconds'), key
    """).where(F.col("window.end") <= F.timestamp_micros(F.lit(int(wm_us))))
    assert want.count() > 0
    assert_df_equality(got, want, ignore_row_order=True, ignore_nullable=True, ignore_metadata=True)


def test_per_batch_jobs_have_no_exchange(spark, tweets, tmp_path):
    agg = source(spark, tweets).stretchAggregate(keys="words", window="60 seconds")
    q = (agg.writeStream.format("delta").option("checkpointLocation", str(tmp_path / "c"))
         .trigger(availableNow=True).start(str(tmp_path / "o")))
    q.awaitTermination()
    plans = q.metrics()["plans"]
    assert plans and all("Exchange" not in p for p in plans), plans


def _run(spark, agg, out):
    q = (agg.writeStream.format("delta").option("checkpointLocation", str(out) + "-ckpt")
         .trigger(availableNow=True).start(str(out)))
    q.awaitTermination()
    return q


def _native(agg, out):
    """The native query of ``agg`` run into ``out`` (availableNow), for its progress."""
    q = (agg.native().writeStream.format("delta").outputMode("append")
         .option("checkpointLocation", str(out) + "-ckpt")
         .trigger(availableNow=True).start(str(out)))
    q.awaitTermination()
    return q


def _delta_wordcount(spark, src):
    return (spark.readStream.format("delta").option("maxFilesPerTrigger", 1).load(str(src))
            .withWatermark("ts", "10 seconds")
            .stretchAggregate(keys=F.col("words"), window=("120 seconds", "60 seconds"),
                              agg="count"))


def _event_times(q) -> dict:
    """Spark's per-batch event-time statistics (from the watermark's accumulator)."""
    return {p["batchId"]: p["eventTime"] for p in q.recentProgress if p["numInputRows"]}


@pytest.mark.slow  # (for time: the default run stays under 20 minutes; CI runs -m slow)
def test_file_columnar_and_row_ingest_equal_native_with_spark_progress_intact(spark, tweets,
                                                                              tmp_path):
    agg = source(spark, tweets).stretchAggregate(
        keys=F.col("words"), window=("120 seconds", "60 seconds"), agg="count")
    native = _native(agg, tmp_path / "n")
    want = spark.read.format("delta").load(str(tmp_path / "n"))
    runs = {"files": _run(spark, agg, tmp_path / "files")}
    for path, conf in (("columnar", "spark.stretch.ingest.files"),
                       ("rows", "spark.stretch.ingest.columnar")):
        spark.conf.set(conf, "false")
        try:
            runs[path] = _run(spark, agg, tmp_path / path)
        finally:
            spark.conf.unset(conf)
    # Each path was taken: the engine read the files (no Spark job), the scan's columns were
    # sent by the shim, or foreachBatch's rows were written.
    for path, q in runs.items():
        assert q.metrics()["ingest"] == {path: 4}, q.metrics()
    assert all("FileScan parquet" in p and "ExistingRDD" not in p
               for p in runs["columnar"].metrics()["plans"][::2])
    assert all("ExistingRDD" in p for p in runs["rows"].metrics()["plans"][::2])
    for q in runs.values():  # (the paths that run a Spark job run it without a shuffle)
        assert not any("Exchange" in p for p in q.metrics()["plans"]), q.metrics()["plans"]
    for path, q in runs.items():
        got = spark.read.format("delta").load(str(tmp_path / path))
        assert_df_equality(got, want, ignore_row_order=True, ignore_nullable=True,
                           ignore_metadata=True)
        # Spark's own progress as if the rows had flowed through the plan: input rows counted by
        # the scan, and the watermark's event-time statistics (max/min/avg/watermark) per batch.
        assert sum(p["numInputRows"] for p in q.recentProgress) == 6000
        assert _event_times(q) == _event_times(native)


@pytest.mark.parametrize("unlike", ["int96", "case"])
def test_files_spark_reads_otherwise_are_read_by_spark(spark, tmp_path, unlike):
    # INT96 timestamps (Spark converts them; pyarrow reads nanoseconds) and column names that
    # match only ignoring case (Spark's default): the engine declines, names why, and the batch
    # goes through Spark's own reading; the table is native's.
    import pyarrow.parquet as pq

    from spark_stretch.testing import tweets_table

    (tmp_path / "src").mkdir()
    for i in range(2):
        t = tweets_table(500, start_s=25.0 * i, rate=20.0, vocab=40, seed=i)
        if unlike == "case":
            t = t.rename_columns([c.upper() for c in t.column_names])
        pq.write_table(t, tmp_path / f"t{i}.parquet",
                       use_deprecated_int96_timestamps=unlike == "int96")
        publish(tmp_path / f"t{i}.parquet", tmp_path / "src")  # (increasing mtimes: in order)
    agg = source(spark, tmp_path / "src").stretchAggregate(
        keys=F.col("words"), window=("20 seconds", "10 seconds"), agg="count")
    q = _run(spark, agg, tmp_path / "o")
    m = q.metrics()
    assert m["ingest"] == {"columnar": 2}, m
    assert {"int96": "column 'ts' is INT96 from a non-Spark", "case": "no column 'ts'"}[unlike] \
        in m["files_off"], m["files_off"]
    got = spark.read.format("delta").load(str(tmp_path / "o"))
    assert_df_equality(got, run_native(spark, agg, tmp_path / "n"), ignore_row_order=True,
                       ignore_nullable=True, ignore_metadata=True)


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_files_spark_wrote_with_int96_timestamps_are_read_by_the_engine(spark, tweets, tmp_path):
    # Spark writes TIMESTAMP as INT96 by default; from a Spark 3.1+ writer Spark reads them
    # unchanged, and so does the engine: the table and Spark's per-batch statistics are native's.
    import pyarrow.parquet as pq

    (tmp_path / "spark-src").mkdir()
    for i, f in enumerate(sorted(Path(tweets).glob("*.parquet"))):
        spark.read.parquet(str(f)).coalesce(1).write.parquet(str(tmp_path / f"w{i}"))
        publish(next((tmp_path / f"w{i}").glob("*.parquet")), tmp_path / "spark-src")  # (in order)
    first = pq.ParquetFile(next((tmp_path / "spark-src").glob("*.parquet")))
    assert first.schema.column(first.schema_arrow.get_field_index("ts")).physical_type == "INT96"
    agg = source(spark, tmp_path / "spark-src").stretchAggregate(
        keys=F.col("words"), window=("120 seconds", "60 seconds"), agg="count")
    q = _run(spark, agg, tmp_path / "o")
    assert q.metrics()["ingest"] == {"files": 4}, q.metrics()
    native = _native(agg, tmp_path / "n")
    assert_df_equality(spark.read.format("delta").load(str(tmp_path / "o")),
                       spark.read.format("delta").load(str(tmp_path / "n")),
                       ignore_row_order=True, ignore_nullable=True, ignore_metadata=True)
    assert _event_times(q) == _event_times(native)


@pytest.mark.parametrize("mapping,path", [
    ("none", "files"), pytest.param("name", "columnar", marks=pytest.mark.soak)])
def test_delta_source_equals_native(spark, tweets, tmp_path, mapping, path):
    # The usual source: a Delta table Spark appended to, a version per file. Its files are
    # plain Parquet without column mapping, and the engine reads them itself; with it (files
    # hold physical names) the scan's columns go through the shim. Both are native's table, with
    # Spark's per-batch statistics.
    src = tmp_path / "delta-src"
    key = "spark.databricks.delta.properties.defaults.columnMapping.mode"
    spark.conf.set(key, mapping)
    try:
        for f in sorted(Path(tweets).glob("*.parquet")):
            spark.read.parquet(str(f)).coalesce(1).write.format("delta").mode("append") \
                .save(str(src))
    finally:
        spark.conf.unset(key)
    agg = _delta_wordcount(spark, src)
    q = _run(spark, agg, tmp_path / "o")
    assert q.metrics()["ingest"] == {path: 4}, q.metrics()
    native = _native(agg, tmp_path / "n")
    assert_df_equality(spark.read.format("delta").load(str(tmp_path / "o")),
                       spark.read.format("delta").load(str(tmp_path / "n")),
                       ignore_row_order=True, ignore_nullable=True, ignore_metadata=True)
    assert sum(p["numInputRows"] for p in q.recentProgress) == 6000
    assert _event_times(q) == _event_times(native)


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_delta_source_with_deletion_vectors_is_read_by_spark(spark, tweets, tmp_path):
    # A DELETE on a table with deletion vectors leaves the files with a vector each: a file also
    # holds its deleted rows, so the engine must not read it; Spark's scan applies the vector.
    # (A file the DELETE did not touch is plain, and the engine may read it.) Native's table.
    src = tmp_path / "delta-src"
    for i, f in enumerate(sorted(Path(tweets).glob("*.parquet"))):
        w = spark.read.parquet(str(f)).coalesce(1).write.format("delta").mode("append")
        if i == 0:
            w = w.option("delta.enableDeletionVectors", "true")
        w.save(str(src))
    spark.sql(f"DELETE FROM delta.`{src}` WHERE user = 'u1'")
    log = sorted((src / "_delta_log").glob("*.json"))[-1].read_text().splitlines()
    with_dv = sum(1 for a in map(json.loads, log) if a.get("add", {}).get("deletionVector"))
    assert 0 < with_dv < 4  # (the DELETE's commit: files re-added with their vectors)
    agg = _delta_wordcount(spark, src)
    q = _run(spark, agg, tmp_path / "o")
    ingest = q.metrics()["ingest"]
    assert sum(ingest.values()) == 4 and ingest.get("files", 0) == 4 - with_dv, ingest
    native = _native(agg, tmp_path / "n")
    assert_df_equality(spark.read.format("delta").load(str(tmp_path / "o")),
                       spark.read.format("delta").load(str(tmp_path / "n")),
                       ignore_row_order=True, ignore_nullable=True, ignore_metadata=True)
    assert _event_times(q) == _event_times(native)


def test_null_keys_fail_the_query_naming_the_column(spark, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.errors import StreamingQueryException

    (tmp_path / "src").mkdir()
    pq.write_table(pa.table({
        "ts": pa.array([1_000_000, 2_000_000], pa.timestamp("us", tz="UTC")),
        "words": pa.array([["a"], ["b"]]), "user": pa.array(["u1", None]),
        "len": pa.array([1, 1], pa.int64())}), tmp_path / "src" / "a.parquet")
    agg = source(spark, tmp_path / "src").stretchAggregate(keys="user", window="60 seconds")
    q = (agg.writeStream.format("delta").option("checkpointLocation", str(tmp_path / "c"))
         .trigger(availableNow=True).start(str(tmp_path / "o")))
    with pytest.raises(StreamingQueryException, match="keys column 'user' has 1 null keys"):
        q.awaitTermination()
