"""Messages between the host engine and the drop-in's instance processes.

Each instance process (:mod:`spark_stretch.worker`) has a socket pair to the host engine's
:class:`~spark_stretch.host.grouped.GroupedRuntime`; messages cross it pickled
(``multiprocessing.connection``), one reply per request. A batch's rows and outputs do not: they
are Arrow IPC files in the query's shared-memory directory, named here.

Examples
--------
>>> from spark_stretch.protocol.instances import input_file
>>> input_file("/dev/shm/x", 3, 1).parent.name
'x'
>>> input_file("/dev/shm/x", 3, 1).name
'in-3-1.arrow'
>>> pending_dir("/dev/shm/x", 3, 1).name
'new-3-1'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from .specs import GroupedSpec

__all__ = ["Init", "Batch", "Exit", "Ready", "BatchDone", "Failed", "input_file", "output_file",
           "pending_dir"]


@dataclass(frozen=True)
class Init:
    """Start: the query's spec (its ``func`` left out), the function (cloudpickled), the
    shared-memory directory, this instance's index."""

    spec: GroupedSpec
    func: bytes
    shm: str
    index: int


@dataclass(frozen=True)
class Batch:
    """Run one step on the buckets this instance owns: the keys with data (``input``: an Arrow
    file sorted by (bucket, key), ``starts`` the first row of each key, ``group_buckets`` each
    key's bucket), then the keys whose timeout passed. ``reload``: buckets that just became
    this instance's (read them from shared memory again)."""

    batch: int
    seq: int
    owned: np.ndarray
    reload: np.ndarray
    batch_ts_ms: int
    watermark_ms: int
    input: Optional[str] = None
    starts: Optional[np.ndarray] = None
    group_buckets: Optional[np.ndarray] = None


@dataclass(frozen=True)
class Exit:
    """Stop (the query closes)."""


@dataclass(frozen=True)
class Ready:
    pid: int


@dataclass(frozen=True)
class BatchDone:
    """A step done: its output file (None: no rows), the buckets it changed (their new files in
    :func:`pending_dir`, for the engine to put in place), and figures."""

    out: Optional[str]
    rows: int
    dirty: List[int]
    calls: int
    timeout_calls: int
    bucket_loads: int
    state_keys: int
    times: Dict[str, float] = field(default_factory=dict)
    updated: int = 0  # keys whose state the batch wrote
    removed: int = 0  # keys whose state it deleted


@dataclass(frozen=True)
class Failed:
    """The request failed in the instance: its Python traceback."""

    error: str


def input_file(shm, seq: int, index: int) -> Path:
    """Step ``seq``'s input file for instance ``index``."""
    return Path(shm) / f"in-{seq}-{index}.arrow"


def output_file(shm, seq: int, index: int) -> Path:
    """Step ``seq``'s output file of instance ``index``."""
    return Path(shm) / f"out-{seq}-{index}.arrow"


def pending_dir(shm, seq: int, index: int) -> Path:
    """Where instance ``index`` writes the bucket files it changed in step ``seq``. The engine
    moves them over the live ones only once every instance of the step is done, so an instance
    that dies mid-step leaves the step's state untouched (its share can be run again)."""
    return Path(shm) / f"new-{seq}-{index}"
