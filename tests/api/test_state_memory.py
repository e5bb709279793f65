"""``spark.stretch.state.memory``: an aggregation whose state is many times the engine's memory
budget runs to the end, its tables in files on local disk, equal to native Spark on the same
files (the oracle), through a kill -9 of the engine too; the state's bytes on disk are in
``lastProgress["stateOperators"]``. The applyInPandasWithState drop-in under the same setting
keeps the store's pages its processes map within the budget."""

from __future__ import annotations

import json
import sys

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql import functions as F
from pyspark.sql.streaming.state import GroupStateTimeout

import spark_stretch
from spark_stretch.host.faults import ENV
from spark_stretch.testing import assert_same_rows

from pyspark import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

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
    assert_same_rows(got, want)


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


BLOB = 1024
DROPIN_FILES, DROPIN_USERS = 3, 2000


def _blob_count(key, pdfs, state):
    """A count per user, with 1 KB of state per user (made from the user's id)."""
    n = state.get[0] if state.exists else 0
    blob = (str(key[0]) * BLOB)[:BLOB]
    if state.exists:
        assert state.get[1] == blob  # (read back intact)
    for pdf in pdfs:
        n += len(pdf)
    state.update((n, blob))
    yield pd.DataFrame({"user": [key[0]], "n": [n]})


@pytest.mark.slow  # (a minute: three runs of the drop-in, one native)
def test_the_drop_in_keeps_its_store_pages_within_the_budget(spark, tmp_path):
    """The applyInPandasWithState drop-in under ``spark.stretch.state.memory``: each process
    keeps the store's pages it mapped within its share (after every batch, as
    ``memoryUsedBytes``), the store many times the budget on disk; rows equal to native
    Spark's; without the setting the same run keeps more mapped (what the bound is against)."""
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(3)
    rows = 0  # (a row per user and batch)
    for i in range(DROPIN_FILES):  # (new users each file, and some of the earlier files')
        users = np.concatenate([np.arange(i * DROPIN_USERS, (i + 1) * DROPIN_USERS),
                                rng.integers(0, max(i, 1) * DROPIN_USERS, 500)])
        rows += len(np.unique(users))
        pq.write_table(pa.table({"ts": pa.array(np.full(len(users), i * 10**6), pa.timestamp("us")),
                                 "user": users, "x": np.ones(len(users), np.int64)}),
                       src / f"part-{i}.parquet")
    args = (_blob_count, "user long, n long", "n long, blob string", "Append",
            GroupStateTimeout.NoTimeout)

    def grouped(stretch):
        gd = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1)
              .parquet(str(src)).groupBy("user"))
        return (gd.stretchApplyInPandasWithState(*args, parallelism=2) if stretch
                else gd.applyInPandasWithState(*args))

    budget = 256 << 10
    q, got = _run(spark, grouped(True), tmp_path / "o", **{"spark.stretch.state.memory": "256k"})
    free, _ = _run(spark, grouped(True), tmp_path / "free")
    _, want = _run(spark, grouped(False), tmp_path / "native")
    assert want.count() == rows
    assert got.exceptAll(want).isEmpty() and want.exceptAll(got).isEmpty()

    def ops(q):
        return [json.loads(p.json)["stateOperators"][0] for p in q.recentProgress
                if json.loads(p.json)["stateOperators"]]

    bounded, unbounded = ops(q), ops(free)
    assert len(bounded) >= DROPIN_FILES
    assert all(op["memoryUsedBytes"] <= budget for op in bounded), bounded
    assert max(op["customMetrics"]["stateOnCurrentVersionSizeBytes"] for op in bounded) > 10 * budget
    assert max(op["memoryUsedBytes"] for op in unbounded) > budget, unbounded
