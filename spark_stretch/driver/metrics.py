"""A running query's figures on the driver, as ``StretchQuery.metrics()`` returns them.

Keys: ``batches``, ``output_rows``, ``batch_times`` (the last 100 batches: ingest, engine, output
and checkpoint times, the checkpoint's figures), ``last_batch``, ``per_batch`` (each batch's
figures: rates, event-time latency, utilization and load per instance, parallelism, switches;
:class:`~.policy.BatchMetrics`, :mod:`.elastic`), ``plans`` (the Spark plans of the first
batches' jobs: tests assert no Exchange), ``reconfigurations`` (each with its ``cause``,
``parallelism`` and ``switch_ms``), ``ingest`` (batches
per ingest path) and, when they happened, ``files_off``, ``direct_writes``,
``direct_write_off``, ``flushes``, ``engine_restarts``, ``realigned``, ``instance_retries``
(the drop-in's shares of a step run again after their instance died); ``engine`` is the host
engine's own figures, merged in by the query (with ``kernels``: ``"library"`` when its kernels
run from the library built ahead of time, ``"numba"`` when numba compiles them; on several
hosts each host's in ``engine["hosts"]``).

Examples
--------
>>> from spark_stretch.driver.metrics import QueryMetrics
>>> m = QueryMetrics()
>>> m.count("ingest", "files"); m.record_batch({"batch": 0}, rows=3, plans=[])
>>> s = m.snapshot(); s["batches"], s["output_rows"], s["ingest"]
(1, 3, {'files': 1})
"""

from __future__ import annotations

import threading
from typing import List, Optional

__all__ = ["QueryMetrics"]

_PLANS_KEPT = 6
_BATCHES_KEPT = 100


class QueryMetrics:
    """Thread-safe figures of one query (the micro-batch thread, its finisher and the user's
    thread all write or read them)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._m = {"batches": 0, "output_rows": 0, "plans": [], "reconfigurations": [],
                   "per_batch": []}

    def wants_plans(self) -> bool:
        """Whether the next batch's plans are still kept (the first few batches' only)."""
        return len(self._m["plans"]) < _PLANS_KEPT

    def record_batch(self, times: dict, rows: int, plans: List[str]) -> None:
        """Count a finished batch; keep its figures and the plans of its Spark jobs."""
        with self._lock:
            m = self._m
            m["batches"] += 1
            m["output_rows"] += rows
            m["last_batch"] = times
            m.setdefault("batch_times", []).append(times)
            del m["batch_times"][:-_BATCHES_KEPT]
            m["plans"].extend(plans[:_PLANS_KEPT - len(m["plans"])])

    def count(self, key: str, what: str) -> None:
        """One more ``what`` under ``key`` (a dict of counts)."""
        with self._lock:
            counts = self._m.setdefault(key, {})
            counts[what] = counts.get(what, 0) + 1

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._m[key] = self._m.get(key, 0) + n

    def append(self, key: str, item, keep: Optional[int] = None) -> None:
        """Add ``item`` to the list ``key`` (keeping its last ``keep`` items, if given)."""
        with self._lock:
            items = self._m.setdefault(key, [])
            items.append(item)
            if keep is not None:
                del items[:-keep]

    def set(self, key: str, value) -> None:
        with self._lock:
            self._m[key] = value

    @property
    def batches(self) -> int:
        return self._m["batches"]

    def snapshot(self) -> dict:
        """A copy (lists copied: the caller may keep it while the query runs)."""
        with self._lock:
            return {k: (list(v) if isinstance(v, list) else v) for k, v in self._m.items()}
