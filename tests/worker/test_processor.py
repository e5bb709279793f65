"""The transformWithState drop-in's output: what the processor yields, converted to Arrow.

Oracle: pyspark's conversion of each DataFrame alone (what ``TransformWithStateInPandasSerializer``
does natively).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from pyspark.sql.conversion import PandasToArrowConversion
from pyspark.sql.types import (ArrayType, BooleanType, DoubleType, IntegerType, LongType,
                               StringType, StructField, StructType, TimestampType)

from spark_stretch.worker.processor import _Output

SCHEMA = StructType([StructField("k", StringType()), StructField("n", LongType()),
                     StructField("x", DoubleType()), StructField("b", BooleanType()),
                     StructField("i", IntegerType()), StructField("t", TimestampType())])


def _inst(schema=SCHEMA, safecheck=True):
    return SimpleNamespace(out_schema=schema, tz="UTC", safecheck=safecheck,
                           assign_cols_by_name=True, int_to_decimal=False, use_rows=False)


def _alone(inst, frames):
    return pa.Table.from_batches([PandasToArrowConversion.convert(
        f, inst.out_schema, timezone=inst.tz, safecheck=inst.safecheck, arrow_cast=True,
        assign_cols_by_name=True, int_to_decimal_coercion_enabled=False)
        for f in frames if len(f)])


def _frames(rng, count):
    out = []
    for _ in range(count):
        r = int(rng.integers(0, 4))
        x = rng.normal(size=r)
        x[rng.random(r) < 0.2] = np.nan
        k = pd.array([None if rng.random() < 0.2 else f"u{v}" for v in rng.integers(0, 9, r)],
                     dtype="str")
        out.append(pd.DataFrame({
            "k": k, "n": rng.integers(-2**62, 2**62, r), "x": x, "b": rng.random(r) < 0.5,
            "i": rng.integers(-5, 5, r).astype(np.int32),
            "t": pd.to_datetime(rng.integers(0, 2**40, r), unit="ms")}))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_frames_converted_together_equal_each_converted_alone(seed):
    rng = np.random.default_rng(seed)
    frames = _frames(rng, 300)
    # (a few of other signatures between: columns reordered, an int column as float, objects)
    frames[50] = frames[50][["n", "k", "x", "b", "i", "t"]]
    frames[120] = frames[120].astype({"n": "float64"})
    frames[200] = frames[200].astype({"k": object})
    inst = _inst()
    out = _Output(inst)
    for f in frames:
        out.add(f)
    got = pa.Table.from_batches(out.finish())
    assert got.equals(_alone(inst, frames))
    assert got.num_rows == sum(map(len, frames)) > 0


def test_object_columns_are_converted_frame_by_frame():
    schema = StructType([StructField("a", ArrayType(LongType()))])
    inst = _inst(schema)
    frames = [pd.DataFrame({"a": [[1, 2]]}), pd.DataFrame({"a": [[3]]})]
    out = _Output(inst)
    for f in frames:
        out.add(f)
    got = out.finish()
    assert len(got) == 2  # (one per frame)
    assert pa.Table.from_batches(got).equals(_alone(inst, frames))


def test_an_error_is_pysparks_for_its_frame():
    # a value that does not fit the output's int column: pyspark's error, as for the frame alone
    schema = StructType([StructField("i", IntegerType())])
    inst = _inst(schema)
    frames = [pd.DataFrame({"i": [1]}), pd.DataFrame({"i": [2**40]}), pd.DataFrame({"i": [3]})]
    with pytest.raises(Exception) as alone:
        _alone(inst, frames)
    out = _Output(inst)
    for f in frames:
        out.add(f)
    with pytest.raises(type(alone.value)) as together:
        out.finish()
    assert str(together.value) == str(alone.value)
