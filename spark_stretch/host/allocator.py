"""How the host engine's process allocates: Arrow and numpy on glibc's malloc, tuned so what a
batch frees is reused within it, and given back to the system once it is taken in and stepped.

Measured (BENCHMARKS.md, "The engine's allocator"): with every array of 128 KB and more mapped
and unmapped, a quarter of the engine's CPU on a Nexmark batch of 1M rows was the kernel
faulting in and zeroing fresh pages; with glibc's default (a threshold that rises after the
first large free, an arena per thread), the heap kept 100-120 MB more of a batch's buffers at
5M live windows. Here: one arena (a batch is built on one thread and freed on another), arrays
under 4 MB from the heap (a slice of a batch: 262,144 rows of 8 bytes is 2 MB), larger ones
mapped (a 1M-row column, the state's tables, which must leave memory when they grow or spill),
and the heap trimmed after a batch is taken in and after it is stepped: the engine's memory
as before (+2 B a window at 5M), its CPU 8-12% less on Nexmark's aggregations.
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional

__all__ = ["tune_malloc", "set_up", "give_back"]

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


def give_back() -> None:
    """Return the heap's free pages to the system: called after a batch is taken in and after
    it is stepped, when what they allocated is freed (within them, the heap reused it)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
