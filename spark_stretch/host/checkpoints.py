"""A query's checkpoint store in the host engine: one directory per checkpointed batch.

``<checkpoint>/stretch/state/<N>/`` holds the state after batch N: a runtime's files, then its
meta file (``bridge.json`` or ``grouped.json``, see :mod:`spark_stretch.protocol.layout`), whose
presence marks a whole directory. A checkpoint is *full*, or a *delta* naming its ``parent``;
restoring batch N follows ``parent`` links back to a full one. The store decides which to write
(:meth:`CheckpointStore.delta_due`: the rule both runtimes share), writes it in a background
thread while the batch's output is written, cleans old ones like Spark's
``minBatchesToRetain``, and holds the one-writer lock. No Spark import here.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import pyarrow as pa

from ..protocol.errors import StateError
from ..protocol.layout import CHECKPOINT_FORMATS, READABLE_FORMATS, check_format, lock_of
from ..protocol.specs import Checkpointing
from . import faults

__all__ = ["CheckpointStore", "read_arrow", "arrow_bytes"]


def read_arrow(path: Path) -> pa.Table:
    """The table in an Arrow IPC file (memory-mapped: its buffers are the file's pages)."""
    with pa.memory_map(str(path)) as src:
        return pa.ipc.open_file(src).read_all()


def arrow_bytes(table: pa.Table) -> pa.Buffer:
    """``table`` as the bytes of an Arrow IPC file (a buffer: not copied again into ``bytes``,
    a batch's output can be large)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue()


class CheckpointStore:
    """The checkpoints of one query (``config.state_dir`` None: none are kept).

    Parameters
    ----------
    config : Checkpointing
        Where, how often, and how many (from the query's spec).
    meta : str
        The runtime's meta file name (its format is ``CHECKPOINT_FORMATS[meta]``).
    on_saved : callable, optional
        ``on_saved(batch)`` after a checkpoint is in place (the input log drops what it covers).
    """

    def __init__(self, config: Checkpointing, meta: str,
                 on_saved: Optional[Callable[[int], None]] = None):
        self.config = config
        self.meta = meta
        self.format = CHECKPOINT_FORMATS[meta]
        self.dir = Path(config.state_dir) if config.state_dir else None
        self._on_saved = on_saved
        self.chain: Optional[dict] = None  # the last checkpoint: {"parent", "deltas", ...}
        self.stats: dict = {}
        self._saver: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._lock_fd: Optional[int] = None

    @property
    def enabled(self) -> bool:
        return self.dir is not None

    # -- one writer --------------------------------------------------------------------------
    def hold_lock(self, timeout: float = 60.0) -> None:
        """Be the only engine writing this query's checkpoint: an ``flock`` on
        ``<checkpoint>/stretch/engine.lock``, held until :meth:`release_lock` or the process
        ends. An engine whose driver was killed may finish a step for a few seconds more; a
        restart of the query waits for it instead of writing beside it."""
        if self.dir is None:
            return
        path = lock_of(self.dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise StateError(
                        f"another stretch engine still holds {path} after {timeout:.0f} s: is the "
                        "same checkpointLocation used by two running queries?") from None
                time.sleep(0.05)
        self._lock_fd = fd

    def release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # (closing the file drops its flock)
            self._lock_fd = None

    # -- reading -------------------------------------------------------------------------------
    def latest(self, batch: int) -> Optional[int]:
        """The latest whole checkpoint at or before ``batch`` (None: there is none)."""
        if self.dir is None or not self.dir.is_dir():
            return None
        have = [int(d.name) for d in self.dir.iterdir()
                if d.name.isdigit() and int(d.name) <= batch and (d / self.meta).exists()]
        return max(have) if have else None

    def read_meta(self, batch: int) -> dict:
        """The meta of the checkpoint of ``batch``, its format checked."""
        f = self.dir / str(batch) / self.meta
        if not f.exists():
            raise StateError(f"no engine state for batch {batch} under {self.dir}: the checkpoint "
                             "was not written by this stretch query or was cleaned")
        meta = json.loads(f.read_text())
        check_format(meta.get("format"), READABLE_FORMATS[self.meta], f"engine checkpoint {f}")
        return meta

    def chain_of(self, batch: int) -> list:
        """The batches whose checkpoints make the state after ``batch``: a full one, then deltas."""
        chain, b = [], batch
        while True:
            meta = self.read_meta(b)
            chain.append(b)
            if meta.get("kind", "full") == "full":
                return chain[::-1]
            b = int(meta["parent"])

    # -- writing -------------------------------------------------------------------------------
    def delta_due(self, batch: int, changed: float, full: bool = False) -> bool:
        """Whether the state after ``batch`` is written as a delta: not when asked for a full
        one, not first, not after ``min_deltas`` deltas in a chain (Spark's
        ``minDeltasForSnapshot``), and not when more than half of the state changed anyway
        (``changed``: the fraction of buckets)."""
        chain = self.chain
        return (not full and chain is not None and chain["parent"] < batch
                and chain["deltas"] + 1 < self.config.min_deltas and changed <= 0.5)

    def save(self, batch: int, delta: bool, meta: dict, files: Callable[[], dict], stats: dict,
             **chain) -> None:
        """Checkpoint the state after ``batch`` in the background: ``files()`` (run by the
        writer thread) gives the runtime's files, ``meta`` its meta (the store adds format,
        kind and parent); ``chain`` is kept with this checkpoint for the next
        :meth:`delta_due` (and readable as ``self.chain``). The next save and :meth:`join`
        wait for it. A file given as a :class:`~pathlib.Path` is moved into the checkpoint."""
        prev = self.chain
        meta = {"format": self.format, "kind": "delta" if delta else "full",
                "parent": prev["parent"] if delta else None, **meta}
        self.chain = {"parent": batch, "deltas": prev["deltas"] + 1 if delta else 0, **chain}
        stats = {"batch": batch, "kind": meta["kind"], **stats}

        def write():
            try:
                t0 = time.perf_counter()
                blobs = files()
                blobs[self.meta] = json.dumps(meta).encode()  # last: marks a whole directory
                t1 = time.perf_counter()
                size = sum(b.stat().st_size if isinstance(b, Path) else len(b)
                           for b in blobs.values())
                self._write_dir(batch, blobs)
                self.stats = {**stats, "bytes": size,
                              "snapshot_ms": (t1 - t0) * 1e3,
                              "write_ms": (time.perf_counter() - t1) * 1e3}
            except BaseException as e:  # reported by join(), on the driver's request
                self._error = e

        self._saver = threading.Thread(target=write, name=f"stretch-save-{batch}", daemon=True)
        self._saver.start()

    def promote(self, batch: int, files: dict, writing=None) -> bool:
        """Make the delta checkpoint of ``batch`` a full one, with ``files`` (name -> a
        :class:`~pathlib.Path`, moved in: the whole state after ``batch``), written in the
        background while later batches run (``writing``: the thread writing that delta, waited
        for). Its meta is replaced last, so a crash leaves the delta as it was; its own delta
        files are then dropped. False if the checkpoint is gone (cleaned meanwhile)."""
        if writing is not None:
            writing.join()
        d = self.dir / str(batch)
        if not (d / self.meta).exists():
            return False
        meta = json.loads((d / self.meta).read_text())
        if meta.get("kind") != "delta":
            return False
        old = [f for f in d.iterdir() if f.name != self.meta]
        for name, f in files.items():
            shutil.move(f, d / f".{name}.tmp")
            os.replace(d / f".{name}.tmp", d / name)
        meta.update(kind="full", parent=None, promoted=True, format=self.format)  # (its files')
        tmp = d / f".{self.meta}.tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps(meta))
            if self.config.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, d / self.meta)
        for f in old:
            if f.name not in files:
                f.unlink(missing_ok=True)
        return True

    def logged(self, batch: int) -> None:
        """The state after ``batch`` is its last checkpoint plus the logged inputs after it."""
        self.join()
        self.stats = {"batch": batch, "kind": "log", "checkpoint": self.chain["parent"]}

    def join(self) -> None:
        """Wait for the checkpoint being written; raise (once) what writing it raised."""
        if self._saver is not None:
            self._saver.join()
            self._saver = None
        if self._error is not None:
            e, self._error = self._error, None
            raise StateError(f"writing the engine state to {self.dir} failed: {e}") from e

    def _write_dir(self, batch: int, blobs: dict) -> None:
        """Write ``blobs`` (file name -> bytes or an engine snapshot's ``Blob``, the meta last) as the checkpoint of ``batch``:
        into a temporary directory, then renamed, so a crash leaves whole checkpoints only; then
        clean old ones. As durable as Spark's own checkpoint files (written, renamed, not
        fsynced: a process crash loses nothing, a power cut may) unless ``fsync``
        (``spark.stretch.checkpoint.fsync=true``): then each file and the directory are fsynced
        before the rename."""
        tmp = self.dir / f".{batch}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        sync = self.config.fsync
        for name, blob in blobs.items():
            if isinstance(blob, Path):
                shutil.move(blob, tmp / name)
                if sync:
                    with open(tmp / name, "rb") as f:
                        os.fsync(f.fileno())
                continue
            with open(tmp / name, "wb") as f:
                if hasattr(blob, "write_to"):  # (an engine snapshot: its parts, unjoined)
                    blob.write_to(f)
                else:
                    f.write(blob)
                if sync:
                    os.fsync(f.fileno())
        if sync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        faults.inject("checkpoint", batch)
        final = self.dir / str(batch)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        self._clean(batch)
        if self._on_saved is not None:
            self._on_saved(batch)

    def _clean(self, batch: int) -> None:
        """Keep the states of the last ``min_batches_to_retain`` batches (Spark's
        ``minBatchesToRetain``) and the full checkpoints their deltas build on; drop older ones."""
        have = sorted(int(d.name) for d in self.dir.iterdir() if d.name.isdigit())
        keep = [b for b in have if b > batch - self.config.min_batches_to_retain]
        if not keep:
            return
        oldest = self.chain_of(keep[0])[0]
        for b in have:
            if b < oldest:
                shutil.rmtree(self.dir / str(b), ignore_errors=True)
