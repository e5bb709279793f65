"""The Delta metrics table (``spark.stretch.metrics.table``): every batch's figures, appended.

One row per micro-batch of every query that has the setting when it starts, with the query's
ids; written in the background (a commit holds every row waiting when it starts, so a slow
store never holds a batch up). A path (``/tmp/m``, ``s3://b/m``) is appended to with
``deltalake`` from the driver (no Spark job); a table name through Spark's Delta writer. A
table written by an earlier version gains the columns it lacks (schema merge).

Examples
--------
>>> import pyarrow as pa
>>> t = table_of([{"batch": 0, "parallelism": 1, "utilization": [0.5]}], {"stretch_id": "q"})
>>> t.column("batch").to_pylist(), t.column("utilization").type
([0], ListType(list<item: double>))
"""

from __future__ import annotations

import queue
import threading
from typing import List, Optional

import pyarrow as pa

__all__ = ["MetricsTable", "SCHEMA", "table_of"]

_F, _I, _S = pa.float64(), pa.int64(), pa.string()

#: The table's columns: the query's ids, then :meth:`~.policy.BatchMetrics.row`'s.
SCHEMA = pa.schema([
    ("stretch_id", _S), ("query_id", _S), ("run_id", _S), ("query_name", _S),
    ("batch", _I), ("time", pa.timestamp("ms", tz="UTC")), ("parallelism", _I),
    ("max_parallelism", _I), ("epoch", _I), ("input_rows", _I), ("input_rate", _F),
    ("processed_rate", _F), ("latency_p50_ms", _F), ("latency_p99_ms", _F),
    ("utilization_mean", _F), ("utilization_max", _F), ("utilization", pa.list_(_F)),
    ("busy_ms", pa.list_(_F)), ("instances", pa.list_(_I)), ("load", pa.list_(_I)),
    ("imbalance", _F), ("demand", _F), ("step_ms", _F), ("budget_ms", _F), ("tuples", _I),
    ("live_windows", _I), ("state_bytes", _I), ("batches_since_switch", _I),
    ("switched", _S), ("switch_ms", _F), ("host_imbalance", _F), ("batches_since_move", _I),
    ("hosts", pa.list_(pa.struct([  # (on several hosts: BatchMetrics.host_row of each)
        ("host", _S), ("parallelism", _I), ("key_groups", _I), ("load", _I),
        ("utilization_mean", _F), ("utilization_max", _F), ("demand", _F), ("imbalance", _F),
        ("input_rows", _I), ("tuples", _I), ("batches_since_switch", _I),
        ("switched", _S)])))])


def table_of(rows: List[dict], ids: dict) -> pa.Table:
    """Per-batch rows (with the query's ``ids``) as an Arrow table of :data:`SCHEMA`."""
    cols = {f.name: [] for f in SCHEMA}
    for r in rows:
        for name in cols:
            v = ids.get(name) if name in ids else r.get("time_ms" if name == "time" else name)
            cols[name].append(v)
    return pa.table({f.name: pa.array(cols[f.name], f.type) for f in SCHEMA}, schema=SCHEMA)


class MetricsTable:
    """Appends a query's per-batch rows to ``target`` (a Delta path, or a table name written
    through ``spark``) from a background thread. ``ids()``: the query's ids, asked at each
    write (Spark's ids are known once the query started)."""

    def __init__(self, spark, target: str, ids):
        self._spark = spark
        self.target = target
        self._ids = ids
        self._path = "/" in target or "://" in target
        self._q: "queue.Queue[Optional[dict]]" = queue.Queue()
        self.error: Optional[BaseException] = None
        self.commits = 0
        self._thread = threading.Thread(target=self._run, name="stretch-metrics-table",
                                        daemon=True)
        self._thread.start()

    def append(self, row: dict) -> None:
        self._q.put(row)

    def close(self, timeout: float = 60.0) -> None:
        """Write what is waiting, then stop."""
        self._q.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        done = False
        while not done:
            rows = [self._q.get()]
            while True:  # everything waiting goes in one commit
                try:
                    rows.append(self._q.get_nowait())
                except queue.Empty:
                    break
            done = rows[-1] is None or None in rows
            rows = [r for r in rows if r is not None]
            if rows and self.error is None:
                try:
                    self._write(table_of(rows, self._ids()))
                    self.commits += 1
                except Exception as e:  # reported by metrics(): the query goes on
                    self.error = e

    def _write(self, table: pa.Table) -> None:
        if self._path:
            from deltalake import write_deltalake

            write_deltalake(self.target, table, mode="append", schema_mode="merge")
        else:
            df = self._spark.createDataFrame(table)
            df.write.format("delta").mode("append").option("mergeSchema", "true") \
                .saveAsTable(self.target)
