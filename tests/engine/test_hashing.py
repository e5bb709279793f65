"""The engine's content hash is Spark's own xxhash64 (the key groups of every host and of the
JVM routing rows agree on it), checked against Spark on the same values."""

from __future__ import annotations

import random
import string

import pyarrow as pa
from pyspark.sql import functions as F

from spark_stretch.engine.hashing import xxhash64


def test_xxhash64_equals_sparks_for_strings_binaries_and_longs(spark):
    rnd = random.Random(7)
    strs = ["", "a"] + ["".join(rnd.choice(string.ascii_letters + "éü☃")
                                for _ in range(rnd.randint(0, 90))) for _ in range(300)]
    longs = [0, 1, -1, 2 ** 63 - 1, -2 ** 63] + [rnd.randint(-2 ** 63, 2 ** 63 - 1)
                                                 for _ in range(297)]
    df = spark.createDataFrame([(s, s.encode(), v) for s, v in zip(strs, longs)],
                               "s string, b binary, v bigint")
    want = df.select(F.xxhash64("s"), F.xxhash64("b"), F.xxhash64("v")).collect()
    assert xxhash64(pa.array(strs)).tolist() == [r[0] for r in want]
    assert xxhash64(pa.array([s.encode() for s in strs], pa.binary())).tolist() == \
        [r[1] for r in want]
    assert xxhash64(pa.array(longs, pa.int64())).tolist() == [r[2] for r in want]
    # an offset slice of an Arrow array hashes its own values
    assert xxhash64(pa.array(strs).slice(5, 40)).tolist() == [r[0] for r in want[5:45]]
    # ints are hashed as Spark hashes a bigint (the routing casts integral keys to bigint)
    assert xxhash64(pa.array([1, -1], pa.int32())).tolist() == [r[2] for r in want[1:3]]
    # a null's hash is Spark's (the seed): the group the routing gives a nullable key's nulls
    nulls = spark.createDataFrame([(None, None)], "s string, v bigint").select(
        F.xxhash64("s"), F.xxhash64("v")).first()
    assert xxhash64(pa.array([None, "a"])).tolist() == [nulls[0], want[1][0]]
    assert xxhash64(pa.array([None, 1], pa.int64())).tolist() == [nulls[1], want[1][2]]


def test_spark_xxhash64_of_several_columns_equals_sparks(spark):
    # Spark's xxhash64(c1, c2, ...) of every type a grouping key may have here, nulls included
    # (a null leaves the hash as it was): the buckets of a one-host checkpoint moved to several
    from spark_stretch.engine.hashing import spark_xxhash64

    rnd = random.Random(11)

    def maybe(v):
        return None if rnd.random() < 0.15 else v

    rows = []
    for i in range(400):
        rows.append((
            maybe("".join(rnd.choice("abcé☃") for _ in range(rnd.randint(0, 40)))),
            maybe(rnd.randint(-2 ** 31, 2 ** 31 - 1)), maybe(rnd.randint(-2 ** 63, 2 ** 63 - 1)),
            maybe(rnd.randint(-2 ** 15, 2 ** 15 - 1)), maybe(rnd.randint(-128, 127)),
            maybe(rnd.random() < 0.5),
            maybe(rnd.choice([0.0, -0.0, 1.5, -2.25, 1e300, rnd.random()])),
            maybe(rnd.choice([0.0, -0.0, 1.5, rnd.random()])),
            maybe(rnd.randint(-10 ** 12, 10 ** 12) * 1000), maybe(rnd.randint(-20000, 40000)),
            maybe(bytes(rnd.randrange(256) for _ in range(rnd.randint(0, 50))))))
    ddl = ("s string, i int, l bigint, h smallint, t tinyint, b boolean, d double, f float, "
           "ts_us bigint, days int, bin binary")
    df = (spark.createDataFrame(rows, ddl)
          .withColumn("ts", F.timestamp_micros("ts_us")).withColumn("dt", F.date_from_unix_date("days"))
          .drop("ts_us", "days"))
    cols = df.columns
    sets = [[c] for c in cols] + [["s", "i"], ["l", "s", "b"], cols, ["dt", "ts", "f", "d"]]
    want = df.select(*[F.xxhash64(*c).alias(f"h{j}") for j, c in enumerate(sets)]).collect()
    table = df.toArrow()
    for j, c in enumerate(sets):
        got = spark_xxhash64([table.column(k) for k in c]).tolist()
        assert got == [r[j] for r in want], c
