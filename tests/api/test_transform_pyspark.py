"""pyspark's own tests of ``transformWithStateInPandas``, run natively and through ``stretch(df)``.

Ported from ``python/pyspark/sql/tests/pandas/streaming/test_pandas_transform_with_state.py``
(Spark 4.x) with its processors from ``helper/helper_pandas_transform_with_state.py``: each
case's processor, input files, query and ``check_results`` as pyspark has them, run once as the
user wrote it (native Spark, RocksDB state as Spark requires) and once through
``spark_stretch.stretch(df)`` over the same DataFrame, the original assertions holding on both,
and the batch ids and row counts of every micro-batch equal to native's.

Ported so far: ``test_transform_with_state_basic``, ``_query_restarts``, ``_proc_timer``,
``_event_time``, ``_with_wmark_and_non_event_time``, ``_non_contiguous_grouping_cols``.
Not applied: ``_query_restarts``' read of the operator's custom metrics
(``numValueStateVars``, ``numDeletedStateVars``: counters of Spark's own state store, which
does not run under ``stretch(df)``). Input files are ordered by their modification times set
directly, where pyspark sleeps 2 s between them. ``_proc_timer`` runs without no-data
batches (see there), as does ``_with_wmark_and_non_event_time`` in processing time.
"""

from __future__ import annotations

import os
import sys
import unittest
from typing import Iterator

import pandas as pd
import pytest
from pyspark.errors import PySparkRuntimeError
from pyspark.sql import Row
from pyspark.sql.functions import col, from_unixtime, split
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle
from pyspark.sql.types import IntegerType, StringType, StructField, StructType

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


def run(spark, tws_df, side, check_results, checkpoint=None, query_name="this_query"):
    """The query over ``tws_df`` (natively, or through ``stretch``) into ``foreachBatch``:
    ``check_results`` on every batch; returns ``[(batch_id, rows)]``."""
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
    assert q.name == query_name
    assert q.isActive
    q.processAllAvailable()
    q.stop()
    q.awaitTermination(10)
    assert q.exception() is None
    return seen


def both(spark, make, check_results, **kw):
    """Run natively and through ``stretch``: the checks hold on both, the same batches."""
    got = {side: run(spark, make(), side, check_results, **kw) for side in SIDES}
    assert got["native"], "native ran no batch"
    assert got["stretch"] == got["native"]
    return got


# -- the tests --------------------------------------------------------------------------------
def test_transform_with_state_basic(rocksdb, tmp_path):
    spark = rocksdb
    resource1(tmp_path)
    resource2(tmp_path)

    def check_results(batch_df, batch_id):
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

    def make():
        return build_test_df(spark, tmp_path).groupBy("id").transformWithStateInPandas(
            statefulProcessor=PandasSimpleStatefulProcessor(), outputStructType=BASIC_OUT,
            outputMode="Update", timeMode="None")

    got = both(spark, make, check_results)
    assert [b for b, _ in got["stretch"]] == [0, 1]


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_transform_with_state_event_time(rocksdb, tmp_path):
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
        return event_time_df(spark, tmp_path).groupBy("id").transformWithStateInPandas(
            statefulProcessor=PandasEventTimeStatefulProcessor(), outputStructType=EVENT_OUT,
            outputMode="Update", timeMode="eventtime")

    both(spark, make, check_results, query_name="event_time_test_query")


@pytest.mark.slow
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


@pytest.mark.slow
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
