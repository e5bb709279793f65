"""pyspark's own tests of ``transformWithStateInPandas``, run natively and through ``stretch(df)``.

Ported from ``python/pyspark/sql/tests/pandas/streaming/test_pandas_transform_with_state.py``
(Spark 4.x) with its processors from ``helper/helper_pandas_transform_with_state.py``: each
case's processor, input files, query and ``check_results`` as pyspark has them, run once as the
user wrote it (native Spark, RocksDB state as Spark requires) and once through
``spark_stretch.stretch(df)`` over the same DataFrame, the original assertions holding on both,
and the batch ids and row counts of every micro-batch equal to native's.

pyspark runs each test with ``transformWithStateInPandas`` and with the row-based
``transformWithState``; here ``_basic`` and ``_event_time`` run both ways, the others in pandas.
Ported so far: ``test_transform_with_state_basic``, ``_query_restarts``, ``_proc_timer``,
``_event_time``, ``_with_wmark_and_non_event_time``, ``_non_contiguous_grouping_cols``,
``_chaining_ops`` (``eventTimeColumnName``, a streaming aggregation after it), ``_init_state``
(``initialState``), ``_init_state_with_timers``, ``_non_contiguous_grouping_cols_with_init_state``,
``test_schema_evolution_scenarios`` (a value state's schema evolving over five restarts),
``test_schema_evolution_fails``, ``test_not_nullable_fails`` (Spark's errors, asserted on both
sides),
``_in_pandas_composite_type`` (arrays, maps and structs in value, list and map state).
Input files are ordered by their modification times set
directly, where pyspark sleeps 2 s between them. ``_proc_timer`` runs without no-data
batches (see there), as does ``_with_wmark_and_non_event_time`` in processing time.
"""

from __future__ import annotations

import os
import sys
import unittest
from typing import Iterator, NamedTuple

import pandas as pd
import pytest
from pyspark.errors import PySparkRuntimeError
from pyspark.sql import Row
from pyspark.sql.functions import col, from_unixtime, split
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle
from pyspark.sql.types import (ArrayType, BooleanType, FloatType, IntegerType, LongType,
                               MapType, StringType, StructField, StructType, TimestampType)

import spark_stretch
from spark_stretch.api.frame import StretchFrame

# Shipped by value: Python workers and stretch instances cannot import this test module.
from pyspark import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SIDES = ("native", "stretch")
ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"


# -- pyspark's processors (helper_pandas_transform_with_state.py) ----------------------------
class PandasSimpleStatefulProcessor(StatefulProcessor, unittest.TestCase):
    dict = {0: {"0": 1, "1": 2}, 1: {"0": 4, "1": 3}}
    batch_id = 0

    def init(self, handle: StatefulProcessorHandle) -> None:
        # Test both string type and struct type schemas
        self.num_violations_state = handle.getValueState("numViolations", "value int")
        state_schema = StructType([StructField("value", IntegerType(), True)])
        self.temp_state = handle.getValueState("tempState", state_schema)
        handle.deleteIfExists("tempState")

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        with self.assertRaisesRegex(PySparkRuntimeError, "Error checking value state exists"):
            self.temp_state.exists()
        new_violations = 0
        count = 0
        key_str = key[0]
        exists = self.num_violations_state.exists()
        if exists:
            existing_violations_row = self.num_violations_state.get()
            existing_violations = existing_violations_row[0]
            assert existing_violations == self.dict[0][key_str]
            self.batch_id = 1
        else:
            existing_violations = 0
        for pdf in rows:
            pdf_count = pdf.count()
            count += pdf_count.get("temperature")
            violations_pdf = pdf.loc[pdf["temperature"] > 100]
            new_violations += violations_pdf.count().get("temperature")
        updated_violations = new_violations + existing_violations
        assert updated_violations == self.dict[self.batch_id][key_str]
        self.num_violations_state.update((updated_violations,))
        yield pd.DataFrame({"id": key, "countAsString": str(count)})

    def close(self) -> None:
        pass


class RowSimpleStatefulProcessor(StatefulProcessor, unittest.TestCase):
    dict = {0: {"0": 1, "1": 2}, 1: {"0": 4, "1": 3}}
    batch_id = 0

    def init(self, handle: StatefulProcessorHandle) -> None:
        # Test both string type and struct type schemas
        self.num_violations_state = handle.getValueState("numViolations", "value int")
        state_schema = StructType([StructField("value", IntegerType(), True)])
        self.temp_state = handle.getValueState("tempState", state_schema)
        handle.deleteIfExists("tempState")

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        with self.assertRaisesRegex(PySparkRuntimeError, "Error checking value state exists"):
            self.temp_state.exists()
        new_violations = 0
        count = 0
        key_str = key[0]
        exists = self.num_violations_state.exists()
        if exists:
            existing_violations_row = self.num_violations_state.get()
            existing_violations = existing_violations_row[0]
            assert existing_violations == self.dict[0][key_str]
            self.batch_id = 1
        else:
            existing_violations = 0
        for row in rows:
            # temperature should be non-NA to be counted
            temperature = row.temperature
            if temperature is not None:
                count += 1
                if temperature > 100:
                    new_violations += 1
        updated_violations = new_violations + existing_violations
        assert updated_violations == self.dict[self.batch_id][key_str]
        self.num_violations_state.update((updated_violations,))
        yield Row(id=key[0], countAsString=str(count))

    def close(self) -> None:
        pass


class RowEventTimeStatefulProcessor(StatefulProcessor):
    def init(self, handle: StatefulProcessorHandle) -> None:
        state_schema = StructType([StructField("value", StringType(), True)])
        self.handle = handle
        self.max_state = handle.getValueState("max_state", state_schema)

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator[Row]:
        self.max_state.clear()
        self.handle.deleteTimer(expiredTimerInfo.getExpiryTimeInMs())
        str_key = f"{str(key[0])}-expired"
        yield Row(id=str_key, timestamp=str(expiredTimerInfo.getExpiryTimeInMs()))

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        timestamp_list = []
        for row in rows:
            # timestamp is microsecond, restore to second
            timestamp_list.append(int(row.eventTime.timestamp()))

        if self.max_state.exists():
            cur_max = int(self.max_state.get()[0])
        else:
            cur_max = 0
        max_event_time = str(max(cur_max, max(timestamp_list)))

        self.max_state.update((max_event_time,))
        self.handle.registerTimer(timerValues.getCurrentWatermarkInMs())

        yield Row(id=key[0], timestamp=max_event_time)

    def close(self) -> None:
        pass


class PandasProcTimeStatefulProcessor(StatefulProcessor):
    def init(self, handle: StatefulProcessorHandle) -> None:
        state_schema = StructType([StructField("value", StringType(), True)])
        self.handle = handle
        self.count_state = handle.getValueState("count_state", state_schema)

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator[pd.DataFrame]:
        # reset count state each time the timer is expired
        timer_list_1 = [e for e in self.handle.listTimers()]
        timer_list_2 = []
        idx = 0
        for e in self.handle.listTimers():
            timer_list_2.append(e)
            # check multiple iterator on the same grouping key works
            assert timer_list_2[idx] == timer_list_1[idx]
            idx += 1

        if len(timer_list_1) > 0:
            assert len(timer_list_1) == 2
        self.count_state.clear()
        self.handle.deleteTimer(expiredTimerInfo.getExpiryTimeInMs())
        yield pd.DataFrame(
            {
                "id": key,
                "countAsString": str("-1"),
                "timeValues": str(expiredTimerInfo.getExpiryTimeInMs()),
            }
        )

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        if not self.count_state.exists():
            count = 0
        else:
            count = int(self.count_state.get()[0])

        if key == ("0",):
            self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs() + 1)

        rows_count = 0
        for pdf in rows:
            pdf_count = len(pdf)
            rows_count += pdf_count

        count = count + rows_count

        self.count_state.update((str(count),))
        timestamp = str(timerValues.getCurrentProcessingTimeInMs())

        yield pd.DataFrame({"id": key, "countAsString": str(count), "timeValues": timestamp})

    def close(self) -> None:
        pass


class PandasEventTimeStatefulProcessor(StatefulProcessor):
    def init(self, handle: StatefulProcessorHandle) -> None:
        state_schema = StructType([StructField("value", StringType(), True)])
        self.handle = handle
        self.max_state = handle.getValueState("max_state", state_schema)

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator[pd.DataFrame]:
        self.max_state.clear()
        self.handle.deleteTimer(expiredTimerInfo.getExpiryTimeInMs())
        str_key = f"{str(key[0])}-expired"
        yield pd.DataFrame(
            {"id": (str_key,), "timestamp": str(expiredTimerInfo.getExpiryTimeInMs())}
        )

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        timestamp_list = []
        for pdf in rows:
            # int64 will represent timestamp in nanosecond, restore to second
            timestamp_list.extend((pdf["eventTime"].astype("int64") // 10**9).tolist())

        if self.max_state.exists():
            cur_max = int(self.max_state.get()[0])
        else:
            cur_max = 0
        max_event_time = str(max(cur_max, max(timestamp_list)))

        self.max_state.update((max_event_time,))
        self.handle.registerTimer(timerValues.getCurrentWatermarkInMs())

        yield pd.DataFrame({"id": key, "timestamp": max_event_time})

    def close(self) -> None:
        pass


class PandasMinEventTimeStatefulProcessor(StatefulProcessor):
    def init(self, handle: StatefulProcessorHandle) -> None:
        state_schema = StructType([StructField("value", StringType(), True)])
        self.handle = handle
        self.min_state = handle.getValueState("min_state", state_schema)

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        timestamp_list = []
        for pdf in rows:
            # int64 will represent timestamp in nanosecond, restore to second
            timestamp_list.extend((pdf["eventTime"].astype("int64") // 10**9).tolist())

        if self.min_state.exists():
            cur_min = int(self.min_state.get()[0])
        else:
            cur_min = sys.maxsize
        min_event_time = str(min(cur_min, min(timestamp_list)))

        self.min_state.update((min_event_time,))

        yield pd.DataFrame({"id": key, "timestamp": min_event_time})

    def close(self) -> None:
        pass


class PandasSimpleStatefulProcessorWithInitialState(StatefulProcessor):
    # this dict is the same as input initial state dataframe
    dict = {("0",): 789, ("3",): 987}

    def init(self, handle: StatefulProcessorHandle) -> None:
        state_schema = StructType([StructField("value", IntegerType(), True)])
        self.value_state = handle.getValueState("value_state", state_schema)
        self.handle = handle

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        exists = self.value_state.exists()
        if exists:
            value_row = self.value_state.get()
            existing_value = value_row[0]
        else:
            existing_value = 0

        accumulated_value = existing_value

        for pdf in rows:
            value = pdf["temperature"].astype(int).sum()
            accumulated_value += value

        self.value_state.update((accumulated_value,))

        if len(key) > 1:
            yield pd.DataFrame(
                {"id1": (key[0],), "id2": (key[1],), "value": str(accumulated_value)}
            )
        else:
            yield pd.DataFrame({"id": key, "value": str(accumulated_value)})

    def handleInitialState(self, key, initialState, timerValues) -> None:
        init_val = initialState.at[0, "initVal"]
        self.value_state.update((init_val,))
        if len(key) == 1:
            assert self.dict[key] == init_val

    def close(self) -> None:
        pass


# -- the test class's input (TransformWithStateTestsMixin) -------------------------------------
def _write(path, name, col1, col2, mtime, col3=None):
    """One input file, its modification time ``mtime`` (files are read in that order)."""
    os.makedirs(path, exist_ok=True)
    with open(f"{path}/{name}", "w") as fw:
        for i, (e1, e2) in enumerate(zip(col1, col2)):
            fw.write(f"{e1}, {e2}\n" if col3 is None else f"{e1},{e2},{col3[i]}\n")
    os.utime(f"{path}/{name}", (mtime, mtime))


def resource1(path, t=1e9):
    _write(path, "text-test1.txt", [0, 0, 1, 1], [123, 46, 146, 346], t)


def resource2(path, t=1e9 + 10):
    _write(path, "text-test2.txt", [0, 0, 0, 1, 1], [123, 223, 323, 246, 6], t)


def resource3(path, t=1e9 - 10):
    _write(path, "text-test3.txt", [0, 1], [123, 6], t)


def build_test_df(spark, input_path):
    df = spark.readStream.format("text").option("maxFilesPerTrigger", 1).load(str(input_path))
    df_split = df.withColumn("split_values", split(df["value"], ","))
    return df_split.select(
        df_split.split_values.getItem(0).alias("id").cast("string"),
        df_split.split_values.getItem(1).alias("temperature").cast("int"),
    )


BASIC_OUT = StructType([StructField("id", StringType(), True),
                        StructField("countAsString", StringType(), True)])


@pytest.fixture
def rocksdb(spark):
    """Native transformWithState needs Spark's RocksDB state store."""
    key = "spark.sql.streaming.stateStore.providerClass"
    old = spark.conf.get(key, None)
    spark.conf.set(key, ROCKSDB)
    yield spark
    if old is None:
        spark.conf.unset(key)
    else:
        spark.conf.set(key, old)


def run(spark, tws_df, side, check_results, checkpoint=None, query_name="this_query",
        queries=None):
    """The query over ``tws_df`` (natively, or through ``stretch``) into ``foreachBatch``:
    ``check_results`` on every batch; returns ``[(batch_id, rows)]`` (the query appended to
    ``queries``, if given)."""
    if side == "stretch":
        tws_df = spark_stretch.stretch(tws_df, parallelism=2, max_parallelism=2, buckets=16)
        assert isinstance(tws_df, StretchFrame), "fell back to native Spark"
    seen = []

    def check(batch_df, batch_id):
        rows = batch_df.collect()
        seen.append((batch_id, len(rows)))
        check_results(batch_df, batch_id)

    w = tws_df.writeStream.queryName(query_name).foreachBatch(check).outputMode("update")
    if checkpoint is not None:
        w = w.option("checkpointLocation", str(checkpoint))
    q = w.start()
    if queries is not None:
        queries.append(q)
    assert q.name == query_name
    assert q.isActive
    q.processAllAvailable()
    q.stop()
    q.awaitTermination(10)
    assert q.exception() is None
    return seen


def both(spark, make, check_results, checkpoint=None, **kw):
    """Run natively and through ``stretch``: the checks hold on both, the same batches.
    ``check_results`` may be a dict of one per side; ``checkpoint``, a folder for both."""
    got = {side: run(spark, make(), side,
                     check_results[side] if isinstance(check_results, dict) else check_results,
                     checkpoint=None if checkpoint is None else checkpoint / side, **kw)
           for side in SIDES}
    assert got["native"], "native ran no batch"
    assert got["stretch"] == got["native"]
    return got


# -- the tests --------------------------------------------------------------------------------
def tws_of(grouped, use_pandas: bool, processor, **kw):
    """``transformWithStateInPandas`` or the row-based ``transformWithState`` (pyspark runs
    each test both ways)."""
    if use_pandas:
        return grouped.transformWithStateInPandas(statefulProcessor=processor, **kw)
    return grouped.transformWithState(statefulProcessor=processor, **kw)


def check_basic_results(batch_df, batch_id):
    """pyspark's ``check_results`` of its basic tests (value state, resources 1 then 2)."""
    batch_df.collect()
    if batch_id == 0:
        assert set(batch_df.sort("id").collect()) == {
            Row(id="0", countAsString="2"),
            Row(id="1", countAsString="2"),
        }
    else:
        assert set(batch_df.sort("id").collect()) == {
            Row(id="0", countAsString="3"),
            Row(id="1", countAsString="2"),
        }


@pytest.mark.parametrize("use_pandas", [True, pytest.param(False, marks=pytest.mark.soak)],
                         ids=["pandas", "row"])
def test_transform_with_state_basic(rocksdb, tmp_path, use_pandas):
    spark = rocksdb
    resource1(tmp_path)
    resource2(tmp_path)
    check_results = check_basic_results

    def make():
        proc = PandasSimpleStatefulProcessor() if use_pandas else RowSimpleStatefulProcessor()
        return tws_of(build_test_df(spark, tmp_path).groupBy("id"), use_pandas, proc,
                      outputStructType=BASIC_OUT, outputMode="Update", timeMode="None")

    got = both(spark, make, check_results)
    assert [b for b, _ in got["stretch"]] == [0, 1]


@pytest.mark.soak
def test_transform_with_state_query_restarts(rocksdb, tmp_path):
    spark = rocksdb
    for side in SIDES:
        root = tmp_path / side
        input_path, checkpoint_path, output_path = root / "input", root / "ckpt", root / "out"
        input_path.mkdir(parents=True)
        resource1(input_path)

        df = build_test_df(spark, input_path)
        tws_df = df.groupBy("id").transformWithStateInPandas(
            statefulProcessor=PandasSimpleStatefulProcessor(), outputStructType=BASIC_OUT,
            outputMode="Update", timeMode="None")
        if side == "stretch":
            tws_df = spark_stretch.stretch(tws_df, parallelism=2, max_parallelism=2,
                                           buckets=16)
            assert isinstance(tws_df, StretchFrame)
        base_query = (tws_df.writeStream.queryName("this_query").format("parquet")
                      .outputMode("append").option("checkpointLocation", str(checkpoint_path))
                      .option("path", str(output_path)))
        q = base_query.start()
        assert q.name == "this_query"
        assert q.isActive
        q.processAllAvailable()
        q.stop()
        q.awaitTermination(10)
        assert q.exception() is None

        # Verify custom metrics.
        assert q.lastProgress.stateOperators[0].customMetrics["numValueStateVars"] > 0, side
        assert q.lastProgress.stateOperators[0].customMetrics["numDeletedStateVars"] > 0, side

        resource2(input_path)
        q = base_query.start()
        q.processAllAvailable()
        q.stop()
        q.awaitTermination(10)
        assert q.exception() is None
        result_df = spark.read.parquet(str(output_path))
        assert set(result_df.sort("id").collect()) == {
            Row(id="0", countAsString="2"),
            Row(id="0", countAsString="3"),
            Row(id="1", countAsString="2"),
            Row(id="1", countAsString="2"),
        }, side


@pytest.mark.soak
def test_transform_with_state_proc_timer(rocksdb, tmp_path):
    spark = rocksdb
    resource3(tmp_path)
    resource1(tmp_path)
    resource2(tmp_path)
    out = StructType([StructField("id", StringType(), True),
                      StructField("countAsString", StringType(), True),
                      StructField("timeValues", StringType(), True)])

    def check_results(batch_df, batch_id):
        batch_df.collect()

        # helper function to check expired timestamp is smaller than current processing time
        def check_timestamp(batch_df):
            expired_df = (
                batch_df.filter(batch_df["countAsString"] == "-1")
                .select("id", "timeValues")
                .withColumnRenamed("timeValues", "expiredTimestamp")
            )
            count_df = (
                batch_df.filter(batch_df["countAsString"] != "-1")
                .select("id", "timeValues")
                .withColumnRenamed("timeValues", "countStateTimestamp")
            )
            joined_df = expired_df.join(count_df, on="id")
            for row in joined_df.collect():
                assert row["expiredTimestamp"] < row["countStateTimestamp"]

        if batch_id == 0:
            assert set(batch_df.sort("id").select("id", "countAsString").collect()) == {
                Row(id="0", countAsString="1"),
                Row(id="1", countAsString="1"),
            }
        elif batch_id == 1:
            # for key 0, the accumulated count is emitted before the count state is cleared
            # during the timer process
            assert set(batch_df.sort("id").select("id", "countAsString").collect()) == {
                Row(id="0", countAsString="3"),
                Row(id="0", countAsString="-1"),
                Row(id="1", countAsString="3"),
            }
            check_timestamp(batch_df)
        else:
            assert set(batch_df.sort("id").select("id", "countAsString").collect()) == {
                Row(id="0", countAsString="3"),
                Row(id="0", countAsString="-1"),
                Row(id="1", countAsString="5"),
            }

    def make():
        return build_test_df(spark, tmp_path).groupBy("id").transformWithStateInPandas(
            statefulProcessor=PandasProcTimeStatefulProcessor(), outputStructType=out,
            outputMode="Update", timeMode="processingtime")

    # (pyspark's run stops the query before Spark's no-data batch after the last file, which
    # processing time runs at once: a race the native side loses here, its processor's own
    # assertion failing on the one timer left; no-data batches off, as the test means)
    spark.conf.set("spark.sql.streaming.noDataMicroBatches.enabled", "false")
    try:
        both(spark, make, check_results, query_name="processing_time_test_query")
    finally:
        spark.conf.unset("spark.sql.streaming.noDataMicroBatches.enabled")


def event_time_df(spark, input_path):
    with open(f"{input_path}/text-test3.txt", "w") as fw:
        fw.write("a, 20\n")
    with open(f"{input_path}/text-test1.txt", "w") as fw:
        fw.write("a, 4\n")
    with open(f"{input_path}/text-test2.txt", "w") as fw:
        fw.write("a, 2\n")
        fw.write("a, 11\n")
        fw.write("a, 13\n")
        fw.write("a, 15\n")
    for i, name in enumerate(["text-test3.txt", "text-test1.txt", "text-test2.txt"]):
        os.utime(f"{input_path}/{name}", (1e9 + 10 * i, 1e9 + 10 * i))
    df = build_test_df(spark, input_path)
    return df.select(
        "id", from_unixtime(col("temperature")).alias("eventTime").cast("timestamp")
    ).withWatermark("eventTime", "10 seconds")


EVENT_OUT = StructType([StructField("id", StringType(), True),
                        StructField("timestamp", StringType(), True)])


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
@pytest.mark.parametrize("use_pandas", [True, False], ids=["pandas", "row"])
def test_transform_with_state_event_time(rocksdb, tmp_path, use_pandas):
    spark = rocksdb

    def check_results(batch_df, batch_id):
        batch_df.collect()
        if batch_id == 0:
            # watermark for late event = 0
            # watermark for eviction = 0
            # timer is registered with expiration time = 0, hence expired at the same batch
            assert set(batch_df.sort("id").collect()) == {
                Row(id="a", timestamp="20"),
                Row(id="a-expired", timestamp="0"),
            }
        elif batch_id == 1:
            # watermark for late event = 0
            # watermark for eviction = 10 (20 - 10)
            # timer is registered with expiration time = 10, hence expired at the same batch
            assert set(batch_df.sort("id").collect()) == {
                Row(id="a", timestamp="4"),
                Row(id="a-expired", timestamp="10000"),
            }
        else:
            # watermark for late event = 10
            # watermark for eviction = 10 (unchanged as 4 < 10)
            # timer is registered with expiration time = 10, hence expired at the same batch
            assert set(batch_df.sort("id").collect()) == {
                Row(id="a", timestamp="15"),
                Row(id="a-expired", timestamp="10000"),
            }

    def make():
        proc = PandasEventTimeStatefulProcessor() if use_pandas \
            else RowEventTimeStatefulProcessor()
        return tws_of(event_time_df(spark, tmp_path).groupBy("id"), use_pandas, proc,
                      outputStructType=EVENT_OUT, outputMode="Update", timeMode="eventtime")

    both(spark, make, check_results, query_name="event_time_test_query")


@pytest.mark.soak
@pytest.mark.parametrize("time_mode", ["None", "ProcessingTime"])
def test_transform_with_state_with_wmark_and_non_event_time(rocksdb, tmp_path, time_mode):
    spark = rocksdb

    def check_results(batch_df, batch_id):
        batch_df.collect()
        if batch_id == 0:
            # watermark for late event = 0 and min event = 20
            assert set(batch_df.sort("id").collect()) == {
                Row(id="a", timestamp="20"),
            }
        elif batch_id == 1:
            # watermark for late event = 0 and min event = 4
            assert set(batch_df.sort("id").collect()) == {
                Row(id="a", timestamp="4"),
            }
        elif batch_id == 2:
            # watermark for late event = 10 and min event = 2 with no filtering
            assert set(batch_df.sort("id").collect()) == {
                Row(id="a", timestamp="2"),
            }
        else:
            for q in batch_df.sparkSession.streams.active:
                q.stop()

    def make():
        return event_time_df(spark, tmp_path).groupBy("id").transformWithStateInPandas(
            statefulProcessor=PandasMinEventTimeStatefulProcessor(),
            outputStructType=EVENT_OUT, outputMode="Update", timeMode=time_mode)

    if time_mode == "ProcessingTime":
        # (processing time runs a no-data batch after every batch, so native Spark's
        # processAllAvailable never returns here: the check's stop of "every active query"
        # from foreachBatch sees none in the batch's session; no-data batches off)
        spark.conf.set("spark.sql.streaming.noDataMicroBatches.enabled", "false")
    try:
        both(spark, make, check_results, query_name="event_time_test_query")
    finally:
        spark.conf.unset("spark.sql.streaming.noDataMicroBatches.enabled")


@pytest.mark.soak
def test_transform_with_state_non_contiguous_grouping_cols(rocksdb, tmp_path):
    spark = rocksdb
    _write(tmp_path, "text-test1.txt", [0, 0, 1, 1], [123, 46, 146, 346], 1e9, [1, 1, 2, 2])
    out = StructType([StructField("id1", StringType(), True),
                      StructField("id2", StringType(), True),
                      StructField("value", StringType(), True)])

    def check_results(batch_df, batch_id):
        batch_df.collect()
        assert set(batch_df.collect()) == {
            Row(id1="0", id2="1", value=str(123 + 46)),
            Row(id1="1", id2="2", value=str(146 + 346)),
        }

    def make():
        df = spark.readStream.format("text").option("maxFilesPerTrigger", 1).load(str(tmp_path))
        df_split = df.withColumn("split_values", split(df["value"], ","))
        df = df_split.select(
            df_split.split_values.getItem(0).alias("id1").cast("string"),
            df_split.split_values.getItem(1).alias("temperature").cast("int"),
            df_split.split_values.getItem(2).alias("id2").cast("string"),
        )
        return df.groupBy("id1", "id2").transformWithStateInPandas(
            statefulProcessor=PandasSimpleStatefulProcessorWithInitialState(),
            outputStructType=out, outputMode="Update", timeMode="None")

    both(spark, make, check_results)


class PandasStatefulProcessorChainingOps(StatefulProcessor):
    def init(self, handle: StatefulProcessorHandle) -> None:
        pass

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        for pdf in rows:
            timestamp_list = pdf["eventTime"].tolist()
        yield pd.DataFrame({"id": key, "outputTimestamp": timestamp_list[0]})

    def close(self) -> None:
        pass


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
@pytest.mark.parametrize("grouping_cols", [["outputTimestamp"], ["outputTimestamp", "id"]])
def test_transform_with_state_chaining_ops(rocksdb, tmp_path, grouping_cols):
    import datetime

    spark = rocksdb
    _write(tmp_path, "text-test3.txt", ["a", "b"], [10, 15], 1e9)
    _write(tmp_path, "text-test4.txt", ["a", "c"], [11, 25], 1e9 + 10)
    _write(tmp_path, "text-test1.txt", ["a"], [5], 1e9 + 20)
    out = StructType([StructField("id", StringType(), True),
                      StructField("outputTimestamp", TimestampType(), True)])

    def check_results(batch_df, batch_id):
        batch_df.collect()
        if batch_id == 0:
            assert batch_df.isEmpty()
        elif batch_id == 1:
            # eviction watermark = 15 - 5 = 10 (max event time from batch 0),
            # late event watermark = 0 (eviction event time from batch 0)
            assert set(
                batch_df.sort("outputTimestamp").select("outputTimestamp", "count").collect()
            ) == {
                Row(outputTimestamp=datetime.datetime(1970, 1, 1, 0, 0, 10), count=1),
            }
        elif batch_id == 2:
            # eviction watermark = 25 - 5 = 20, late event watermark = 10;
            # row with watermark=5<10 is dropped so it does not show up in the results;
            # row with eventTime<=20 are finalized and emitted
            assert set(
                batch_df.sort("outputTimestamp").select("outputTimestamp", "count").collect()
            ) == {
                Row(outputTimestamp=datetime.datetime(1970, 1, 1, 0, 0, 11), count=1),
                Row(outputTimestamp=datetime.datetime(1970, 1, 1, 0, 0, 15), count=1),
            }

    got = {}
    for side in SIDES:
        df = build_test_df(spark, tmp_path)
        df = df.select(
            "id", from_unixtime(col("temperature")).alias("eventTime").cast("timestamp")
        ).withWatermark("eventTime", "5 seconds")
        tws_df = df.groupBy("id").transformWithStateInPandas(
            statefulProcessor=PandasStatefulProcessorChainingOps(), outputStructType=out,
            outputMode="Append", timeMode="eventTime", eventTimeColumnName="outputTimestamp")
        if side == "stretch":
            tws_df = spark_stretch.stretch(tws_df, parallelism=2, max_parallelism=2, buckets=16)
            assert isinstance(tws_df, StretchFrame), "fell back to native Spark"
        seen = []

        def check(batch_df, batch_id):
            seen.append((batch_id, batch_df.count()))
            check_results(batch_df, batch_id)

        q = (tws_df.groupBy(grouping_cols).count().writeStream
             .queryName("chaining_ops_query").foreachBatch(check).outputMode("append").start())
        assert q.name == "chaining_ops_query"
        assert q.isActive
        q.processAllAvailable()
        q.stop()
        q.awaitTermination(10)
        assert q.exception() is None
        got[side] = seen
    assert got["native"] and got["stretch"] == got["native"]


class RowSimpleStatefulProcessorWithInitialState(StatefulProcessor):
    # this dict is the same as input initial state dataframe
    dict = {("0",): 789, ("3",): 987}

    def init(self, handle: StatefulProcessorHandle) -> None:
        state_schema = StructType([StructField("value", IntegerType(), True)])
        self.value_state = handle.getValueState("value_state", state_schema)
        self.handle = handle

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        exists = self.value_state.exists()
        if exists:
            value_row = self.value_state.get()
            existing_value = value_row[0]
        else:
            existing_value = 0

        accumulated_value = existing_value

        for row in rows:
            value = row.temperature
            accumulated_value += value

        self.value_state.update((accumulated_value,))

        if len(key) > 1:
            yield Row(id1=key[0], id2=key[1], value=str(accumulated_value))
        else:
            yield Row(id=key[0], value=str(accumulated_value))

    def handleInitialState(self, key, initialState, timerValues) -> None:
        init_val = initialState.initVal
        self.value_state.update((init_val,))
        if len(key) == 1:
            assert self.dict[key] == init_val

    def close(self) -> None:
        pass


class PandasStatefulProcessorWithInitialStateTimers(PandasSimpleStatefulProcessorWithInitialState):
    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator[pd.DataFrame]:
        self.handle.deleteTimer(expiredTimerInfo.getExpiryTimeInMs())
        str_key = f"{str(key[0])}-expired"
        yield pd.DataFrame({"id": (str_key,), "value": str(expiredTimerInfo.getExpiryTimeInMs())})

    def handleInitialState(self, key, initialState, timerValues) -> None:
        super().handleInitialState(key, initialState, timerValues)
        self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs() - 1)


def _init_state_run(spark, tmp_path, processor, check_results, time_mode, use_pandas=True,
                    initial_state=None, then=None, **kw):
    """pyspark's ``_test_transform_with_state_init_state``, both sides: ``initial_state`` (a
    grouped DataFrame) or pyspark's two keys; ``then`` a step after the operator (its
    ``with_extra_transformation``); ``kw`` to ``run``."""
    resource1(tmp_path)
    _write(tmp_path, "text-test2.txt", [0, 3], [67, 12], 1e9 + 10)

    def make():
        init = initial_state if initial_state is not None else spark.createDataFrame(
            [("0", 789), ("3", 987)], "id string, initVal int").groupBy("id")
        tws_df = tws_of(build_test_df(spark, tmp_path).groupBy("id"), use_pandas, processor(),
                        outputStructType="id string, value string", outputMode="Update",
                        timeMode=time_mode, initialState=init)
        return tws_df if then is None else then(tws_df)

    return both(spark, make, check_results, **kw)


@pytest.mark.parametrize("use_pandas", [True, pytest.param(False, marks=pytest.mark.soak)],
                         ids=["pandas", "row"])
def test_transform_with_state_init_state(rocksdb, tmp_path, use_pandas):
    def check_results(batch_df, batch_id):
        if batch_id == 0:
            # for key 0, initial state was processed and it was only processed once;
            # for key 1, it did not appear in the initial state df;
            # for key 3, it did not appear in the first batch of input keys
            # so it won't be emitted
            assert set(batch_df.sort("id").collect()) == {
                Row(id="0", value=str(789 + 123 + 46)),
                Row(id="1", value=str(146 + 346)),
            }
        else:
            # for key 0, verify initial state was only processed once in the first batch;
            # for key 3, verify init state was processed and reflected in the accumulated value
            assert set(batch_df.sort("id").collect()) == {
                Row(id="0", value=str(789 + 123 + 46 + 67)),
                Row(id="3", value=str(987 + 12)),
            }

    processor = PandasSimpleStatefulProcessorWithInitialState if use_pandas \
        else RowSimpleStatefulProcessorWithInitialState
    _init_state_run(rocksdb, tmp_path, processor, check_results, "None", use_pandas)


@pytest.mark.soak
def test_transform_with_state_init_state_with_timers(rocksdb, tmp_path):
    def check_results(batch_df, batch_id):
        if batch_id == 0:
            # timers are registered and handled in the first batch for
            # rows in initial state; For key=0 and key=3 which contains
            # expired timers, both should be handled by handleExpiredTimers
            # regardless of whether key exists in the data rows or not
            expired_df = batch_df.filter(batch_df["id"].contains("expired"))
            data_df = batch_df.filter(~batch_df["id"].contains("expired"))
            assert set(expired_df.sort("id").select("id").collect()) == {
                Row(id="0-expired"),
                Row(id="3-expired"),
            }
            assert set(data_df.sort("id").collect()) == {
                Row(id="0", value=str(789 + 123 + 46)),
                Row(id="1", value=str(146 + 346)),
            }
        else:
            # handleInitialState is only processed in the first batch,
            # no more timer is registered so no more expired timers
            assert set(batch_df.sort("id").collect()) == {
                Row(id="0", value=str(789 + 123 + 46 + 67)),
                Row(id="3", value=str(987 + 12)),
            }

    # (processing time: no-data batches off, as in _proc_timer)
    rocksdb.conf.set("spark.sql.streaming.noDataMicroBatches.enabled", "false")
    try:
        _init_state_run(rocksdb, tmp_path, PandasStatefulProcessorWithInitialStateTimers,
                        check_results, "processingTime")
    finally:
        rocksdb.conf.unset("spark.sql.streaming.noDataMicroBatches.enabled")


@pytest.mark.soak
def test_transform_with_state_non_contiguous_grouping_cols_with_init_state(rocksdb, tmp_path):
    spark = rocksdb
    _write(tmp_path, "text-test1.txt", [0, 0, 1, 1], [123, 46, 146, 346], 1e9, [1, 1, 2, 2])

    def check_results(batch_df, batch_id):
        # initial state for key (0, 1) is processed
        assert set(batch_df.collect()) == {
            Row(id1="0", id2="1", value=str(789 + 123 + 46)),
            Row(id1="1", id2="2", value=str(146 + 346)),
        }

    def make():
        # grouping key of initial state is also not starting from the beginning of attributes
        initial_state = spark.createDataFrame(
            [(789, "0", "1"), (987, "3", "2")], "initVal int, id1 string, id2 string"
        ).groupBy("id1", "id2")
        df = spark.readStream.format("text").option("maxFilesPerTrigger", 1).load(str(tmp_path))
        df_split = df.withColumn("split_values", split(df["value"], ","))
        df = df_split.select(
            df_split.split_values.getItem(0).alias("id1").cast("string"),
            df_split.split_values.getItem(1).alias("temperature").cast("int"),
            df_split.split_values.getItem(2).alias("id2").cast("string"),
        )
        return df.groupBy("id1", "id2").transformWithStateInPandas(
            statefulProcessor=PandasSimpleStatefulProcessorWithInitialState(),
            outputStructType="id1 string, id2 string, value string", outputMode="Update",
            timeMode="None", initialState=initial_state)

    both(spark, make, check_results)


# -- schema evolution (pyspark's test_schema_evolution_scenarios) -----------------------------
class PandasBasicProcessor(StatefulProcessor):
    # Schema definitions
    state_schema = StructType(
        [StructField("id", IntegerType(), True), StructField("name", StringType(), True)]
    )

    def init(self, handle):
        self.state = handle.getValueState("state", self.state_schema)

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        for pdf in rows:
            pass
        id_val = int(key[0])
        name = f"name-{id_val}"
        self.state.update((id_val, name))
        yield pd.DataFrame({"id": [key[0]], "value": [{"id": id_val, "name": name}]})

    def close(self) -> None:
        pass


class PandasAddFieldsProcessor(StatefulProcessor):
    state_schema = StructType(
        [
            StructField("id", IntegerType(), True),
            StructField("name", StringType(), True),
            StructField("count", IntegerType(), True),
            StructField("active", BooleanType(), True),
            StructField("score", FloatType(), True),
        ]
    )

    def init(self, handle):
        self.state = handle.getValueState("state", self.state_schema)

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        for pdf in rows:
            pass
        id_val = int(key[0])
        name = f"name-{id_val}"

        if self.state.exists():
            state_data = self.state.get()
            state_dict = {
                "id": state_data[0],
                "name": state_data[1],
                "count": state_data[2],
                "active": state_data[3],
                "score": state_data[4],
            }
        else:
            state_dict = {
                "id": id_val,
                "name": name,
                "count": 100,
                "active": True,
                "score": 99.9,
            }

        self.state.update(
            (
                state_dict["id"],
                state_dict["name"] + "0",
                state_dict["count"],
                state_dict["active"],
                state_dict["score"],
            )
        )
        yield pd.DataFrame({"id": [key[0]], "value": [state_dict]})

    def close(self) -> None:
        pass


class PandasRemoveFieldsProcessor(StatefulProcessor):
    # Schema definitions
    state_schema = StructType(
        [StructField("id", IntegerType(), True), StructField("name", StringType(), True)]
    )

    def init(self, handle):
        self.state = handle.getValueState("state", self.state_schema)

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        for pdf in rows:
            pass
        id_val = int(key[0])
        name = f"name-{id_val}"
        if self.state.exists():
            name = self.state.get()[1]
        self.state.update((id_val, name))
        yield pd.DataFrame({"id": [key[0]], "value": [{"id": id_val, "name": name}]})

    def close(self) -> None:
        pass


class PandasReorderedFieldsProcessor(StatefulProcessor):
    state_schema = StructType(
        [
            StructField("name", StringType(), True),
            StructField("id", IntegerType(), True),
            StructField("score", FloatType(), True),
            StructField("count", IntegerType(), True),
            StructField("active", BooleanType(), True),
        ]
    )

    def init(self, handle):
        self.state = handle.getValueState("state", self.state_schema)

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        for pdf in rows:
            pass
        id_val = int(key[0])
        name = f"name-{id_val}"

        if self.state.exists():
            state_data = self.state.get()
            state_dict = {
                "name": state_data[0],
                "id": state_data[1],
                "score": state_data[2],
                "count": state_data[3],
                "active": state_data[4],
            }
        else:
            state_dict = {
                "name": name,
                "id": id_val,
                "score": 99.9,
                "count": 100,
                "active": True,
            }
        self.state.update(
            (
                state_dict["name"],
                state_dict["id"],
                state_dict["score"],
                state_dict["count"],
                state_dict["active"],
            )
        )
        yield pd.DataFrame({"id": [key[0]], "value": [state_dict]})

    def close(self) -> None:
        pass


class PandasUpcastProcessor(StatefulProcessor):
    state_schema = StructType(
        [
            StructField("id", LongType(), True),  # Upcast from Int to Long
            StructField("name", StringType(), True),
        ]
    )

    def init(self, handle):
        self.state = handle.getValueState("state", self.state_schema)

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        for pdf in rows:
            pass
        id_val = int(key[0])
        name = f"name-{id_val}"
        if self.state.exists():
            id_val += self.state.get()[0] + 1
        self.state.update((id_val, name))
        yield pd.DataFrame({"id": [key[0]], "value": [{"id": id_val, "name": name}]})

    def close(self) -> None:
        pass


@pytest.mark.soak
def test_schema_evolution_scenarios(rocksdb, tmp_path):
    # Five runs of one query from one checkpoint, each with a processor whose value state
    # schema evolved (fields added, removed, reordered, widened), as pyspark's test (which reads
    # the first row of each batch; here the row of key "0", sorted, on both sides).
    spark = rocksdb

    def first(batch_df):
        return batch_df.sort("id").collect()[0]

    def check_basic_state(batch_df, batch_id):
        result = first(batch_df)
        assert result.value["id"] == 0  # First ID from test data
        assert result.value["name"] == "name-0"

    def check_add_fields(batch_df, batch_id):
        result = first(batch_df)
        # Check default values for existing key
        assert result.value["id"] == 0
        assert result.value["count"] is None
        assert result.value["active"] is None
        assert result.value["score"] is None

    def check_remove_fields(batch_df, batch_id):
        result = first(batch_df)
        assert result.value["id"] == 0  # First ID from test data
        assert result.value["name"] == "name-00"

    def check_reorder_fields(batch_df, batch_id):
        result = first(batch_df)
        assert result.value["name"] == "name-00"
        assert result.value["id"] == 0

    def check_upcast(batch_df, batch_id):
        result = first(batch_df)
        assert result.value["id"] == 1
        assert result.value["name"] == "name-0"

    runs = [(PandasBasicProcessor, check_basic_state, resource1),
            (PandasAddFieldsProcessor, check_add_fields, resource2),
            (PandasRemoveFieldsProcessor, check_remove_fields, resource3),
            (PandasReorderedFieldsProcessor, check_reorder_fields,
             lambda p: _write(p, "text-test4.txt", [0, 1], [123, 6], 1e9 + 20)),
            (PandasUpcastProcessor, check_upcast,
             lambda p: _write(p, "text-test5.txt", [0, 1], [123, 6], 1e9 + 30))]
    spark.conf.set("spark.sql.streaming.stateStore.encodingFormat", "avro")
    got = {}
    try:
        for side in SIDES:
            input_path = tmp_path / side / "input"
            input_path.mkdir(parents=True)
            seen = []
            for processor, check_results, add_input in runs:
                add_input(input_path)
                out = StructType([StructField("id", StringType(), True),
                                  StructField("value", processor.state_schema, True)])
                tws_df = build_test_df(spark, input_path).groupBy("id") \
                    .transformWithStateInPandas(statefulProcessor=processor(),
                                                outputStructType=out, outputMode="Update",
                                                timeMode="None")
                seen.append(run(spark, tws_df, side, check_results,
                                checkpoint=tmp_path / side / "ckpt",
                                query_name="evolution_test"))
            assert all(seen), (side, seen)
            got[side] = seen
        assert got["stretch"] == got["native"]
    finally:
        spark.conf.unset("spark.sql.streaming.stateStore.encodingFormat")


class PandasBasicProcessorNotNullable(PandasBasicProcessor):
    # (pyspark's BasicProcessorNotNullable: the basic processor's state, its fields not null)
    state_schema = StructType(
        [StructField("id", IntegerType(), False), StructField("name", StringType(), False)]
    )


def _fails_with(spark, tmp_path, side, runs, *expected):
    """The runs of one query from one checkpoint (``(processor, add_input)``), the last one
    failing: its StreamingQueryException says ``expected``."""
    from pyspark.errors.exceptions.captured import StreamingQueryException

    input_path = tmp_path / side / "input"
    input_path.mkdir(parents=True)
    for i, (processor, add_input) in enumerate(runs):
        add_input(input_path)
        out = StructType([StructField("id", StringType(), True),
                          StructField("value", processor.state_schema, True)])
        tws_df = build_test_df(spark, input_path).groupBy("id").transformWithStateInPandas(
            statefulProcessor=processor(), outputStructType=out, outputMode="Update",
            timeMode="None")
        if i < len(runs) - 1:
            run(spark, tws_df, side, lambda *_: None, checkpoint=tmp_path / side / "ckpt",
                query_name="evolution_test")
            continue
        with pytest.raises(StreamingQueryException) as e:
            run(spark, tws_df, side, lambda *_: None, checkpoint=tmp_path / side / "ckpt",
                query_name="evolution_test")
        for text in expected:
            assert text in str(e.value), (side, str(e.value)[:6000])


@pytest.mark.soak
@pytest.mark.parametrize("side", SIDES)
def test_schema_evolution_fails(rocksdb, tmp_path, side):
    # Added fields, then upcast (int to long), then back to int: Avro refuses the downcast.
    # (pyspark's test passes whether or not the last run fails; here it must, on both sides.)
    rocksdb.conf.set("spark.sql.streaming.stateStore.encodingFormat", "avro")
    try:
        _fails_with(rocksdb, tmp_path, side,
                    [(PandasAddFieldsProcessor, resource1), (PandasUpcastProcessor, resource2),
                     (PandasBasicProcessor, resource3)],
                    "[STREAM_FAILED]", "[STATE_STORE_INVALID_VALUE_SCHEMA_EVOLUTION]",
                    "Schema evolution is not possible")
    finally:
        rocksdb.conf.unset("spark.sql.streaming.stateStore.encodingFormat")


@pytest.mark.parametrize("side", SIDES)
def test_not_nullable_fails(rocksdb, tmp_path, side):
    rocksdb.conf.set("spark.sql.streaming.stateStore.encodingFormat", "avro")
    try:
        _fails_with(rocksdb, tmp_path, side, [(PandasBasicProcessorNotNullable, resource1)],
                    "[TRANSFORM_WITH_STATE_SCHEMA_MUST_BE_NULLABLE]",
                    "column family state must be nullable")
    finally:
        rocksdb.conf.unset("spark.sql.streaming.stateStore.encodingFormat")


@pytest.mark.soak
@pytest.mark.parametrize("side", SIDES)
def test_unsaferow_schema_change_fails(rocksdb, tmp_path, side):
    # (not pyspark's) Spark's default encoding keeps a value schema's fields and types: the
    # added fields of pyspark's second evolution run fail without Avro, on both sides.
    _fails_with(rocksdb, tmp_path, side,
                [(PandasBasicProcessor, resource1), (PandasAddFieldsProcessor, resource2)],
                "[STREAM_FAILED]", "[STATE_STORE_VALUE_SCHEMA_NOT_COMPATIBLE]")


class PandasMapStringKeyProcessor(StatefulProcessor):
    """(not pyspark's) A map state whose user key schema the next runs change."""
    state_schema = StructType([StructField("n", IntegerType(), True)])
    key_schema = StructType([StructField("k", StringType(), True)])
    user_key = ("a",)

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.map = handle.getMapState("map", self.key_schema, self.state_schema)

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        n = sum(len(pdf) for pdf in rows)
        self.map.updateValue(self.user_key, (n,))
        yield pd.DataFrame({"id": key, "value": [(n,)]})


class PandasMapIntKeyProcessor(PandasMapStringKeyProcessor):
    key_schema = StructType([StructField("k", IntegerType(), True)])
    user_key = (1,)


class PandasMapTwoKeysProcessor(PandasMapStringKeyProcessor):
    key_schema = StructType([StructField("k", StringType(), True),
                             StructField("j", StringType(), True)])
    user_key = ("a", "b")


@pytest.mark.soak
@pytest.mark.parametrize("encoding", ["unsaferow", "avro"])
@pytest.mark.parametrize("then", [PandasMapIntKeyProcessor, PandasMapTwoKeysProcessor],
                         ids=["retyped", "added"])
@pytest.mark.parametrize("side", SIDES)
def test_map_key_schema_change_fails(rocksdb, tmp_path, side, then, encoding):
    # (not pyspark's) A map state's user key may not change, with either encoding (Avro evolves
    # values only): Spark's error on both sides.
    rocksdb.conf.set("spark.sql.streaming.stateStore.encodingFormat", encoding)
    try:
        _fails_with(rocksdb, tmp_path, side,
                    [(PandasMapStringKeyProcessor, resource1), (then, resource2)],
                    "[STREAM_FAILED]", "[STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE]",
                    "StructField(userKey,StructType(StructField(k,StringType,true)),true)")
    finally:
        rocksdb.conf.unset("spark.sql.streaming.stateStore.encodingFormat")


# -- composite types (pyspark's test_transform_with_state_in_pandas_composite_type) -----------
class PandasStatefulProcessorCompositeType(StatefulProcessor):
    class Address(NamedTuple):
        road_id: int
        city: str

    TAGS = [["dummy1", "dummy2"], ["dummy3"]]
    METADATA = [{"key": "env", "value": "prod"}, {"key": "region", "value": "us-west"}]
    ATTRIBUTES_MAP = {"key1": [1], "key2": [10]}
    CONFS_MAP = {"e1": {"e2": 5, "e3": 10}}
    ADDRESS = [Address(1, "Seattle"), Address(3, "SF")]

    def init(self, handle: StatefulProcessorHandle) -> None:
        obj_schema = StructType(
            [
                StructField("id", ArrayType(IntegerType())),
                StructField("tags", ArrayType(ArrayType(StringType()))),
                StructField(
                    "metadata",
                    ArrayType(
                        StructType(
                            [StructField("key", StringType()), StructField("value", StringType())]
                        )
                    ),
                ),
                StructField(
                    "address",
                    ArrayType(
                        StructType(
                            [
                                StructField("road_id", IntegerType()),
                                StructField("city", StringType()),
                            ]
                        )
                    ),
                ),
            ]
        )

        map_value_schema = StructType(
            [
                StructField("id", IntegerType(), True),
                StructField("attributes", MapType(StringType(), ArrayType(IntegerType())), True),
                StructField(
                    "confs", MapType(StringType(), MapType(StringType(), IntegerType()), True), True
                ),
            ]
        )

        self.obj_state = handle.getValueState("obj_state", obj_schema)
        self.list_state = handle.getListState("list_state", obj_schema)
        self.map_state = handle.getMapState("map_state", "name string", map_value_schema)

    def _update_obj_state(self, total_temperature):
        if self.obj_state.exists():
            ids, tags, metadata, address = self.obj_state.get()
            assert tags == self.TAGS, f"Tag mismatch: {tags}"
            assert metadata == [Row(**m) for m in self.METADATA], f"Metadata mismatch: {metadata}"
            assert address == [
                Row(**e._asdict()) for e in self.ADDRESS
            ], f"Address mismatch: {address}"
            ids = [int(x + total_temperature) for x in ids]
        else:
            ids = [0]
        self.obj_state.update((ids, self.TAGS, self.METADATA, self.ADDRESS))
        return ids

    def _update_list_state(self, total_temperature, initial_obj):
        existing_list = self.list_state.get()
        updated_list = []
        for ids, tags, metadata, address in existing_list:
            ids.append(total_temperature)
            updated_list.append((ids, tags, [row.asDict() for row in metadata], address))
        if not updated_list:
            updated_list.append(initial_obj)
        self.list_state.put(updated_list)
        return [id_val for ids, _, _, _ in updated_list for id_val in ids]

    def _update_map_state(self, key, total_temperature):
        if not self.map_state.containsKey(key):
            self.map_state.updateValue(key, (0, self.ATTRIBUTES_MAP, self.CONFS_MAP))
        else:
            id_val, attributes, confs = self.map_state.getValue(key)
            attributes[key] = [total_temperature]
            confs.setdefault("e1", {})[key] = total_temperature
            self.map_state.updateValue(key, (id_val, attributes, confs))
        return self.map_state.getValue(key)[1], self.map_state.getValue(key)[2]

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        key = key[0]
        total_temperature = sum(pdf["temperature"].astype(int).sum() for pdf in rows)

        updated_ids = self._update_obj_state(total_temperature)
        flattened_ids = self._update_list_state(
            total_temperature, (updated_ids, self.TAGS, self.METADATA, self.ADDRESS)
        )
        attributes_map, confs_map = self._update_map_state(key, total_temperature)

        import json
        import numpy as np

        def np_int64_to_int(x):
            if isinstance(x, np.int64):
                return int(x)
            return x

        yield pd.DataFrame(
            {
                "id": [key],
                "value_arr": [",".join(map(str, updated_ids))],
                "list_state_arr": [",".join(map(str, flattened_ids))],
                "map_state_arr": [
                    json.dumps(attributes_map, default=np_int64_to_int, sort_keys=True)
                ],
                "nested_map_state_arr": [
                    json.dumps(confs_map, default=np_int64_to_int, sort_keys=True)
                ],
            }
        )

    def close(self) -> None:
        pass


@pytest.mark.soak
def test_transform_with_state_in_pandas_composite_type(rocksdb, tmp_path):
    import json

    spark = rocksdb
    resource1(tmp_path)
    resource2(tmp_path)

    def check_results(batch_df, batch_id):
        if batch_id == 0:
            map_val = {"key1": [1], "key2": [10]}
            nested_map_val = {"e1": {"e2": 5, "e3": 10}}
            assert set(batch_df.sort("id").collect()) == {
                Row(
                    id="0",
                    value_arr="0",
                    list_state_arr="0",
                    map_state_arr=json.dumps(map_val, sort_keys=True),
                    nested_map_state_arr=json.dumps(nested_map_val, sort_keys=True),
                ),
                Row(
                    id="1",
                    value_arr="0",
                    list_state_arr="0",
                    map_state_arr=json.dumps(map_val, sort_keys=True),
                    nested_map_state_arr=json.dumps(nested_map_val, sort_keys=True),
                ),
            }, f"batch id: {batch_id}, real df is: {batch_df.collect()}"
        else:
            map_val_0 = {"key1": [1], "key2": [10], "0": [669]}
            map_val_1 = {"key1": [1], "key2": [10], "1": [252]}
            nested_map_val_0 = {"e1": {"e2": 5, "e3": 10, "0": 669}}
            nested_map_val_1 = {"e1": {"e2": 5, "e3": 10, "1": 252}}
            assert set(batch_df.sort("id").collect()) == {
                Row(
                    id="0",
                    countAsString="669",
                    list_state_arr="0,669",
                    map_state_arr=json.dumps(map_val_0, sort_keys=True),
                    nested_map_state_arr=json.dumps(nested_map_val_0, sort_keys=True),
                ),
                Row(
                    id="1",
                    countAsString="252",
                    list_state_arr="0,252",
                    map_state_arr=json.dumps(map_val_1, sort_keys=True),
                    nested_map_state_arr=json.dumps(nested_map_val_1, sort_keys=True),
                ),
            }, f"batch id: {batch_id}, real df is: {batch_df.collect()}"

    output_schema = StructType(
        [
            StructField("id", StringType(), True),
            StructField("value_arr", StringType(), True),
            StructField("list_state_arr", StringType(), True),
            StructField("map_state_arr", StringType(), True),
            StructField("nested_map_state_arr", StringType(), True),
        ]
    )

    def make():
        return build_test_df(spark, tmp_path).groupBy("id").transformWithStateInPandas(
            statefulProcessor=PandasStatefulProcessorCompositeType(),
            outputStructType=output_schema, outputMode="Update", timeMode="None")

    both(spark, make, check_results)
