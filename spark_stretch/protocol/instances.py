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
>>> changes_file("/dev/shm/x", 3, 1).name
'changes-3-1.arrow'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from .specs import GroupedSpec

__all__ = ["Init", "Batch", "Exit", "Ready", "BatchDone", "Failed", "input_file",
           "initial_file", "output_file", "changes_file"]


@dataclass(frozen=True)
class Init:
    """Start: the query's spec (its ``func`` left out), the function (cloudpickled), the
    shared-memory directory (the steps' files), the state store's directory
    (:class:`~spark_stretch.engine.keyed.KeyedStore`), this instance's index."""

    spec: GroupedSpec
    func: bytes
    shm: str
    index: int
    state: str = ""


@dataclass(frozen=True)
class Batch:
    """Run one step on the buckets this instance owns: the keys with data (``input``: an Arrow
    file sorted by (bucket, key), ``starts`` the first row of each key, ``group_buckets`` each
    key's bucket), then the keys whose timeout passed, in the buckets it ``owned`` (any
    bucket's state is in the shared store: a new owner reads it there)."""

    batch: int
    seq: int
    owned: np.ndarray
    batch_ts_ms: int
    watermark_ms: int
    input: Optional[str] = None
    starts: Optional[np.ndarray] = None
    group_buckets: Optional[np.ndarray] = None
    # transformWithState's initial state, in the query's first step only (the same layout)
    initial: Optional[str] = None
    initial_starts: Optional[np.ndarray] = None
    initial_buckets: Optional[np.ndarray] = None


@dataclass(frozen=True)
class Exit:
    """Stop (the query closes)."""


@dataclass(frozen=True)
class Ready:
    pid: int


@dataclass(frozen=True)
class BatchDone:
    """A step done and committed to the state store: its output file (with no rows: the
    output's columns), the buckets it changed, its changelog file (:func:`changes_file`; None:
    no change), and figures."""

    out: Optional[str]
    rows: int
    dirty: List[int]
    calls: int
    timeout_calls: int
    changes: Optional[str] = None
    changed_rows: int = 0
    times: Dict[str, float] = field(default_factory=dict)
    updated: int = 0  # keys whose state the batch wrote
    removed: int = 0  # keys whose state it deleted
    # the operator's own counters (transformWithState's, named as Spark's customMetrics)
    operator: Dict[str, int] = field(default_factory=dict)
    held: int = 0  # bytes of the state store's pages the instance keeps mapped after the step


@dataclass(frozen=True)
class Failed:
    """The request failed in the instance: its Python traceback."""

    error: str


def input_file(shm, seq: int, index: int) -> Path:
    """Step ``seq``'s input file for instance ``index``."""
    return Path(shm) / f"in-{seq}-{index}.arrow"


def initial_file(shm, seq: int, index: int) -> Path:
    """Step ``seq``'s initial state (transformWithState's ``initialState``) for instance
    ``index``."""
    return Path(shm) / f"initial-{seq}-{index}.arrow"


def output_file(shm, seq: int, index: int) -> Path:
    """Step ``seq``'s output file of instance ``index``."""
    return Path(shm) / f"out-{seq}-{index}.arrow"


def changes_file(shm, seq: int, index: int) -> Path:
    """Step ``seq``'s changelog of instance ``index`` (Arrow: ``key``, ``value``)."""
    return Path(shm) / f"changes-{seq}-{index}.arrow"
