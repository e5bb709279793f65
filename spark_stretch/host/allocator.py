"""How the host engine's process allocates: Arrow and numpy on glibc's malloc, tuned so what a
batch frees is reused within it, and given back to the system once it is taken in and stepped.

Measured (BENCHMARKS.md, "The engine's allocator"): with every array of 128 KB and more mapped
and unmapped, a quarter of the engine's CPU on a Nexmark batch of 1M rows was the kernel
faulting in and zeroing fresh pages; with glibc's default (a threshold that rises after the
first large free, an arena per thread), the heap kept 100-120 MB more of a batch's buffers at
5M live windows. Here: one arena (a batch is built on one thread and freed on another), arrays
under 4 MB from the heap (a slice of a batch: 65,536 rows of 8 bytes is 512 KB), larger ones
mapped (a 1M-row column, the state's tables, which must leave memory when they grow or spill),
and the heap trimmed after a batch is taken in and after it is stepped: the engine's memory
as before (+2 B a window at 5M), its CPU 8-12% less on Nexmark's aggregations. And pyarrow
is kept from importing pandas, which the engine does not use (:func:`arrow_without_pandas`).

``deltalake`` (the engine's Delta appends) brings its own jemalloc, which keeps freed pages for
ten seconds and in an arena per thread: appending the 4.75M windows a close at 5M keys fires
took 61-81 MiB more and kept them after. With its pages given back as they are freed
(:data:`DELTALAKE_MALLOC_CONF`, set by the engine process unless the user set
``_RJEM_MALLOC_CONF``) it takes 34 MiB and keeps 12, 0.2-0.3 s slower on those rows
(BENCHMARKS.md, aggregation state at scale).
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Optional

__all__ = ["tune_malloc", "set_up", "give_back", "arrow_without_pandas", "DELTALAKE_MALLOC_CONF"]

DELTALAKE_MALLOC_CONF = "dirty_decay_ms:0,muzzy_decay_ms:0"
"""deltalake's jemalloc (its variable is ``_RJEM_MALLOC_CONF``): freed pages go back at once."""

_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 4 << 20

_libc: Optional[ctypes.CDLL] = None


def _glibc() -> Optional[ctypes.CDLL]:
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(None)
            libc.mallopt, libc.malloc_trim  # (glibc's; elsewhere neither)
        except (OSError, AttributeError):
            return None
        _libc = libc
    return _libc


def tune_malloc() -> None:
    """glibc's malloc set as above; called first in the engine process, before numpy, pyarrow
    and their threads allocate. A user's ``GLIBC_TUNABLES`` for malloc stands."""
    libc = _glibc()
    if libc is None or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return
    libc.mallopt(_M_ARENA_MAX, 1)
    libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def set_up() -> None:
    """Arrow's Python calls on the system's malloc (``set_memory_pool`` reaches those only;
    Arrow's own allocations, the Parquet reader's, follow ``ARROW_DEFAULT_MEMORY_POOL``, which
    the engine process sets before pyarrow loads).

    >>> from spark_stretch.host import allocator
    >>> allocator.tune_malloc(); allocator.set_up()  # doctest: +SKIP
    >>> allocator.MMAP_THRESHOLD >> 20  # (MB: smaller arrays come from the heap)
    4
    >>> allocator.give_back()  # (after an ingest and a step: glibc's malloc_trim)
    """
    import pyarrow as pa

    pa.set_memory_pool(pa.system_memory_pool())
    arrow_without_pandas()


def arrow_without_pandas() -> bool:
    """Keep pandas out of the engine process until something in it needs pandas.

    pyarrow imports pandas the first time it asks whether a value is a pandas object (any
    ``pa.array`` or ``pa.scalar``) and the first time it converts to numpy (``to_numpy``, from
    C++). The engine never hands it a pandas object, and pandas costs the process about 30 MB
    (5M live windows: 6-7 B a window, BENCHMARKS.md). Each asked once while pandas cannot be
    imported, pyarrow takes it that there is none and does not ask again; what needs pandas
    (``to_pandas``, ``from_pandas``) still imports it when called, and gives what it gives in
    a process that had pandas all along (timestamps, dates, decimals, strings, numbers,
    booleans, lists, structs, binaries: ``tests/host/test_allocator.py``). Before such a call,
    ``pa.array`` of a pandas object sees a plain sequence: the engine makes none. Returns
    whether it did: not when pandas is loaded already, nor if pyarrow's private pandas shim is
    not where pyarrow 26 has it (then pyarrow imports pandas as it would).

    >>> import subprocess, sys
    >>> code = ("import sys, numpy as np, pyarrow as pa; "
    ...         "from spark_stretch.host import allocator; allocator.arrow_without_pandas(); "
    ...         "a = pa.array(np.arange(3)); print('pandas' in sys.modules, a.to_numpy().sum(), "
    ...         "type(pa.table({'a': a}).to_pandas()).__name__)")
    >>> subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    'False 3 DataFrame\\n'
    """
    import pyarrow as pa

    shim = getattr(pa.lib, "_pandas_api", None)
    if "pandas" in sys.modules or shim is None:
        return False
    sys.meta_path.insert(0, _NoPandas)
    try:
        shim.have_pandas  # (the Python side's one try)
        pa.array([0], pa.int64()).to_numpy()  # (the C++ side's)
    finally:
        sys.meta_path.remove(_NoPandas)
    return "pandas" not in sys.modules


class _NoPandas:
    """A finder for which pandas cannot be imported (:func:`arrow_without_pandas`)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "pandas":
            raise ModuleNotFoundError("pandas left out of the engine until needed", name=name)
        return None


def give_back() -> None:
    """Return the heap's free pages to the system: called after a batch is taken in and after
    it is stepped, when what they allocated is freed (within them, the heap reused it)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
