"""pyspark's own tests of ``applyInPandasWithState``, run natively and through the drop-in.

Ported from ``python/pyspark/sql/tests/pandas/test_pandas_grouped_map_with_state.py`` (Spark
4.x): each case's function, input, sink and expectation as pyspark has them, run once with
``applyInPandasWithState`` and once with ``stretchApplyInPandasWithState`` (the same arguments),
the original assertions holding on both.

- ``test_apply_in_pandas_with_state_basic`` and its variants (``_no_state``,
  ``_no_state_no_data``, ``_more_data``, ``_fewer_data``, ``_with_null``): a text source, the
  function's rows checked in ``foreachBatch`` (``check_results``), the query's name and
  ``isActive``, ``processAllAvailable`` and no exception. The check also counts its calls here,
  so that a query that ran no batch cannot pass.
- ``test_apply_in_pandas_with_state_python_worker_random_failure``: the function calls
  ``sys.exit(1)`` with probability 1/30; a json file sink in append mode; the query is
  restarted from its checkpoint whenever it failed, until the sink's ``max(count)`` per value is
  the count of the whole input. ``sys.exit`` inside the function is the function's failure on
  both sides (pyspark's worker reports the ``SystemExit`` as the task's Python exception; the
  drop-in's instance as the batch's), so both restart the query (a local master runs a task
  once); an instance *process* that dies is the other case, which the drop-in retries alone
  (``tests/api/test_grouped.py``). Slow: a few query restarts on each side.

Not ported: the test class's ``spark.sql.shuffle.partitions=5`` (the drop-in has no shuffle,
native's result does not depend on it) and its ``for q in spark.streams.active: q.stop()``
(one query at a time here).
"""

from __future__ import annotations

import random
import sys
import time

import pandas as pd
import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import Row
from pyspark.sql.streaming.state import GroupState, GroupStateTimeout
from pyspark.sql.types import LongType, StringType, StructField, StructType

# Shipped by value: Python workers and stretch instances cannot import this test module.
from pyspark import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SIDES = ("applyInPandasWithState", "stretchApplyInPandasWithState")


def basic(key, pdf_iter, state):
    assert isinstance(state, GroupState)
    total_len = 0
    for pdf in pdf_iter:
        total_len += len(pdf)
    state.update((total_len,))
    assert state.get[0] == 1
    yield pd.DataFrame({"key": [key[0]], "countAsString": [str(total_len)]})


def basic_no_state(key, pdf_iter, state):
    assert isinstance(state, GroupState)
    # 2 data rows
    yield pd.DataFrame({"key": [key[0], "foo"], "countAsString": ["100", "222"]})


def basic_no_state_no_data(key, pdf_iter, state):
    assert isinstance(state, GroupState)
    yield pd.DataFrame({"key": [], "countAsString": []})


def basic_more_data(key, pdf_iter, state):
    # Test data rows returned are more or fewer than state.
    state.update((1,))
    assert isinstance(state, GroupState)
    # 3 rows
    yield pd.DataFrame(
        {"key": [key[0], "foo", key[0] + "_2"], "countAsString": ["1", "666", "2"]})


def basic_fewer_data(key, pdf_iter, state):
    state.update((1,))
    assert isinstance(state, GroupState)
    yield pd.DataFrame({"key": [], "countAsString": []})


def basic_with_null(key, pdf_iter, state):
    assert isinstance(state, GroupState)
    total_len = 0
    for pdf in pdf_iter:
        total_len += len(pdf)
    state.update((total_len,))
    assert state.get[0] == 1
    yield pd.DataFrame({"key": [None], "countAsString": [str(total_len)]})


BASIC = {
    "basic": (basic, {Row(key="hello", countAsString="1"), Row(key="this", countAsString="1")}),
    "basic_no_state": (basic_no_state, {Row(key="hello", countAsString="100"),
                                        Row(key="this", countAsString="100"),
                                        Row(key="foo", countAsString="222")}),
    "basic_no_state_no_data": (basic_no_state_no_data, set()),
    "basic_more_data": (basic_more_data, {Row(key="hello", countAsString="1"),
                                          Row(key="foo", countAsString="666"),
                                          Row(key="hello_2", countAsString="2"),
                                          Row(key="this", countAsString="1"),
                                          Row(key="this_2", countAsString="2")}),
    "basic_fewer_data": (basic_fewer_data, set()),
    "basic_with_null": (basic_with_null, {Row(key=None, countAsString="1")}),
}


def _slow(name):
    return pytest.param(name, marks=pytest.mark.soak)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("case", ["basic", _slow("basic_more_data"), _slow("basic_with_null"),
                                  _slow("basic_no_state"), _slow("basic_no_state_no_data"),
                                  _slow("basic_fewer_data")])
def test_apply_in_pandas_with_state_basic(spark, tmp_path, case, side):
    func, expected = BASIC[case]
    input_path = tmp_path / "input"
    input_path.mkdir()
    with open(input_path / "text-test.txt", "w") as fw:
        fw.write("hello\n")
        fw.write("this\n")

    df = spark.readStream.format("text").load(str(input_path))
    assert df.isStreaming

    output_type = StructType(
        [StructField("key", StringType()), StructField("countAsString", StringType())])
    state_type = StructType([StructField("c", LongType())])
    checked = []

    def check_results(batch_df, _):
        checked.append(True)
        assert set(batch_df.sort("key").collect()) == expected

    q = (getattr(df.groupBy(df["value"]), side)(
            func, output_type, state_type, "Update", GroupStateTimeout.NoTimeout)
         .writeStream.queryName("this_query")
         .foreachBatch(check_results)
         .outputMode("update")
         .option("checkpointLocation", str(tmp_path / "ckpt"))
         .start())
    try:
        assert q.name == "this_query"
        assert q.isActive
        q.processAllAvailable()
        assert q.exception() is None
        assert checked
    finally:
        q.stop()


def random_failure(key, pdf_iter, state):
    assert isinstance(state, GroupState)

    # user function call will happen at most 26 times
    # should be huge enough to not trigger kill in every batches
    # but should be also reasonable to trigger kill multiple times across batches
    if random.randrange(30) == 1:
        sys.exit(1)

    count = state.getOption
    if count is None:
        count = 0
    else:
        count = count[0]

    for pdf in pdf_iter:
        count += len(pdf)

    state.update((count,))
    yield pd.DataFrame({"value": [key[0]], "count": [count]})


@pytest.mark.soak  # a few query restarts on each side (make test-soak)
@pytest.mark.parametrize("side", SIDES)
def test_apply_in_pandas_with_state_python_worker_random_failure(spark, tmp_path, side):
    input_path, output_path = tmp_path / "input", tmp_path / "output"
    checkpoint_loc = tmp_path / "ckpt"
    input_path.mkdir()
    data_range = "abcdefghijklmnopqrstuvwxyz"
    for i in range(5):
        picked_data = [data_range[random.randrange(0, len(data_range) - 1)] for x in range(100)]
        with open(input_path / f"part-{i}.txt", "w") as fw:
            for data in picked_data:
                fw.write(data + "\n")

    def run_query():
        df = spark.readStream.format("text").option("maxFilesPerTrigger", "1") \
            .load(str(input_path))
        assert df.isStreaming
        output_type = StructType(
            [StructField("value", StringType()), StructField("count", LongType())])
        state_type = StructType([StructField("cnt", LongType())])
        return (getattr(df.groupBy(df["value"]), side)(
                    random_failure, output_type, state_type, "Append",
                    GroupStateTimeout.NoTimeout)
                .writeStream.queryName("this_query")
                .format("json")
                .outputMode("append")
                .option("path", str(output_path))
                .option("checkpointLocation", str(checkpoint_loc))
                .start())

    expected = (spark.read.format("text").load(str(input_path)).groupBy("value").count()
                .sort("value").collect())
    q = run_query()
    assert q.name == "this_query"
    assert q.isActive
    restarts = 0
    deadline = time.time() + 300
    try:
        while True:  # pyspark's eventually(assert_test, timeout=120), with more time here
            assert time.time() < deadline, f"not done after {restarts} restarts"
            if not q.isActive:
                # rerunning query as the query may have been killed by killed python worker
                with pytest.raises(StreamingQueryException, match="SystemExit"):
                    q.awaitTermination()
                restarts += 1
                q = run_query()
                assert q.name == "this_query"
                assert q.isActive
            status = q.status
            if not status["isDataAvailable"] and not status["isTriggerActive"]:
                result = (spark.read.schema("value string, count int").format("json")
                          .load(str(output_path)).groupBy("value").max("count")
                          .selectExpr("value", "`max(count)` AS count").sort("value").collect())
                if result == expected:
                    break
            time.sleep(0.5)
    finally:
        q.stop()
