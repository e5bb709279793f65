"""The input log of a pipelined query: each batch's input on disk before Spark may commit it.

A pipelined query lets Spark commit batch N before the engine has stepped it (the step runs while
Spark plans and ingests batch N+1). What makes that safe: the input of batch N is in this log
(``<checkpoint>/stretch/input/<N>.arrow``, or ``<N>.empty`` for a batch with no rows) before
Spark commits it, and stays until a checkpoint at or after N is on disk; a restart loads the
latest checkpoint at or before Spark's last committed batch and steps the logged batches after
it again (their outputs are rewritten idempotently). Files are written to a temporary name and
renamed, like Spark's own offset and commit logs. Each carries its format version
(:data:`~spark_stretch.protocol.layout.INPUT_LOG_FORMAT`) in its Arrow schema's metadata.

Examples
--------
>>> import tempfile, pyarrow as pa
>>> from pathlib import Path
>>> from spark_stretch.host.input_log import InputLog
>>> d = tempfile.TemporaryDirectory()
>>> log = InputLog(Path(d.name))
>>> log.write(3, pa.table({"x": [1, 2]}))
>>> log.read(3).num_rows, log.batches()
(2, [3])
>>> log.drop_through(3); log.batches()
[]
>>> d.cleanup()
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional

import pyarrow as pa

from ..protocol.errors import StateError
from ..protocol.layout import INPUT_LOG_FORMAT, INPUT_LOG_KEY, check_format
from . import faults
from .checkpoints import read_arrow

__all__ = ["InputLog"]

_EXTRA_KEY = b"stretch.input_log.extra"  # (the JSON logged with a batch's rows)


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
        faults.inject("logged", batch)

    def read(self, batch: int, extra: bool = False):
        """The logged input of ``batch`` (None: it had no rows), and with ``extra`` the dict
        logged with it (``(table, dict)``); a StateError naming the batch if it is not in the
        log, or is in a format this version does not read."""
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
                      if f.stem.isdigit() and f.suffix in (".arrow", ".empty"))

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
