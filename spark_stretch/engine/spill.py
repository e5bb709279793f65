"""State larger than memory: bucket tables in files on local disk, paged by the operating system.

Under a memory budget (``spark.stretch.state.memory``, :class:`Spill`) a
:class:`~spark_stretch.engine.state.BucketState` keeps a table that fits in the budget in memory
as before; a table grown past it lives in a file instead, mapped shared, which the kernels read
and write as any array. The file is under the engine's temporary directory (local disk) and is
unlinked as soon as it is mapped, so nothing is left behind, even after ``kill -9``; a restart
rebuilds the state from the checkpoint, as always.

Why a mapped file and not an embedded store: the engine's state is already fixed-width rows in
per-bucket tables, which the jitted kernels probe in place; a mapping keeps them so, and the
operating system does the tiering: pages of a mapped file are written back and reclaimed under
memory pressure (never the OOM killer's business), and come back when touched.
:meth:`Spill.trim` drops the pages the engine holds (their bytes stay in the file and the page
cache), so its resident memory stays near the budget: every few thousand tuples a kernel applies (it
returns ``NEED_TRIM``, :mod:`~spark_stretch.engine.kernels`), after a grow, and while a
checkpoint is copied out.

Examples
--------
>>> import numpy as np
>>> from spark_stretch.engine.spill import Spill
>>> sp = Spill(budget=1 << 20)
>>> t = sp.table((64, 1024, 4), np.int64, fill=-1)     # 2 MiB: past the budget, in a file
>>> sp.spilled(t), int(t[3, 5, 2]), t.shape
(True, -1, (64, 1024, 4))
>>> sp.spilled(sp.table((4, 8, 2), np.int64))          # small: in memory
False
>>> sp.trim(t); int(t[3, 5, 2])                        # pages dropped, bytes kept
-1
"""
from __future__ import annotations

import mmap
import os
import tempfile

import numpy as np

PAGE = mmap.PAGESIZE
# bytes of table a chunked pass (fill, rehash, copy) touches before it drops its pages again
CHUNK_BYTES = 16 << 20


class Spill:
    """The memory budget of one engine's state and the files of its tables past it.

    Parameters
    ----------
    budget : int
        Bytes of state to keep in memory; a table larger than this is mapped from a file.
    directory : str, optional
        Local disk for the files (default: the process's temporary directory; on an executor
        host, the executor's ``java.io.tmpdir``). Never a tmpfs: that is memory.
    """

    def __init__(self, budget: int, directory: str | None = None):
        if budget <= 0:
            raise ValueError(f"state memory budget {budget}; it must be > 0 bytes")
        self.budget = int(budget)
        self.directory = directory or tempfile.gettempdir()

    # ---- tables -----------------------------------------------------------------------------------
    def table(self, shape, dtype, fill=0, in_file=None) -> np.ndarray:
        """A new array of ``shape`` filled with ``fill``: in memory if it fits in the budget
        (or ``in_file`` is False: the caller decides for all its tables), else in a new
        unlinked file (filled a chunk at a time, its pages dropped as it goes)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if nbytes == 0 or not (nbytes > self.budget if in_file is None else in_file):
            # (zeros: the pages are mapped as touched, not all written now)
            return np.zeros(shape, dtype) if fill == 0 else np.full(shape, fill, dtype)
        fd, path = tempfile.mkstemp(prefix="stretch-state-", dir=self.directory)
        try:
            os.unlink(path)
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            # (probes are random: no read-ahead, no mapping of the pages around a touched one)
            mm.madvise(mmap.MADV_RANDOM)
        finally:
            os.close(fd)
        arr = np.frombuffer(mm, dtype).reshape(shape)  # (its base: the mapping, unmapped with it)
        if fill:
            for lo, hi in self.chunks(arr):
                arr[lo:hi] = fill
                self.trim(arr)
        return arr

    def spilled(self, arr) -> bool:
        """Whether ``arr`` (or the table it is a view of) is mapped from a file."""
        return mapping_of(arr) is not None

    def trim(self, *arrays) -> None:
        """Drop the pages of the mapped tables among ``arrays`` from the process (their bytes
        stay in the file and the page cache; touching them maps them again)."""
        for arr in arrays:
            mm = mapping_of(arr)
            if mm is not None and not mm.closed:
                mm.madvise(mmap.MADV_DONTNEED)

    def chunks(self, arr):
        """``(lo, hi)`` ranges of ``arr``'s first axis (buckets) of about :data:`CHUNK_BYTES`
        (at most an eighth of the budget: a grow reads the old table's and writes the new)."""
        return chunk_ranges(arr, min(CHUNK_BYTES, self.budget // 8))

    def resident(self, arr) -> int:
        """Bytes of ``arr``'s mapped file the process holds now (0 for an in-memory table:
        see ``nbytes``), from ``/proc/self/smaps``."""
        mm = mapping_of(arr)
        if mm is None or mm.closed:
            return 0
        return _smaps_rss(np.frombuffer(mm, np.uint8, count=1).ctypes.data)

    def disk_bytes(self, *arrays) -> int:
        """Bytes of the files behind ``arrays`` (the state kept on local disk)."""
        return sum(a.nbytes for a in arrays if self.spilled(a))


def chunk_ranges(arr, nbytes: int = CHUNK_BYTES) -> list:
    """``(lo, hi)`` ranges of ``arr``'s first axis (buckets) of about ``nbytes`` each."""
    n = arr.shape[0]
    row = max(arr.nbytes // max(n, 1), 1)
    step = max(1, min(n, nbytes // row))
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


class Gathered:
    """An array of ``shape`` and ``dtype`` made of the parts ``part(lo, hi)`` gives for each
    range of ``ranges``, in order, and never whole in memory: a checkpoint's copy of the live
    windows, gathered a chunk of buckets at a time as the snapshot is written
    (:class:`~spark_stretch.engine.snapshot.Blob`; ``after()`` once each part is used).
    ``np.asarray`` joins the parts.

    Examples
    --------
    >>> t = np.arange(12).reshape(4, 3)
    >>> g = Gathered((6,), t.dtype, [(0, 2), (2, 4)], lambda lo, hi: t[lo:hi][t[lo:hi] % 2 == 0])
    >>> [p.tolist() for p in g.parts()], np.asarray(g).tolist(), g.nbytes
    ([[0, 2, 4], [6, 8, 10]], [0, 2, 4, 6, 8, 10], 48)
    """

    def __init__(self, shape, dtype, ranges, part, after=None):
        self.shape, self.dtype = tuple(int(x) for x in shape), np.dtype(dtype)
        self.ranges, self.part, self.after = ranges, part, after
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def parts(self):
        """Each part, checked against the shape it was announced with."""
        rows = 0
        for lo, hi in self.ranges:
            p = np.ascontiguousarray(self.part(lo, hi), self.dtype)
            rows += len(p)
            if rows > self.shape[0] or p.shape[1:] != self.shape[1:]:
                break
            yield p
            if self.after is not None:
                self.after()
        if rows != self.shape[0]:  # (the state changed between the count and the copy)
            raise RuntimeError(f"gathered {rows} rows of {self.shape}: the state changed while "
                               "its snapshot was written")

    def __array__(self, dtype=None, copy=None):
        out = np.empty(self.shape, self.dtype)
        at = 0
        for p in self.parts():
            out[at:at + len(p)] = p
            at += len(p)
        return out if dtype is None else out.astype(dtype)


def mapping_of(obj):
    """The file mapping (``mmap``) an array or a buffer is a view of, or None."""
    base = obj
    for _ in range(64):
        if isinstance(base, mmap.mmap) or base is None:
            return base
        if isinstance(base, np.ndarray):
            base = base.base
        elif isinstance(base, memoryview):  # (np.frombuffer's base; a pickle buffer's raw view)
            base = base.obj
        else:
            return None
    return None


def write_dropping(f, buf) -> None:
    """Write ``buf`` to ``f``; if it is a view of a mapped file, a chunk at a time, dropping the
    pages each chunk mapped (a spilled table's copy is written without holding it all)."""
    mm = mapping_of(buf)
    if mm is None:
        f.write(buf)
        return
    view = memoryview(buf).cast("B")
    for at in range(0, len(view), CHUNK_BYTES):
        f.write(view[at:at + CHUNK_BYTES])
        mm.madvise(mmap.MADV_DONTNEED)


def default_budget() -> int:
    """The state's memory budget when ``spark.stretch.state.memory`` is unset: half this host's
    memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def file_pages_held(path) -> list:
    """``(start, end, rss)`` of each mapping of file ``path`` in this process (from
    ``/proc/self/smaps``): a library's own mapping of its file (LMDB's), which no Python object
    here owns."""
    want = os.path.realpath(path)
    return [(lo, hi, rss) for lo, hi, name, rss in _smaps() if name == want]


def drop_file_pages(path, keep: int) -> int:
    """If this process holds more than ``keep`` bytes of file ``path``'s mapped pages, drop them
    (``madvise(MADV_DONTNEED)``: the bytes stay in the file and the page cache; touching them
    maps them again). Returns the bytes held before."""
    held = file_pages_held(path)
    total = sum(r for _, _, r in held)
    if total > keep:
        for lo, hi, _ in held:
            _madvise(lo, hi - lo, mmap.MADV_DONTNEED)
    return total


def release_done(arr, lo: int, hi: int) -> None:
    """Give the pages of buckets ``lo:hi`` of the in-memory table ``arr`` back to the system:
    a grow is done with them (it rehashed them into the new table), so the old table and the
    new are never both whole in memory (their sum was the peak: 2.5 times the old table).

    Only an array that owns its memory (not a view, not a mapped file) and is past
    :data:`CHUNK_BYTES` is touched, and only the pages wholly inside the range and past its
    first page (malloc keeps its bookkeeping before and at the start of a block). The bytes
    read as zeros afterwards: ``arr`` must not be read again.

    Examples
    --------
    >>> import numpy as np
    >>> t = np.ones((64, 1 << 16), np.int64)               # 32 MiB
    >>> release_done(t, 32, 64); int(t[10, 0]), int(t[40, 0]), int(t[31, -1])
    (1, 0, 1)
    """
    if arr.base is not None or arr.nbytes < CHUNK_BYTES:
        return
    base = arr.ctypes.data
    row = arr.nbytes // arr.shape[0]
    start = max(base + lo * row, base + PAGE)
    start = -(-start // PAGE) * PAGE
    end = (base + hi * row) // PAGE * PAGE
    if end > start:
        _madvise(start, end - start, mmap.MADV_DONTNEED)


def _madvise(addr: int, length: int, advice: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(addr, length, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise({addr:#x}, {length}): {os.strerror(err)}")


def _smaps_rss(start: int) -> int:
    """The ``Rss`` of the mapping starting at address ``start`` in ``/proc/self/smaps``."""
    return next((rss for lo, _, _, rss in _smaps() if lo == start), 0)


def _smaps():
    """``(start, end, file name or "", rss)`` of each mapping in ``/proc/self/smaps`` (none if
    it cannot be read)."""
    cur = None
    try:
        with open("/proc/self/smaps") as f:
            for ln in f:
                if cur is None:
                    head = ln.split(maxsplit=5)
                    if "-" in head[0]:  # (a mapping's line: its range, then its fields)
                        lo, hi = head[0].split("-")
                        cur = (int(lo, 16), int(hi, 16), head[5].rstrip("\n") if len(head) > 5
                               else "")
                elif ln.startswith("Rss:"):
                    yield (*cur, int(ln.split()[1]) * 1024)
                    cur = None
    except OSError:
        return
