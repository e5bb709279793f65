"""Where a stretch query keeps its files, and the format version of each.

Under the query's ``checkpointLocation`` (beside Spark's own ``offsets/``, ``commits/``)::

    stretch/query.json        ids that make a restart the same query (driver)
    stretch/engine.lock       flock held by the one engine writing this checkpoint (host)
    stretch/input/<N>.arrow   the input log: batch N's input, Arrow IPC (host); <N>.empty: no rows
    stretch/state/<N>/        the state after batch N: <meta> last, then its files (host)
    stretch/hosts/<i>/        a query on several hosts: host i's engine.lock, input/, state/
    stretch/operators/<op>/   a query with several stretch aggregations (``stretch(df)``):
                              each one's own files as above, by its Spark state operator id

and, on the engine's host, the drop-in's steps' files in shared memory
(``stretch-<query>-<pid>-*/``) and its state store on local disk
(``$TMPDIR/stretch-<query>-<pid>-state-*/``) (host and worker). Each JSON file and the input log carry a format version; a reader refuses a
version it does not know with a :class:`~.errors.StateError` naming the file.

Examples
--------
>>> from spark_stretch.protocol.layout import QueryLayout
>>> QueryLayout("/ckpt").state_dir
PosixPath('/ckpt/stretch/state')
>>> QueryLayout("/ckpt", operator=2).state_dir
PosixPath('/ckpt/stretch/operators/2/state')
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .errors import StateError

__all__ = ["QueryLayout", "AGGREGATE_META", "GROUPED_META", "CHECKPOINT_FORMATS", "READABLE_FORMATS",
           "INPUT_LOG_FORMAT", "INPUT_LOG_KEY", "QUERY_FORMAT", "check_format",
           "input_log_of", "lock_of", "shm_root", "state_root",
           "shm_prefix", "write_json"]

# A checkpoint directory's meta file, written last (its presence marks a whole directory), per
# runtime: the aggregate runtime's (the built-in aggregations and engine operators) keeps the
# name it was first written under, so older checkpoints stay readable.
AGGREGATE_META = "bridge.json"
GROUPED_META = "grouped.json"
# The format each meta file is written in. The drop-in's is 4: its state store (LMDB) copied whole
# (zstd: state.mdb.zst) or as changelogs (Arrow IPC, zstd buffers). Format 3 (the same,
# uncompressed: state.mdb) is read as it is; format 2 (pickled buckets placed by
# protocol.placement) is read and converted; format 1 took SipHash mod B and is refused.
CHECKPOINT_FORMATS = {AGGREGATE_META: 1, GROUPED_META: 4}
READABLE_FORMATS = {AGGREGATE_META: (1,), GROUPED_META: (2, 3, 4)}
INPUT_LOG_FORMAT = 1
INPUT_LOG_KEY = b"stretch.input_log.format"  # in each logged file's Arrow schema metadata
QUERY_FORMAT = 1


@dataclass(frozen=True)
class QueryLayout:
    """The paths of one query's checkpoint (``checkpointLocation``, a local path or ``file:``);
    ``operator``: of one of its several stretch aggregations, by its Spark state operator id
    (a query with one keeps its files in ``stretch/`` itself)."""

    checkpoint: str
    operator: Optional[int] = None

    @property
    def root(self) -> Path:
        c = str(self.checkpoint)
        root = Path(c[5:] if c.startswith("file:") else c) / "stretch"
        return root if self.operator is None else root / "operators" / str(self.operator)

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    def host_state_dir(self, host: int) -> Path:
        """Host ``host``'s state directory of a query on several hosts (its input log and lock
        beside it)."""
        return self.root / "hosts" / str(host) / "state"

    @property
    def input_log(self) -> Path:
        return input_log_of(self.state_dir)

    @property
    def lock(self) -> Path:
        return lock_of(self.state_dir)

    @property
    def query_file(self) -> Path:
        return self.root / "query.json"



def input_log_of(state_dir) -> Path:
    """The input log beside a query's state directory (the host knows only the latter)."""
    return Path(state_dir).parent / "input"


def lock_of(state_dir) -> Path:
    """The one-writer lock beside a query's state directory."""
    return Path(state_dir).parent / "engine.lock"


def check_format(found, known, where) -> None:
    """Refuse a file whose format version is not ``known`` (one version, or a tuple of those
    read; a missing one counts as 1, the format written before versions were checked)."""
    v = 1 if found is None else found
    ok = known if isinstance(known, tuple) else (known,)
    if v not in ok:
        said = " or ".join(str(k) for k in ok)
        if len(ok) > 2:
            said = ", ".join(str(k) for k in ok[:-1]) + f" or {ok[-1]}"
        raise StateError(f"{where} has format {v!r}; this version of spark-stretch reads format "
                         f"{said}. Restart the query with a new checkpointLocation, or run it "
                         "with the spark-stretch version that wrote it")


def write_json(path: Path, obj: dict) -> None:
    """Write ``obj`` to ``path`` atomically (a temporary file, then a rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def shm_root() -> str:
    """Where the drop-in's bucket files live: tmpfs (``/dev/shm``) when there is one."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
        else tempfile.gettempdir()


def state_root() -> str:
    """Where the drop-in's state store lives: local disk, the engine process's temporary
    directory (on an executor host, the executor's ``java.io.tmpdir``)."""
    return tempfile.gettempdir()


def shm_prefix(query: str) -> str:
    """The name prefix of a query's directories in :func:`shm_root` (one per engine pid)."""
    return f"stretch-{query}-"

