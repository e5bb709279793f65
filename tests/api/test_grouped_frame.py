"""The drop-in's result is a streaming DataFrame: what Spark users do with
``applyInPandasWithState``'s gives native's rows, batch by batch, and file sinks keep Spark's
exactly-once contract.

Oracle: native ``applyInPandasWithState`` with the same arguments over the same files, through
the same downstream steps and the same sink (Spark's own sink on both sides).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest
from pyspark.errors import AnalysisException
from pyspark.sql import functions as F
from pyspark.sql.streaming.state import GroupStateTimeout

import spark_stretch
from spark_stretch.api.frame import StretchStreamingQuery
from spark_stretch.testing import publish

from .test_grouped import SESSION_OUT, SESSION_STATE, running_count, sessions, source, \
    write_tweets

# Shipped by value: Python workers and stretch instances cannot import this test module.
from pyspark import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

COUNT_OUT, COUNT_STATE = "user string, n long, words long", "n long"
SIDES = (("native", lambda g, *a: g.applyInPandasWithState(*a)),
         ("stretch", lambda g, *a: g.stretchApplyInPandasWithState(*a)))


@pytest.fixture(scope="module")
def tweets(tmp_path_factory):
    """Three one-file micro-batches, late rows and stragglers among them."""
    return write_tweets(tmp_path_factory.mktemp("frame") / "src", 360, files=3, rate=12.0,
                        users=40, vocab=30, late_fraction=0.05, late_by_s=20.0, jitter_s=4.0,
                        seed=21)


def _sessions(spark, src, side):
    args = (sessions, SESSION_OUT, SESSION_STATE, "Update", GroupStateTimeout.EventTimeTimeout)
    return side(source(spark, src).groupBy("user"), *args)


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_select_filter_join_into_memory_sink_equal_native(spark, tweets, tmp_path):
    dims = spark.createDataFrame([(f"u{i}", i % 3) for i in range(0, 40, 2)],
                                 "user string, tier int")
    for name, side in SIDES:
        out = _sessions(spark, tweets, side)
        assert out.isStreaming
        df = (out.where("n > 1 OR closed").select("user", "n", "closed", "wm")
              .join(dims, "user", "left").withColumn("twice", F.col("n") * 2))
        q = (df.writeStream.format("memory").queryName(f"frame_{name}").outputMode("update")
             .option("checkpointLocation", str(tmp_path / name)).trigger(availableNow=True)
             .start())
        q.awaitTermination()
        assert q.exception() is None
        if name == "stretch":  # Spark's own query (of a transformed frame), and its handle
            figures = spark_stretch.control(q).metrics()
            # three batches and Spark's no-data batch after them, on the engine
            assert figures["batches"] == 4 == q.lastProgress["batchId"] + 1
            assert figures["engine"]["late_rows"] > 0
    want = spark.table("frame_native").collect()
    assert sorted(spark.table("frame_stretch").collect()) == sorted(want)
    assert any(r.closed for r in want) and any(r.tier is not None for r in want)


def _counts(spark, src, side, mode="Append"):
    return side(source(spark, src, False).groupBy("user"), running_count, COUNT_OUT,
                COUNT_STATE, mode, GroupStateTimeout.NoTimeout)


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_an_aggregation_after_it_equals_native_or_is_refused_as_natively(spark, tweets,
                                                                         tmp_path):
    for name, side in SIDES:  # Spark's UnsupportedOperationChecker sees Spark's own operator
        with pytest.raises(AnalysisException, match="applyInPandasWithState in update mode is "
                           "not supported with aggregation on a streaming DataFrame"):
            (_counts(spark, tweets, side, "Update").groupBy("n").count().writeStream
             .format("memory").queryName(f"refused_{name}").outputMode("complete").start())
        q = (_counts(spark, tweets, side).groupBy("n").agg(F.count("*").alias("users"),
                                                          F.sum("words").alias("words"))
             .writeStream.format("memory").queryName(f"chained_{name}").outputMode("complete")
             .option("checkpointLocation", str(tmp_path / name)).trigger(availableNow=True)
             .start())
        q.awaitTermination()
        assert q.exception() is None
        if name == "stretch":
            assert spark_stretch.control(q).metrics()["engine"]["input_rows"] == 360
    want = spark.table("chained_native").collect()
    assert sorted(spark.table("chained_stretch").collect()) == sorted(want) and len(want) > 3


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_to_table_equals_native(spark, tweets, tmp_path):
    try:
        for name, side in SIDES:
            q = (_counts(spark, tweets, side).writeStream.outputMode("append")
                 .option("checkpointLocation", str(tmp_path / name)).trigger(availableNow=True)
                 .toTable(f"frame_table_{name}"))
            q.awaitTermination()
            assert q.exception() is None
            if name == "stretch":  # written unchanged: Spark's query with the handle's methods
                assert isinstance(q, StretchStreamingQuery) and q.metrics()["batches"] == 3
        want = spark.table("frame_table_native").collect()
        assert sorted(spark.table("frame_table_stretch").collect()) == sorted(want) and want
    finally:
        for name, _ in SIDES:
            spark.sql(f"DROP TABLE IF EXISTS frame_table_{name}")


def _file_sink(spark, fmt, src, side, out: Path, ckpt: Path):
    """The running counts into a ``fmt`` file sink (append mode) until the files are done;
    whether the sink's log existed as soon as ``start()`` returned."""
    q = (_counts(spark, src, side).writeStream.format(fmt).outputMode("append")
         .option("checkpointLocation", str(ckpt)).trigger(availableNow=True).start(str(out)))
    at_start = (out / "_spark_metadata").is_dir()
    q.awaitTermination()
    assert q.exception() is None
    return q, at_start


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
@pytest.mark.parametrize("fmt", ["parquet", "json", "orc"])
def test_file_sinks_keep_sparks_exactly_once_contract(spark, tweets, tmp_path, fmt):
    # Both queries run the first three files, then lose their last commit (a crash between the
    # sink's write of batch 2 and Spark's commit log): restarted with a fourth file, Spark
    # replays batch 2, which the file sink's log says it has (not written again), then batch 3,
    # whose counts need batch 2's state (the engine continues from its state after batch 2).
    files = sorted(tweets.glob("*.parquet"))
    fourth = write_tweets(tmp_path / "more", 120, files=1, first_file=3, rate=12.0, users=40,
                          vocab=30, seed=22)
    for name, side in SIDES:
        live, out, ckpt = tmp_path / f"src-{name}", tmp_path / name, tmp_path / f"{name}-ckpt"
        live.mkdir()
        for f in files:
            publish(f, live)
        assert _file_sink(spark, fmt, live, side, out, ckpt)[1]  # the sink's log at start
        for f in ("2", ".2.crc"):
            (ckpt / "commits" / f).unlink()
        publish(next(fourth.glob("*.parquet")), live)
        q, _ = _file_sink(spark, fmt, live, side, out, ckpt)
        if name == "stretch":  # opened after Spark's last commit, continued after batch 2
            # (unless Spark had committed its replay of batch 2, which runs no plan, before the
            # engine read the commit log at the start: then opened after batch 2 itself)
            realigned = q.metrics().get("realigned")
            assert realigned is None or (
                realigned["opened_after"], realigned["continued_after"]) == (1, 2), realigned
        logged = sorted(int(p.name) for p in (out / "_spark_metadata").iterdir()
                        if p.name.isdigit())
        assert logged == [0, 1, 2, 3], logged  # (batch 2 once)
    got, want = (spark.read.format(fmt).schema(COUNT_OUT).load(str(tmp_path / n)).collect()
                 for n in ("stretch", "native"))
    assert sorted(got) == sorted(want) and len(set(want)) == len(want)
    # batch 3's counts went on from batch 2's (a user of both files counts both)
    users = [set(pd.read_parquet(f, columns=["user"])["user"]) for f in files[2:3] + [
        next(fourth.glob("*.parquet"))]]
    assert users[0] & users[1]


def test_a_stateful_operator_before_it_equals_native_in_foreach_batch(spark, tweets, tmp_path):
    # A deduplication before the drop-in: the marker's input runs it, the chain's copy of it
    # never runs (its stores reported committed, as Spark's commit check of foreachBatch needs).
    got = {}

    def collect(name):
        def each(batch_df, batch_id):
            got.setdefault(name, {})[batch_id] = sorted(batch_df.collect())
        return each

    for name, side in SIDES:
        deduped = source(spark, tweets).dropDuplicates(["user", "len"]).groupBy("user")
        q = (side(deduped, running_count, COUNT_OUT, COUNT_STATE, "Update",
                  GroupStateTimeout.NoTimeout).writeStream.outputMode("update")
             .foreachBatch(collect(name)).option("checkpointLocation", str(tmp_path / name))
             .trigger(availableNow=True).start())
        q.awaitTermination()
        assert q.exception() is None
    assert got["stretch"] == got["native"] and len(got["native"]) >= 3
