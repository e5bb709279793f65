"""numba's on-disk cache after a helper in another module changes (engine/jitcache.py)."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

_A = """
from numba import njit
from .b import helper

@njit(cache=True)
def kernel(x):
    return helper(x) + 1
"""


def _package(root, purge: bool, helper_body: str):
    pkg = root / "jitpkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        from pathlib import Path
        from spark_stretch.engine.jitcache import purge_stale
        purge_stale(Path(__file__).parent)
    """) if purge else "")
    (pkg / "a.py").write_text(_A)
    os.utime(pkg / "a.py", ns=(10**18, 10**18))  # the kernel's file as if untouched
    (pkg / "b.py").write_text("from numba import njit\n\n@njit(cache=True)\n"
                              f"def helper(x):\n    return {helper_body}\n")


def _kernel_of_2(root) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root)] + sys.path)}
    out = subprocess.run([sys.executable, "-c", "from jitpkg.a import kernel; print(kernel(2))"],
                         env=env, capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


@pytest.mark.parametrize("purge", [False, True])
def test_a_kernel_follows_its_helper_in_another_file(tmp_path, purge):
    _package(tmp_path, purge, "x * 10")
    assert _kernel_of_2(tmp_path) == 21  # compiled and cached
    _package(tmp_path, purge, "x * 100")  # only the helper's file changes
    got = _kernel_of_2(tmp_path)
    # numba alone keeps the kernel it cached (21: the old helper inlined); the purge recompiles
    assert got == (201 if purge else 21)


_RUNTIME_SCRIPT = """
import json, sys
from pathlib import Path

import numpy as np
from numba import njit
from numba.core.runtime import nrtdynmod

import importlib.util
# (jitcache.py alone: importing the engine package sets numba's runtime up from its own cache)
spec = importlib.util.spec_from_file_location("jitcache", sys.argv[2])
jitcache = importlib.util.module_from_spec(spec)
spec.loader.exec_module(jitcache)
cache_runtime = jitcache.cache_runtime

made = []
create = nrtdynmod.create_nrt_module
nrtdynmod.create_nrt_module = lambda ctx: made.append(1) or create(ctx)  # (compiled, not loaded)
ready = cache_runtime(Path(sys.argv[1]))


@njit
def churn(n):  # arrays made and dropped in jitted code: the runtime's reference counts
    tot = 0.0
    for i in range(n):
        a = np.arange(i + 1) * 2.0
        b = a[::2].copy()
        tot += b.sum()
    return tot, np.ones(n)


tot, ones = churn(300)
print(json.dumps({"ready": ready, "compiled": len(made), "tot": tot, "ones": float(ones.sum())}))
"""


def _runtime_run(pkg) -> dict:
    import json

    import spark_stretch.engine.jitcache as jitcache

    out = subprocess.run([sys.executable, "-c", _RUNTIME_SCRIPT, str(pkg), jitcache.__file__],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_numbas_runtime_is_compiled_once_then_loaded_with_the_same_results(tmp_path):
    """numba compiles its runtime's functions in every process; with ``cache_runtime`` the
    first process keeps them as object code and the next loads them. Jitted code that makes
    and drops arrays (the runtime's reference counts) gives a sequential sum's result either
    way, and a damaged file is compiled and written again, not trusted."""
    want = sum(float(np.arange(i + 1)[::2].sum()) * 2.0 for i in range(300))
    first = _runtime_run(tmp_path)
    assert first == {"ready": True, "compiled": 1, "tot": want, "ones": 300.0}
    (kept,) = (tmp_path / "__pycache__").glob("stretch-nrt-*.nbo")
    again = _runtime_run(tmp_path)
    assert again == {"ready": True, "compiled": 0, "tot": want, "ones": 300.0}
    kept.write_bytes(b"not a pickle")
    damaged = _runtime_run(tmp_path)
    assert damaged == {"ready": True, "compiled": 1, "tot": want, "ones": 300.0}
    assert _runtime_run(tmp_path) == again  # (written again whole)
