"""A batch's input read here from its Parquet files (:meth:`FileInput.ingest_files`):
whole, or kept as its files and read a slice at a time.

A runtime that applies a batch a slice at a time (:meth:`FileInput._file_slices`: the
aggregations that apply whole batches, on one host) does not keep the batch's rows between
its ingest and its step: at the ingest, the files are read once a slice at a time, each slice
checked (so bad rows still fail the batch's own Spark job) and its event times counted, then let
go; the step reads them again, a slice at a time (:class:`FileBatch`). A batch of millions of
rows then never sits in the engine whole, nor two at once while a pipelined query ingests
batch N+1 as it steps batch N (BENCHMARKS.md, aggregation state at scale). The price: the
files are decoded twice.

Examples
--------
>>> import pyarrow as pa, pyarrow.parquet as pq, tempfile, os
>>> from spark_stretch.protocol import messages as M
>>> d = tempfile.TemporaryDirectory()
>>> f = os.path.join(d.name, "a.parquet")
>>> t = pa.table({"ts": pa.array([1_000, 5_000, 3_000], pa.timestamp("us", "UTC"))})
>>> pq.write_table(t, f)
>>> msg = M.IngestFiles(query="q", batch=0, files=[f], columns=["ts"],
...                     schema=M.schema_to_wire(t.schema), watermarks=["ts"])
>>> got, ref, stats = take_in_slices(msg, 2, arrived=lambda t: t, validate=lambda t, b: None)
>>> got.num_rows, stats  # (ms: max, min, mean, count)
(3, [(5, 1, 3.0, 3)])
>>> [t.num_rows for t in got.slices(2)]
[2, 1]
>>> d.cleanup()
"""

from __future__ import annotations

from typing import Callable, Iterator, List, Optional, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..protocol import messages as M
from ..protocol.errors import InputRejected, StateError
from . import allocator, faults
from .input_log import LoggedFiles, check_unchanged
from .parquet import file_stats

__all__ = ["FileBatch", "FileInput", "event_time_stats", "pieces", "read_files", "take_in_slices"]


CHECK_ROWS = 1 << 16
"""Rows at a time the ingest reads and checks a batch kept as its files in (while the batch
before it steps: measured at 5M keys, 4-5 B a live window less than at the step's 262,144)."""


class FileBatch:
    """The input of ``batch`` kept as its files (``ref``, as the input log names them) until
    it is stepped, ``num_rows`` rows; ``arrived`` makes each slice read the runtime's input
    (:meth:`.runtime.Runtime._arrived`)."""

    def __init__(self, batch: int, ref: LoggedFiles, num_rows: int,
                 arrived: Callable[[pa.Table], pa.Table]):
        self.batch, self.ref, self.num_rows, self.arrived = batch, ref, num_rows, arrived

    def slices(self, rows: int) -> Iterator[pa.Table]:
        """The batch again, ``rows`` at a time, as it was read at its ingest; a StateError,
        naming the batch and the file, if a file is gone or changed since."""
        check_unchanged(self.batch, self.ref)
        got = self.ref.slices(rows)
        if isinstance(got, str):
            raise StateError(f"batch {self.batch}'s input files cannot be read again: {got}")
        for t in got:
            yield self.arrived(t)


class FileInput:
    """What a runtime (:class:`~.runtime.Runtime`) does with a batch's Parquet files."""

    def ingest_files(self, msg: M.IngestFiles) -> M.FilesIngested:
        """The input of a batch, read from its Parquet files here (Spark would only read them
        and hand the rows over: see ``StretchIngest.parquetFiles``), with Spark's event-time
        statistics of each watermark column (ms), or ``unsupported``: why Spark must read them
        (:func:`~spark_stretch.host.parquet.read_like_spark`). Rows the engine cannot take
        (null keys) raise, as in the batch's ingest job. Kept as its files until its step when
        the runtime takes it in slices (:meth:`_file_slices`, :mod:`.file_batch`)."""
        faults.inject("files", msg.batch)
        rows = min(self._file_slices(), CHECK_ROWS)
        got, ref, times = take_in_slices(msg, rows, self._arrived, self._validate) if rows \
            else read_files(msg)
        if ref is None:
            return M.FilesIngested(unsupported=got)
        if rows:
            self.pending[msg.batch] = got
            allocator.give_back()  # (what reading and checking it freed)
        else:  # (Runtime.ingest: kept as rows until its step)
            self.ingest(f"in:{msg.batch}", "files", got)
        if getattr(self, "share", None) is None:  # (one host: the log keeps the files)
            self.logging.read_from(msg.batch, ref)
        return M.FilesIngested(rows=got.num_rows, event_times=times)

    def _file_slices(self) -> int:
        """Rows at a time of a batch read from files that its step takes (0: whole)."""
        return 0


def pieces(table: Union[pa.Table, FileBatch], rows: int) -> Iterator[pa.Table]:
    """A step's input ``rows`` at a time (0: at once): a table's slices, or a
    :class:`FileBatch` read a slice at a time."""
    if isinstance(table, FileBatch):
        yield from table.slices(rows or max(table.num_rows, 1))
        return
    for lo in range(0, table.num_rows, rows or table.num_rows):
        yield table.slice(lo, rows) if rows else table


def read_files(msg: M.IngestFiles) -> Tuple[Union[pa.Table, str], Optional[LoggedFiles],
                                            Optional[list]]:
    """``(table, input log entry, event-time stats)`` of a batch's files read here whole, or
    ``(why not, None, None)``: Spark reads them."""
    ref = LoggedFiles(list(msg.files), list(msg.columns), msg.schema, [])
    got = ref.read()
    if isinstance(got, str):
        return got, None, None
    ref.stats = file_stats(msg.files)
    return got, ref, event_time_stats(got, msg)


def take_in_slices(msg: M.IngestFiles, rows: int, arrived: Callable[[pa.Table], pa.Table],
                   validate: Callable[[pa.Table, int], None]
                   ) -> Tuple[Union[FileBatch, str], Optional[LoggedFiles], Optional[list]]:
    """``(FileBatch, input log entry, event-time stats)`` of the batch's files, read once
    ``rows`` at a time: each slice made the runtime's input (``arrived``), checked
    (``validate(table, batch)``: its InputRejected names the whole batch's count, read whole
    to say it), its event times counted, and let go. Or ``(why not, None, None)``: Spark reads
    the files."""
    ref = LoggedFiles(list(msg.files), list(msg.columns), msg.schema, [])
    try:
        ref.stats = file_stats(ref.files)  # (before reading: a change meanwhile is seen later)
    except OSError as e:
        return f"{type(e).__name__}: {e}", None, None
    got = ref.slices(rows)
    if isinstance(got, str):
        return got, None, None
    n, times = 0, _EventTimes(msg.watermarks)
    while True:
        try:
            raw = next(got)
        except StopIteration:
            break
        except Exception as e:  # (as read_like_spark: Spark reads them, and says why)
            return f"{type(e).__name__}: {e}", None, None
        try:
            validate(arrived(raw), msg.batch)
        except InputRejected:  # (its message names the batch's count, not the slice's)
            whole = ref.read()
            if isinstance(whole, pa.Table):
                validate(arrived(whole), msg.batch)
            raise
        n += raw.num_rows
        times.add(raw)
    return FileBatch(msg.batch, ref, n, arrived), ref, times.stats()


def event_time_stats(table: pa.Table, msg: M.IngestFiles) -> list:
    """Spark's event-time statistics of each watermark column of ``table`` (ms): max, min,
    mean, count. (Spark adds ``DateTimeUtils.microsToMillis``: a floor division.)"""
    times = _EventTimes(msg.watermarks)
    times.add(table)
    return times.stats()


class _EventTimes:
    """:func:`event_time_stats` summed over the slices of a batch."""

    def __init__(self, columns: List[str]):
        self.columns = list(columns)
        self.acc = [[None, None, 0.0, 0] for _ in self.columns]  # max, min, sum, count

    def add(self, table: pa.Table) -> None:
        for c, a in zip(self.columns, self.acc):
            us = pc.cast(table.column(c).drop_null(), pa.int64()).to_numpy()
            if not len(us):
                continue
            ms = np.floor_divide(us, 1000)
            hi, lo = int(ms.max()), int(ms.min())
            a[0] = hi if a[0] is None else max(a[0], hi)
            a[1] = lo if a[1] is None else min(a[1], lo)
            a[2] += float(ms.sum(dtype=np.float64))
            a[3] += len(ms)

    def stats(self) -> list:
        return [(hi, lo, s / n, n) if n else (0, 0, 0.0, 0) for hi, lo, s, n in self.acc]
