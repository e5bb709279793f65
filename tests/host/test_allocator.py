"""The engine process's allocator: pyarrow without pandas until something needs it
(``allocator.arrow_without_pandas``), against a process that had pandas all along."""

from __future__ import annotations

import subprocess
import sys

_ENV = {"SPARK_STRETCH_PROCESS": "host", "PATH": "/usr/bin:/bin"}

_TO_PANDAS = """
import sys, datetime, decimal
import pyarrow as pa
from spark_stretch.host import allocator
if sys.argv[1] == "without":
    assert allocator.arrow_without_pandas() and "pandas" not in sys.modules
t = pa.table({
    "ts": pa.array([datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc), None],
                   pa.timestamp("us", "UTC")),
    "ntz": pa.array([datetime.datetime(2020, 1, 1), None], pa.timestamp("us")),
    "d": pa.array([datetime.date(2020, 1, 2), None], pa.date32()),
    "dec": pa.array([decimal.Decimal("1.5"), None], pa.decimal128(10, 2)),
    "s": pa.array(["a", None]), "i": pa.array([1, None], pa.int64()),
    "f": pa.array([1.5, None]), "b": pa.array([True, None]), "l": pa.array([[1, 2], None]),
    "st": pa.array([{"x": 1}, None]), "bin": pa.array([b"x", None]),
    "dict": pa.array(["a", "b"]).dictionary_encode()})
print("pandas" in sys.modules, [c.to_numpy(zero_copy_only=False).tolist() for c in t.columns])
import pandas as pd
df = t.to_pandas()
print(df.dtypes.tolist(), df.values.tolist())
print(pd.util.hash_pandas_object(df[["ts", "ntz", "d", "dec", "s", "i", "f", "b", "bin"]],
                                 index=False).tolist())
print(pa.array(pd.Series(["a", "b"], dtype="category")).type, pa.Table.from_pandas(df).schema)
"""


def _run(code: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=300, env=_ENV)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_pyarrow_without_pandas_converts_as_a_process_with_pandas_does():
    """numpy and pandas from every kind of column, pandas hashes, and pandas objects back to
    Arrow: the same after ``arrow_without_pandas`` (pandas imported only by ``to_pandas``) as
    in a process where pyarrow had pandas from the start."""
    without, normal = _run(_TO_PANDAS, "without"), _run(_TO_PANDAS, "with")
    assert without.splitlines()[0].startswith("False ")  # (to_numpy of every column: no pandas)
    assert normal.splitlines()[0].startswith("True ")
    assert without.splitlines()[1:] == normal.splitlines()[1:]


_AGGREGATE_AND_WRITE = """
import sys
from spark_stretch.host import allocator
allocator.tune_malloc(); allocator.set_up()  # (as the daemon's main)
import numpy as np, pyarrow as pa
from deltalake import DeltaTable, write_deltalake
from spark_stretch.host import delta
from spark_stretch.host.aggregate import AggregateRuntime
from spark_stretch.protocol.specs import AggregateSpec, Checkpointing

class Kept:
    def __init__(self):
        self.out = []
    def offer(self, stream, table):
        if table is not None: self.out.append(table)

d = sys.argv[1]
spec = AggregateSpec(ts_column="ts", delay_ms=0, key_kind="scalar", key_column="user",
                     key_type="long", window_us=10_000_000, slide_us=10_000_000,
                     aggs=[("count", None), ("sum", "x"), ("max", "x")],
                     value_types={"x": "long"}, parallelism=2, max_parallelism=2, buckets=64,
                     checkpoint=Checkpointing(state_dir=d + "/state"))
kept = Kept()
rt = AggregateRuntime("q", spec, kept)
rt.warm_up()
s = np.arange(1000)
for b, (sec, user) in enumerate([(s, s % 7), (np.array([10_000]), np.array([0]))]):
    rt.ingest(f"in:{b}", "j", pa.table({"ts": pa.array(sec * 1_000_000, pa.timestamp("us", "UTC")),
                                       "user": user, "x": user * 2}))
    rt.step(b)
rt.step(2)  # (Spark's no-data batch: the watermark closes the windows)
rt.close()
out = pa.concat_tables(kept.out)
write_deltalake(d + "/t", out.slice(0, 0))
delta.append(d + "/t", out, "app", 0)
print("pandas" in sys.modules, DeltaTable(d + "/t").to_pyarrow_table().num_rows,
      sum(out.column(2).to_pylist()), flush=True)
import os
os._exit(0)  # (as the daemon ends: no interpreter teardown, where a library's thread may abort)
"""


def test_an_aggregation_and_its_delta_write_leave_pandas_out_of_the_engine(tmp_path):
    """The engine's process keeps pandas out (``allocator.arrow_without_pandas``: 30 MB)
    through an aggregation's batches, its checkpoints, its close and its Delta write: the rows
    are the windows a sequential count makes."""
    windows = {(sec // 10, sec % 7) for sec in range(1000)}
    assert _run(_AGGREGATE_AND_WRITE, str(tmp_path)).split() == [
        "False", str(len(windows)), "1000"]


_DELTA_WRITE_RETAINS = """
import runpy, sys
sys.argv = ['daemon', '--help']
try:
    runpy.run_module('spark_stretch.host.daemon', run_name='__main__')
except SystemExit:
    pass
import numpy as np, pyarrow as pa
from deltalake import write_deltalake
n = 2_000_000
rng = np.random.default_rng(1)
t = pa.table({"user": rng.integers(1, 1 << 62, n), "n": rng.integers(1, 5, n),
              "s": rng.integers(0, 1 << 40, n)})
write_deltalake(PATH, t.slice(0, 0))
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) << 10
before = rss()
write_deltalake(PATH, t, mode="append")
print(rss() - before)
"""


def test_the_engines_delta_appends_give_their_memory_back(tmp_path):
    """deltalake's own jemalloc, as the engine's process sets it up
    (``allocator.DELTALAKE_MALLOC_CONF``), gives an append's pages back: it keeps well under
    half of what it keeps with jemalloc's defaults (a user's ``_RJEM_MALLOC_CONF``, here empty,
    stands)."""
    def kept(name, **env):
        code = _DELTA_WRITE_RETAINS.replace("PATH", repr(str(tmp_path / name)))
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=300, env={"SPARK_STRETCH_PROCESS": "host",
                                                "PATH": "/usr/bin:/bin", **env})
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout.split()[-1])

    default = kept("default", _RJEM_MALLOC_CONF="")
    tuned = kept("tuned")
    assert default > 16 << 20, default  # (what the setting is for)
    assert tuned < default / 2, (tuned, default)
