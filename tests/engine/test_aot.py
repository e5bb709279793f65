"""The engine's kernels built ahead of time (engine/aot.py, loaded by engine/native.py and
engine/jit.py): an aggregation runs on the library without numba in the process and gives the
windows a pandas reference gives, as numba's kernels do; a signature the library lacks falls
back to numba; a damaged library is not used."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from spark_stretch.engine.aot import build
from spark_stretch.engine.native import library_path
import spark_stretch.engine as engine
from pathlib import Path

PKG = Path(engine.__file__).parent

# An aggregation through the host's runtime (tables grown, windows fired at the watermark),
# then, after the signatures are kept, xxhash64 over int32 values (a kernel signature no
# aggregation of bigints compiles).
_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np, pandas as pd, pyarrow as pa, pyarrow.compute as pc
    from spark_stretch.engine import jit
    from spark_stretch.engine.hashing import xxhash64
    from spark_stretch.host.aggregate import AggregateRuntime
    from spark_stretch.protocol.specs import AggregateSpec

    class Kept:
        def __init__(self):
            self.out = {}
        def offer(self, stream, table):
            if table is not None:
                self.out[stream] = table

    W = 10_000_000
    rng = np.random.default_rng(5)
    batches = []
    for b in range(3):
        ts = (b * 20 + rng.integers(0, 20, 20_000)) * 1_000_000
        batches.append(pa.table({"ts": pa.array(ts, pa.timestamp("us", "UTC")),
                                 "user": rng.integers(0, 3_000, 20_000),
                                 "x": rng.integers(-50, 1_000, 20_000)}))
    batches.append(pa.table({"ts": pa.array([10_000 * 1_000_000], pa.timestamp("us", "UTC")),
                             "user": pa.array([0], pa.int64()), "x": pa.array([0], pa.int64())}))
    spec = AggregateSpec(ts_column="ts", delay_ms=0, key_kind="scalar", key_column="user",
                         key_type="long", window_us=W, slide_us=W,
                         aggs=[("count", None), ("sum", "x"), ("max", "x")],
                         value_types={"x": "long"}, parallelism=2, max_parallelism=2, buckets=64)
    kept = Kept()
    rt = AggregateRuntime("q", spec, kept)
    for b, t in enumerate(batches + [None]):
        if t is not None:
            rt.ingest(f"in:{b}", "j", t)
        rt.step(b)
    rt.close()
    out = pa.concat_tables(list(kept.out.values()))
    start = pc.cast(pc.struct_field(out.column(0), [0]), pa.int64()).to_numpy()
    rows = sorted(zip(start.tolist(), *(out.column(i).to_pylist() for i in range(1, 5))))
    t = pa.concat_tables(batches[:-1])
    us = pc.cast(t.column("ts"), pa.int64()).to_numpy()
    df = pd.DataFrame({"start": us - us % W, "user": t.column("user").to_numpy(),
                       "x": t.column("x").to_numpy()})
    g = df.groupby(["start", "user"]).x.agg(["count", "sum", "max"]).reset_index()
    ref = sorted(map(tuple, g[["start", "user", "count", "sum", "max"]].to_numpy().tolist()))
    numba_during_run = "numba" in sys.modules
    kept_sigs = jit.record_signatures() if sys.argv[1] == "record" else None
    h = xxhash64(pa.array(np.arange(1000, dtype=np.int32))).tolist()
    print(json.dumps({"equal": [list(r) for r in rows] == [list(r) for r in ref],
                      "windows": len(rows), "numba_during_run": numba_during_run,
                      "numba_after": "numba" in sys.modules, "hash": h,
                      "library": jit.library() is not None, "kept": kept_sigs}))
""")


def _run(tmp_path, mode, **env):
    e = dict(os.environ, SPARK_STRETCH_AOT_DIR=str(tmp_path), **env)
    e.pop("PYTHONPATH", None)
    r = subprocess.run([sys.executable, "-c", _SCRIPT, mode], env=e, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("aot")
    numba_run, _ = _run(d, "record", SPARK_STRETCH_AOT="0")
    old = os.environ.get("SPARK_STRETCH_AOT_DIR")
    os.environ["SPARK_STRETCH_AOT_DIR"] = str(d)
    try:
        path = build(PKG)
    finally:
        if old is None:
            os.environ.pop("SPARK_STRETCH_AOT_DIR")
        else:
            os.environ["SPARK_STRETCH_AOT_DIR"] = old
    return d, path, numba_run


def test_an_aggregation_on_the_library_imports_no_numba_and_equals_the_reference(built):
    d, path, numba_run = built
    assert path.exists() and path.parent == d
    assert numba_run["equal"] and numba_run["windows"] > 10_000 and numba_run["kept"] >= 3
    assert numba_run["numba_during_run"] and not numba_run["library"]
    lib_run, _ = _run(d, "plain")
    assert lib_run["library"]
    assert lib_run["equal"] and lib_run["windows"] == numba_run["windows"]
    assert not lib_run["numba_during_run"]  # (the engine ran on the library alone)
    # a signature the library lacks: numba compiles it, with the same hashes
    assert lib_run["numba_after"] and lib_run["hash"] == numba_run["hash"]


def test_a_damaged_library_is_not_used(built, tmp_path):
    d, path, numba_run = built
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in d.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / path.name).write_bytes(b"not a shared library")
    run, err = _run(bad, "plain")
    assert not run["library"] and "did not load" in err
    assert run["equal"] and run["numba_during_run"]


def test_a_library_of_other_sources_is_not_used(built, tmp_path, monkeypatch):
    d, path, _ = built
    monkeypatch.setenv("SPARK_STRETCH_AOT_DIR", str(d))
    assert library_path(PKG) == path  # (this checkout's key)
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.py").write_text("x = 1\n")
    assert library_path(other).name != path.name


_CALLS = textwrap.dedent("""
    import json, sys
    import numpy as np
    from spark_stretch.engine import jit
    from tests.engine.aot_kernels import divide, mixed

    grid = np.arange(12, dtype=np.float64).reshape(3, 4)
    pair = (np.array([5, 6], np.int64), np.array([7, 8], np.int64))
    got = {"divide": divide(17, 5),
           "mixed": list(mixed(3, 0.5, np.float32(2.5), np.uint64(2**63 + 5), True,
                               np.int32(-4), grid, pair)),
           "written": grid[0, 0]}
    try:
        divide(1, 0)
    except ZeroDivisionError as e:
        got["raised"] = ["ZeroDivisionError", str(e)]
    if sys.argv[1] == "record":
        jit.record_signatures()
    got["numba"] = "numba" in sys.modules
    print(json.dumps(got))
""")


def test_entries_pack_every_argument_kind_return_tuples_and_raise_as_numba(tmp_path):
    """Scalars of five types (a uint64 past 2**63, a float32, a bool), a 2-d array written
    through, a tuple of arrays, a tuple returned and an exception: equal to numba's."""
    root = str(Path(__file__).parents[2])
    env = dict(os.environ, SPARK_STRETCH_AOT_DIR=str(tmp_path))
    env.pop("PYTHONPATH", None)

    def run(mode, **extra):
        r = subprocess.run([sys.executable, "-c", _CALLS, mode], env=dict(env, **extra),
                           capture_output=True, text=True, timeout=300, cwd=root)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    by_numba = run("record", SPARK_STRETCH_AOT="0")
    assert by_numba["numba"] and by_numba["divide"] == 3 and by_numba["written"] == -1.0
    assert by_numba["raised"][0] == "ZeroDivisionError"
    r = subprocess.run([sys.executable, "-m", "spark_stretch.engine.aot", str(PKG)],
                       env=dict(env, SPARK_STRETCH_AOT="0", NUMBA_CACHE_DIR=str(tmp_path / "nc")),
                       capture_output=True, text=True, timeout=600, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    built = json.loads(r.stdout.strip().splitlines()[-1])
    assert not [s for s in built["skipped"] if "aot_kernels" in s], built["skipped"]
    by_library = run("plain")
    assert not by_library.pop("numba")  # (every call on the library)
    by_numba.pop("numba")
    assert by_library == by_numba
