"""``spark.stretch.state.memory``: an aggregation whose state is many times the engine's memory
budget runs to the end, its tables in files on local disk, equal to native Spark on the same
files (the oracle), through a kill -9 of the engine too; the state's bytes on disk are in
``lastProgress["stateOperators"]``."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql import functions as F

import spark_stretch
from spark_stretch.host.faults import ENV

SCHEMA = "ts TIMESTAMP, user BIGINT, x BIGINT"
FILES, ROWS, USERS = 4, 40_000, 60_000
BUDGET = "512k"  # (the state: about 6 MB of tables)


@pytest.fixture(scope="module")
def events(tmp_path_factory):
    """Four files (micro-batches) of bigint users, event time rising 30 s a file, so windows
    close as the stream goes; and native Spark's table over them."""
    src = tmp_path_factory.mktemp("state-memory") / "src"
    src.mkdir()
    rng = np.random.default_rng(5)
    for i in range(FILES):
        ts = (i * 30 + rng.uniform(0, 40, ROWS)) * 1e6
        pq.write_table(pa.table({"ts": pa.array(ts.astype(np.int64), pa.timestamp("us")),
                                 "user": rng.integers(0, USERS, ROWS) * 7919,
                                 "x": rng.integers(-1000, 1000, ROWS)}), src / f"part-{i}.parquet")
    return src


def _query(spark, src):
    return (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(src))
            .withWatermark("ts", "5 seconds")
            .groupBy(F.window("ts", "30 seconds"), "user")
            .agg(F.count("*").alias("n"), F.sum("x").alias("s"), F.max("x").alias("m")))


def _run(spark, df, out, **conf):
    for k, v in conf.items():
        spark.conf.set(k, v)
    try:
        q = (df.writeStream.format("delta").outputMode("append")
             .option("checkpointLocation", str(out) + "-ckpt").trigger(availableNow=True)
             .start(str(out)))
        q.awaitTermination()
    finally:
        for k in conf:
            spark.conf.unset(k)
    return q, spark.read.format("delta").load(str(out))


def _equal(got, want):
    assert want.count() > 50_000
    extra, missing = got.exceptAll(want), want.exceptAll(got)
    assert extra.isEmpty() and missing.isEmpty(), (
        f"{got.count()} rows, {want.count()} expected; extra: {extra.limit(3).collect()}, "
        f"missing: {missing.limit(3).collect()}")


@pytest.fixture(scope="module")
def native(spark, events, tmp_path_factory):
    return _run(spark, _query(spark, events), tmp_path_factory.mktemp("native") / "o")[1]


def test_state_many_times_the_budget_equals_native(spark, events, native, tmp_path):
    q, got = _run(spark, spark_stretch.stretch(_query(spark, events)), tmp_path / "o",
                  **{"spark.stretch.state.memory": BUDGET, "spark.stretch.fallback": "false"})
    _equal(got, native)
    # (Spark's own operator of the chain, with the engine's figures: the tables past the budget
    # as the state store provider names its state's size, ten times the budget and more)
    ops = [json.loads(p.json)["stateOperators"] for p in q.recentProgress]
    disk = [op[0]["customMetrics"].get("stateOnCurrentVersionSizeBytes", 0) for op in ops if op]
    assert max(disk) > 10 * (512 << 10), ops


@pytest.mark.slow  # a kill and restart: in `make test-slow`
def test_engine_killed_with_its_state_on_disk_restarts_exact(spark, events, native, tmp_path,
                                                             monkeypatch):
    # kill -9 of the engine in batch 2's step, its tables in (unlinked) files: the restarted
    # engine rebuilds them from its checkpoint under the same budget and redoes the batches after
    monkeypatch.setenv(ENV, f"kill@step:2:{tmp_path / 'fired'}")
    q, got = _run(spark, spark_stretch.stretch(_query(spark, events)), tmp_path / "o",
                  **{"spark.stretch.state.memory": BUDGET, "spark.stretch.fallback": "false",
                     "spark.stretch.checkpoint.interval": "1"})
    assert (tmp_path / "fired").exists(), "the fault did not fire"
    assert len(q.metrics()["engine_restarts"]) == 1
    _equal(got, native)
