"""A step's figures for the driver's elastic controller and per-batch metrics.

Every step's reply carries them under ``metrics["elastic"]`` (:meth:`Runtime.step`):

- ``step_ms``: the step's wall time; ``since_ms``: from the end of the query's previous step to
  the end of this one (None for the first step after the query opened);
- ``instances``: the active instances; ``busy_ms``: each one's busy time in the step (its
  kernel's wall time on its thread for the engine, its function's time for the drop-in's
  instance processes); ``load``: each one's keys processed (the drop-in: rows);
- ``bucket_load`` (keys, or rows, per bucket) and ``owner_map``, from which a rebalance is
  computed; absent when the operator's keys are the user's (``f_MK`` of an engine operator);
- ``input_rows`` (the batch's), ``tuples`` (processed in the step: in append mode the
  watermark releases them, so some are earlier batches'), ``parallelism``, ``epoch``,
  ``live_windows``, ``state_bytes`` (in memory) and, for state past the engine's memory
  budget, ``state_disk_bytes`` (its files on local disk);
- on several hosts, ``group_load``: the keys the batch brought each key group this host owns
  (``[[group, keys], ...]``, :func:`~.share.group_loads`), by which key groups move between
  hosts;
- ``end_ms_q``: the median and the 1st percentile of the output rows' window ends (ms), so the
  driver, which knows when the rows reached the sink, has the event-time latency's p50 and
  p99 (None: no rows, or no window column).

Examples
--------
>>> import pyarrow as pa
>>> from datetime import datetime
>>> w = pa.array([{"start": datetime(2024, 1, 1, 0, 0, s), "end": datetime(2024, 1, 1, 0, 1, s)}
...               for s in range(3)])
>>> window_end_quantiles(pa.table({"window": w}))
[1704067261000, 1704067260000]
>>> window_end_quantiles(pa.table({"x": [1]})) is None
True
"""

from __future__ import annotations

import time
from typing import List, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


__all__ = ["StepClock", "engine_figures", "grouped_figures", "window_changes",
           "window_end_quantiles"]

_QUANTILE_ROWS = 200_000  # window ends read per step (evenly spaced) for the quantiles


class StepClock:
    """When the query's steps end (``perf_counter``): a step's ``since_ms``."""

    def __init__(self):
        self._last: Optional[float] = None

    def lap(self) -> Optional[float]:
        """Milliseconds since the previous call (None the first time)."""
        now = time.perf_counter()
        last, self._last = self._last, now
        return None if last is None else (now - last) * 1e3


def window_end_quantiles(table: Optional[pa.Table]) -> Optional[List[int]]:
    """The median and 1st percentile (ms) of ``table``'s ``window.end``, or None."""
    if table is None or table.num_rows == 0 or "window" not in table.column_names:
        return None
    col = table.column("window")
    if not pa.types.is_struct(col.type) or col.type.get_field_index("end") < 0:
        return None
    step = max(1, table.num_rows // _QUANTILE_ROWS)
    end = pc.cast(pc.struct_field(col, "end"), pa.int64()).to_numpy(zero_copy_only=False)
    end = end[::step] // 1000
    if not len(end):
        return None
    return [int(x) for x in np.quantile(end, [0.5, 0.01], method="lower")]


def window_changes(rt, batch: int, before: int, out: pa.Table) -> dict:
    """A step's changes to an aggregation's state rows (its windows: ``before`` the step, and
    the lead engine's after it), for the query's state operator in Spark's progress: ``rows_removed`` the
    windows it closed (append mode: its rows; update mode: evicted unsaid, ``rt._evicted``),
    ``rows_updated`` the windows it changed (update mode: its rows; complete mode: those with
    its stamp, ``batch + 1``) or, in append mode, the windows it opened (which existing
    windows a step updated is not tracked there)."""
    after = rt.engines[0].live_windows()
    if not getattr(rt, "windows_changed", True):
        return {"state_rows": int(after)}
    mode = getattr(rt.spec, "output_mode", "append")
    removed = out.num_rows if mode == "append" else rt._evicted
    if mode == "update":
        updated = out.num_rows
    elif mode == "complete":
        updated = rt.engines[0].stamped_rows(batch + 1)
    else:
        updated = max(0, after - before + removed)
    return {"state_rows": int(after), "rows_updated": int(updated), "rows_removed": int(removed)}


def _common(step_ms: float, since_ms: Optional[float], instances, busy_s, load, parallelism,
            epoch, out: Optional[pa.Table]) -> dict:
    return {"step_ms": step_ms, "since_ms": since_ms, "instances": [int(j) for j in instances],
            "busy_ms": [float(busy_s[j]) * 1e3 for j in instances],
            "load": None if load is None else [int(x) for x in load],
            "parallelism": int(parallelism), "epoch": int(epoch),
            "end_ms_q": window_end_quantiles(out)}


def engine_figures(rt, t0: float, since_ms: Optional[float]) -> dict:
    """The figures of a step of a runtime over engines (``rt.engines``, one owner map), which
    started at ``t0`` (``perf_counter``)."""
    from ..engine.meter import state_bytes  # (here: the daemon says READY before numba loads)

    step_ms = (time.perf_counter() - t0) * 1e3
    engines = rt.engines
    lead = engines[0]
    taken = [eng.meter.take() for eng in engines]
    busy = np.sum([t["busy_s"] for t in taken], axis=0)
    bucket_load = np.sum([t["bucket_load"] for t in taken], axis=0)
    active = list(lead.active)
    builtin = all(getattr(eng.op, "builtin_ip", None) is not None for eng in engines)
    om = np.asarray(lead.owner_map, np.int64)
    load = (np.bincount(om, weights=bucket_load, minlength=lead.n)[active]
            if builtin else None)
    fig = _common(step_ms, since_ms, active, busy, load, len(active), lead.epoch, rt._last_out)
    fig.update(tuples=int(taken[0]["tuples"]),
               live_windows=int(sum(eng.live_windows() for eng in engines)),
               state_bytes=int(sum(state_bytes(eng) for eng in engines)))
    disk = int(sum(state_bytes(eng, "disk") for eng in engines))
    if disk:  # (past the memory budget: the tables' files)
        fig["state_disk_bytes"] = disk
    if builtin:
        fig.update(bucket_load=bucket_load.tolist(), owner_map=om.tolist())
    gl = getattr(rt, "group_load", None)
    if gl is not None:
        fig["group_load"] = [[int(g), int(gl[g])] for g in np.flatnonzero(gl)]
    return fig


def grouped_figures(rt, t0: float, since_ms: Optional[float], bucket_rows) -> dict:
    """The figures of a step of the drop-in's runtime (``rt``: its instances' last figures,
    owner map, state store: its bytes in use, on disk and in the kernel's page cache as
    touched); ``bucket_rows``: the step's rows per bucket."""
    step_ms = (time.perf_counter() - t0) * 1e3
    per = {p["instance"]: p for p in rt.last_metrics.get("instances", [])}
    om = np.asarray(rt.owner, np.int64)
    active = list(range(rt.parallelism))  # (an instance that owns no bucket is idle)
    busy = np.zeros(rt.n, np.float64)
    for j, p in per.items():
        busy[j] = (p.get("data_ms", 0.0) + p.get("timeouts_ms", 0.0)) / 1e3
    rows = np.zeros(rt.B, np.int64) if bucket_rows is None else np.asarray(bucket_rows)
    load = np.bincount(om, weights=rows, minlength=rt.n)[active]
    fig = _common(step_ms, since_ms, active, busy, load, rt.parallelism, rt.epoch, rt._last_out)
    disk = int(rt.last_metrics.get("state_disk_bytes", 0))  # (measured once, by the step)
    held = int(rt.last_metrics.get("state_memory_bytes", 0))
    fig.update(tuples=int(rows.sum()), live_windows=int(rt.state_keys),
               state_bytes=held, state_disk_bytes=disk, bucket_load=rows.tolist(),
               owner_map=om.tolist(), operator_metrics=rt.last_metrics.get("operator_metrics", {}))
    share = rt.spec.share
    if share is not None:  # (several hosts: a bucket's key group is pmod(bucket, G))
        gl = np.bincount(np.arange(rt.B) % share.key_groups, weights=rows,
                         minlength=share.key_groups).astype(np.int64)
        fig["group_load"] = [[int(g), int(gl[g])] for g in np.flatnonzero(gl)]
    return fig
