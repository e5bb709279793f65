"""What the engine-side query runtimes share: outputs offered to the executors, per-batch
checkpoint directories (a full checkpoint, then deltas naming their ``parent``) written by a
background thread and cleaned like Spark's ``minBatchesToRetain``, and the input log of the
pipelined kinds. No Spark import here."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Optional
from urllib.parse import unquote, urlparse

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import faults

__all__ = ["CheckpointedRuntime", "read_arrow"]


def _read_parquet_like_spark(files: list, columns: list, schema: pa.Schema):
    """``files`` read as Spark's Parquet reader would for ``columns`` of ``schema`` (a table),
    or why not (a string)."""
    import pyarrow.parquet as pq

    tables = []
    for uri in files:
        path = urlparse(uri)
        if path.scheme not in ("", "file"):
            return f"{uri} is not a local file"
        try:
            # (INT96 as microseconds, Spark's unit; _unlike_spark says when Spark reads it so)
            f = pq.ParquetFile(unquote(path.path), coerce_int96_timestamp_unit="us")
            why = _unlike_spark(f, columns, schema)
            if why:
                return f"{uri}: {why}"
            tables.append(f.read(columns=columns, use_threads=True))
        except Exception as e:  # (Spark reports its own error, or ignores what it may)
            return f"{uri}: {type(e).__name__}: {e}"
    try:
        out = pa.concat_tables(tables) if tables else schema.empty_table()
        return out.cast(pa.schema([schema.field(c) for c in columns]))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        return f"{type(e).__name__}: {e}"


def _unlike_spark(f, columns: list, schema: pa.Schema) -> str:
    """Why Spark would read ``columns`` of Parquet file ``f`` otherwise than pyarrow ('' if it
    would not)."""
    meta = f.metadata.metadata or {}  # (the file's key-value metadata)
    written = meta.get(b"org.apache.spark.version")  # by Spark, which version
    spark = tuple(int(x) for x in re.findall(r"\d+", written.decode())[:2]) if written else None
    if (spark is not None and spark < (3, 0)) \
            or any(k.startswith(b"org.apache.spark.legacy") for k in meta):
        return "written by a legacy Spark writer (datetime rebasing)"
    int96 = {f.schema.column(j).path for j in range(len(f.schema))
             if f.schema.column(j).physical_type == "INT96"}
    have = f.schema_arrow
    for c in columns:
        i = have.get_field_index(c)
        if i < 0:
            return f"no column '{c}' (Spark matches names ignoring case, or reads nulls)"
        if c in int96:
            # Spark reads INT96 unchanged only from Spark 3.1+ files without the legacy key
            # (DataSourceUtils.int96RebaseSpec); others are rebased or, from other writers,
            # time-zone converted by settings: Spark reads them.
            if spark is None or spark < (3, 1):
                return f"column '{c}' is INT96 from a non-Spark or pre-3.1 writer"
            want = schema.field(c).type
            if pa.types.is_timestamp(want) and want.tz is not None:  # (TIMESTAMP, not _NTZ)
                continue
        if not _reads_as(have.field(i).type, schema.field(c).type):
            return f"column '{c}' is {have.field(i).type}, read as {schema.field(c).type}"
    return ""


def _reads_as(file_type: pa.DataType, want: pa.DataType) -> bool:
    """Whether pyarrow's ``file_type`` holds the values Spark reads as ``want``."""
    t = pa.types
    if t.is_timestamp(want):  # INT64 TIMESTAMP(isAdjustedToUTC, MILLIS|MICROS) only
        return t.is_timestamp(file_type) and file_type.tz in ("UTC", "+00:00") \
            and file_type.unit in ("ms", "us")
    if t.is_list(want) or t.is_large_list(want):
        return (t.is_list(file_type) or t.is_large_list(file_type)) and \
            _reads_as(file_type.value_type, want.value_type)
    if t.is_string(want) or t.is_large_string(want):
        return t.is_string(file_type) or t.is_large_string(file_type)
    return file_type == want and (t.is_integer(want) or t.is_floating(want)
                                  or t.is_boolean(want) or t.is_date32(want))


def read_arrow(path: Path) -> pa.Table:
    """The table in an Arrow IPC file (memory-mapped: its buffers are the file's pages)."""
    with pa.memory_map(str(path)) as src:
        return pa.ipc.open_file(src).read_all()


class CheckpointedRuntime:
    """Mixin of :class:`~spark_stretch.spark.bridge.QueryRuntime` and
    :class:`~spark_stretch.spark.grouped_runtime.GroupedRuntime`.

    The subclass sets ``qid``, ``pending``, ``state_dir`` (or None), ``spec``, ``lock``, ``receiver``, ``counters``,
    ``last_batch``, ``_offered``, ``_saver``, ``_save_error`` and ``save_stats``; ``META`` names the
    JSON file whose presence marks a whole checkpoint directory (with ``kind`` and ``parent``).
    """

    META = "bridge.json"
    state_dir = None
    _checkpoint_lock = None
    # Set by an engine whose driver died: the lock is dropped when the process exits, not at
    # close(), so nothing it still does (a Delta append of a request in flight) can overlap a
    # restarted engine of the same query.
    keep_checkpoint_lock = False

    def _hold_checkpoint(self, timeout: float = 60.0) -> None:
        """Be the only engine writing this query's checkpoint: an ``flock`` on
        ``<checkpoint>/stretch/engine.lock``, held until :meth:`_release_checkpoint` or the
        process ends. An engine whose driver was killed may finish a step for a few seconds
        more; a restart of the query waits for it instead of writing beside it."""
        if self.state_dir is None:
            return
        self.state_dir.parent.mkdir(parents=True, exist_ok=True)
        path = self.state_dir.parent / "engine.lock"
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise RuntimeError(
                        f"another stretch engine still holds {path} after {timeout:.0f} s: is the "
                        "same checkpointLocation used by two running queries?") from None
                time.sleep(0.05)
        self._checkpoint_lock = fd

    def _release_checkpoint(self) -> None:
        if self._checkpoint_lock is not None and not self.keep_checkpoint_lock:
            os.close(self._checkpoint_lock)  # (closing the file drops its flock)
            self._checkpoint_lock = None

    def ingest(self, rest: str, job: str, table: pa.Table) -> None:
        """The committed input of a batch (stream ``in:<N>``), kept until its step.

        Not under ``lock``: a pipelined query ingests batch N+1 while batch N is stepped. Rows
        the engine cannot take fail here (:meth:`_validate`), so they fail the batch's own
        Spark job and the query names the batch and column.
        """
        kind, _, batch = rest.partition(":")
        if kind != "in":
            raise ValueError(f"unexpected stream '{rest}' for query {self.qid}")
        self._validate(table, int(batch))
        # One save() per batch; a re-run of the batch replaces what an earlier run delivered.
        # (A dict store is atomic: the step thread only pops other batches.)
        self.pending[int(batch)] = table

    def _validate(self, table: pa.Table, batch: int) -> None:
        """Raise a ValueError naming the column if the engine cannot take ``table``'s rows."""

    def ingest_files(self, batch: int, files: list, columns: list, schema: pa.Schema,
                     watermarks: list) -> dict:
        """The input of ``batch``, read from its Parquet files here (Spark would only read them
        and hand the rows over: see ``StretchIngest.parquetFiles``).

        Returns ``{"rows": n, "event_times": [[max, min, avg, count], ...]}`` (milliseconds, per
        watermark column, for Spark's own statistics), or ``{"unsupported": why}`` when Spark
        must read them: a file that is not local, a column missing or only differing in case, a
        type Spark reads differently (unannotated timestamps, INT96 not from a Spark 3.1+
        writer, binary as string, narrower integers), a legacy Spark writer (datetime
        rebasing), or any read error. Rows
        the engine cannot take (null keys) raise, as in the batch's ingest job.
        """
        faults.inject("files", batch)
        got = _read_parquet_like_spark(files, columns, schema)
        if isinstance(got, str):
            return {"unsupported": got}
        self.ingest(f"in:{batch}", "files", got)
        stats = []
        for c in watermarks:  # (Spark adds DateTimeUtils.microsToMillis: a floor division)
            us = pc.cast(got.column(c).drop_null(), pa.int64()).to_numpy()
            ms = np.floor_divide(us, 1000)
            stats.append([int(ms.max()), int(ms.min()), float(ms.mean()), len(ms)] if len(ms)
                         else [0, 0, 0.0, 0])
        return {"rows": got.num_rows, "event_times": stats}

    # -- the input log ---------------------------------------------------------------------------
    # A pipelined query lets Spark commit batch N before the engine has stepped it (the step runs
    # while Spark plans and ingests batch N+1). What makes that safe: the input of batch N is in
    # this log before Spark commits it, and stays until a checkpoint at or after N is on disk; a
    # restart loads the latest checkpoint at or before Spark's last committed batch and steps the
    # logged batches after it again (their outputs are rewritten idempotently).
    def _log_dir(self) -> Path:
        return self.state_dir.parent / "input"

    def log_input(self, batch: int) -> None:
        """Write the pending input of ``batch`` to the input log: an Arrow IPC file (or an
        ``.empty`` marker), written and renamed like Spark's own offset and commit logs."""
        if self.state_dir is None:
            return
        d = self._log_dir()
        d.mkdir(parents=True, exist_ok=True)
        table = self.pending.get(batch)
        tmp = d / f".{batch}.tmp"
        if table is None:  # no rows (Spark ran the batch, nothing reached the engine)
            tmp.write_bytes(b"")
            final = d / f"{batch}.empty"
        else:
            with pa.OSFile(str(tmp), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
                w.write_table(table)
            final = d / f"{batch}.arrow"
        os.replace(tmp, final)
        faults.inject("logged", batch)

    def _logged_input(self, batch: int) -> Optional[pa.Table]:
        """The logged input of ``batch`` (None: it had no rows)."""
        d = self._log_dir() if self.state_dir is not None else None
        if d is not None and (d / f"{batch}.arrow").exists():
            return read_arrow(d / f"{batch}.arrow")
        if d is not None and (d / f"{batch}.empty").exists():
            return None
        raise RuntimeError(f"the input of batch {batch} is neither pending nor in the input log "
                           f"{d}: the engine cannot redo the batch (restart the query from its "
                           "checkpoint)")

    def _latest_checkpoint(self, batch: int) -> Optional[int]:
        """The latest whole checkpoint at or before ``batch`` (None: there is none)."""
        if self.state_dir is None or not self.state_dir.is_dir():
            return None
        have = [int(d.name) for d in self.state_dir.iterdir()
                if d.name.isdigit() and int(d.name) <= batch and (d / self.META).exists()]
        return max(have) if have else None

    def _offer(self, stream: str, out: pa.Table, metrics: dict) -> dict:
        # Keep the previous output offered until the next one replaces it (a retried read task,
        # or a replayed batch, reads the same rows).
        if self._offered is not None and self._offered != stream:
            self.receiver.offer(self._offered, None)
        self.receiver.offer(stream, out)
        self._offered = stream
        self.counters["output_rows"] += out.num_rows
        return {"rows": out.num_rows, "stream": stream, "metrics": metrics}

    def _write_dir(self, batch: int, blobs: dict) -> None:
        """Write ``blobs`` (file name -> bytes, ``META`` last) as the checkpoint of ``batch``:
        into a temporary directory, then renamed, so a crash leaves whole checkpoints only; then
        clean old ones. As durable as Spark's own checkpoint files (written, renamed, not
        fsynced: a process crash loses nothing, a power cut may) unless the spec says ``fsync``
        (``spark.stretch.checkpoint.fsync=true``): then each file and the directory are fsynced
        before the rename."""
        tmp = self.state_dir / f".{batch}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        sync = bool(self.spec.get("fsync"))
        for name, blob in blobs.items():
            with open(tmp / name, "wb") as f:
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
        final = self.state_dir / str(batch)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        self._clean(batch)
        log = self._log_dir()
        if log.is_dir():  # logged inputs up to this batch are in the state now
            for f in log.iterdir():
                if f.stem.isdigit() and int(f.stem) <= batch:
                    f.unlink(missing_ok=True)

    def _clean(self, batch: int) -> None:
        """Keep the states of the last ``min_batches_to_retain`` batches (Spark's
        ``minBatchesToRetain``) and the full checkpoints their deltas build on; drop older ones."""
        have = sorted(int(d.name) for d in self.state_dir.iterdir() if d.name.isdigit())
        keep = [b for b in have if b > batch - self.spec.get("min_batches_to_retain", 100)]
        if not keep:
            return
        oldest = self._chain_of(keep[0])[0]
        for b in have:
            if b < oldest:
                shutil.rmtree(self.state_dir / str(b), ignore_errors=True)

    def _chain_of(self, batch: int) -> list:
        """The batches whose checkpoints make the state after ``batch``: a full one, then deltas."""
        chain, b = [], batch
        while True:
            f = self.state_dir / str(b) / self.META
            if not f.exists():
                raise RuntimeError(
                    f"no engine state for batch {b} under {self.state_dir} (needed for the state "
                    f"after batch {batch}): the checkpoint was not written by this stretch query "
                    "or was cleaned")
            meta = json.loads(f.read_text())
            chain.append(b)
            if meta.get("kind", "full") == "full":
                return chain[::-1]
            b = int(meta["parent"])

    def _join_saver(self) -> None:
        if self._saver is not None:
            self._saver.join()
            self._saver = None
        if self._save_error is not None:
            e, self._save_error = self._save_error, None
            raise RuntimeError(f"writing the engine state to {self.state_dir} failed: {e}") from e

    def wait_saved(self) -> dict:
        """Block until the last checkpoint is on disk (before Spark may commit its batch)."""
        with self.lock:
            self._join_saver()
            faults.inject("saved", self.last_batch)
            return dict(self.save_stats)
