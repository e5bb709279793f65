"""Shared state: B buckets of window instances, the owner map, and string interning.

Keys hash to ``B`` buckets (``((mix64(key) >> 32) * B) >> 32``: the placement policy of
:mod:`spark_stretch.protocol.placement`); each bucket holds an open-addressing
table of window instances keyed by the full ``(key, window start)`` pair. The owner map is an int array
of length ``B``: ``owner_map[b] = j`` means instance ``j`` alone reads and writes bucket ``b`` in the
current epoch, so the hot path takes no lock. An epoch switch replaces the owner map (O(B)); no state is
copied.
"""
from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa

from . import kernels as K
from . import strings as S
from ..protocol import placement
from .errors import EngineError
from .batch import frozen
from .buckets import next_cap
from .spill import Gathered, chunk_ranges, release_done

GATHER_BYTES = 4 << 20  # (bytes of table a lazy snapshot copies the live windows of at a time)


class Interner:
    """Exact value -> int64 id dictionary (ids 0, 1, 2, ... in order of first appearance).

    Strings, the common case, live in a jitted table of their UTF-8 bytes
    (:mod:`~spark_stretch.engine.strings`): interning an Arrow string array reads its buffers
    in one pass, and only strings never seen before become Python strings (kept for
    :meth:`lookup` and checkpoints). Other values (the long keys of word pairs) go through a
    dictionary. Ids are stable for the life of the engine (and across snapshot/restore).
    Thread-safe.

    Examples
    --------
    >>> it = Interner()
    >>> it.intern(["a", "b", "a"]).tolist()
    [0, 1, 0]
    >>> it.lookup([1, 0])
    ['b', 'a']
    """

    def __init__(self, strings=()):
        self._ids: dict = {}        # values other than strings -> id
        self._strings: list = []    # id -> value
        self._lock = threading.Lock()
        # the string table (engine/strings.py) and, per table entry, its id here
        self._slots = np.full(1 << 12, -1, np.int64)
        self._hashes = np.empty(1 << 11, np.uint64)
        self._offs = np.zeros((1 << 11) + 1, np.int64)
        self._store = np.empty(1 << 16, np.uint8)
        self._n = 0
        self._gid = np.empty(1 << 11, np.int64)
        self._dense = True          # table entry i has id i (no other values interned yet)
        values = list(strings)
        if values and all(isinstance(s, str) for s in values):
            self._intern_strings(pa.array(values, pa.string()))
        else:
            for s in values:
                self._add(s)

    def _add(self, s):
        if isinstance(s, str):
            return int(self._intern_strings(pa.array([s], pa.string()))[0])
        i = self._ids.get(s)
        if i is None:
            i = len(self._strings)
            self._ids[s] = i
            self._strings.append(s)
            self._dense = False
        return i

    def __len__(self):
        return len(self._strings)

    def intern(self, values) -> np.ndarray:
        """Ids of ``values`` (a pyarrow array, or any iterable of str); new values get new ids."""
        arr = values if isinstance(values, (pa.Array, pa.ChunkedArray)) else pa.array(list(values), pa.string())
        if isinstance(arr, pa.ChunkedArray):
            arr = arr.combine_chunks()
        if arr.null_count:
            raise EngineError(f"string column has {arr.null_count} null values; keys must not be null")
        if len(arr) == 0:
            return np.empty(0, np.int64)
        if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
            with self._lock:
                return self._intern_strings(arr)
        enc = arr.dictionary_encode()
        with self._lock:
            ids = np.fromiter((self._add(s) for s in enc.dictionary.to_pylist()), np.int64, len(enc.dictionary))
        return ids[enc.indices.to_numpy(zero_copy_only=False)]

    def _intern_strings(self, arr) -> np.ndarray:
        n = len(arr)
        _, offsets, data = arr.buffers()
        offsets = np.frombuffer(offsets, np.int64 if pa.types.is_large_string(arr.type) else np.int32)
        offsets = offsets[arr.offset:arr.offset + n + 1]
        data = np.frombuffer(data, np.uint8) if data is not None else np.empty(0, np.uint8)
        local = np.empty(n, np.int64)
        n0, j = self._n, 0
        while True:
            j, self._n = S.intern_run(offsets, data, j, n, local, self._slots, self._hashes,
                                      self._offs, self._store, self._n)
            if j == n:
                break
            self._grow(int(offsets[j + 1] - offsets[j]))
        if self._n > n0:  # new strings: their ids, and the strings themselves for lookup
            base = len(self._strings)
            self._strings.extend(self._decode(n0, self._n))
            if len(self._gid) < self._n:
                self._gid = np.concatenate([self._gid, np.empty(len(self._gid) + self._n, np.int64)])
            self._gid[n0:self._n] = np.arange(base, base + self._n - n0)
            self._dense = self._dense and base == n0
        return local if self._dense else self._gid[local]

    def _grow(self, need: int) -> None:
        """Room for one more string of ``need`` bytes (what :func:`strings.intern_run` ran out of)."""
        n = self._n
        if n >= len(self._slots) // 2:
            self._slots = S.rehash(self._hashes, n, 2 * len(self._slots))
        if n >= len(self._hashes):
            size = 2 * len(self._hashes)
            self._hashes = np.concatenate([self._hashes, np.empty(size - len(self._hashes), np.uint64)])
            offs = np.zeros(size + 1, np.int64)
            offs[:n + 1] = self._offs[:n + 1]
            self._offs = offs
        used = int(self._offs[n])
        if used + need > len(self._store):
            store = np.empty(max(2 * len(self._store), used + need), np.uint8)
            store[:used] = self._store[:used]
            self._store = store

    def _decode(self, a: int, b: int) -> list:
        """Table entries ``a .. b-1`` as Python strings."""
        offs = self._offs[a:b + 1]
        rel = (offs - offs[0]).astype(np.int32)
        data = self._store[offs[0]:offs[-1]]
        return pa.StringArray.from_buffers(b - a, pa.py_buffer(rel), pa.py_buffer(data)).to_pylist()

    def lookup(self, ids) -> list:
        """Values of ``ids`` (inverse of :meth:`intern`)."""
        return [self._strings[int(i)] for i in ids]

    def strings(self) -> list:
        return list(self._strings)


def balanced_owner_map(n_buckets: int, instances) -> np.ndarray:
    """The placement policy's balanced owner map (:func:`spark_stretch.protocol.placement.balanced_owner_map`)."""
    try:
        return placement.balanced_owner_map(n_buckets, instances)
    except placement.PlacementError as e:
        raise EngineError(str(e)) from None


def validate_owner_map(owner_map, n_buckets: int, instances) -> np.ndarray:
    """Check that ``owner_map`` covers all ``n_buckets`` buckets with owners from ``instances``
    (:func:`spark_stretch.protocol.placement.validate_owner_map`, raising EngineError)."""
    try:
        return placement.validate_owner_map(owner_map, n_buckets, instances)
    except placement.PlacementError as e:
        raise EngineError(str(e)) from None


def narrow_floats(a: dict, float_cols) -> dict:
    """A :meth:`BucketState.compact` written when a fused aggregation kept a float slot per
    aggregate, with only the slots ``float_cols`` (``Operator.float_cols``) its operator keeps
    now; any other compact as it is."""
    if float_cols is None or len(a["init_f"]) == len(float_cols):
        return a
    cols = np.asarray(float_cols, np.int64)
    return {**a, "init_f": np.asarray(a["init_f"])[cols],
            "acc_f": np.asarray(a["acc_f"]).reshape(len(a["rec"]), -1)[:, cols]}


def _runs(idx: np.ndarray) -> list:
    """The runs of consecutive buckets in the sorted ``idx``, as ``(lo, hi)`` ranges."""
    cut = np.flatnonzero(np.diff(idx) != 1) + 1
    return [(int(r[0]), int(r[-1]) + 1) for r in np.split(idx, cut) if r.size]


def _insert_rows(bs, rows, afs, rec, acc_f):
    """:func:`~.buckets.insert_rows` compiled once: its inputs C-ordered and read-only,
    whatever the snapshot's arrays were (numba types each flag apart)."""
    K.insert_rows(*(frozen(np.ascontiguousarray(x)) for x in (bs, rows, afs)), rec, acc_f)


class BucketState:
    """B buckets of window instances as numpy arrays (see :mod:`spark_stretch.engine.buckets`).

    Parameters
    ----------
    n_buckets : int
        ``B``; many more than the maximum parallelism ``n``.
    n_int, n_float : int
        Width of the int64 / float64 accumulator record of one window instance.
    init_i, init_f : array_like
        Initial accumulator values of a new window instance.
    cap : int
        Initial slots per bucket; all buckets grow together, by an eighth or more
        (:func:`~spark_stretch.engine.buckets.next_cap`).
    spill : :class:`~spark_stretch.engine.spill.Spill`, optional
        The memory budget: tables larger than it are mapped from files on local disk, and
        passes over a whole table (grow, snapshot, restore) go a chunk of buckets at a time,
        dropping the pages they touched.
    pool : (slots, words, n), optional
        The register pool (:mod:`~spark_stretch.engine.aggregates`): each window holds a row of
        ``words`` int64 words, its number in the record's int ``slots`` (each the same row);
        ``n`` instances take rows, each from its own free rows. ``pool`` has the rows,
        ``free[j, 1:free[j, 0] + 1]`` instance ``j``'s free ones (:meth:`refill`).
    """

    def __init__(self, n_buckets, n_int, n_float, init_i, init_f, cap=8, pool=None, spill=None):
        if n_buckets < 1:
            raise EngineError(f"n_buckets={n_buckets}; it must be >= 1")
        if cap < 1:
            raise EngineError(f"cap={cap}; it must be >= 1")
        self.n_buckets = n_buckets
        self.spill = spill
        self.init_i = np.asarray(init_i, np.int64).reshape(n_int)
        self.init_f = np.asarray(init_f, np.float64).reshape(n_float)
        self.rec = self._new_rec(cap)
        self.acc_f = self._table((n_buckets, cap, n_float), np.float64, cap)
        self.bcount = np.zeros(n_buckets, np.int64)
        self.bminl = np.full(n_buckets, K.NO_L, np.int64)
        self.dirty = np.zeros(n_buckets, np.uint8)
        self.given_back = np.zeros(n_buckets, np.uint8)  # (give_back_empty: pages read as 0)
        self.version = 0  # bumped by grow(): kernels started before must retry
        self._no_pool(*(pool or ((), 0, 1)))

    def _no_pool(self, slots, words, n):
        """An empty register pool of rows of ``words`` (none: 0) held in the int ``slots``."""
        self.pool_slots = tuple(int(x) for x in slots)
        self.pool = np.zeros((0, int(words)), np.int64)
        self.free = np.zeros((int(n), 1), np.int64)

    def _new_rec(self, cap, empty=True):
        # (key, start, acc_i...), unpadded: a window's bytes are the state's size
        rec = self._table((self.n_buckets, cap, 2 + self.init_i.shape[0]), np.int64, cap)
        for lo, hi in self._chunks(rec) if empty else ():  # (a grow empties it as it goes)
            rec[lo:hi, :, 1] = K.EMPTY
            if self.spill is not None:
                self.spill.trim(rec)
        return rec

    # ---- the memory budget (engine.spill) ---------------------------------------------------------
    def _table(self, shape, dtype, cap):
        """A zeroed table; past the budget (both tables at ``cap`` slots), in a file."""
        if self.spill is None:
            return np.zeros(shape, dtype)
        width = 2 + self.init_i.shape[0] + self.init_f.shape[0]
        return self.spill.table(shape, dtype, in_file=self.n_buckets * cap * width * 8 >
                                self.spill.budget)

    def spilled(self) -> bool:
        """Whether the tables are mapped from a file (past the memory budget)."""
        return self.spill is not None and self.spill.spilled(self.rec)

    def _chunks(self, arr):
        """Bucket ranges for a pass over ``arr``: all at once in memory, in chunks if spilled."""
        if self.spill is None or not self.spill.spilled(arr):
            return [(0, arr.shape[0])]
        return self.spill.chunks(arr)

    def trim(self) -> None:
        """Drop the tables' pages from the process if they are mapped from a file."""
        if self.spill is not None:
            self.spill.trim(self.rec, self.acc_f)

    def _gather(self, arr, live):
        """``arr[live]`` (a copy), a chunk of buckets at a time into a file if ``arr`` is spilled."""
        if self.spill is None or not self.spill.spilled(arr):
            return arr[live]
        counts = live.reshape(live.shape[0], -1).sum(1)
        ends = np.cumsum(counts)
        out = self.spill.table((int(ends[-1]) if len(ends) else 0,) + arr.shape[2:], arr.dtype)
        for lo, hi in self.spill.chunks(arr):
            at = int(ends[lo - 1]) if lo else 0
            out[at:int(ends[hi - 1])] = arr[lo:hi][live[lo:hi]]
            self.spill.trim(arr, out)
        return out

    def live_mask(self) -> np.ndarray:
        """Which slots hold a window (``rec[:, :, 1] != EMPTY``), read a chunk at a time if spilled."""
        live = np.empty(self.rec.shape[:2], bool)
        for lo, hi in self._chunks(self.rec):
            np.not_equal(self.rec[lo:hi, :, 1], K.EMPTY, out=live[lo:hi])
            self.trim()
        return live

    def memory(self) -> dict:
        """The tables' bytes: ``memory`` (held in the process), ``disk`` (in files)."""
        tabs = (self.rec, self.acc_f)
        if not self.spilled():
            return {"memory": self.nbytes(), "disk": 0}
        return {"memory": sum(self.spill.resident(a) for a in tabs) + self.pool.nbytes,
                "disk": self.spill.disk_bytes(*tabs)}

    @property
    def cap(self):
        return self.rec.shape[1]

    # view of the record array: its int accumulators (after the key and the window start)
    @property
    def acc_i(self):
        return self.rec[:, :, 2:2 + self.init_i.shape[0]]

    def live_windows(self) -> int:
        return int(self.bcount.sum())

    def nbytes(self) -> int:
        return self.rec.nbytes + self.acc_f.nbytes + self.pool.nbytes

    # ---- the register pool ------------------------------------------------------------------------
    def held_rows(self, live=None) -> np.ndarray:
        """The pool rows the live windows (``live``: a mask of slots) hold."""
        live = self.live_mask() if live is None else live
        return self.rec[:, :, self.pool_slots[0]][live] if self.pool_slots else \
            np.empty(0, np.int64)

    def refill(self, instances, pending=()) -> None:
        """Collect the pool rows that neither a live window nor ``pending`` (rows of windows
        emitted and not yet read) holds, grow the pool until at least half its rows are free
        (and 16 per instance), and share the free rows among ``instances``. Caller holds the
        exclusive lock (no kernel running)."""
        R = self.pool.shape[0]
        used = np.zeros(R, bool)
        used[self.held_rows()] = True
        for rows in pending:
            used[np.asarray(rows, np.int64)] = True
        n_used = int(used.sum())
        size = max(R, 16)
        while size - n_used < max(n_used, 16 * len(instances)):
            size *= 2
        if size > R:
            grown = np.zeros((size, self.pool.shape[1]), np.int64)
            grown[:R] = self.pool
            self.pool = grown
            used = np.concatenate([used, np.zeros(size - R, bool)])
        free = np.flatnonzero(~used)
        parts = np.array_split(free, len(instances))
        table = np.zeros((self.free.shape[0], max(map(len, parts)) + 1), np.int64)
        for j, part in zip(instances, parts):
            table[j, 0] = len(part)
            table[j, 1:len(part) + 1] = part
        self.free = table

    def _pooled(self, rec: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Records ``rec`` (a copy) holding the pool rows ``rows`` instead (one per record)."""
        for sl in self.pool_slots:
            rec[:, sl] = rows
        return rec

    def grow(self, cap=None):
        """Grow every bucket's table to ``cap`` slots (default: :func:`~.buckets.next_cap`; fewer
        for :meth:`shrink`), rehashing. Caller must hold the exclusive lock."""
        cap = next_cap(self.cap) if cap is None else int(cap)
        nrec = self._new_rec(cap, empty=False)  # (zeroed pages, not yet touched)
        naf = self._table((self.n_buckets, cap, self.acc_f.shape[2]), np.float64, cap)
        # (spilled: a chunk of the new table's file at a time; in memory: a chunk of the old)
        spilled = self.spill is not None and self.spill.spilled(nrec)
        for lo, hi in self._chunks(nrec) if spilled else chunk_ranges(self.rec):
            nrec[lo:hi, :, 1] = K.EMPTY
            K.rehash_into(self.rec[lo:hi], self.acc_f[lo:hi], self.bcount[lo:hi], nrec[lo:hi],
                          naf[lo:hi])
            if self.spill is not None:
                self.spill.trim(self.rec, self.acc_f, nrec, naf)
            release_done(self.rec, lo, hi)  # (in memory: the old chunk's pages go as the new fill)
            release_done(self.acc_f, lo, hi)
        self.rec, self.acc_f = nrec, naf
        self.given_back[:] = 0  # (the new tables are whole)
        self.version += 1

    def shrink(self, cap0: int) -> bool:
        """Rehash into tables of twice the fullest bucket's windows, never below ``cap0``
        slots, when that fullest bucket fills at most an eighth of its slots (after a window
        close emptied them) and the tables at least halve: a close's memory goes back to the
        system before its rows are made, not at the end of the query. Returns whether it
        did. Caller must hold the exclusive lock."""
        most = int(self.bcount.max(initial=0))
        cap = max(int(cap0), 2 * most)
        if most * 8 > self.cap or cap * 2 > self.cap:
            return False
        self.grow(cap)
        return True

    def give_back_empty(self, lo: int, hi: int, mine=None) -> int:
        """Give the pages of the buckets ``lo:hi`` (those ``mine`` marks) that hold no window
        back to the system, while a close fires the others: the windows go out of the tables
        as their rows go into output blocks, instead of both being whole at once. Only tables
        in memory, with no register pool. Their pages then read as zeros, not as empty slots:
        until :meth:`settle_given_back`, only a rehash (which skips buckets with no window)
        may read them. Returns the buckets given back. Caller holds the shared lock and owns
        the buckets (no kernel writes them meanwhile)."""
        if hi <= lo or self.spilled() or self.pool_slots:
            return 0
        empty = (self.bcount[lo:hi] == 0) & (self.given_back[lo:hi] == 0)
        if mine is not None:
            empty &= mine
        idx = np.flatnonzero(empty)
        if not idx.size:
            return 0
        self.given_back[lo + idx] = 1
        for a, b in _runs(lo + idx):  # (one madvise a run)
            for arr in (self.rec, self.acc_f):
                release_done(arr, a, b)
        return int(idx.size)

    def settle_given_back(self, cap0: int) -> bool:
        """After the close that gave buckets back (:meth:`give_back_empty`): shrink the tables
        if the windows left fill little of them (:meth:`shrink`), else make the buckets given
        back empty slots again. Returns whether the tables shrank. Caller holds the exclusive
        lock."""
        if not self.given_back.any():
            return False
        if self.shrink(cap0):
            return True
        for a, b in _runs(np.flatnonzero(self.given_back)):
            self.rec[a:b, :, 1] = K.EMPTY
        self.given_back[:] = 0
        return False

    def arrays(self) -> dict:
        return {"rec": self.rec, "acc_f": self.acc_f, "bcount": self.bcount, "bminl": self.bminl,
                "dirty": self.dirty, "init_i": self.init_i, "init_f": self.init_f}

    def compact(self, buckets=None, lazy=False) -> dict:
        """The live window instances only, copied (what a snapshot stores).

        The tables are mostly empty slots (every bucket has the capacity of the fullest one), so
        a snapshot of the live slots is several times smaller than :meth:`arrays`. With
        ``buckets`` (an incremental checkpoint), only the live slots of those buckets. With
        ``lazy``, the per-window arrays are :class:`~spark_stretch.engine.spill.Gathered`: copied
        a chunk of buckets at a time when written, so the state must not change until then
        (a checkpoint written at once; not with a register pool).
        """
        if lazy and not self.pool_slots:
            return self._compact_lazily(buckets)
        live = self.live_mask()
        if buckets is not None:
            buckets = np.asarray(buckets, np.int64)
            keep = np.zeros(self.n_buckets, bool)
            keep[buckets] = True
            live &= keep[:, None]
        rec, held = self._gather(self.rec, live), self.held_rows(live)  # (pool row: its words)
        return {"cap": self.cap, "only": buckets, "b": np.nonzero(live)[0].astype(np.int64),
                "rec": self._pooled(rec, np.arange(len(rec))) if self.pool_slots else rec,
                "acc_f": self._gather(self.acc_f, live), "bcount": self.bcount.copy(),
                "bminl": self.bminl.copy(), "init_i": self.init_i, "init_f": self.init_f,
                "pool": (self.pool_slots, self.pool[held], self.free.shape[0])}

    def _compact_lazily(self, buckets) -> dict:
        keep = None
        if buckets is not None:
            keep = np.zeros(self.n_buckets, bool)
            keep[np.asarray(buckets, np.int64)] = True

        def live(lo, hi):
            m = self.rec[lo:hi, :, 1] != K.EMPTY
            return m if keep is None else m & keep[lo:hi, None]

        ranges = chunk_ranges(self.rec, GATHER_BYTES)
        n = 0
        for lo, hi in ranges:
            n += int(np.count_nonzero(live(lo, hi)))
            self.trim()

        def rows(arr):
            return Gathered((n,) + arr.shape[2:], arr.dtype, ranges,
                            lambda lo, hi: arr[lo:hi][live(lo, hi)], self.trim)

        return {"cap": self.cap, "only": buckets, "rec": rows(self.rec), "acc_f": rows(self.acc_f),
                "b": Gathered((n,), np.int64, ranges,
                              lambda lo, hi: np.nonzero(live(lo, hi))[0] + lo, self.trim),
                "bcount": self.bcount.copy(), "bminl": self.bminl.copy(),
                "init_i": self.init_i, "init_f": self.init_f,
                "pool": (self.pool_slots, self.pool[:0], self.free.shape[0])}

    @classmethod
    def from_compact(cls, a: dict, spill=None) -> "BucketState":
        """The state a full :meth:`compact` described, with every live slot re-inserted
        (``spill``: the memory budget, as the constructor's)."""
        if a.get("only") is not None:
            raise ValueError("an incremental bucket snapshot needs its base: use apply_compact")
        st = cls.__new__(cls)
        st.n_buckets = len(a["bcount"])
        st.spill = spill
        st.init_i, st.init_f = np.array(a["init_i"]), np.array(a["init_f"])
        st.rec = st._new_rec(int(a["cap"]))
        st.acc_f = st._table((st.n_buckets, int(a["cap"]), st.init_f.shape[0]), np.float64,
                             int(a["cap"]))
        st.version = 0
        st.dirty = np.zeros(st.n_buckets, np.uint8)  # equal to the snapshot: nothing changed since
        st.given_back = np.zeros(st.n_buckets, np.uint8)
        slots, words, n = a.get("pool", ((), np.zeros((0, 0), np.int64), 1))
        st._no_pool(slots, words.shape[1], n)
        st.apply_compact(a)
        return st

    def apply_compact(self, a: dict) -> None:
        """Replace the buckets an incremental :meth:`compact` lists (all of them for a full one)."""
        if self.cap < int(a["cap"]):
            self.grow(int(a["cap"]))
        only = a.get("only")
        if only is None:
            for lo, hi in self._chunks(self.rec):
                self.rec[lo:hi, :, 1] = K.EMPTY
                self.trim()
        else:
            self.rec[np.asarray(only, np.int64), :, 1] = K.EMPTY
        # (a snapshot written before records lost their padding has wider rows: the padding
        # is zeros, after every slot a record uses)
        rows = np.ascontiguousarray(np.asarray(a["rec"], np.int64)[:, :self.rec.shape[2]])
        if self.pool_slots:  # (the windows' words as new rows; the rows of those they replace
            #                   are collected by the next refill)
            words = a["pool"][1]
            rows = self._pooled(rows.copy(), self.pool.shape[0] + np.arange(len(rows)))
            self.pool = np.concatenate([self.pool, words])
        bs, afs = np.asarray(a["b"], np.int64), np.asarray(a["acc_f"], np.float64)
        chunks = self._chunks(self.rec)
        if len(chunks) == 1:
            _insert_rows(bs, rows, afs, self.rec, self.acc_f)
        else:  # (a chunk of buckets at a time, in bucket order, dropping the pages: of the
            #      tables, and of the snapshot when it is a mapped file)
            if len(bs) > 1 and not bool(np.all(bs[1:] >= bs[:-1])):  # (a snapshot is in order)
                order = np.argsort(bs, kind="stable")
                bs, rows, afs = bs[order], rows[order], afs[order]
            for lo, hi in chunks:
                i0, i1 = np.searchsorted(bs, [lo, hi])
                _insert_rows(bs[i0:i1], rows[i0:i1], afs[i0:i1], self.rec, self.acc_f)
                self.spill.trim(self.rec, self.acc_f, rows, afs)
        self.bcount, self.bminl = np.array(a["bcount"]), np.array(a["bminl"])

    def move_buckets(self, other: "BucketState", buckets) -> int:
        """Copy ``buckets`` from ``other`` into self and clear them there (shared-nothing state transfer).

        Returns the number of bytes copied.
        """
        for st in (self, other):  # (slots are copied as they are: the same capacity both)
            if st.cap < max(self.cap, other.cap):
                st.grow(max(self.cap, other.cap))
        nbytes = 0
        for name in ("rec", "acc_f"):
            dst, src = getattr(self, name), getattr(other, name)
            dst[buckets] = src[buckets]
            nbytes += src[buckets].nbytes
        if self.pool_slots:  # (their pool rows copied as new rows here)
            moved = self.rec[buckets]
            live = moved[:, :, 1] != K.EMPTY
            words = other.pool[moved[:, :, self.pool_slots[0]][live]]
            recs = moved[live]
            moved[live] = self._pooled(recs, self.pool.shape[0] + np.arange(len(recs)))
            self.rec[buckets] = moved
            self.pool = np.concatenate([self.pool, words])
            nbytes += words.nbytes
        self.bcount[buckets] = other.bcount[buckets]
        self.bminl[buckets] = other.bminl[buckets]
        self.dirty[buckets] = 1
        other.rec[buckets, :, 1] = K.EMPTY
        other.bcount[buckets] = 0
        other.bminl[buckets] = K.NO_L
        other.dirty[buckets] = 1
        return nbytes

    def bucket_rows(self):
        """Live window instances as (key, window start, acc_i, acc_f) arrays (for tests / debugging)."""
        m = self.rec[:, :, 1] != K.EMPTY
        return self.rec[:, :, 0][m], self.rec[:, :, 1][m], self.acc_i[m], self.acc_f[m]


class RWLock:
    """Many kernel calls (shared) or one state grow (exclusive); writers take precedence."""

    def __init__(self):
        self._c = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting = 0

    def acquire_read(self):
        with self._c:
            while self._writer or self._waiting:
                self._c.wait()
            self._readers += 1

    def release_read(self):
        with self._c:
            self._readers -= 1
            if self._readers == 0:
                self._c.notify_all()

    def acquire_write(self):
        with self._c:
            self._waiting += 1
            while self._writer or self._readers:
                self._c.wait()
            self._waiting -= 1
            self._writer = True

    def release_write(self):
        with self._c:
            self._writer = False
            self._c.notify_all()
