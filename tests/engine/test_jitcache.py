"""numba's on-disk cache after a helper in another module changes (engine/jitcache.py)."""

import os
import subprocess
import sys
import textwrap

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
