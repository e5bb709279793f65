"""The input log of a pipelined query: each batch's input on disk before Spark may commit it.

A pipelined query lets Spark commit batch N before the engine has stepped it (the step runs while
Spark plans and ingests batch N+1). What makes that safe: the input of batch N is in this log
(``<checkpoint>/stretch/input/<N>.arrow``, or ``<N>.empty`` for a batch with no rows) before
Spark commits it, and stays until a checkpoint at or after N is on disk; a restart loads the
latest checkpoint at or before Spark's last committed batch and steps the logged batches after
it again (their outputs are rewritten idempotently). Files are written to a temporary name and
renamed, like Spark's own offset and commit logs. Each carries its format version
(:data:`~spark_stretch.protocol.layout.INPUT_LOG_FORMAT`) in its Arrow schema's metadata.

A batch the engine read from Parquet files itself, on one host, is logged by reference
(``<N>.files``: the files, their sizes and modification times, the columns read;
:class:`LoggedFiles`), as Spark's file source logs the files of a batch and not their rows:
writing a million rows takes about 100 ms, on the path to Spark's commit. Its replay reads the
files again, and refuses if one is gone or changed (:func:`read_again`).

Examples
--------
>>> import tempfile, pyarrow as pa
>>> from pathlib import Path
>>> from spark_stretch.host.input_log import InputLog, LoggedFiles
>>> d = tempfile.TemporaryDirectory()
>>> log = InputLog(Path(d.name))
>>> log.write(3, pa.table({"x": [1, 2]}))
>>> log.read(3).num_rows, log.batches()
(2, [3])
>>> log.write_files(4, LoggedFiles(["/data/part-0.parquet"], ["x"], "", [[10, 0]]))
>>> log.read(4).files, log.batches()
(['/data/part-0.parquet'], [3, 4])
>>> log.drop_through(4); log.batches()
[]
>>> d.cleanup()
"""

from __future__ import annotations

import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Union

import pyarrow as pa

from ..protocol.errors import StateError
from ..protocol.layout import INPUT_LOG_FORMAT, INPUT_LOG_KEY, check_format
from . import faults
from .checkpoints import read_arrow

__all__ = ["InputLog", "InputLogWriter", "LoggedFiles", "check_unchanged", "read_again"]

_EXTRA_KEY = b"stretch.input_log.extra"  # (the JSON logged with a batch's rows)


@dataclass
class LoggedFiles:
    """A batch's input by reference: the Parquet ``files`` the engine read it from, the
    ``columns`` read, their Arrow ``schema`` (base64 IPC, as in
    :class:`~spark_stretch.protocol.messages.IngestFiles`) and each file's ``[size,
    mtime_ns]`` when read (:func:`~spark_stretch.host.parquet.file_stats`)."""

    files: List[str]
    columns: List[str]
    schema: str
    stats: List[List[int]]

    def read(self) -> Union[pa.Table, str]:
        """The files read as Spark would read them, or why not
        (:func:`~spark_stretch.host.parquet.read_like_spark`)."""
        from ..protocol.messages import schema_from_wire
        from .parquet import read_like_spark

        return read_like_spark(self.files, self.columns, schema_from_wire(self.schema))

    def slices(self, rows: int) -> Union[Iterator[pa.Table], str]:
        """The files read as :meth:`read` reads them, ``rows`` at a time, or why not
        (:func:`~spark_stretch.host.parquet.slices_like_spark`)."""
        from ..protocol.messages import schema_from_wire
        from .parquet import slices_like_spark

        return slices_like_spark(self.files, self.columns, schema_from_wire(self.schema), rows)


class InputLog:
    """The input log in directory ``path`` (made on the first write)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def write(self, batch: int, table: Optional[pa.Table], extra: Optional[dict] = None) -> None:
        """Log the input of ``batch`` (None: it had no rows), with ``extra`` (JSON) beside it:
        what the driver decided for the batch (a query on several hosts: the event times of
        every host up to the batch before), read back by :meth:`read` with ``extra=True``."""
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.path / f".{batch}.tmp"
        if table is None:  # no rows (Spark ran the batch, nothing reached the engine)
            tmp.write_bytes(str(INPUT_LOG_FORMAT).encode() + b"\n" + json.dumps(extra).encode())
            final = self.path / f"{batch}.empty"
        else:
            meta = dict(table.schema.metadata or {})
            meta[INPUT_LOG_KEY] = str(INPUT_LOG_FORMAT).encode()
            if extra:
                meta[_EXTRA_KEY] = json.dumps(extra).encode()
            table = table.replace_schema_metadata(meta)
            with pa.OSFile(str(tmp), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
                w.write_table(table)
            final = self.path / f"{batch}.arrow"
        os.replace(tmp, final)
        self._drop_other(batch, final.suffix)
        faults.inject("logged", batch)

    def write_files(self, batch: int, files: LoggedFiles, extra: Optional[dict] = None
                    ) -> None:
        """Log the input of ``batch`` by reference (:class:`LoggedFiles`), with ``extra``
        as :meth:`write`."""
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.path / f".{batch}.tmp"
        tmp.write_text(json.dumps({"format": INPUT_LOG_FORMAT, "files": asdict(files),
                                   "extra": extra}))
        os.replace(tmp, self.path / f"{batch}.files")
        self._drop_other(batch, ".files")
        faults.inject("logged", batch)

    def _drop_other(self, batch: int, kept: str) -> None:
        """A batch logged again (Spark ran it again): the other kinds of its entry go."""
        for suffix in (".arrow", ".empty", ".files"):
            if suffix != kept:
                (self.path / f"{batch}{suffix}").unlink(missing_ok=True)

    def read(self, batch: int, extra: bool = False):
        """The logged input of ``batch`` (None: it had no rows; a :class:`LoggedFiles`: by
        reference), and with ``extra`` the dict logged with it (``(table, dict)``); a
        StateError naming the batch if it is not in the log, or is in a format this version
        does not read."""
        arrow, empty = self.path / f"{batch}.arrow", self.path / f"{batch}.empty"
        if arrow.exists():
            table = read_arrow(arrow)
            meta = table.schema.metadata or {}
            found = meta.get(INPUT_LOG_KEY)
            check_format(None if found is None else _int(found), INPUT_LOG_FORMAT,
                         f"the input log file {arrow}")
            more = json.loads(meta[_EXTRA_KEY]) if _EXTRA_KEY in meta else None
            rest = {k: v for k, v in meta.items() if k not in (INPUT_LOG_KEY, _EXTRA_KEY)}
            table = table.replace_schema_metadata(rest or None)
            return (table, more or {}) if extra else table
        files = self.path / f"{batch}.files"
        if files.exists():
            got = json.loads(files.read_text())
            check_format(got.get("format"), INPUT_LOG_FORMAT, f"the input log file {files}")
            ref = LoggedFiles(**got["files"])
            return (ref, got.get("extra") or {}) if extra else ref
        if empty.exists():
            found, _, more = empty.read_bytes().partition(b"\n")
            check_format(_int(found.strip()) if found.strip() else None, INPUT_LOG_FORMAT,
                         f"the input log file {empty}")
            return (None, json.loads(more) or {} if more.strip() else {}) if extra else None
        raise StateError(f"the input of batch {batch} is neither pending nor in the input log "
                         f"{self.path}: the engine cannot redo the batch (restart the query from "
                         "its checkpoint)")

    def batches(self) -> List[int]:
        """The batches in the log, in order."""
        if not self.path.is_dir():
            return []
        return sorted(int(f.stem) for f in self.path.iterdir()
                      if f.stem.isdigit() and f.suffix in (".arrow", ".empty", ".files"))

    def drop_through(self, batch: int) -> None:
        """Delete the logged inputs up to ``batch`` (a checkpoint holds them now)."""
        if not self.path.is_dir():
            return
        for f in self.path.iterdir():
            if f.stem.isdigit() and int(f.stem) <= batch:
                f.unlink(missing_ok=True)


def _int(raw: bytes):
    try:
        return int(raw)
    except ValueError:
        return raw.decode(errors="replace")


def read_again(batch: int, ref: LoggedFiles) -> pa.Table:
    """The input of ``batch`` read again from the files of its log entry ``ref``, as the
    engine read it the first time; a StateError if a file is gone or changed since."""
    check_unchanged(batch, ref)
    got = ref.read()
    if isinstance(got, str):
        raise StateError(f"batch {batch}'s input files cannot be read again: {got}")
    return got


def check_unchanged(batch: int, ref: LoggedFiles) -> None:
    """A StateError, naming the batch and the file, if a file of ``ref`` is gone or changed
    (size or modification time) since the batch read it."""
    from .parquet import file_stats

    how = ("Spark's file source needs them to redo the batch too: put them back, or start the "
           "query from a new checkpoint")
    try:
        now = file_stats(ref.files)
    except OSError as e:
        raise StateError(f"batch {batch}'s input file is gone ({e}); {how}") from e
    changed = [f for f, a, b in zip(ref.files, ref.stats, now) if list(a) != list(b)]
    if changed:
        raise StateError(f"batch {batch}'s input file {changed[0]} changed since the batch read "
                         f"it (size or modification time); {how}")


class InputLogWriter:
    """How a runtime logs its batches' inputs into ``log`` (None: a query without one; its
    runtime writes nothing) (:meth:`~.runtime.Runtime.submit`):
    by reference when the engine read the batch from its files itself (:meth:`read_from`);
    else the rows, at once, or, when the driver waits for the step's result before Spark may
    commit the batch (inside Spark's plan), on a thread of its own while the batch steps
    (:meth:`write` with ``beside_step``, then :meth:`wait`). A write that failed beside a step
    fails its batch, and every later one (:meth:`check`): the batch was stepped, and a restart
    could not redo it.

    Examples
    --------
    >>> import tempfile, pyarrow as pa
    >>> from pathlib import Path
    >>> d = tempfile.TemporaryDirectory()
    >>> w = InputLogWriter(InputLog(Path(d.name)), "q")
    >>> w.write(0, pa.table({"x": [1]}), None, beside_step=True); w.wait(0)
    >>> w.log.batches()
    [0]
    >>> w.close(); d.cleanup()
    """

    def __init__(self, log: Optional[InputLog], name: str):
        self.log = log
        self.name = name
        self._pool: Optional[ThreadPoolExecutor] = None
        self._writing: Dict[int, Future] = {}
        self._files: Dict[int, LoggedFiles] = {}  # (batches the engine read from files)
        self.failed: Optional[str] = None

    def read_from(self, batch: int, ref: LoggedFiles) -> None:
        """``batch``'s input was read from the files ``ref`` names: log it by reference."""
        self._files[batch] = ref

    def forget(self, batch: int) -> None:
        """``batch``'s input came another way (or is stepped without being logged)."""
        self._files.pop(batch, None)

    def write(self, batch: int, table: Optional[pa.Table], extra: Optional[dict],
              beside_step: bool = False) -> None:
        """Log ``batch``'s input (``table``, None: no rows), with ``extra``."""
        ref = self._files.pop(batch, None)
        if ref is not None and table is not None:
            self.log.write_files(batch, ref, extra)
        elif beside_step:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"stretch-log-{self.name}")
            self._writing[batch] = self._pool.submit(self.log.write, batch, table, extra)
        else:
            self.log.write(batch, table, extra)

    def wait(self, batch: int) -> None:
        """Wait for ``batch``'s write beside its step, if any; a StateError if it failed."""
        fut = self._writing.get(batch)
        if fut is None:
            return
        try:
            fut.result()
        except Exception as e:
            self.failed = f"the input of batch {batch} could not be logged: {e!r}"
            raise StateError(f"{self.failed}; restart the query from its checkpoint") from e
        finally:  # (only once done: until then a checkpoint's drop_through waits for it)
            self._writing.pop(batch, None)

    def check(self) -> None:
        """A StateError if a write beside a step failed: nothing more may be stepped."""
        if self.failed:
            raise StateError(f"{self.failed}; restart the query from its checkpoint")

    def drop_through(self, batch: int) -> None:
        """A checkpoint of ``batch`` is on disk: the log through it goes, after any write of it
        still in flight (which would otherwise land after the drop)."""
        for b, fut in list(self._writing.items()):
            if b <= batch:
                try:
                    fut.result()
                except Exception:
                    pass  # (wait() reports it)
        self.log.drop_through(batch)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
