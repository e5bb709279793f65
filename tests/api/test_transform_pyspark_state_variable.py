"""pyspark's own tests of ``transformWithStateInPandas``' state variables, run natively and
through ``stretch(df)``, and state TTL against a sequential model.

Ported from ``python/pyspark/sql/tests/pandas/streaming/``
``test_pandas_transform_with_state_state_variable.py`` (Spark 4.x) with its processors from
``helper/helper_pandas_transform_with_state.py`` (pandas variants), each run as the user wrote it
(native Spark, RocksDB) and through ``spark_stretch.stretch(df)`` on the same input, pyspark's
assertions holding on both, the batch ids and row counts of every micro-batch equal:
``test_transform_with_state_non_exist_value_state``, ``_list_state``, ``_list_state_large_list``,
``_list_state_large_ttl``, ``_map_state``, ``_map_state_large_ttl``,
``test_value_state_ttl_basic``, ``test_transform_with_state_init_state_with_extra_transformation``
(a ``select`` after the operator), ``_restart_with_multiple_rows_init_state`` (an initial state
of several rows per key, read natively from a first query's state; its last check, a read of
the second query's state files, native only), ``_with_timers_single_partition``;
``_init_state`` and ``_init_state_with_timers`` are in ``test_transform_pyspark.py`` (the same
in both pyspark files). Not ported: ``test_value_state_ttl_expiration`` (skipped upstream as
flaky: its expectations depend on the wall-clock gap between batches; expiry is tested below
against a model fed the batches' own timestamps instead); the ``_metadata`` tests (white-box
reads of Spark's own state store files, which do not exist under ``stretch(df)``). Not
pyspark's: TTL expiry against a model, frames cut by ``maxRecordsPerBatch`` and
``maxBytesPerBatch``, values of hundreds of KB against a model.
"""

from __future__ import annotations

import sys
import time
import unittest
from typing import Iterator

import pandas as pd
import pytest
from pyspark.sql import Row
from pyspark.sql import functions as fn
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle
from pyspark.sql.types import (IntegerType, LongType, StringType, StructField, StructType,
                               TimestampType)

from .test_transform_pyspark import (BASIC_OUT, PandasSimpleStatefulProcessor,
                                     PandasSimpleStatefulProcessorWithInitialState,
                                     _init_state_run, both, build_test_df,
                                     check_basic_results, resource1, resource2, rocksdb, run,
                                     test_transform_with_state_init_state_with_timers
                                     as _init_state_with_timers)

# Shipped by value: Python workers and stretch instances cannot import this test module.
from pyspark import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

__all__ = ["rocksdb"]  # (the fixture, used by name)


# -- pyspark's processors (helper_pandas_transform_with_state.py) ----------------------------
# A stateful processor that inherit all behavior of SimpleStatefulProcessor except that it use
# ttl state with a large timeout.
class PandasSimpleTTLStatefulProcessor(PandasSimpleStatefulProcessor, unittest.TestCase):
    def init(self, handle: StatefulProcessorHandle) -> None:
        state_schema = StructType([StructField("value", IntegerType(), True)])
        self.num_violations_state = handle.getValueState("numViolations", state_schema, 30000)
        self.temp_state = handle.getValueState("tempState", state_schema)
        handle.deleteIfExists("tempState")


class PandasTTLStatefulProcessor(StatefulProcessor):
    def init(self, handle: StatefulProcessorHandle) -> None:
        state_schema = StructType([StructField("value", IntegerType(), True)])
        user_key_schema = StructType([StructField("id", StringType(), True)])
        self.ttl_count_state = handle.getValueState("ttl-state", state_schema, 10000)
        self.count_state = handle.getValueState("state", state_schema)
        self.ttl_list_state = handle.getListState("ttl-list-state", state_schema, 10000)
        self.ttl_map_state = handle.getMapState(
            "ttl-map-state", user_key_schema, state_schema, 10000
        )

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        count = 0
        ttl_count = 0
        ttl_list_state_count = 0
        ttl_map_state_count = 0
        id = key[0]
        if self.count_state.exists():
            count = self.count_state.get()[0]
        if self.ttl_count_state.exists():
            ttl_count = self.ttl_count_state.get()[0]
        if self.ttl_list_state.exists():
            iter = self.ttl_list_state.get()
            for s in iter:
                ttl_list_state_count += s[0]
        if self.ttl_map_state.exists():
            ttl_map_state_count = self.ttl_map_state.getValue(key)[0]
        for pdf in rows:
            pdf_count = pdf.count().get("temperature")
            count += pdf_count
            ttl_count += pdf_count
            ttl_list_state_count += pdf_count
            ttl_map_state_count += pdf_count

        self.count_state.update((count,))
        # skip updating state for the 2nd batch so that ttl state expire
        if not (ttl_count == 2 and id == "0"):
            self.ttl_count_state.update((ttl_count,))
            self.ttl_list_state.put([(ttl_list_state_count,), (ttl_list_state_count,)])
            self.ttl_map_state.updateValue(key, (ttl_map_state_count,))
        yield pd.DataFrame(
            {
                "id": [
                    f"ttl-count-{id}",
                    f"count-{id}",
                    f"ttl-list-state-count-{id}",
                    f"ttl-map-state-count-{id}",
                ],
                "count": [ttl_count, count, ttl_list_state_count, ttl_map_state_count],
            }
        )


class PandasInvalidSimpleStatefulProcessor(StatefulProcessor):
    def init(self, handle: StatefulProcessorHandle) -> None:
        state_schema = StructType([StructField("value", IntegerType(), True)])
        self.num_violations_state = handle.getValueState("numViolations", state_schema)

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        count = 0
        exists = self.num_violations_state.exists()
        assert not exists
        # try to get a state variable with no value
        assert self.num_violations_state.get() is None
        self.num_violations_state.clear()
        yield pd.DataFrame({"id": key, "countAsString": str(count)})


class PandasListStateProcessor(StatefulProcessor):
    # Dict to store the expected results. The key represents the grouping key string, and the value
    # is a dictionary of pandas dataframe index -> expected temperature value. Since we set
    # maxRecordsPerBatch to 2, we expect the pandas dataframe dictionary to have 2 entries.
    dict = {0: 120, 1: 20}

    def init(self, handle: StatefulProcessorHandle) -> None:
        state_schema = StructType([StructField("temperature", IntegerType(), True)])
        timestamp_schema = StructType([StructField("time", TimestampType(), True)])
        self.list_state1 = handle.getListState("listState1", state_schema)
        self.list_state2 = handle.getListState("listState2", state_schema)
        self.list_state_timestamp = handle.getListState("listStateTimestamp", timestamp_schema)

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        import datetime

        count = 0
        time_list = []
        for pdf in rows:
            list_state_rows = [(120,), (20,)]
            self.list_state1.put(list_state_rows)
            self.list_state2.put(list_state_rows)
            self.list_state1.appendValue((111,))
            self.list_state2.appendValue((222,))
            self.list_state1.appendList(list_state_rows)
            self.list_state2.appendList(list_state_rows)
            pdf_count = pdf.count()
            count += pdf_count.get("temperature")
            current_processing_time = datetime.datetime.fromtimestamp(
                timerValues.getCurrentProcessingTimeInMs() / 1000
            )
            stored_time = current_processing_time + datetime.timedelta(minutes=1)
            time_list.append((stored_time,))
        iter1 = self.list_state1.get()
        iter2 = self.list_state2.get()
        # Mixing the iterator to test it we can resume from the correct point
        assert next(iter1)[0] == self.dict[0]
        assert next(iter2)[0] == self.dict[0]
        assert next(iter1)[0] == self.dict[1]
        assert next(iter2)[0] == self.dict[1]
        # Get another iterator for list_state1 to test if the 2 iterators (iter1 and iter3) don't
        # interfere with each other.
        iter3 = self.list_state1.get()
        assert next(iter3)[0] == self.dict[0]
        assert next(iter3)[0] == self.dict[1]
        # the second arrow batch should contain the appended value 111 for list_state1 and
        # 222 for list_state2
        assert next(iter1)[0] == 111
        assert next(iter2)[0] == 222
        assert next(iter3)[0] == 111
        # since we put another 2 rows after 111/222, check them here
        assert next(iter1)[0] == self.dict[0]
        assert next(iter2)[0] == self.dict[0]
        assert next(iter3)[0] == self.dict[0]
        assert next(iter1)[0] == self.dict[1]
        assert next(iter2)[0] == self.dict[1]
        assert next(iter3)[0] == self.dict[1]
        if time_list:
            # Validate timestamp type can work properly with arrow transmission
            self.list_state_timestamp.put(time_list)
        yield pd.DataFrame({"id": key, "countAsString": str(count)})

    def close(self) -> None:
        pass


class PandasListStateLargeListProcessor(StatefulProcessor):
    def init(self, handle: StatefulProcessorHandle) -> None:
        list_state_schema = StructType(
            [
                StructField("value", IntegerType(), True),
                StructField("valueNull", IntegerType(), True),
            ]
        )
        value_state_schema = StructType([StructField("size", IntegerType(), True)])
        self.list_state = handle.getListState("listState", list_state_schema)
        self.list_size_state = handle.getValueState("listSizeState", value_state_schema)

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        elements_iter = self.list_state.get()
        elements = list(elements_iter)

        # Use the magic number 100 to test with both inline proto case and Arrow case.
        # Now the magic number is not actually used, but this is to make this test be a regression
        # test of SPARK-53743.
        # Explicitly put 100 elements of list which triggered Arrow based list serialization before
        # SPARK-53743.

        if len(elements) == 0:
            # should be the first batch
            assert self.list_size_state.get() is None
            new_elements = [(i, None) for i in range(100)]
            if key == ("0",):
                self.list_state.put(new_elements)
            else:
                self.list_state.appendList(new_elements)
            self.list_size_state.update((len(new_elements),))
        else:
            # check the elements
            list_size = self.list_size_state.get()
            assert list_size is not None
            list_size = list_size[0]
            assert list_size == len(
                elements
            ), f"list_size ({list_size}) != len(elements) ({len(elements)})"

            expected_elements_in_state = [(i, None) for i in range(list_size)]
            assert (
                elements == expected_elements_in_state
            ), f"expected {expected_elements_in_state} but got {elements}"

            if key == ("0",):
                # Use the operation `put`
                new_elements = [(i, None) for i in range(list_size + 90)]
                self.list_state.put(new_elements)
                final_size = len(new_elements)
                self.list_size_state.update((final_size,))
            else:
                # Use the operation `appendList`
                new_elements = [(i, None) for i in range(list_size, list_size + 90)]
                self.list_state.appendList(new_elements)
                final_size = len(new_elements) + list_size
                self.list_size_state.update((final_size,))

        prev_elements = ",".join(map(lambda x: str(x[0]), elements))
        updated_elements = ",".join(map(lambda x: str(x[0]), self.list_state.get()))

        yield pd.DataFrame(
            {
                "id": key,
                "prevElements": prev_elements,
                "updatedElements": updated_elements,
            }
        )


class PandasListStateLargeTTLProcessor(PandasListStateProcessor):
    def init(self, handle: StatefulProcessorHandle) -> None:
        state_schema = StructType([StructField("temperature", IntegerType(), True)])
        timestamp_schema = StructType([StructField("time", TimestampType(), True)])
        self.list_state1 = handle.getListState("listState1", state_schema, 30000)
        self.list_state2 = handle.getListState("listState2", state_schema, 30000)
        self.list_state_timestamp = handle.getListState("listStateTimestamp", timestamp_schema)


class PandasMapStateProcessor(StatefulProcessor):
    def init(self, handle: StatefulProcessorHandle):
        # Test string type schemas
        self.map_state = handle.getMapState("mapState", "name string", "count int")

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        count = 0
        key1 = ("key1",)
        key2 = ("key2",)
        for pdf in rows:
            pdf_count = pdf.count()
            count += pdf_count.get("temperature")
        value1 = count
        value2 = count
        if self.map_state.exists():
            if self.map_state.containsKey(key1):
                value1 += self.map_state.getValue(key1)[0]
            if self.map_state.containsKey(key2):
                value2 += self.map_state.getValue(key2)[0]
        self.map_state.updateValue(key1, (value1,))
        self.map_state.updateValue(key2, (value2,))
        key_iter = self.map_state.keys()
        assert next(key_iter)[0] == "key1"
        assert next(key_iter)[0] == "key2"
        value_iter = self.map_state.values()
        assert next(value_iter)[0] == value1
        assert next(value_iter)[0] == value2
        map_iter = self.map_state.iterator()
        assert next(map_iter)[0] == key1
        assert next(map_iter)[1] == (value2,)
        self.map_state.removeKey(key1)
        assert not self.map_state.containsKey(key1)
        assert self.map_state.exists()
        self.map_state.clear()
        assert not self.map_state.exists()
        yield pd.DataFrame({"id": key, "countAsString": str(count)})

    def close(self) -> None:
        pass


# A stateful processor that inherit all behavior of MapStateProcessor except that it use
# ttl state with a large timeout.
class PandasMapStateLargeTTLProcessor(PandasMapStateProcessor):
    def init(self, handle: StatefulProcessorHandle) -> None:
        key_schema = StructType([StructField("name", StringType(), True)])
        value_schema = StructType([StructField("count", IntegerType(), True)])
        # Use a large timeout as long as 1 year
        self.map_state = handle.getMapState("mapState", key_schema, value_schema, 31536000000)
        self.list_state = handle.getListState("listState", key_schema)


# -- the tests --------------------------------------------------------------------------------
@pytest.fixture
def no_data_batches_off(rocksdb):
    """Processing time runs a no-data batch after each batch natively; pyspark's runs stop
    before it (a race): off, as the tests mean (see ``test_transform_pyspark``'s _proc_timer)."""
    rocksdb.conf.set("spark.sql.streaming.noDataMicroBatches.enabled", "false")
    yield rocksdb
    rocksdb.conf.unset("spark.sql.streaming.noDataMicroBatches.enabled")


def _basic(spark, tmp_path, processor, check_results, single_batch=False, time_mode="None",
           output_schema=BASIC_OUT):
    """pyspark's ``_test_transform_with_state_basic`` on both sides."""
    resource1(tmp_path)
    if not single_batch:
        resource2(tmp_path)

    def make():
        return build_test_df(spark, tmp_path).groupBy("id").transformWithStateInPandas(
            statefulProcessor=processor(), outputStructType=output_schema,
            outputMode="Update", timeMode=time_mode)

    return both(spark, make, check_results)


def _two_per_key(batch_df, _):
    assert set(batch_df.sort("id").collect()) == {
        Row(id="0", countAsString="2"),
        Row(id="1", countAsString="2"),
    }


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_transform_with_state_non_exist_value_state(rocksdb, tmp_path):
    def check_results(batch_df, _):
        assert set(batch_df.sort("id").collect()) == {
            Row(id="0", countAsString="0"),
            Row(id="1", countAsString="0"),
        }

    _basic(rocksdb, tmp_path, PandasInvalidSimpleStatefulProcessor, check_results, True)


def test_transform_with_state_list_state(no_data_batches_off, tmp_path):
    _basic(no_data_batches_off, tmp_path, PandasListStateProcessor, _two_per_key, True,
           "processingTime")


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_transform_with_state_list_state_large_list(rocksdb, tmp_path):
    def check_results(batch_df, batch_id):
        if batch_id == 0:
            expected_prev_elements = ""
            expected_updated_elements = ",".join(map(lambda x: str(x), range(100)))
        else:
            expected_prev_elements = ",".join(map(lambda x: str(x), range(100)))
            expected_updated_elements = ",".join(map(lambda x: str(x), range(190)))
        assert set(batch_df.sort("id").collect()) == {
            Row(id="0", prevElements=expected_prev_elements,
                updatedElements=expected_updated_elements),
            Row(id="1", prevElements=expected_prev_elements,
                updatedElements=expected_updated_elements),
        }

    out = StructType([StructField("id", StringType(), True),
                      StructField("prevElements", StringType(), True),
                      StructField("updatedElements", StringType(), True)])
    got = _basic(rocksdb, tmp_path, PandasListStateLargeListProcessor, check_results,
                 output_schema=out)
    assert [b for b, _ in got["stretch"]] == [0, 1]


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_transform_with_state_list_state_large_ttl(no_data_batches_off, tmp_path):
    _basic(no_data_batches_off, tmp_path, PandasListStateLargeTTLProcessor, _two_per_key, True,
           "processingTime")


def test_transform_with_state_map_state(rocksdb, tmp_path):
    _basic(rocksdb, tmp_path, PandasMapStateProcessor, _two_per_key, True)


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_transform_with_state_map_state_large_ttl(no_data_batches_off, tmp_path):
    _basic(no_data_batches_off, tmp_path, PandasMapStateLargeTTLProcessor, _two_per_key, True,
           "processingTime")


def test_value_state_ttl_basic(no_data_batches_off, tmp_path):
    got = _basic(no_data_batches_off, tmp_path, PandasSimpleTTLStatefulProcessor,
                 check_basic_results, False, "processingTime")
    assert [b for b, _ in got["stretch"]] == [0, 1]


class PandasStatefulProcessorWithListStateInitialState(
    PandasSimpleStatefulProcessorWithInitialState
):
    def init(self, handle: StatefulProcessorHandle) -> None:
        super().init(handle)
        list_ele_schema = StructType([StructField("value", IntegerType(), True)])
        self.list_state = handle.getListState("list_state", list_ele_schema)

    def handleInitialState(self, key, initialState, timerValues) -> None:
        for val in initialState["initVal"].tolist():
            self.list_state.appendValue((val,))


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_transform_with_state_init_state_with_extra_transformation(rocksdb, tmp_path):
    def check_results(batch_df, batch_id):
        if batch_id == 0:
            assert set(batch_df.sort("key").collect()) == {
                Row(key="0", value=f'{{"value":"{789 + 123 + 46}"}}'),
                Row(key="1", value=f'{{"value":"{146 + 346}"}}'),
            }
        else:
            assert set(batch_df.sort("key").collect()) == {
                Row(key="0", value=f'{{"value":"{789 + 123 + 46 + 67}"}}'),
                Row(key="3", value=f'{{"value":"{987 + 12}"}}'),
            }

    def then(tws_df):
        return tws_df.select(fn.col("id").cast("string").alias("key"),
                             fn.to_json(fn.struct(fn.col("value"))).alias("value"))

    _init_state_run(rocksdb, tmp_path, PandasSimpleStatefulProcessorWithInitialState,
                    check_results, "None", then=then)


def _restart_with_multiple_rows_init_state(spark, tmp_path):
    """pyspark's test: a list-state query's state, read back natively with Spark's
    ``statestore`` source, is the next query's initial state (several rows per key), on both
    sides. pyspark then reads the new query's list state the same way; that white-box read is
    asserted natively only (``stretch(df)`` keeps no Spark state store files)."""
    (tmp_path / "ckpt").mkdir(parents=True)
    resource1(tmp_path / "first")
    first = tmp_path / "first-ckpt"
    run(spark, build_test_df(spark, tmp_path / "first").groupBy("id").transformWithStateInPandas(
        statefulProcessor=PandasListStateProcessor(), outputStructType=BASIC_OUT,
        outputMode="Update", timeMode="None"), "native", _two_per_key, checkpoint=first)
    init_df = (spark.read.format("statestore").option("path", str(first))
               .option("stateVarName", "listState1").load()
               ).selectExpr("key.id AS id", "list_element.temperature AS initVal")
    assert sorted(r.initVal for r in init_df.collect()) == sorted([20, 20, 111, 120, 120] * 2)

    def check_results(batch_df, batch_id, ckpt=None):
        if batch_id == 0:
            assert set(batch_df.sort("id").collect()) == {
                Row(id="0", value=str(123 + 46)),
                Row(id="1", value=str(146 + 346)),
            }
        else:
            assert set(batch_df.sort("id").collect()) == {
                Row(id="0", value=str(123 + 46 + 67)),
                Row(id="3", value=str(12)),
            }
            if ckpt is not None:  # (native)
                df = (batch_df.sparkSession.read.format("statestore")
                      .option("path", str(ckpt)).option("stateVarName", "list_state")
                      .load()).selectExpr("key.id AS id", "list_element.value AS value")
                for k in ("0", "1"):
                    assert sorted(r.value for r in df.filter(df.id == k).collect()) \
                        == [20, 20, 111, 120, 120]

    ckpt = tmp_path / "ckpt"
    checks = {"native": lambda df, b: check_results(df, b, ckpt / "native"),
              "stretch": check_results}
    got = _init_state_run(spark, tmp_path / "input",
                          PandasStatefulProcessorWithListStateInitialState, checks, "None", initial_state=init_df.groupBy("id"), checkpoint=ckpt)
    assert [b for b, _ in got["stretch"]] == [0, 1]


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_transform_with_state_restart_with_multiple_rows_init_state(rocksdb, tmp_path):
    _restart_with_multiple_rows_init_state(rocksdb, tmp_path)


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_transform_with_state_with_timers_single_partition(rocksdb, tmp_path):
    old = rocksdb.conf.get("spark.sql.shuffle.partitions")
    rocksdb.conf.set("spark.sql.shuffle.partitions", "1")
    try:
        _init_state_with_timers(rocksdb, tmp_path / "timers")
        _restart_with_multiple_rows_init_state(rocksdb, tmp_path / "restart")
    finally:
        rocksdb.conf.set("spark.sql.shuffle.partitions", old)


# -- state TTL expiring, against a sequential model of Spark's TTL ---------------------------
TTL_MS = 3_000
TTL_OUT = StructType([StructField("id", StringType()), StructField("ts", LongType()),
                      StructField("value", LongType()), StructField("listed", StringType()),
                      StructField("mapped", StringType())])


class TTLReads(StatefulProcessor):
    """Per key: what its value, list and map state (each with a TTL) hold when its rows come,
    then, if the rows' sum is odd, the sum written to each."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.value = handle.getValueState("v", "n long", TTL_MS)
        self.list = handle.getListState("l", "n long", TTL_MS)
        self.map = handle.getMapState("m", "k string", "n long", TTL_MS)

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        now = timerValues.getCurrentProcessingTimeInMs()
        v = self.value.get()
        listed = ",".join(str(x[0]) for x in self.list.get())
        mapped = ",".join(sorted(f"{a[0]}={b[0]}" for a, b in self.map.iterator()))
        s = int(sum(int(pdf["temperature"].sum()) for pdf in rows))
        if s % 2:
            self.value.update((s,))
            self.list.appendValue((s,))
            self.map.updateValue((f"k{s % 3}",), (s,))
        yield pd.DataFrame({"id": [key[0]], "ts": [now], "value": [-1 if v is None else v[0]],
                            "listed": [listed], "mapped": [mapped]})


# (id, temperature) per batch: odd sums write, even ones only read
TTL_BATCHES = [[("a", 1), ("b", 1), ("c", 3)],
               [("a", 2), ("b", 3)],
               [("a", 2), ("b", 2), ("c", 2)],
               [("a", 1), ("b", 2), ("c", 2)],
               [("a", 2), ("b", 2), ("c", 1)]]
SLEEP_AFTER = [0.0, TTL_MS / 1000 + 1, 0.0, TTL_MS / 1000 + 1, 0.0]  # (s, in foreachBatch)


def ttl_model(batches, stamps):
    """What ``TTLReads`` outputs under Spark's TTL (what is written at batch time t expires at
    t + TTL and is not read at a batch time >= that), given each batch's timestamp."""
    state = {}
    out = []
    for rows, now in zip(batches, stamps):
        sums = {}
        for k, t in rows:
            sums[k] = sums.get(k, 0) + t
        for k in sorted(sums):
            st = state.setdefault(k, {"v": None, "l": [], "m": {}})
            v = st["v"][0] if st["v"] and st["v"][1] > now else -1
            listed = ",".join(str(x) for x, e in st["l"] if e > now)
            mapped = ",".join(sorted(f"{a}={b}" for a, (b, e) in st["m"].items() if e > now))
            out.append(Row(id=k, ts=now, value=v, listed=listed, mapped=mapped))
            s = sums[k]
            if s % 2:
                st["v"] = (s, now + TTL_MS)
                st["l"] = [(x, e) for x, e in st["l"] if e > now] + [(s, now + TTL_MS)]
                st["m"] = {a: (b, e) for a, (b, e) in st["m"].items() if e > now}
                st["m"][f"k{s % 3}"] = (s, now + TTL_MS)
    return out


@pytest.mark.soak  # (28 s of TTL waits: make test-soak)
def test_state_ttl_expires_as_sparks_on_both_sides(no_data_batches_off, tmp_path):
    """Value, list and map state with a TTL, batches apart by more and by less than it: each
    side's rows are what the model gives for that side's own batch timestamps (native Spark
    checks the model), and state did expire on both."""
    import os

    spark = no_data_batches_off
    for i, rows in enumerate(TTL_BATCHES):
        f = tmp_path / f"in{i}.txt"
        f.write_text("".join(f"{k}, {t}\n" for k, t in rows))
        os.utime(f, (1e9 + i, 1e9 + i))

    def make():
        return build_test_df(spark, tmp_path).groupBy("id").transformWithStateInPandas(
            statefulProcessor=TTLReads(), outputStructType=TTL_OUT, outputMode="Update",
            timeMode="ProcessingTime")

    for side in ("native", "stretch"):
        got = {}

        def check(batch_df, batch_id):
            got[batch_id] = sorted(batch_df.collect())
            time.sleep(SLEEP_AFTER[batch_id])

        queries = []
        seen = run(spark, make(), side, check, queries=queries)
        assert [b for b, _ in seen] == list(range(len(TTL_BATCHES))), seen
        stamps = [got[b][0].ts for b in sorted(got)]
        want = ttl_model(TTL_BATCHES, stamps)
        assert [r for b in sorted(got) for r in got[b]] == want, side
        # (batch 2 comes more than the TTL after batch 1's writes: they have expired)
        assert stamps[2] - stamps[1] >= TTL_MS
        assert [r.value for r in got[2]] == [-1, -1, -1], (side, got[2])
        if stamps[1] - stamps[0] < TTL_MS:  # (b's write of batch 0 read in batch 1)
            assert got[1][1].value == 1, got[1]
    # What expired is gone from the engine's store, read or not since (a's write of batch 3
    # expired by batch 4, where a only read; b's of batch 1 by batch 2): c's state is left
    ops = queries[0].lastProgress["stateOperators"]
    assert ops[0]["numRowsTotal"] == 1, ops


# -- a key's rows cut into DataFrames as pyspark cuts them --------------------------------------
class ChunkSizes(StatefulProcessor):
    """Per key, the sizes of the DataFrames its rows came in."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        pass

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        sizes = [len(pdf) for pdf in rows]
        yield pd.DataFrame({"id": [key[0]], "countAsString": [",".join(map(str, sizes))]})


@pytest.mark.parametrize("conf", [
    {"spark.sql.execution.arrow.maxRecordsPerBatch": "2",
     # (pyspark's test class sets this one: it sizes the JVM's Arrow batches, not the frames)
     "spark.sql.execution.arrow.transformWithStateInPandas.maxRecordsPerBatch": "3"},
    pytest.param({"spark.sql.execution.arrow.maxBytesPerBatch": "20"},
                 marks=pytest.mark.soak)], ids=["records", "bytes"])
def test_rows_cut_by_max_records_and_max_bytes_per_batch_as_natively(rocksdb, tmp_path, conf):
    """A key's rows come in DataFrames of at most ``maxRecordsPerBatch`` rows (the frames'
    sizes equal native's), or fewer where their average Arrow size reaches
    ``maxBytesPerBatch`` (natively the average over the JVM's Arrow batches, their buffers
    padded; here the batch's: both cut every key's rows, the sizes may differ by a row)."""
    spark = rocksdb
    with open(tmp_path / "a.txt", "w") as fw:
        fw.write("".join(f"{k}, {t}\n" for k in "012" for t in range(7 * (int(k) + 1))))
    seen = {}

    def check_results(batch_df, _):
        seen.setdefault("n", []).append(sorted(batch_df.collect()))

    def make():
        return build_test_df(spark, tmp_path).groupBy("id").transformWithStateInPandas(
            statefulProcessor=ChunkSizes(), outputStructType=BASIC_OUT, outputMode="Update",
            timeMode="None")

    for k, v in conf.items():
        spark.conf.set(k, v)
    try:
        both(spark, make, check_results)
    finally:
        for k in conf:
            spark.conf.unset(k)
    native, stretch = seen["n"]

    def sizes(rows):
        return {r.id: [int(n) for n in r.countAsString.split(",")] for r in rows}

    if "spark.sql.execution.arrow.maxBytesPerBatch" not in conf:
        assert native == stretch
    for side in (native, stretch):
        got = sizes(side)
        assert {k: sum(v) for k, v in got.items()} == {"0": 7, "1": 14, "2": 21}, side
        assert all(max(v) < 7 and len(set(v[:-1])) <= 1 for v in got.values()), side


# -- large values ------------------------------------------------------------------------------
BLOB = 100_000  # (characters added per key and batch: values of hundreds of KB)
LARGE_OUT = StructType([StructField("id", StringType()), StructField("value", LongType()),
                        StructField("listed", StringType()), StructField("mapped", StringType())])


class LargeValues(StatefulProcessor):
    """(not pyspark's) Per key and batch, ``BLOB`` characters more in a value state string, one
    ``BLOB``-long element more in a list state and one more map entry: it outputs their sizes and
    checksums."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.value = handle.getValueState("v", "s string")
        self.list = handle.getListState("l", "s string")
        self.map = handle.getMapState("m", "k int", "s string, b binary")

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        import zlib

        t = int(sum(int(pdf["temperature"].sum()) for pdf in rows))
        blob = (f"{key[0]}:{t};" * BLOB)[:BLOB]
        old = self.value.get()
        v = (old[0] if old else "") + blob
        self.value.update((v,))
        self.list.appendValue((blob,))
        self.map.updateValue((len(v) // BLOB,), (blob, blob.encode()))
        listed = [x[0] for x in self.list.get()]
        mapped = sorted((k[0], s, bytes(b)) for k, (s, b) in self.map.iterator())
        assert all(s.encode() == b for _, s, b in mapped)
        yield pd.DataFrame({
            "id": [key[0]], "value": [zlib.crc32(v.encode())],
            "listed": [f"{len(listed)}:{sum(map(len, listed))}:"
                       f"{zlib.crc32(''.join(listed).encode())}"],
            "mapped": [";".join(f"{k}:{len(s)}:{zlib.crc32(b)}" for k, s, b in mapped)]})


def _large_values_model(batches):
    """What ``LargeValues`` outputs, computed sequentially."""
    import zlib

    state, out = {}, []
    for rows in batches:
        sums = {}
        for k, t in rows:
            sums[k] = sums.get(k, 0) + t
        got = []
        for k, t in sums.items():
            blob = (f"{k}:{t};" * BLOB)[:BLOB]
            v, listed, mapped = state.get(k, ("", [], {}))
            v += blob
            listed = listed + [blob]
            mapped = {**mapped, len(v) // BLOB: blob}
            state[k] = (v, listed, mapped)
            got.append(Row(id=k, value=zlib.crc32(v.encode()),
                           listed=f"{len(listed)}:{sum(map(len, listed))}:"
                                  f"{zlib.crc32(''.join(listed).encode())}",
                           mapped=";".join(f"{m}:{len(s)}:{zlib.crc32(s.encode())}"
                                           for m, s in sorted(mapped.items()))))
        out.append(sorted(got))
    return out


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_large_values_in_value_list_and_map_state(rocksdb, tmp_path):
    """Values of 100 KB to 300 KB (a value state string, list elements, map entries of a string
    and its bytes), three batches: each side's rows are the sequential model's."""
    import os

    batches = [[("0", 1), ("1", 2), ("2", 3)], [("0", 4), ("1", 5)], [("0", 6), ("2", 7)]]
    for i, rows in enumerate(batches):
        f = tmp_path / f"in{i}.txt"
        f.write_text("".join(f"{k}, {t}\n" for k, t in rows))
        os.utime(f, (1e9 + i, 1e9 + i))
    want = _large_values_model(batches)

    def check_results(batch_df, batch_id):
        assert sorted(batch_df.collect()) == want[batch_id]

    def make():
        return build_test_df(rocksdb, tmp_path).groupBy("id").transformWithStateInPandas(
            statefulProcessor=LargeValues(), outputStructType=LARGE_OUT, outputMode="Update",
            timeMode="None")

    got = both(rocksdb, make, check_results)
    assert [b for b, _ in got["stretch"]] == [0, 1, 2]
