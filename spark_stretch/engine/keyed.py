"""The drop-ins' keyed state store: one LMDB environment per query and host, on local disk, shared
by the host engine and its instance processes.

Chosen by measurement (``python/bench/state_store.py``, BENCHMARKS.md): a batch touching 50k keys
costs the same at 1M and 4M live keys, less than RocksDB (``rocksdict``) and the pickled buckets
it replaces; several processes read it at once, so any instance can own any bucket after an
epoch switch with no byte moved (VSN); its pages are the operating system's page cache, so state
larger than memory stays on disk and comes back when touched.

Layout (LMDB sub-databases)::

    state   bucket (2 bytes, big-endian) + pickle(key)             -> pickle((key, value, timeout))
    timers  bucket (2) + timeout + 2**63 (8, big-endian) + pickle(key) -> b""   (timeout != -1)
    done    instance index (decimal)                               -> pickle((seq, reply))

``key`` is the grouping key as the function saw it, ``value`` the state in Spark's internal form
(or None), ``timeout`` the timeout timestamp in ms (-1: none), or for the transformWithState
drop-in a tuple of timers (ms, each one in the timer index). The key's bytes are its pickle with
numpy scalars made Python's, so one key is one entry whatever dtype carried it.

An instance reads through a :class:`Step` (its own writes first, then a read transaction) and
applies the step in one write transaction at its end (:meth:`Step.commit`), with a ``done``
marker: an instance killed after the commit and before its reply finds the step applied and
answers again without running it twice. Each step's changes are also a *changelog* (an Arrow
table ``key, value``; a null value deletes), the drop-in's incremental checkpoint; a full
checkpoint is a compact copy of the environment (:meth:`KeyedStore.snapshot`).

Examples
--------
>>> import tempfile
>>> d = tempfile.TemporaryDirectory()
>>> kv = KeyedStore(d.name)
>>> s = kv.step()
>>> kb = encode_key(3, ("a", 1))
>>> s.put(kb, (("a", 1), (5,), 1000))
>>> s.get(kb)
(('a', 1), (5,), 1000)
>>> s.due(3, 2000) == [kb]
True
>>> log = s.commit(0, 1, "reply")
>>> kv.rows(), log.num_rows, kv.applied(0, 1)
(1, 1, 'reply')
>>> kv.close(); d.cleanup()
"""

from __future__ import annotations

import os
import pickle
import shutil
import struct
import threading
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa

from .spill import default_budget, drop_file_pages, file_pages_held

__all__ = ["KeyedStore", "Step", "encode_key", "memory_share", "pickled_bucket_entries",
           "timers_of", "unpack_snapshot", "write_changelog", "NO_TIMEOUT", "RESERVED_BUCKET",
           "CHANGELOG_SCHEMA", "SNAPSHOT_CODEC"]

NO_TIMEOUT = -1
RESERVED_BUCKET = 0xFFFF  # (a bucket no query has, B <= 4096: the query's own entries)
_RESERVED = RESERVED_BUCKET.to_bytes(2, "big")
MAP_SIZE = 1 << 40  # address space only: the file grows as state does
CHANGELOG_SCHEMA = pa.schema([("key", pa.binary()), ("value", pa.binary())])
_TS = struct.Struct(">Q")
_OFFSET = 1 << 63
# Checkpoints (format 4) compress the store's copy and the changelogs: a full copy is a
# zstd stream of LMDB's file (``state.mdb.zst``), a changelog Arrow IPC with zstd buffers.
SNAPSHOT_CODEC = "zstd"
_LOG_OPTIONS = pa.ipc.IpcWriteOptions(compression=SNAPSHOT_CODEC)

Entry = Tuple[object, object, int]  # (key, value in Spark's internal form or None, timeout)


def _plain(v):
    item = getattr(v, "item", None)  # numpy scalars (np.str_, np.int64, ...) -> Python's
    return item() if item is not None and type(v).__module__ == "numpy" else v


def encode_key(bucket: int, key: tuple) -> bytes:
    """The store's key of grouping key ``key`` (a tuple) in ``bucket``."""
    return bucket.to_bytes(2, "big") + pickle.dumps(tuple(_plain(v) for v in key), protocol=5)


def _timer(kb: bytes, timeout: int) -> bytes:
    return kb[:2] + _TS.pack(timeout + _OFFSET) + kb[2:]


def memory_share(spec) -> int:
    """Each process's share of the state's memory budget (``spec.state_memory``, from
    ``spark.stretch.state.memory``, in bytes; 0: the default,
    :func:`~spark_stretch.engine.spill.default_budget`) among the processes that map one store:
    the host engine and its ``spec.max_parallelism`` instances."""
    return max(1, (int(spec.state_memory) or default_budget()) // (int(spec.max_parallelism) + 1))


def timers_of(timeout) -> tuple:
    """An entry's timers: ``timeout`` is one (-1: none) or a tuple of them."""
    if isinstance(timeout, tuple):
        return timeout
    return () if timeout == NO_TIMEOUT else (timeout,)


def pickled_bucket_entries(files) -> Dict[bytes, Entry]:
    """The entries of the drop-in's format-2 checkpoint files (spark-stretch 0.18): one pickled
    dict ``key -> (value, timeout)`` per bucket, in ``b<bucket>.pkl``."""
    entries = {}
    for f in files:
        bucket = int(Path(f).name[1:-4])
        for key, (value, timeout) in pickle.loads(Path(f).read_bytes()).items():
            entries[encode_key(bucket, key)] = (key, value, int(timeout))
    return entries


def unpack_snapshot(src: Path, data_file: Path) -> None:
    """Write a store's file (``data_file``, LMDB's ``data.mdb``) from a full checkpoint's copy:
    ``state.mdb.zst`` (format 4, :meth:`KeyedStore.snapshot`) or ``state.mdb`` (format 3, as
    LMDB wrote it)."""
    src = Path(src)
    if not src.name.endswith(".zst"):
        shutil.copyfile(src, data_file)
        return
    with pa.CompressedInputStream(str(src), SNAPSHOT_CODEC) as f, open(data_file, "wb") as out:
        while True:
            chunk = f.read(1 << 22)
            if not chunk:
                break
            out.write(chunk)


def write_changelog(path, log: pa.Table) -> None:
    """A step's changelog as an Arrow IPC file, its buffers compressed (:data:`SNAPSHOT_CODEC`:
    a changelog's pickled entries compress about 5x); Arrow's readers decompress it."""
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, log.schema, options=_LOG_OPTIONS) as w:
        w.write_table(log)


class KeyedStore:
    """One LMDB environment in directory ``path`` (made if missing), opened by each process that
    uses it (the engine, every instance). ``memory``: bytes of the store's pages this process
    keeps mapped (its share of ``spark.stretch.state.memory``; 0: as many as the operating
    system leaves it), checked after each write (:meth:`hold`)."""

    def __init__(self, path, memory: int = 0):
        import lmdb

        self.path = Path(path)
        self.memory = int(memory)
        self.path.mkdir(parents=True, exist_ok=True)
        # sync=False: a process crash loses nothing (the pages are the kernel's); the checkpoint
        # under checkpointLocation is what survives a machine's. readahead=False: lookups are
        # random, and state larger than memory should not pull in its neighbours.
        self.env = lmdb.open(str(self.path), map_size=MAP_SIZE, max_dbs=3, sync=False,
                             metasync=False, readahead=False, max_readers=1024)
        self.state = self.env.open_db(b"state")
        self.timers = self.env.open_db(b"timers")
        self.done = self.env.open_db(b"done")

    def close(self) -> None:
        self.env.close()

    def held(self) -> int:
        """Bytes of the store's pages this process has mapped now."""
        return sum(r for _, _, r in file_pages_held(self.path / "data.mdb"))

    def hold(self) -> int:
        """Keep the store's pages this process has mapped within ``memory``: past it, drop them
        all (they stay in the file and the page cache: a key read again maps its page again).
        Returns the bytes mapped before. (The store's file is LMDB's mapping, not an array of
        ours: :func:`~spark_stretch.engine.spill.drop_file_pages` finds it by its path.)"""
        if not self.memory or self.disk_bytes() <= self.memory:
            return 0  # (it cannot hold more than the file)
        return drop_file_pages(self.path / "data.mdb", self.memory)

    # -- figures ------------------------------------------------------------------------------
    def rows(self) -> int:
        """Keys with state (not the query's own entries, in bucket :data:`RESERVED_BUCKET`)."""
        with self.env.begin() as t:
            n = int(t.stat(self.state)["entries"])
            cur = t.cursor(db=self.state)
            if cur.set_range(_RESERVED):
                n -= sum(1 for kb in cur.iternext(values=False) if kb[:2] == _RESERVED)
            return n

    def entries(self):
        """Every ``(store key, entry)``, in key order (bucket first)."""
        with self.env.begin(buffers=False) as t:
            for kb, raw in t.cursor(db=self.state):
                yield kb, pickle.loads(raw)

    def changelog_of(self, buckets) -> pa.Table:
        """The entries of the buckets ``buckets`` selects (a bool per bucket) as a changelog,
        which :meth:`apply` puts into another store (key groups changing hosts)."""
        keys, values = [], []
        with self.env.begin(buffers=False) as t:
            cur = t.cursor(db=self.state)
            for b in np.flatnonzero(np.asarray(buckets, np.bool_)):
                prefix = int(b).to_bytes(2, "big")
                if not cur.set_range(prefix):
                    break
                for kb, raw in cur:
                    if kb[:2] != prefix:
                        break
                    keys.append(kb)
                    values.append(raw)
        return pa.table({"key": pa.array(keys, pa.binary()),
                         "value": pa.array(values, pa.binary())}, schema=CHANGELOG_SCHEMA)

    def disk_bytes(self) -> int:
        """Bytes of the environment's file in use (its last page)."""
        info, st = self.env.info(), self.env.stat()
        return int((info["last_pgno"] + 1) * st["psize"])

    # -- an instance's step -------------------------------------------------------------------
    def step(self) -> "Step":
        return Step(self)

    def applied(self, index: int, seq: int):
        """The reply instance ``index`` stored with step ``seq`` if it applied it (else None)."""
        with self.env.begin() as t:
            raw = t.get(str(index).encode(), db=self.done)
        if raw is None:
            return None
        s, reply = pickle.loads(raw)
        return reply if s == seq else None

    # -- checkpoints ---------------------------------------------------------------------------
    def snapshot(self, dest: Path, txn=None) -> Path:
        """A compact copy of the whole store, compressed (:data:`SNAPSHOT_CODEC`), as file
        ``dest``: as of read transaction ``txn`` (begun when the state was the one to copy;
        ended here), else as of now. :func:`unpack_snapshot` makes it a store's file again.

        LMDB writes the copy into a pipe that a thread compresses from, so the uncompressed
        copy (the size of the state) is never on disk; LMDB's pages compress about 5x."""
        tmp = Path(f"{dest}.tmp")
        r, w = os.pipe()
        failed: List[BaseException] = []

        def pump():
            try:
                with os.fdopen(r, "rb") as src, \
                        pa.CompressedOutputStream(str(tmp), SNAPSHOT_CODEC) as out:
                    while True:
                        chunk = src.read(1 << 20)
                        if not chunk:
                            break
                        out.write(chunk)
            except BaseException as e:  # (closing the pipe's end stops the copy: EPIPE)
                failed.append(e)

        pumping = threading.Thread(target=pump, name="stretch-snapshot", daemon=True)
        pumping.start()
        try:
            self.env.copyfd(w, compact=True, txn=txn)
        except BaseException as e:
            failed.append(e)
        finally:
            os.close(w)
            pumping.join()
            if txn is not None:
                txn.abort()
        if failed:
            tmp.unlink(missing_ok=True)
            raise failed[0]
        os.replace(tmp, dest)
        return dest

    def apply(self, log: pa.Table) -> None:
        """Apply a changelog (restoring a checkpoint)."""
        keys = log.column("key").to_pylist()
        values = log.column("value").to_pylist()
        with self.env.begin(write=True) as w:
            for kb, raw in zip(keys, values):
                old = w.get(kb, db=self.state)
                if old is not None:
                    for t in timers_of(pickle.loads(old)[2]):
                        w.delete(_timer(kb, t), db=self.timers)
                if raw is None:
                    w.delete(kb, db=self.state)
                else:
                    w.put(kb, raw, db=self.state)
                    for t in timers_of(pickle.loads(raw)[2]):
                        w.put(_timer(kb, t), b"", db=self.timers)
        self.hold()

    def rebucketed(self, buckets_of, keep=None, chunk: int = 100_000):
        """This store's entries as changelogs (of ``chunk`` keys or fewer) with each key in the
        bucket ``buckets_of(keys)`` gives it (an int per key tuple, or -1: left out), for
        :meth:`apply` into another store: keys placed by another rule (a checkpoint of the
        query on one host taken to several, or back). ``keep``: a bool per bucket of this
        store, the others' keys left out. The query's own entries (bucket
        :data:`RESERVED_BUCKET`) come as they are."""
        with self.env.begin(buffers=False) as t:
            cur = t.cursor(db=self.state)
            more = cur.first()
            while more:
                kbs, raws = [], []
                while more and len(kbs) < chunk:
                    kb, raw = cur.item()
                    kbs.append(kb)
                    raws.append(raw)
                    more = cur.next()
                own = [i for i, kb in enumerate(kbs) if kb[:2] == _RESERVED]
                rest = [i for i, kb in enumerate(kbs) if kb[:2] != _RESERVED
                        and (keep is None or keep[int.from_bytes(kb[:2], "big")])]
                new = (np.asarray(buckets_of([pickle.loads(kbs[i][2:]) for i in rest]), np.int64)
                       if rest else np.empty(0, np.int64))
                keys = [kbs[i] for i in own] + [int(b).to_bytes(2, "big") + kbs[i][2:]
                                                for i, b in zip(rest, new) if b >= 0]
                values = [raws[i] for i in own] + [raws[i] for i, b in zip(rest, new) if b >= 0]
                yield pa.table({"key": pa.array(keys, pa.binary()),
                                "value": pa.array(values, pa.binary())}, schema=CHANGELOG_SCHEMA)

    def load(self, entries: Dict[bytes, Entry]) -> None:
        """Put ``entries`` (store key -> entry), e.g. converted from an older checkpoint."""
        log = pa.table({"key": list(entries),
                        "value": [pickle.dumps(e, protocol=5) for e in entries.values()]},
                       schema=CHANGELOG_SCHEMA)
        self.apply(log)

    def forget_steps(self) -> None:
        """Drop the ``done`` markers (a restored store starts counting steps again)."""
        with self.env.begin(write=True) as w:
            w.drop(self.done, delete=False)


class Step:
    """One instance's changes in one step, read back before they are committed."""

    def __init__(self, store: KeyedStore):
        self.store = store
        self.txn = store.env.begin(buffers=False)
        self.pending: Dict[bytes, Optional[Entry]] = {}
        # The pending keys of each bucket (by its 2-byte prefix): a step asks for each owned
        # bucket's due timers, and scanning all pending keys per bucket made a step's cost
        # grow with its keys times the buckets (a fifth of an instance's time at 250k keys).
        self._pending_in: Dict[bytes, set] = {}
        self.committed_timeout: Dict[bytes, object] = {}

    def get(self, kb: bytes) -> Optional[Entry]:
        if kb in self.pending:
            return self.pending[kb]
        raw = self.txn.get(kb, db=self.store.state)
        e = None if raw is None else pickle.loads(raw)
        self.committed_timeout.setdefault(kb, NO_TIMEOUT if e is None else e[2])
        return e

    def put(self, kb: bytes, entry: Entry) -> None:
        self._write(kb, entry)

    def delete(self, kb: bytes) -> None:
        self._write(kb, None)

    def _write(self, kb: bytes, entry: Optional[Entry]) -> None:
        """Keep ``entry`` (None: deleted) as ``kb``'s until the commit, its committed timeout
        read first (the commit removes that timer)."""
        if kb not in self.committed_timeout:
            self.get(kb)
        self.pending[kb] = entry
        self._pending_in.setdefault(kb[:2], set()).add(kb)

    def _clear(self) -> None:
        self.pending.clear()
        self._pending_in.clear()

    def due(self, bucket: int, threshold: int) -> List[bytes]:
        """The keys of ``bucket`` whose timeout is set and earlier than ``threshold``, this
        step's writes included, in timeout order."""
        return [kb for _, kb in self.due_timers(bucket, threshold)]

    def due_timers(self, bucket: int, threshold: int, since: Optional[int] = None
                   ) -> List[Tuple[int, bytes]]:
        """``(timer, key)`` of every timer of ``bucket`` earlier than ``threshold`` (and not
        earlier than ``since``), this step's writes included, in timer order (then key
        order)."""
        prefix = bucket.to_bytes(2, "big")
        found = []
        cur = self.txn.cursor(db=self.store.timers)
        start = prefix if since is None else prefix + _TS.pack(since + _OFFSET)
        if cur.set_range(start):
            limit = _TS.pack(threshold + _OFFSET) if threshold > -_OFFSET else b""
            for tk in cur.iternext(values=False):
                if tk[:2] != prefix or tk[2:10] >= limit:
                    break
                kb = prefix + tk[10:]
                if kb not in self.pending:
                    found.append((_TS.unpack(tk[2:10])[0] - _OFFSET, kb))
        cur.close()
        for kb in self._pending_in.get(prefix, ()):
            e = self.pending[kb]
            if e is not None:
                found.extend((t, kb) for t in timers_of(e[2])
                             if t < threshold and (since is None or t >= since))
        found.sort()
        return found

    def abort(self) -> None:
        self.txn.abort()
        self._clear()

    def changelog(self) -> pa.Table:
        """This step's changes as an Arrow table (``value`` null: deleted)."""
        return pa.table({"key": list(self.pending),
                         "value": [None if e is None else pickle.dumps(e, protocol=5)
                                   for e in self.pending.values()]}, schema=CHANGELOG_SCHEMA)

    def commit(self, index: int, seq: int, reply, log: Optional[pa.Table] = None) -> pa.Table:
        """Apply the step in one write transaction, marked done with ``reply`` for instance
        ``index``'s step ``seq``; return its changelog (``log``, if already made)."""
        self.txn.abort()  # (a reader slot; the write below sees the latest state anyway)
        if log is None:
            log = self.changelog()
        st, tm = self.store.state, self.store.timers
        with self.store.env.begin(write=True) as w:
            for kb, raw in zip(log.column("key").to_pylist(), log.column("value").to_pylist()):
                for t in timers_of(self.committed_timeout.get(kb, NO_TIMEOUT)):
                    w.delete(_timer(kb, t), db=tm)
                if raw is None:
                    w.delete(kb, db=st)
                else:
                    w.put(kb, raw, db=st)
                    for t in timers_of(self.pending[kb][2]):
                        w.put(_timer(kb, t), b"", db=tm)
            w.put(str(index).encode(), pickle.dumps((seq, reply), protocol=5),
                  db=self.store.done)
        self._clear()
        self.store.hold()
        return log
