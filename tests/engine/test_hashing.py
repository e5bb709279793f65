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
