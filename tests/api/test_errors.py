"""Bad stretchAggregate calls fail before the query starts, naming the column or argument."""

from __future__ import annotations

import pytest
from pyspark.sql import functions as F

import spark_stretch

SCHEMA = "ts TIMESTAMP, words ARRAY<STRING>, user STRING, n BIGINT, x DOUBLE, s STRING, d DATE, nested ARRAY<ARRAY<STRING>>"


@pytest.fixture
def stream(spark, tmp_path):
    (tmp_path / "in").mkdir()
    return spark.readStream.schema(SCHEMA).parquet(str(tmp_path / "in"))


@pytest.fixture
def wm(stream):
    return stream.withWatermark("ts", "10 seconds")


def test_no_watermark(stream):
    with pytest.raises(ValueError, match=r"needs an event-time watermark: call df.withWatermark"):
        stream.stretchAggregate(keys="user", window="1 minute")


def test_not_streaming(spark):
    with pytest.raises(ValueError, match="needs a streaming DataFrame"):
        spark.range(3).stretchAggregate(keys="id", window="1 minute")


@pytest.mark.parametrize("keys,needle", [
    ("nope", "keys column 'nope' is not in the input"),
    ("x", "keys column 'x' has type double; stretchAggregate needs a string or integer key column"),
    ("d", "keys column 'd' has type date"),
    ("nested", "keys column 'nested' has type array<array<string>>"),
    (spark_stretch.pairs("user"), "keys column 'user' has type string; pairs\\(\\) needs an array"),
])
def test_wrong_key_column(wm, keys, needle):
    with pytest.raises(ValueError, match=needle):
        wm.stretchAggregate(keys=keys, window="1 minute")


def test_key_expression_must_be_a_column(wm):
    with pytest.raises(ValueError, match="keys must be a column reference"):
        wm.stretchAggregate(keys=F.upper("user"), window="1 minute")


@pytest.mark.parametrize("agg,err,needle", [
    ("median(x)", ValueError, "unknown aggregation 'median\\(x\\)' in agg"),
    ("sum", ValueError, "agg 'sum': sum needs a column"),
    ("sum(s)", ValueError, "agg column 's' has type string; sum needs a numeric"),
    ("max(zz)", ValueError, "agg column 'zz' is not in the input"),
    (42, TypeError, "agg must be 'count'"),
])
def test_bad_agg(wm, agg, err, needle):
    with pytest.raises(err, match=needle):
        wm.stretchAggregate(keys="user", window="1 minute", agg=agg)


@pytest.mark.parametrize("window,needle", [
    (None, "window is required"),
    ("soon", "window 'soon' is not an interval"),
    ("1 month", "must not use months"),
    (("1 minute", "2 minutes"), "window slide 2 minutes is longer than its size 1 minute"),
])
def test_bad_window(wm, window, needle):
    with pytest.raises(ValueError, match=needle):
        wm.stretchAggregate(keys="user", window=window)


def test_bad_parallelism(wm):
    with pytest.raises(ValueError, match="parallelism=3 > max_parallelism=2"):
        wm.stretchAggregate(keys="user", window="1 minute", parallelism=3, max_parallelism=2)
    with pytest.raises(ValueError, match="parallelism must be a positive int, got 0"):
        wm.stretchAggregate(keys="user", window="1 minute", parallelism=0)


def test_unsupported_output_mode_and_sink(wm):
    agg = wm.stretchAggregate(keys="user", window="1 minute")
    with pytest.raises(ValueError, match="outputMode 'complete' is not supported"):
        agg.writeStream.outputMode("complete")
    with pytest.raises(ValueError, match="format 'kafka' is not supported"):
        agg.writeStream.format("kafka").start("/tmp/x")


def test_output_schema_names_like_spark(wm):
    agg = wm.stretchAggregate(keys="user", window="1 minute", agg=["count", "sum(n)", "mean(x)", "max(x)"])
    assert agg.schema.names == ["window", "key", "count", "sum(n)", "avg(x)", "max(x)"]
    native = agg.native()
    assert native.schema.names == agg.schema.names
    assert [f.dataType for f in native.schema.fields][2:] == [f.dataType for f in agg.schema.fields][2:]


def test_grouped_drop_in_checks_arguments_like_native(wm):
    # groupBy(...).stretchApplyInPandasWithState is the applyInPandasWithState drop-in
    # (tests/api/test_grouped.py): its arguments are checked by the native operator itself,
    # under either of its names (stretchAggregate is its alias).
    g = wm.groupBy("user").stretchApplyInPandasWithState(lambda k, it, s: it, "user string",
                                                         "n long", "Update", "NoTimeout")
    assert g.schema.simpleString() == "struct<user:string>"
    with pytest.raises(AssertionError):
        wm.groupBy("user").stretchAggregate(lambda k, it, s: it, "user string", "n long", "Update",
                                            "SometimesTimeout")
