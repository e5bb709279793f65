"""The ``stretch`` data source moves real data between executor JVMs and the host receiver."""

from __future__ import annotations

import pyarrow as pa
import pytest
from chispa import assert_df_equality
from pyspark.errors import IllegalArgumentException
from pyspark.sql import functions as F

from spark_stretch.driver.shim import shim_jar

ROWS = 1_000_000


def _sample(spark, n):
    return spark.range(n).select(
        "id",
        F.expr("cast(id % 97 as string)").alias("word"),
        F.expr("timestamp_seconds(id)").alias("ts"),
        (F.col("id") / 3).alias("x"),
        F.when(F.col("id") % 5 == 0, None).otherwise(F.col("id")).alias("maybe"),
        F.expr("array(cast(id as string), 'a')").alias("words"),
    )


def test_format_resolves_to_the_shim(spark):
    cls = spark._jvm.org.apache.spark.sql.execution.datasources.DataSource.lookupDataSource(
        "stretch", spark._jsparkSession.sessionState().conf())
    assert cls.getName() == "org.apache.spark.sql.stretch.StretchDataSource"
    assert str(shim_jar()) in spark.conf.get("spark.jars")


def test_million_rows_arrive_complete_and_identical(spark, receiver):
    df = _sample(spark, ROWS)
    df.write.format("stretch").mode("append").options(**receiver.options("in")).save()
    got = receiver.take("in")
    assert isinstance(got, pa.Table) and got.num_rows == ROWS
    assert receiver.take("in") is None  # taken once
    # Spark's own Arrow of the same frame is the oracle (chispa on a million rows takes a minute)
    want = df.toArrow()
    order = [("id", "ascending")]
    assert got.select(want.column_names).sort_by(order).cast(want.schema) \
        .equals(want.sort_by(order))


def test_each_save_is_one_committed_job(spark, receiver):
    for _ in range(3):
        spark.range(0, 10, 1, 4).write.format("stretch").mode("append") \
            .options(**receiver.options("s")).save()
    assert receiver.jobs_committed == 3
    assert sorted(receiver.take("s")["id"].to_pylist()) == sorted(list(range(10)) * 3)


def test_empty_partitions_and_empty_frames(spark, receiver):
    spark.range(0).write.format("stretch").mode("append").options(**receiver.options("e")).save()
    got = receiver.take("e")
    assert got is not None and got.num_rows == 0 and got.column_names == ["id"]


def test_read_returns_what_was_offered(spark, receiver):
    offered = pa.table({
        "k": pa.array(["a", "b", None, "d"], pa.large_string()),
        "v": pa.array([1.5, 2.5, 3.5, None]),
        "ts": pa.array([0, 1_000, 2_000, 3_000], pa.timestamp("ms", tz="UTC")),
        "n": pa.array([[1, 2], [], None, [3]], pa.list_(pa.int64())),
    })
    receiver.offer("out", offered)
    df = spark.read.format("stretch").options(**receiver.options("out")).load()
    assert df.rdd.getNumPartitions() == 1  # one input partition per receiver
    expected = spark.createDataFrame(offered.cast(pa.schema([
        ("k", pa.string()), ("v", pa.float64()), ("ts", pa.timestamp("us", tz="UTC")),
        ("n", pa.list_(pa.int64()))])))
    assert_df_equality(df, expected, ignore_row_order=True, ignore_nullable=True)
    # Offers stay until replaced, so a retried read task sees the same rows.
    assert df.count() == 4 and df.count() == 4


def test_read_is_placed_on_the_receivers_host(spark, receiver):
    receiver.offer("out", pa.table({"x": [1]}))
    df = spark.read.format("stretch").options(**receiver.options("out")).load()
    rdd = df._jdf.queryExecution().toRdd()
    # What the scheduler uses to place the task (it walks down to the scan's own RDD).
    locs = spark.sparkContext._jsc.sc().getPreferredLocs(rdd, 0)
    assert locs.mkString(",") == receiver.host


def test_large_read_with_nested_columns(spark, receiver):
    # Several Arrow batches (batchRows 65536), with struct and list columns: Spark frees consumed
    # batches, which must not break the next one (a struct vector loses its children on close).
    n = 300_000
    ids = pa.array(range(n))
    table = pa.table({"id": ids, "s": pa.StructArray.from_arrays([ids, ids], names=["a", "b"]),
                      "l": pa.ListArray.from_arrays(pa.array(range(0, 2 * n + 1, 2), pa.int32()),
                                                    pa.array(range(2 * n)))})
    receiver.offer("big", table)
    df = spark.read.format("stretch").options(**receiver.options("big")).load()
    row = df.agg(F.count("*").alias("n"), F.sum("id").alias("i"), F.sum("s.b").alias("b"),
                 F.sum(F.element_at("l", 2)).alias("l")).first()
    assert (row.n, row.i, row.b, row.l) == (n, sum(range(n)), sum(range(n)),
                                            sum(2 * k + 1 for k in range(n)))


@pytest.mark.parametrize("splits", [2, 3, 7])
def test_read_in_splits_returns_every_row_once(spark, receiver, splits):
    # `splits` partitions per receiver (so several cores write the output), each a slice of rows.
    n = 100_003
    receiver.offer("big", pa.table({"id": pa.array(range(n))}))
    df = spark.read.format("stretch").options(**receiver.options("big")).option("splits", splits).load()
    assert df.rdd.getNumPartitions() == splits
    per = df.groupBy(F.spark_partition_id().alias("p")).agg(F.count("*").alias("n")).collect()
    assert sorted(r.n for r in per) == sorted(n * (j + 1) // splits - n * j // splits
                                              for j in range(splits))
    row = df.agg(F.count("*").alias("n"), F.countDistinct("id").alias("d"), F.sum("id").alias("s")).first()
    assert (row.n, row.d, row.s) == (n, n, sum(range(n)))


@pytest.mark.parametrize("option,value,needle", [
    ("splits", "0", "The option 'splits' must be a positive integer"),
    ("batchRows", "zero", "Invalid value 'zero'. The option 'batchRows' must be a positive integer"),
    ("batchRows", "-3", "The option 'batchRows' must be a positive integer"),
    ("timeoutMs", "1.5", "The option 'timeoutMs' must be a positive integer"),
    ("stream", "no spaces allowed", "The option 'stream' must be"),
    ("endpoints", "relative/path.sock", "The option 'endpoints' must be"),
])
def test_wrong_option_value_names_the_option(spark, receiver, option, value, needle):
    writer = spark.range(3).write.format("stretch").mode("append") \
        .options(**receiver.options("in")).option(option, value)
    with pytest.raises(IllegalArgumentException, match=needle):
        writer.save()


def test_missing_endpoints_is_explained(spark):
    with pytest.raises(IllegalArgumentException, match="The option 'endpoints' is required"):
        spark.range(3).write.format("stretch").mode("append").save()


def test_unreachable_receiver_is_a_clear_error(spark, tmp_path):
    with pytest.raises(Exception, match="Cannot reach the stretch receiver"):
        spark.range(3).write.format("stretch").mode("append") \
            .option("endpoints", f"*={tmp_path}/nobody.sock").save()


def test_reading_a_stream_with_no_offer_is_a_clear_error(spark, receiver):
    with pytest.raises(Exception, match="nothing is offered on stream 'nothing'"):
        spark.read.format("stretch").options(**receiver.options("nothing")).load().collect()


# -- the wire: garbage is refused, other clients are not harmed ---------------------------------
def _raw(path, payload: bytes, read=True) -> bytes:
    import socket

    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while read:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
        return out


def _reply(raw: bytes) -> dict:
    import json
    import struct

    (n,) = struct.unpack(">i", raw[:4])
    return json.loads(raw[4:4 + n])


@pytest.mark.parametrize("payload,code,needle", [
    (b"GET / HTTP/1.1\r\n\r\n", "BAD_REQUEST", "not a stretch frame"),
    (b"\x7f\xff\xff\xff" + b"x" * 64, "BAD_REQUEST", "not a stretch frame"),
    (b"\x00\x00\x00\x05hello", "BAD_REQUEST", "not UTF-8 JSON"),
    (b"\x00\x00\x00\x02[]", "BAD_REQUEST", "JSON list, not an object"),
    (b'\x00\x00\x00\x0f{"op": "nope"}\n', "BAD_REQUEST", "unknown op 'nope'"),
    (b'\x00\x00\x00\x17{"v": 9, "op": "ping"}\n\n', "BAD_REQUEST", "protocol version 9"),
])
def test_garbage_on_the_socket_is_refused_and_other_clients_are_served(payload, code, needle):
    import threading

    import spark_stretch
    from spark_stretch.protocol import messages as M
    from spark_stretch.protocol.framing import call

    with spark_stretch.Receiver() as r:
        r.offer("out", pa.table({"x": [1, 2, 3]}))
        pongs = []

        def well_behaved():  # a client talking while the garbage arrives
            for _ in range(20):
                pongs.append(call(r.socket_path, M.encode_request(M.Ping()))["pid"])

        t = threading.Thread(target=well_behaved)
        t.start()
        reply = _reply(_raw(r.socket_path, payload))
        t.join()
        assert reply["ok"] is False and reply["code"] == code and needle in reply["error"]
        assert len(pongs) == 20
        _raw(r.socket_path, b"\x00\x00", read=False)  # a half frame, then gone: nothing to answer
        assert call(r.socket_path, M.encode_request(M.Ping()))["ok"]
        assert r.offered("out").num_rows == 3


def test_a_control_op_on_a_bare_endpoint_is_refused_with_its_code():
    import spark_stretch
    from spark_stretch.protocol import messages as M
    from spark_stretch.protocol.errors import ErrorCode, RemoteError
    from spark_stretch.protocol.framing import call

    with spark_stretch.Receiver() as r:
        with pytest.raises(RemoteError) as e:
            call(r.socket_path, M.encode_request(M.Step(query="q", batch=0)))
        assert e.value.code is ErrorCode.BAD_REQUEST and "not served here" in str(e.value)
        with pytest.raises(RemoteError) as e:
            call(r.socket_path, M.encode_request(M.Read(stream="none")))
        assert e.value.code is ErrorCode.NOT_OFFERED
