"""The engine's own column work: Spark's unsafe rows of a composite key built from Arrow
columns and read back, and the input projection evaluated as Spark evaluates it."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pyarrow as pa
import pytest

from spark_stretch.host.columns import prepare, unsafe_row_field, unsafe_rows

FIELDS = [
    ("string", pa.array(["", None, "naïve", "exactly8", "a" * 17, "b"])),
    ("long", pa.array([0, -1, None, 2 ** 62, -2 ** 63, 7], pa.int64())),
    ("int", pa.array([-1, None, 2 ** 31 - 1, -2 ** 31, 0, 3], pa.int32())),
    ("short", pa.array([-2, 5, None, 300, 0, 1], pa.int16())),
    ("byte", pa.array([-3, None, 127, -128, 0, 1], pa.int8())),
    ("bool", pa.array([True, False, None, True, False, True])),
    ("date", pa.array([dt.date(1969, 12, 31), None, dt.date(2024, 2, 29), dt.date(1970, 1, 1),
                       dt.date(1, 1, 1), dt.date(9999, 12, 31)])),
    ("timestamp", pa.array([-1, 0, None, 1_700_000_000_000_000, 5, 6],
                           pa.timestamp("us", "UTC"))),
    ("string", pa.array([None, "x", "", "two words", None, "é" * 5])),
]


def test_unsafe_rows_read_back_field_by_field():
    types, arrays = zip(*FIELDS)
    rows = unsafe_rows(list(arrays), list(types), 6)
    for j, (t, a) in enumerate(FIELDS):
        assert unsafe_row_field(rows, len(FIELDS), j, t).to_pylist() == a.to_pylist(), t
    # Spark's layout: 8-byte aligned rows, the null bits, zeroed padding
    data = [r.as_py() for r in rows]
    assert all(len(r) % 8 == 0 for r in data)
    head = 8 + 8 * len(FIELDS)
    assert int.from_bytes(data[1][:8], "little") == (1 << 0) | (1 << 2) | (1 << 4) | (1 << 6)
    assert data[2][head:head + 8] == "naïve".encode() + b"\0\0"   # 6 bytes, padded to 8
    assert data[0][8:16] == (head << 32).to_bytes(8, "little")    # "" at the var section's start


def test_equal_keys_give_equal_bytes_and_others_differ():
    # nulls grouped as Spark groups them: (null, "y") and ("y", null) are different keys
    a = pa.array(["y", None, "y", None, "y"])
    b = pa.array([None, "y", None, "y", "y"])
    rows = unsafe_rows([a, b], ["string", "string"], 5).to_pylist()
    assert rows[0] == rows[2] and rows[1] == rows[3]
    assert len({rows[0], rows[1], rows[4]}) == 3


def test_more_than_64_fields_use_two_null_words():
    fields = [pa.array([i, None], pa.int64()) for i in range(70)]
    rows = unsafe_rows(fields, ["long"] * 70, 2)
    assert [unsafe_row_field(rows, 70, j, "long").to_pylist() for j in (0, 65, 69)] == \
        [[0, None], [65, None], [69, None]]
    assert len(rows[0].as_py()) == 8 * (2 + 70)


@pytest.mark.parametrize("legacy, want", [(False, [2, None, 0]), (True, [2, -1, 0])])
def test_prepare_size_coalesce_if_and_key(legacy, want):
    t = pa.table({"w": pa.array([["a", "b"], None, []]), "v": pa.array([1, None, 3], pa.int32()),
                  "k": pa.array(["x", "y", None]),
                  "t": pa.array([0, None, 5], pa.timestamp("us", "UTC"))})
    got = prepare(t, [
        {"name": "n", "expr": {"size": [{"col": "w"}], "legacy": legacy}},
        {"name": "s", "expr": {"coalesce": [{"cast": {"col": "v"}, "type": "double"},
                                            {"lit": 0.0, "type": "double"}]}},
        {"name": "nn", "expr": {"if": [{"or": [{"isnull": [{"col": "v"}]},
                                               {"isnull": [{"col": "k"}]}]},
                                       {"lit": 0, "type": "long"}, {"lit": 1, "type": "long"}]}},
        {"name": "end", "expr": {"cast": {"addus": {"col": "t"}, "us": 2_000_000},
                                 "type": "timestamp"}},
        {"name": "key", "expr": {"row": [{"col": "k"}, {"size": [{"col": "w"}],
                                                        "legacy": legacy}],
                                 "types": ["string", "int"]}},
    ])
    assert got.column("n").to_pylist() == want
    assert got.column("s").to_pylist() == [1.0, 0.0, 3.0]
    assert got.column("nn").to_pylist() == [1, 0, 0]
    assert unsafe_row_field(got.column("key"), 2, 0, "string").to_pylist() == ["x", "y", None]
    assert unsafe_row_field(got.column("key"), 2, 1, "int").to_pylist() == want
    assert np.asarray(got.column("s")).dtype == np.float64
    assert got.column("end").to_pylist() == [dt.datetime(1970, 1, 1, 0, 0, 2, tzinfo=dt.timezone.utc),
                                             None, dt.datetime(1970, 1, 1, 0, 0, 2, 5,
                                                               tzinfo=dt.timezone.utc)]


def test_coalesce_of_a_column_without_nulls_shares_its_buffer():
    import pyarrow.compute as pc

    t = pa.table({"x": pa.chunked_array([[1, 2], [3]], pa.int64()),
                  "y": pa.array([1, None, 3], pa.int64())})
    cols = [{"name": c, "expr": {"coalesce": [{"cast": {"col": c}, "type": "long"},
                                              {"lit": 0, "type": "long"}]}} for c in "xy"]
    got = prepare(t, cols)
    for c in "xy":  # (Arrow's coalesce, the oracle)
        assert got.column(c).to_pylist() == pc.coalesce(t.column(c), 0).to_pylist()
    # the column without nulls is the scan's own (no copy); the one with nulls a new array
    assert [ch.buffers()[1].address for ch in got.column("x").chunks] == \
        [ch.buffers()[1].address for ch in t.column("x").chunks]
    assert got.column("y").chunk(0).buffers()[1].address != t.column("y").chunk(0).buffers()[1].address
    # a first argument of another type than the rest: Arrow's coalesce decides (no shortcut)
    odd = prepare(t, [{"name": "z", "expr": {"coalesce": [{"col": "x"},
                                                          {"lit": 0.5, "type": "double"}]}}])
    assert odd.column("z").to_pylist() == pc.coalesce(t.column("x"), 0.5).to_pylist()
    assert odd.column("z").type == pa.float64()  # (ints would compare equal to the doubles)


def test_a_doubles_bits_as_longs_and_back():
    # (max_by/min_by of doubles keep the bits in the engine's int slot); Java's
    # doubleToRawLongBits as the oracle: struct's view of the same 8 bytes
    import struct

    from spark_stretch.host.columns import finish

    xs = [1.5, -0.0, float("inf"), None, 2.0 ** -1074, -3.25e300]
    t = prepare(pa.table({"x": pa.array(xs, pa.float64())}),
                [{"name": "b", "expr": {"bits": [{"col": "x"}]}}])
    want = [None if x is None else struct.unpack("<q", struct.pack("<d", x))[0] for x in xs]
    assert t.column("b").to_pylist() == want
    back = finish(t, [{"name": "x", "expr": {"unbits": [{"ref": 0}]}}]).column("x").to_pylist()
    assert [None if x is None else struct.pack("<d", x) for x in back] == \
        [None if x is None else struct.pack("<d", x) for x in xs]
    nan = prepare(pa.table({"x": pa.array([float("nan")])}),
                  [{"name": "b", "expr": {"bits": [{"col": "x"}]}}]).column("b")
    assert np.isnan(finish(pa.table({"b": nan}), [{"name": "x", "expr": {"unbits": [{"ref": 0}]}}])
                    .column("x")[0].as_py())


def test_doubles_as_longs_in_sparks_order():
    # (a max_by/min_by ordered by a double): NaN above +inf, -0.0 equal to 0.0, every NaN one
    import struct

    xs = [float("-inf"), -3.25e300, -1.5, -2.0 ** -1074, -0.0, 0.0, 2.0 ** -1074, 1.5,
          float("inf"), float("nan"), None]
    neg_nan = struct.unpack("<d", struct.pack("<q", -1))[0]  # (a NaN with its sign bit set)
    keys = prepare(pa.table({"x": pa.array(xs + [neg_nan], pa.float64())}),
                   [{"name": "o", "expr": {"dorder": [{"col": "x"}]}}]).column("o").to_pylist()
    assert keys[-2] is None and keys[4] == keys[5] == 0 and keys[9] == keys[11]
    ordered = keys[:4] + keys[5:10]
    assert ordered == sorted(ordered) and len(set(ordered)) == len(ordered)
