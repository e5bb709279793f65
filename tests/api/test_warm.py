"""``python -m spark_stretch warm`` (spark_stretch/api/warm.py): the engine's kernels compiled
and cached by small queries before a real query needs them."""

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import spark_stretch.engine as engine
from spark_stretch.api.warm import warm
from spark_stretch.engine.aot import build


def _signatures(cache, name: str) -> int:
    """How many compiled versions numba's cache under ``cache`` holds of the function ``name``
    (``module.function``)."""
    index = [f for f in cache.rglob("*.nbi") if f.name.startswith(name + "-")]
    assert len(index) == 1, (name, sorted(f.name for f in cache.rglob("*.nbi")))
    return _versions(index[0])


def _module_function(kernel: str) -> str:
    """``module.function`` of a kernel's full name (``spark_stretch.engine.module.function``)."""
    return ".".join(kernel.rsplit(".", 2)[-2:])


def _versions(index) -> int:
    """The compiled versions a numba cache index file lists: a pickled version, then
    (stamp, overloads)."""
    with open(index, "rb") as f:
        pickle.load(f)
        return len(pickle.loads(f.read())[1])


@pytest.mark.slow  # (a minute or two of Spark queries; make setup runs it on every fresh clone)
def test_warm_compiles_the_kernels_once_each_into_numbas_cache(spark, tmp_path, monkeypatch):
    # The engines the warm-up's queries start (child processes of this one) cache into an empty
    # NUMBA_CACHE_DIR: after it, the aggregation, session and string kernels are there, each
    # compiled once (one signature: the queries' batches all reach them with the same types)
    cache = tmp_path / "numba"
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(cache))
    # (numba in the engines, as on a fresh machine; they keep the signatures they compile)
    monkeypatch.setenv("SPARK_STRETCH_AOT", "0")
    monkeypatch.setenv("SPARK_STRETCH_AOT_DIR", str(tmp_path / "aot"))
    assert warm(spark, tmp_path) > 0
    for name in ("kernels._agg_kernel_py", "kernels._fire_bucket_py",
                 "sessions._session_kernel_py", "strings.intern_run", "buckets.insert_rows"):
        assert _signatures(cache, name) == 1, name
    # (and every other cached function: one reached with read-only and writable arrays
    # compiles twice, a first batch's seconds)
    twice = {f.name: n for f in cache.rglob("*.nbi") if (n := _versions(f)) != 1}
    assert not twice, twice
    assert not list(tmp_path.glob("stretch-warm-*")), "the warm-up left its folder"
    # the kernels the queries ran, built ahead of time from what the engines kept (as
    # `python -m spark_stretch warm` does after warm())
    monkeypatch.delenv("SPARK_STRETCH_AOT")
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    manifest = json.loads(build(Path(engine.__file__).parent).with_suffix(".json").read_text())
    built = {_module_function(e["kernel"]) for e in manifest["entries"]}
    assert {"kernels._agg_kernel_py", "sessions._session_kernel_py", "strings.intern_run",
            "buckets.insert_rows", "strings._rehash_into", "batch._take_list_into",
            "order._fix_ties"} <= built, built
    # every kernel they ran is in it but two that only other kernels call (numba compiles them
    # into their callers; they return constants, which the library's entries do not): an
    # engine on the library runs these queries without numba
    skipped = {_module_function(k.split(" ")[0].rstrip(":")) for k in manifest["skipped"]}
    assert skipped <= {"kernels._out_builtin", "kernels._slide_builtin"}, manifest["skipped"]


def test_the_command_names_its_one_argument():
    r = subprocess.run([sys.executable, "-m", "spark_stretch", "wram"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "usage: python -m spark_stretch warm" in r.stderr
