"""``njit`` for the engine's kernels: from the native library built ahead of time, else numba.

Every engine module defines its kernels with this module's :func:`njit`. When the kernels'
library for this machine and these sources exists (:mod:`.aot` builds it; :mod:`.native`
loads it), ``njit`` returns a :class:`Kernel` that calls the library's machine code for the
signatures it holds, and numba is not imported: the engine's process is about 90 MB smaller
(BENCHMARKS.md, aggregation state at scale). A call with another signature (a query kind the
library was not built for), or a user's numba function (:func:`require_numba`), imports numba
then: every kernel becomes numba's dispatcher, in every module that holds it, and compiles or
loads from numba's cache as without the library. Without a library, ``njit`` is numba's.

Numba mode records the signatures the process's kernels were compiled for
(:func:`record_signatures`), which :mod:`.aot` builds the library from.

Examples
--------
>>> import numpy as np
>>> from spark_stretch.engine.jit import njit
>>> @njit(nogil=True)
... def total(a):
...     s = 0
...     for x in a:
...         s += x
...     return s
>>> int(total(np.arange(5)))
10
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Optional

from . import native

__all__ = ["njit", "Kernel", "as_numba", "require_numba", "numba_loaded", "record_signatures",
           "library"]

_PKG = Path(__file__).parent
_SEEN = "stretch-kernels.seen"
_lock = threading.RLock()
_kernels: list = []  # every Kernel made (library mode)
_numba = False  # numba imported and the kernels switched to its dispatchers
_library: Optional[native.Library] = native.load(_PKG)


def library() -> Optional[native.Library]:
    """The kernels' library this process uses, or None (numba compiles every kernel)."""
    return _library


def numba_loaded() -> bool:
    """Whether this process compiles kernels with numba (no library, or it switched)."""
    return _library is None or _numba


def _name(f) -> str:
    return f"{f.__module__}.{f.__qualname__}"


class Kernel:
    """A kernel of the library, called like numba's dispatcher of ``py_func``."""

    def __init__(self, py_func, opts: dict):
        self.py_func, self.opts = py_func, opts
        self.name = _name(py_func)
        self._entries = _library.entries.get(self.name, ()) if _library is not None else ()
        self.dispatcher = None
        self.__doc__, self.__name__ = py_func.__doc__, py_func.__name__

    def __call__(self, *args):
        for e in self._entries:
            slots = e.pack(args)
            if slots is not None:
                return e(slots)
        require_numba()
        return self.dispatcher(*args)

    def __repr__(self):
        return f"Kernel({self.name}, {len(self._entries)} signatures)"

    def __reduce__(self):  # (by name, as numba pickles its dispatchers: an operator's default)
        return _named, (self.py_func.__module__, self.name)


_made: dict = {}  # name -> what njit first made of it (a Kernel, or numba's dispatcher)


def _named(module: str, name: str):
    """The kernel ``name`` of ``module`` in this process (unpickling)."""
    import importlib

    importlib.import_module(module)
    return as_numba(_made[name]) if numba_loaded() else _made[name]


def as_numba(f):
    """``f`` as numba compiles it into other functions: a :class:`Kernel`'s dispatcher
    (numba imported, :func:`require_numba`), anything else as it is."""
    if isinstance(f, Kernel):
        require_numba()
        return f.dispatcher
    return f


def _numba_njit(f, opts: dict):
    import numba

    d = numba.njit(**opts)(f)
    _made.setdefault(_name(f), d)  # (one a name: an operator's clones are not kept alive)
    return d


def require_numba() -> None:
    """Import numba and make every kernel numba's dispatcher, in every module holding it (a
    kernel numba compiles may call another). Once per process; a no-op in numba mode."""
    global _numba
    if numba_loaded():
        return
    with _lock:
        if _numba:
            return
        from .jitcache import cache_runtime, purge_stale

        purge_stale(_PKG)
        cache_runtime(_PKG)
        for k in _kernels:
            k.dispatcher = _numba_njit(k.py_func, k.opts)
        for mod in list(sys.modules.values()):
            d = getattr(mod, "__dict__", None)
            if not isinstance(d, dict):
                continue
            for name, v in list(d.items()):
                if isinstance(v, Kernel):
                    d[name] = v.dispatcher
        _numba = True


def njit(*args, **opts):
    """``numba.njit`` (keyword options only), or a :class:`Kernel` of the library."""
    if args and callable(args[0]):
        return njit(**opts)(args[0])
    if args:
        raise TypeError("spark_stretch.engine.jit.njit takes no signatures")

    def wrap(f):
        with _lock:
            if numba_loaded():
                return _numba_njit(f, opts)
            k = Kernel(f, opts)
            _kernels.append(k)
            _made[k.name] = k
            return k
    return wrap


def record_signatures(pkg: Path = _PKG) -> int:
    """Add the signatures numba compiled kernels for in this process to the ones kept for
    :mod:`.aot` (:func:`.native.cache_dir`); returns how many are kept. Best effort (a read-only
    cache keeps none)."""
    seen = {}
    with _lock:
        for name, made in _made.items():
            d = made.dispatcher if isinstance(made, Kernel) else made
            sigs = {str(s) for s in d.signatures} if d is not None else ()
            if sigs:
                seen[name] = sigs
    path = native.cache_dir(pkg) / _SEEN
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        kept = {}
    for name, sigs in seen.items():
        kept[name] = sorted(set(kept.get(name, ())) | sigs)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{_SEEN}.{os.getpid()}")
        tmp.write_text(json.dumps(kept, indent=0, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass
    return sum(map(len, kept.values()))
