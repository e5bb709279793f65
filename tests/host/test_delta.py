"""The engine's own Delta appends (spark_stretch.host.delta): exactly once by Delta's txn
rule, Spark's writer where deltalake cannot write, and tables equal to native Spark's."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from chispa import assert_df_equality
from deltalake import DeltaTable, write_deltalake
from pyspark.sql import functions as F

from spark_stretch.host.delta import append
from spark_stretch.testing import run_native, write_tweets
from spark_stretch.testing import tweet_source as source


def _txns(path: Path) -> list:
    """(appId, version, writer) of every commit with a txn action, in commit order."""
    out = []
    for f in sorted((path / "_delta_log").glob("*.json")):
        actions = [json.loads(line) for line in f.read_text().splitlines()]
        info = next((a["commitInfo"] for a in actions if "commitInfo" in a), {})
        writer = "spark" if "engineInfo" in info and "Spark" in info["engineInfo"] else "engine"
        out += [(a["txn"]["appId"], a["txn"]["version"], writer) for a in actions if "txn" in a]
    return out


def _empty(path, schema: pa.Schema) -> None:
    write_deltalake(str(path), schema.empty_table())


def test_append_is_exactly_once_by_the_tables_txn_actions(tmp_path):
    t = pa.table({"k": ["a", "b"], "n": pa.array([1, 2], pa.int64())})
    _empty(tmp_path, t.schema)
    assert append(str(tmp_path), t, "q", 0)["written"]
    assert append(str(tmp_path), t, "q", 1)["written"]
    # A replay of batch 1, and an older batch: no-ops, as Spark's txnAppId/txnVersion writes.
    assert not append(str(tmp_path), t, "q", 1)["written"]
    assert not append(str(tmp_path), t, "q", 0)["written"]
    # Another app id (the idle flush's) has its own versions.
    assert append(str(tmp_path), t, "q-idle", 0)["written"]
    dt = DeltaTable(str(tmp_path))
    assert dt.to_pyarrow_table().num_rows == 6
    assert dt.transaction_version("q") == 1 and dt.transaction_version("q-idle") == 0


def test_what_deltalake_cannot_write_goes_back_to_spark(tmp_path):
    t = pa.table({"k": ["a"], "n": pa.array([1], pa.int64())})
    r = append(str(tmp_path / "none"), t, "q", 0)  # no table yet: Spark creates it
    assert not r["written"] and not r["permanent"] and "no Delta table" in r["unsupported"]
    _empty(tmp_path / "other", pa.schema([("key", pa.string()), ("n", pa.int64())]))
    r = append(str(tmp_path / "other"), t, "q", 0)
    assert not r["written"] and r["permanent"] and "columns ['k', 'n']" in r["unsupported"]
    _empty(tmp_path / "typed", pa.schema([("k", pa.string()), ("n", pa.timestamp("us", "UTC"))]))
    r = append(str(tmp_path / "typed"), t, "q", 0)
    assert not r["written"] and r["permanent"] and "output schema" in r["unsupported"]
    assert DeltaTable(str(tmp_path / "other")).to_pyarrow_table().num_rows == 0
    # A table deltalake cannot open (here a corrupt log; an object store it has no credentials
    # for is the same): Spark, which may be able to, writes.
    log = tmp_path / "corrupt" / "_delta_log"
    log.mkdir(parents=True)
    (log / f"{0:020d}.json").write_text("not json\n")
    r = append(str(tmp_path / "corrupt"), t, "q", 0)
    assert not r["written"] and r["permanent"] and "cannot open" in r["unsupported"], r
    assert "\n" not in r["unsupported"]
    # A table whose writer needs more than a plain append (here CHECK constraints' writer v3).
    _empty(tmp_path / "checked", t.schema)
    DeltaTable(str(tmp_path / "checked")).alter.add_constraint({"n_positive": "n > 0"})
    r = append(str(tmp_path / "checked"), t, "q", 0)
    assert not r["written"] and r["permanent"] and "writer" in r["unsupported"], r


@pytest.fixture
def tweets(tmp_path):
    return write_tweets(tmp_path / "src", 4000, files=4, rate=20.0, vocab=200,
                        late_fraction=0.03, late_by_s=300, jitter_s=5.0, seed=11)


def _start(agg, out: Path, **options):
    w = agg.writeStream.format("delta").option("checkpointLocation", str(out) + "-ckpt")
    for k, v in options.items():
        w = w.option(k, v)
    q = w.trigger(availableNow=True).start(str(out))
    q.awaitTermination()
    return q


def _equal(spark, out: Path, want):
    assert want.count() > 0
    assert_df_equality(spark.read.format("delta").load(str(out)), want, ignore_row_order=True,
                       ignore_nullable=True, ignore_metadata=True, ignore_column_order=True)


@pytest.mark.slow  # (for time: the default run stays under 20 minutes; CI runs -m slow)
def test_engine_appends_to_the_table_spark_created_and_equals_native(spark, tweets, tmp_path):
    def agg():
        return source(spark, tweets).stretchAggregate(keys=F.col("words"),
                                                      window=("60 seconds", "30 seconds"))

    want = run_native(spark, agg(), tmp_path / "native")
    q = _start(agg(), tmp_path / "direct")
    m = q.metrics()
    assert m.get("direct_writes", 0) >= 1 and "direct_write_off" not in m, m
    txns = _txns(tmp_path / "direct")
    # The table was made empty (its first commit, no txn, no files); the engine appended
    # every output batch.
    assert {w for _, _, w in txns} == {"engine"}, txns
    first = [json.loads(line) for line in
             (tmp_path / "direct" / "_delta_log" / f"{0:020d}.json").read_text().splitlines()]
    assert "metaData" in str(first) and not any("add" in a or "txn" in a for a in first), first
    assert [v for a, v, _ in txns if not a.endswith("-idle")] == sorted(
        v for a, v, _ in txns if not a.endswith("-idle"))
    _equal(spark, tmp_path / "direct", want)

    # directWrite=false, or a writer option (Spark's to apply): Spark writes every batch.
    spark.conf.set("spark.stretch.delta.directWrite", "false")
    try:
        q = _start(agg(), tmp_path / "spark")
    finally:
        spark.conf.unset("spark.stretch.delta.directWrite")
    assert "direct_writes" not in q.metrics()
    _equal(spark, tmp_path / "spark", want)
    # Spark's output jobs (the engine's rows read on its host, then the Delta write) shuffle
    # nothing either.
    plans = q.metrics()["plans"]
    assert any("BatchScan stretch" in p for p in plans), plans
    assert not any("Exchange" in p for p in plans), plans
    q = _start(agg(), tmp_path / "options", mergeSchema="true")
    assert "direct_writes" not in q.metrics()
    assert {w for _, _, w in _txns(tmp_path / "options")} == {"spark"}
    _equal(spark, tmp_path / "options", want)


@pytest.mark.slow  # (three queries, about 90 s: the default run stays under 20 minutes)
def test_a_table_spark_writes_exists_when_no_window_closed(spark, tweets, tmp_path):
    """Native Spark's Delta sink commits its first batch even when no window closes, so the
    table exists, empty, with the query's columns: so does the table Spark writes for the
    engine (directWrite=false, or a writer option), not only the one the engine makes."""
    def agg():
        return source(spark, tweets).stretchAggregate(keys="words", window="1 day")

    want = run_native(spark, agg(), tmp_path / "native")
    assert want.count() == 0
    spark.conf.set("spark.stretch.delta.directWrite", "false")
    try:
        q = _start(agg(), tmp_path / "spark")
    finally:
        spark.conf.unset("spark.stretch.delta.directWrite")
    q2 = _start(agg(), tmp_path / "options", mergeSchema="true")
    for out, query in ((tmp_path / "spark", q), (tmp_path / "options", q2)):
        assert "direct_writes" not in query.metrics()
        got = spark.read.format("delta").load(str(out))
        assert got.count() == 0
        assert [(f.name, f.dataType) for f in got.schema] == \
            [(f.name, f.dataType) for f in want.schema]
        assert {w for _, _, w in _txns(out)} <= {"spark"}


def _creator(path: Path) -> str:
    first = (path / "_delta_log" / f"{0:020d}.json").read_text()
    return "spark" if "Apache-Spark" in first else "engine"


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_sink_table_made_by_the_engine_is_the_table_spark_makes(spark, tweets, tmp_path):
    def agg():
        return source(spark, tweets).stretchAggregate(keys="words", window="60 seconds")

    _start(agg(), tmp_path / "engine")
    empty = spark.createDataFrame(spark.sparkContext.emptyRDD(), agg().schema)
    empty.write.format("delta").save(str(tmp_path / "spark"))
    assert (_creator(tmp_path / "engine"), _creator(tmp_path / "spark")) == ("engine", "spark")

    def table(path):
        from delta.tables import DeltaTable as SparkDeltaTable
        d = SparkDeltaTable.forPath(spark, str(path)).detail().first()
        return (d.minReaderVersion, d.minWriterVersion, d.partitionColumns, d.properties,
                spark.read.format("delta").load(str(path)).schema)

    assert table(tmp_path / "engine") == table(tmp_path / "spark")

    # Session defaults for new tables are Spark's to apply: then Spark makes it.
    key = "spark.databricks.delta.properties.defaults.appendOnly"
    spark.conf.set(key, "true")
    try:
        _start(agg(), tmp_path / "defaults")
    finally:
        spark.conf.unset(key)
    assert _creator(tmp_path / "defaults") == "spark"
    assert table(tmp_path / "defaults")[3] == {"delta.appendOnly": "true"}

    # Names Delta takes only with column mapping ('max(len)'): Spark makes it, or says why not.
    with pytest.raises(Exception, match="Invalid column names: max\\(len\\)"):
        _start(source(spark, tweets).stretchAggregate(keys="words", window="60 seconds",
                                                      agg="max(len)"), tmp_path / "odd")


def test_bad_direct_write_setting_is_named(spark, tweets, tmp_path):
    spark.conf.set("spark.stretch.delta.directWrite", "sometimes")
    try:
        with pytest.raises(ValueError, match="spark.stretch.delta.directWrite='sometimes'"):
            source(spark, tweets).stretchAggregate(keys="words", window="60 seconds") \
                .writeStream.format("delta").option("checkpointLocation", str(tmp_path / "c")) \
                .start(str(tmp_path / "o"))
    finally:
        spark.conf.unset("spark.stretch.delta.directWrite")
