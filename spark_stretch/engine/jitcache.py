"""numba's on-disk cache, kept in step with the engine's sources.

numba checks a cached function against its own file only (its modification time and size).
A jitted kernel that calls or inlines a jitted helper of another module (``kernels`` calls
``aggregates``, ``hashing`` is inlined everywhere) keeps the helper's old code after the
helper's file changes, silently. This module stamps the package's ``__pycache__`` with a hash
of every source file of the package and drops numba's cache files there when the hash differs,
so the next import compiles afresh. It runs once per process, before any kernel is defined
(``engine/__init__.py``); hashing the sources takes about a millisecond.

It also keeps numba's own runtime (NRT: a few functions numba compiles with LLVM in every
process, before its first kernel, cached kernels or not) as object code beside them
(:func:`cache_runtime`): a process that loads it instead does not page in LLVM's optimiser and
code generator, about 20 MB of the engine's memory (BENCHMARKS.md, aggregation state at
scale).

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

__all__ = ["purge_stale", "cache_runtime"]

_STAMP = "stretch-jit.stamp"
_RUNTIME = "stretch-nrt-{}.nbo"  # (.nbo: not a numba cache file, kept through purge_stale)


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
    from .native import sources_hash  # (this module is also loaded alone, by its path)

    digest = sources_hash(pkg)
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


def cache_runtime(pkg: Path) -> bool:
    """Have numba load its runtime's compiled functions from ``pkg/__pycache__`` when a process
    compiled them there before, for this numba, llvmlite and CPU; else compile them as numba
    does and keep them there. Returns whether it is set up (numba's runtime not initialised
    yet, ``pkg`` writable).

    Numba compiles its runtime's functions (reference counts, a memory block's data pointer)
    from LLVM IR when its first kernel is called or compiled, cached kernels or not: the only
    compilation in a process whose kernels are all cached, and it pages in LLVM's optimiser and
    code generator (about 20 MB). Loaded as object code, as numba loads a cached kernel, they
    are the same machine code.

    Parameters
    ----------
    pkg : Path
        The package directory whose ``__pycache__`` keeps numba's cache of its kernels.

    Notes
    -----
    Uses numba's code-library interface (``create_nrt_module``, ``serialize_using_object_code``,
    ``unserialize_library``, as its own cache does); where numba has no such interface, or
    anything fails, numba compiles its runtime as before. The file's name holds a hash of the
    numba and llvmlite versions, the codegen's target (triple, CPU name and features, which
    numba's cache checks too) and the settings the functions' code varies by (numba's
    ``DEBUG_NRT`` and ``OPT``). A file written by another process appears whole
    (``os.replace``) or not at all.

    Examples
    --------
    >>> from pathlib import Path
    >>> import spark_stretch.engine as engine
    >>> from spark_stretch.engine.jitcache import cache_runtime
    >>> cache_runtime(Path(engine.__file__).parent)  # (already set up by the engine's import)
    True
    """
    try:
        from numba.core.runtime import nrt, nrtdynmod
    except ImportError:
        return False
    if getattr(nrtdynmod.compile_nrt_functions, "_stretch", False):
        return True
    if nrt.rtsys._init or not os.access(pkg, os.W_OK):
        return False
    compile_nrt = nrtdynmod.compile_nrt_functions

    def compile_or_load(ctx):
        try:
            return _runtime_library(ctx, pkg / "__pycache__", nrtdynmod)
        except Exception:  # (numba's internals moved, a bad file: numba's own way)
            return compile_nrt(ctx)

    compile_or_load._stretch = True
    nrtdynmod.compile_nrt_functions = compile_or_load
    return True


def _runtime_library(ctx, cache: Path, nrtdynmod):
    import pickle

    import llvmlite
    import numba

    from numba.core import config

    codegen = ctx.codegen()
    key = hashlib.blake2b(repr((numba.__version__, llvmlite.__version__, codegen.magic_tuple(),
                                config.DEBUG_NRT, config.OPT)).encode(),  # (what the IR varies by)
                          digest_size=8).hexdigest()
    path = cache / _RUNTIME.format(key)
    try:
        state = pickle.loads(path.read_bytes())
    except Exception:  # (none yet, or damaged: compiled and written again)
        state = None
    if state is not None:
        return codegen.unserialize_library(state)
    ir_mod, library = nrtdynmod.create_nrt_module(ctx)
    library.enable_object_caching()
    library.add_ir_module(ir_mod)
    library.finalize()
    try:
        cache.mkdir(exist_ok=True)
        tmp = cache / f"{path.name}.{os.getpid()}"
        tmp.write_bytes(pickle.dumps(library.serialize_using_object_code(), protocol=5))
        os.replace(tmp, path)
    except OSError:
        pass  # (a read-only cache: compiled again by the next process)
    return library
