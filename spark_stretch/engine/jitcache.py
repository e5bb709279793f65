"""numba's on-disk cache, kept in step with the engine's sources.

numba checks a cached function against its own file only (its modification time and size).
A jitted kernel that calls or inlines a jitted helper of another module (``kernels`` calls
``aggregates``, ``hashing`` is inlined everywhere) keeps the helper's old code after the
helper's file changes, silently. This module stamps the package's ``__pycache__`` with a hash
of every source file of the package and drops numba's cache files there when the hash differs,
so the next import compiles afresh. It runs once per process, before any kernel is defined
(``engine/__init__.py``); hashing the sources takes about a millisecond.

Examples
--------
>>> from pathlib import Path
>>> import spark_stretch.engine as engine
>>> from spark_stretch.engine.jitcache import purge_stale
>>> purge_stale(Path(engine.__file__).parent)  # the sources have not changed since the import
False
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["purge_stale"]

_STAMP = "stretch-jit.stamp"


def _sources_hash(pkg: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    for f in sorted(pkg.glob("*.py")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def purge_stale(pkg: Path) -> bool:
    """Drop numba's cache files in ``pkg/__pycache__`` unless they were made from the package's
    current sources; return whether any were dropped.

    Parameters
    ----------
    pkg : Path
        A package directory whose modules define ``njit(cache=True)`` functions.

    Notes
    -----
    Where ``__pycache__`` cannot be written (an installed, read-only package) numba keeps its
    cache elsewhere and the package's sources do not change: nothing is done. Two processes
    importing at once may both drop the files: each then compiles, nothing worse.
    """
    if not os.access(pkg, os.W_OK):
        return False
    cache = pkg / "__pycache__"
    stamp = cache / _STAMP
    digest = _sources_hash(pkg)
    try:
        if stamp.read_text() == digest:
            return False
    except OSError:
        pass
    dropped = False
    try:
        cache.mkdir(exist_ok=True)
        for f in list(cache.glob("*.nbi")) + list(cache.glob("*.nbc")):
            f.unlink(missing_ok=True)
            dropped = True
        tmp = cache / f"{_STAMP}.{os.getpid()}"
        tmp.write_text(digest)
        os.replace(tmp, stamp)  # whole, for a process reading it now
    except OSError:
        pass  # (a read-only or vanished cache: numba finds its files or compiles)
    return dropped
