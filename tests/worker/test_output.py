"""The drop-in's output conversion: the padded concatenation of the function's DataFrames.

Oracle: ``pd.concat`` itself (what pyspark's ``ApplyInPandasWithStateSerializer`` runs), and
pyspark's Arrow conversion of its result.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from pyspark.sql.conversion import PandasToArrowConversion
from pyspark.sql.types import (BooleanType, DoubleType, IntegerType, LongType, StringType,
                               StructField, StructType, TimestampType)

from spark_stretch.worker import output
from spark_stretch.worker.output import concat_padded

SCHEMA = StructType([StructField("k", StringType()), StructField("n", LongType()),
                     StructField("x", DoubleType()), StructField("b", BooleanType()),
                     StructField("i", IntegerType())])


def _frames(rng, count, rows=(1, 3)):
    out = []
    for _ in range(count):
        r = int(rng.integers(rows[0], rows[1] + 1))
        x = rng.normal(size=r)
        x[rng.random(r) < 0.2] = np.nan
        k = pd.array([None if rng.random() < 0.2 else f"u{v}" for v in rng.integers(0, 9, r)],
                     dtype="str")
        out.append(pd.DataFrame({"k": k, "n": rng.integers(-2**62, 2**62, r), "x": x,
                                 "b": rng.random(r) < 0.5,
                                 "i": rng.integers(-5, 5, r).astype(np.int32)}))
    return out


def _native(pdfs, names, pad):
    return pd.concat(list(pdfs) + [pd.DataFrame(dict.fromkeys(names), index=list(range(pad)))],
                     ignore_index=True)


def _arrow(merged, rows):
    return PandasToArrowConversion.convert(
        merged, SCHEMA, timezone="UTC", safecheck=False, arrow_cast=True,
        assign_cols_by_name=True, int_to_decimal_coercion_enabled=False).slice(0, rows)


@pytest.mark.parametrize("pad", [0, 3])
def test_frames_of_one_layout_are_concatenated_as_pandas_does(pad):
    rng = np.random.default_rng(pad)
    pdfs = _frames(rng, 500)
    fast = output._concat_same_layout(pdfs, SCHEMA.names, pad,
                                      pd.DataFrame(dict.fromkeys(SCHEMA.names),
                                                   index=list(range(pad))))
    assert fast is not None  # (the common case takes the fast path)
    want = _native(pdfs, SCHEMA.names, pad)
    pd.testing.assert_frame_equal(fast, want, check_exact=True)
    assert [[type(v) for v in fast[c]] for c in fast] == [[type(v) for v in want[c]]
                                                         for c in want]
    rows = sum(len(p) for p in pdfs)
    assert _arrow(fast, rows).equals(_arrow(want, rows))


def test_other_frames_go_to_pandas_concat():
    rng = np.random.default_rng(7)
    same = _frames(rng, 3)
    cases = {
        "columns in another order": same[:2] + [same[2][["n", "k", "x", "b", "i"]]],
        "another column type": same[:2] + [same[2].astype({"n": "float64"})],
        "a timestamp column": [p.assign(i=pd.Timestamp("2020-01-01")) for p in same],
        "a missing column": same[:2] + [same[2].drop(columns="i")],
        "nullable integers": [p.astype({"n": "Int64"}) for p in same],
    }
    for what, pdfs in cases.items():
        pad = pd.DataFrame(dict.fromkeys(SCHEMA.names), index=list(range(1)))
        assert output._concat_same_layout(pdfs, SCHEMA.names, 1, pad) is None, what
        pd.testing.assert_frame_equal(concat_padded(pdfs, SCHEMA.names, 1),
                                      _native(pdfs, SCHEMA.names, 1))
