"""``stretch(df)`` with several stretch aggregations in one streaming query (two of one stream in
a union, one over the windows of another), each its own engine query, against native Spark on
the same input (late rows, nulls, several micro-batches), through a restart and an engine kill."""

from __future__ import annotations

import shutil

import pytest
from chispa import assert_df_equality
from pyspark.sql import functions as F

import spark_stretch
from spark_stretch.host.faults import ENV

from .test_native_spelling import FILES, SCHEMA, _per_batch, _write


@pytest.fixture
def src(spark, tmp_path):
    path = tmp_path / "in"
    _write(spark, str(path), FILES)
    return path


def _read(spark, src):
    return (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1)
            .option("recursiveFileLookup", "true").parquet(str(src))
            .withWatermark("ts", "10 seconds"))


def _same(df):
    return df


def _union(df, wrap):
    """Two aggregations of one stream, side by side: tumbling windows by two keys, and
    sliding windows by one (over the same input: Spark would share their chains' exchange)."""
    a = wrap(df.groupBy(F.window("ts", "20 seconds"), "k", "d")
             .agg(F.sum("v").alias("s"), F.count("*").alias("n")))
    b = wrap(df.groupBy(F.window("ts", "20 seconds", "10 seconds"), "k")
             .agg(F.max("v").alias("s"), F.count_if(F.col("v") > 1).alias("n")))
    return (a.select(F.lit("a").alias("agg"), "window", "k", "s", "n")
            .union(b.select(F.lit("b").alias("agg"), "window", "k", "s", "n")))


def _chain(df, wrap):
    """Per key and 20 s window, then per 40 s window of those windows (no key)."""
    first = wrap(df.groupBy(F.window("ts", "20 seconds"), "k")
                 .agg(F.sum("v").alias("s"), F.count("*").alias("n")))
    return wrap(first.groupBy(F.window(F.window_time("window"), "40 seconds").alias("w40"))
                .agg(F.sum("n").alias("n"), F.max("s").alias("top"),
                     F.count("*").alias("keys")))


def test_a_union_of_two_stretch_aggregations_equals_native_batch_by_batch(spark, src,
                                                                          tmp_path):
    want, _ = _per_batch(_union(_read(spark, src), _same), tmp_path, "nat", "append")
    got, q = _per_batch(_union(_read(spark, src), spark_stretch.stretch), tmp_path, "st",
                        "append")
    assert got == want
    rows = [r for b in want.values() for r in b]
    assert {r["agg"] for r in rows} == {"a", "b"} and len(rows) >= 10
    # each aggregation its own engine query, its files by its Spark state operator
    control = spark_stretch.control(q)
    assert len(control.aggregations) == 2
    figures = control.metrics()["aggregations"]
    assert [f["engine"]["input_rows"] for f in figures] == [14, 14]
    assert [f["engine"]["late_rows"] for f in figures] == [1, 1]
    ops = tmp_path / "ck-st" / "stretch" / "operators"
    assert sorted(p.name for p in ops.iterdir()) == ["0", "1"]
    assert all((ops / p / "query.json").exists() for p in ("0", "1"))
    assert not (tmp_path / "ck-st" / "stretch" / "query.json").exists()


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_a_stretch_aggregation_over_a_stretch_aggregation_equals_native(spark, src, tmp_path):
    # The outer aggregation's event time is window_time of the inner's windows; each batch's
    # watermark is Spark's (the outer's input alone would give it a later one)
    want, _ = _per_batch(_chain(_read(spark, src), _same), tmp_path, "nat", "append")
    got, q = _per_batch(_chain(_read(spark, src), spark_stretch.stretch), tmp_path, "st",
                        "append")
    assert got == want and sum(map(len, want.values())) >= 2
    outer, inner = (f["engine"] for f in spark_stretch.control(q).metrics()["aggregations"])
    assert inner["input_rows"] == 14 and inner["late_rows"] == 1
    assert outer["input_rows"] == inner["output_rows"] > 0
    assert len(q.lastProgress["stateOperators"]) == 2  # (as native's: one per aggregation)


def _delta_steps(spark, src, tmp_path, name, query, rescale):
    """Two files under a processing-time trigger (``rescale(q)`` meanwhile), a stop, then a
    third file and a restart from the checkpoint: the Delta table."""
    out, ck = str(tmp_path / name), str(tmp_path / f"ck-{name}")

    def start(**trigger):
        return (query(_read(spark, src)).writeStream.format("delta")
                .option("checkpointLocation", ck).trigger(**trigger).start(out))

    q = start(processingTime="100 milliseconds")
    q.processAllAvailable()
    rescale(q)
    q.stop()
    return start


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_a_restart_of_two_chained_stretch_aggregations_from_the_checkpoint(spark, tmp_path):
    # Mid-stream: the query (its outer aggregation appended to Delta by the engine) stops after
    # two files, both aggregations rescaled; a third file, and the restart continues each from
    # its own files: the table is native Spark's through the same steps
    src = tmp_path / "in"
    _write(spark, str(src), FILES[:2])

    def rescale(q):
        control = spark_stretch.control(q)
        if control is None:  # (native)
            return
        assert control.reconfigure(parallelism=2)["parallelism"] == 2
        assert [c.metrics()["reconfigurations"][-1]["parallelism"]
                for c in control.aggregations] == [2, 2]

    steps = {name: _delta_steps(spark, src, tmp_path, name,
                                lambda df, wrap=wrap: _chain(df, wrap), rescale)
             for name, wrap in (("native", _same), ("stretch", spark_stretch.stretch))}
    _write(spark, str(tmp_path / "in3"), FILES[2:3])
    shutil.move(str(tmp_path / "in3" / "part=0"), str(src / "part=2"))
    for start in steps.values():
        q = start(availableNow=True)
        q.awaitTermination()
        assert q.exception() is None
    got, want = (spark.read.format("delta").load(str(tmp_path / n)) for n in steps)
    assert want.count() >= 2  # (metadata: the engine's table keeps the window marker as text)
    assert_df_equality(got, want, ignore_row_order=True, ignore_nullable=True,
                       ignore_metadata=True)
    ops = tmp_path / "ck-stretch" / "stretch" / "operators"
    assert sorted(p.name for p in ops.iterdir()) == ["0", "1"]


@pytest.mark.slow
def test_two_stretch_aggregations_recover_from_an_engine_kill(spark, src, tmp_path,
                                                                monkeypatch):
    # kill -9 of the engine both aggregations run on, in a batch's step: each restarts its own
    # query from its own checkpoint and input log; no row lost or written twice
    def run(name, wrap):
        q = (_union(_read(spark, src), wrap).writeStream.format("delta")
             .option("checkpointLocation", str(tmp_path / f"ck-{name}"))
             .trigger(availableNow=True).start(str(tmp_path / name)))
        q.awaitTermination()
        assert q.exception() is None
        return q

    run("native", _same)
    monkeypatch.setenv(ENV, f"kill@step:2:{tmp_path / 'fired'}")
    q = run("stretch", spark_stretch.stretch)
    assert (tmp_path / "fired").exists(), "the fault did not fire"
    figures = spark_stretch.control(q).metrics()["aggregations"]
    assert [len(f.get("engine_restarts", [])) for f in figures] == [1, 1]
    got, want = (spark.read.format("delta").load(str(tmp_path / n)) for n in ("stretch", "native"))
    assert want.count() >= 10
    assert_df_equality(got, want, ignore_row_order=True, ignore_nullable=True)


@pytest.mark.soak
def test_a_join_of_two_stretch_aggregations_of_one_stream_equals_native(spark, src, tmp_path):
    def query(wrap):
        df = _read(spark, src)
        a = wrap(df.groupBy(F.window("ts", "20 seconds"), "k").agg(F.sum("v").alias("s")))
        b = wrap(df.groupBy(F.window("ts", "20 seconds"), "k").agg(F.count("*").alias("n")))
        return a.join(b, ["window", "k"])

    want, _ = _per_batch(query(_same), tmp_path, "nat", "append")
    got, q = _per_batch(query(spark_stretch.stretch), tmp_path, "st", "append")
    assert got == want and sum(map(len, want.values())) >= 5
    assert len(spark_stretch.control(q).aggregations) == 2
