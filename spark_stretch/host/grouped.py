"""``groupBy(k).stretchApplyInPandasWithState(func, ...)`` inside the host engine: the
applyInPandasWithState drop-in's runtime. The function itself runs in the instance processes (:mod:`spark_stretch.worker`).

::

    host engine (GroupedRuntime)                   instance processes (n = max_parallelism)
    ────────────────────────────                   ───────────────────────────────────────
    batch N (Arrow) ─ late filter (event time) ─┐
      key hash -> bucket (B), sort, split by    │  in-<s>-<i>.arrow (tmpfs)   ┌──────────────┐
      owner map bucket -> instance  ────────────┼───────────────────────────▶ │ instance i:  │
                                                │                             │ func per key,│
    output = concat(out-<s>-<i>.arrow) ◀────────┼──── out-<s>-<i>.arrow ───── │ then timeouts│
    checkpoint: changes-<s>-<i>.arrow ◀─────────┘                             └──────┬───────┘
                                  state store (LMDB, local disk): $TMPDIR/stretch-<q>-<pid>-state-*

- **State** is in one :class:`~spark_stretch.engine.keyed.KeyedStore` (LMDB) per query on local
  disk, shared by the engine and every instance: per key ``(key, value in Spark's internal form,
  timeout)`` under its bucket, and a timer index. A batch reads and writes only the keys it
  touches and the timers due, so its cost does not grow with the state; the state's pages are
  the kernel's page cache, so more state than memory stays on disk. An instance applies its
  share in one transaction at its end, so one that dies mid-step is started again and runs its
  share again on the previous step's state (:meth:`~.instances.InstancePool.run`). A rescale or
  rebalance only swaps the owner map between two batches: nothing is restarted, shuffled or
  copied; a new owner reads the bucket's keys in the store.
- **Placement**: a key's bucket and owner follow :mod:`spark_stretch.protocol.placement` (a
  SipHash of the key columns, then the engine's rule), as every runtime's do. On several hosts
  Spark computes each row's bucket (``pmod(xxhash64(k1, ...), B)``, column
  ``__stretch_bucket``) and routes the row to the host of its key group (the bucket's
  ``pmod(bucket, G)``: :func:`~spark_stretch.driver.routing.route_grouped`); each host's engine
  has its own store, its own checkpoints (``<checkpoint>/stretch/hosts/<slot>/state``) and the
  keys of its groups only. When key groups change hosts, a host's store is rebuilt from the
  checkpoints of the same batch of the hosts that held its groups: the entries of those
  groups' buckets (:mod:`.grouped_state`, with the checkpoints and restores).
- **Checkpoint** per batch under ``<checkpoint>/stretch/state/<N>/``: ``grouped.json`` plus the
  instances' changelogs of the batch (``changes-<step>-<i>.arrow``: a delta); every
  ``min_deltas`` batches (Spark's ``minDeltasForSnapshot``) that delta is promoted to a full
  checkpoint in the background, a compact copy of the store as of that batch
  (``state.mdb.zst``), while the next batches run; both compressed with zstd (format 4).
  Checkpoints of format 3 (uncompressed) are read as they are, of format 2 (pickled buckets,
  spark-stretch 0.18) read and converted.
"""

from __future__ import annotations

import base64
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..protocol import instances as I
from ..protocol import messages as M
from ..protocol import placement
from ..protocol.errors import BadRequest, InstanceDiedError, StateError, UserFunctionError
from ..engine.keyed import KeyedStore, memory_share
from ..protocol.layout import GROUPED_META, shm_prefix, shm_root, state_root
from ..protocol.specs import GroupedSpec
from . import faults, load
from .checkpoints import read_arrow
from .grouped_state import BUCKET, GroupedState, siphash_buckets
from .instances import InstancePool
from .runtime import Runtime, ms_since

__all__ = ["BUCKET", "GroupedRuntime"]


class GroupedRuntime(GroupedState, Runtime):
    """The engine-side state of one grouped query (``spec``: a
    :class:`~spark_stretch.protocol.specs.GroupedSpec`)."""

    META = GROUPED_META

    def __init__(self, qid: str, spec: GroupedSpec, receiver):
        super().__init__(qid, spec, receiver)
        self.B, self.n = spec.buckets, spec.max_parallelism
        if spec.share is not None and self.B % spec.share.key_groups:
            raise BadRequest(f"buckets={self.B} on several hosts: must be a multiple of "
                             f"spark.stretch.keyGroups ({spec.share.key_groups})")
        self.owner = placement.balanced_owner_map(self.B, range(self.parallelism))
        self.epoch = 0
        self.counters.update(calls=0, timeout_calls=0, instance_retries=0)
        self.max_event_ms: Optional[int] = None
        self.state_keys = 0
        self._broken: Optional[str] = None
        self._seq = 0
        self.last_metrics: dict = {}
        self.pool: Optional[InstancePool] = None
        self.kv: Optional[KeyedStore] = None
        # (the store's pages each process keeps mapped: the engine's and its instances' share
        # of spark.stretch.state.memory)
        self.kv_memory = memory_share(spec)
        self._changes: list = []  # the last step's changelog files: its delta checkpoint
        self._stepping: Optional[int] = None  # the batch whose step the instances run
        self.shm = Path(tempfile.mkdtemp(prefix=f"{shm_prefix(qid)}{os.getpid()}-",
                                         dir=shm_root()))
        self.state_dir = Path(tempfile.mkdtemp(prefix=f"{shm_prefix(qid)}{os.getpid()}-state-",
                                               dir=state_root()))
        # transformWithState's initialState: given to the first step of a query that starts
        # with no state (never again, as natively)
        self._initial: Optional[pa.Table] = None
        try:
            if spec.resume_batch is not None:  # (a checkpoint every batch: exactly that one)
                self._load(spec.resume_batch)
            else:
                self.kv = KeyedStore(self.state_dir, self.kv_memory)
                if spec.initial_state:
                    self._initial = pa.ipc.open_stream(
                        base64.b64decode(spec.initial_state)).read_all()
            self.pool = InstancePool(self.n, self.shm, I.Init(
                spec=replace(spec, func="", initial_state=""),
                func=base64.b64decode(spec.func),
                shm=str(self.shm), index=0, state=str(self.state_dir)))
        except BaseException:
            self.close()
            raise

    def describe(self) -> M.Opened:
        return M.Opened(query=self.qid, parallelism=self.parallelism, max_parallelism=self.n,
                        checkpoint=self.checkpoint,
                        instance_pids=self.pool.pids if self.pool else [])

    # -- data --------------------------------------------------------------------------------
    def _step(self, batch: int, table: Optional[pa.Table], batch_ts_ms: Optional[int]
              ) -> M.StepResult:
        t0 = time.perf_counter()
        s: GroupedSpec = self.spec
        ts_ms = int(batch_ts_ms if batch_ts_ms is not None else time.time() * 1000)
        evict_wm = self.next_watermark_ms                     # W_N
        late = 0
        top = None
        if table is not None and BUCKET in table.column_names and s.share is None:
            raise BadRequest("rows with buckets (routed to several hosts) to a query on one")
        if table is not None and table.num_rows:
            self.counters["input_rows"] += table.num_rows
            if self.key_schema is None:  # (kept with the checkpoints: _convert)
                self.key_schema = pa.schema([table.schema.field(k) for k in s.key_columns])
            if s.ts_column:
                ts = table.column(s.ts_column)
                if ts.null_count < len(ts):
                    top = int(pc.max(pc.cast(ts, pa.int64())).as_py()) // 1000
                if s.timeout_conf == "EventTimeTimeout":
                    # FlatMapGroupsWithStateExecBase: with an event-time timeout, rows at or
                    # before the late-events watermark (the previous batch's) are dropped.
                    keep = pc.fill_null(
                        pc.greater(pc.cast(ts, pa.int64()), self.watermark_ms * 1000), False)
                    before = table.num_rows
                    table = table.filter(keep)
                    late = before - table.num_rows
        faults.inject("step", batch)
        out, metrics = self._run(batch, table, ts_ms, evict_wm)
        self.watermark_ms = evict_wm
        if top is not None:
            self.max_event_ms = top if self.max_event_ms is None else max(self.max_event_ms, top)
        if self.max_event_ms is not None:  # W_{N+1}, used from the next batch
            self.next_watermark_ms = max(self.watermark_ms, self.max_event_ms - s.delay_ms)
        self.counters["late_rows"] += late
        self.counters["batches"] += 1
        self.last_batch = batch
        self._save(batch)
        return self._offer(f"{self.qid}:out:{batch}", out, {
            "watermark_ms": self.watermark_ms, "late_rows": late, "batch_ts_ms": ts_ms,
            "engine_ms": ms_since(t0), **metrics})

    def flush(self) -> M.FlushResult:
        """Spark runs the drop-in's no-data batches itself (it is inside Spark's plan): each is
        a step of its own, without rows."""
        return M.FlushResult(rows=0, batch=self.last_batch)

    def _own(self, table: pa.Table) -> pa.Table:
        """The rows of ``table`` this host keeps: on several hosts, those whose bucket
        (:data:`BUCKET`, Spark's) is in one of its key groups."""
        share = self.spec.share
        if share is None or BUCKET not in table.column_names:
            return table
        groups = np.asarray(table.column(BUCKET).to_numpy(), np.int64) % share.key_groups
        return table.filter(pa.array(np.isin(groups, share.owned())))

    def _part_file(self, parts: dict, i: int, file_of):
        """Instance ``i``'s rows of ``parts`` (:func:`split_rows`) as this step's file
        ``file_of(shm, seq, i)``: ``(path, group starts, group buckets)``, or Nones."""
        if i not in parts:
            return None, None, None
        sub, starts, gb = parts[i]
        path = file_of(self.shm, self._seq, i)
        with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, sub.schema) as w:
            w.write_table(sub)
        return str(path), starts, gb

    def _check_usable(self) -> None:
        if self._broken:
            raise StateError(f"this query's state is unusable after an earlier failure "
                             f"({self._broken}); restart the query from its checkpoint")

    def _run(self, batch: int, table: Optional[pa.Table], ts_ms: int, evict_wm: int):
        """One step on the instances: the keys with data, then the timed-out keys. (The
        previous batch's checkpoint may still be copying the store: it reads the version of
        its own read transaction.)"""
        t0 = time.perf_counter()
        self._seq += 1
        parts = {}
        if table is not None and table.num_rows:
            parts, self.bucket_rows = split_rows(table, self.spec.key_columns, self.B, self.owner)
        t_split = time.perf_counter()
        initial = {}
        if self._initial is not None and self._initial.num_rows:
            initial, _ = split_rows(self._own(self._initial), self.spec.initial_key_columns,
                                    self.B, self.owner)
        msgs = {}
        for i in sorted(set(int(x) for x in np.unique(self.owner))):
            owned = np.flatnonzero(self.owner == i)
            path, starts, gb = self._part_file(parts, i, I.input_file)
            ipath, istarts, igb = self._part_file(initial, i, I.initial_file)
            msgs[i] = I.Batch(batch=batch, seq=self._seq, owned=owned, batch_ts_ms=ts_ms,
                              watermark_ms=evict_wm, input=path, starts=starts,
                              group_buckets=gb, initial=ipath, initial_starts=istarts,
                              initial_buckets=igb)
        what = f"batch {batch}"
        self._stepping = batch
        try:
            replies, retries = self.pool.run(msgs, what, self.spec.instance_max_failures,
                                             self.spec.function_attempts)
        except UserFunctionError:  # instances that finished cached the step, not applied
            self._broken = f"the user function failed in {what}"
            raise
        except InstanceDiedError as e:
            self._broken = str(e)
            raise
        finally:
            self._stepping = None
            for msg in msgs.values():
                for f in (msg.input, msg.initial):
                    if f:
                        Path(f).unlink(missing_ok=True)
        self._initial = None  # (applied with the first step)
        if retries:  # a killed instance's read slot would keep old pages from being reused
            self.kv.env.reader_check()
        t_run = time.perf_counter()
        tables, empty, dirty, per = [], None, set(), []
        for i in sorted(replies):
            r = replies[i]
            dirty.update(r.dirty)
            per.append({"instance": i, "pid": self.pool.instances[i].pid, **r.times,
                        "calls": r.calls, "timeout_calls": r.timeout_calls,
                        "changed_rows": r.changed_rows})
            if r.out:
                t = read_arrow(Path(r.out))  # (the mapping outlives the unlink)
                os.unlink(r.out)
                if t.num_rows:
                    tables.append(t)
                else:
                    empty = t
            if r.changes:
                self._changes.append((i, Path(r.changes), r.changed_rows))
        self.state_keys = self.kv.rows()
        self.kv.hold()  # (its own reads: within its share too)
        calls = sum(r.calls for r in replies.values())
        timeouts = sum(r.timeout_calls for r in replies.values())
        # (no rows: the output's columns, read from every host of a query on several)
        out = pa.concat_tables(tables) if tables else empty if empty is not None else pa.table({})
        self.counters["calls"] += calls
        self.counters["timeout_calls"] += timeouts
        self.counters["instance_retries"] += len(retries)
        self.state_changes = {"state_rows": self.state_keys,
                              "rows_updated": sum(r.updated for r in replies.values()),
                              "rows_removed": sum(r.removed for r in replies.values())}
        operator = Counter()  # (update, not +: a counter of 0 stays)
        for r in replies.values():
            operator.update(r.operator)
        m = {"calls": calls, "timeout_calls": timeouts, "state_keys": self.state_keys,
             "operator_metrics": dict(operator),
             "changed_buckets": len(dirty), "state_disk_bytes": self.kv.disk_bytes(),
             # (the store's pages the processes had mapped: within spark.stretch.state.memory)
             "state_memory_bytes": sum(r.held for r in replies.values()) + self.kv.held(),
             "split_ms": (t_split - t0) * 1e3,
             "instances_ms": (t_run - t_split) * 1e3, "instances": per,
             "instance_retries": len(retries), **({"retries": retries} if retries else {})}
        self.last_metrics = m
        return out, m

    # -- control -----------------------------------------------------------------------------
    def reconfigure(self, parallelism: Optional[int], owner_map, persist=True) -> M.Reconfigured:
        """Epoch switch between two batches: only the owner map changes (no state is moved;
        the next batch's checkpoint holds it, ``persist`` or not)."""
        with self.lock:
            self._check_usable()
            t0 = time.perf_counter()
            if owner_map is not None:
                try:
                    om = placement.validate_owner_map(owner_map, self.B, range(self.n))
                except placement.PlacementError as e:
                    raise BadRequest(str(e)) from None
                m = int(parallelism or (int(om.max()) + 1))
            else:
                m = int(parallelism or self.parallelism)
                om = placement.balanced_owner_map(self.B, range(m))
            moved = placement.moved_buckets(self.owner, om)
            self.owner, self.parallelism = om, m
            self.epoch += 1
            faults.inject("reconfigure", self.last_batch)
            rec = M.Reconfigured(epoch=self.epoch, parallelism=m, switch_ms=ms_since(t0),
                                 after_batch=self.last_batch, moved_buckets=moved,
                                 state_keys=self.state_keys, state_copied_bytes=0)
            self.switches.append(rec.to_dict())
            return rec

    def _step_figures(self, t0: float, since_ms: Optional[float]) -> dict:
        rows, self.bucket_rows = getattr(self, "bucket_rows", None), None
        return load.grouped_figures(self, t0, since_ms, rows)

    def metrics(self) -> dict:
        with self.lock:
            return {**self.counters, "parallelism": self.parallelism, "max_parallelism": self.n,
                    "epoch": self.epoch, "watermark_ms": self.watermark_ms,
                    "switches": list(self.switches), "state_keys": self.state_keys,
                    "checkpoint": dict(self.store.stats), "last_step": dict(self.last_metrics),
                    "promoted": self.promoted,
                    "instance_pids": self.pool.pids if self.pool else [],
                    "pid": os.getpid(), "shm_dir": str(self.shm),
                    "state_dir": str(self.state_dir),
                    "state_disk_bytes": self.kv.disk_bytes() if self.kv else 0,
                    "state_memory_bytes": int(self.last_metrics.get("state_memory_bytes", 0))}

    def cancel(self, batch: int) -> None:
        # (a step runs the user's function for as long as it takes: minutes at a million keys)
        if self._stepping == batch and self.pool is not None:
            self.pool.cancel(f"batch {batch} was cancelled: the query is stopping")

    def abandon(self) -> None:
        if self.pool is not None:  # (their step is lost: a restart redoes it from the checkpoint)
            self.pool.cancel("the engine is exiting: its driver is gone")
        self._remove_files()

    def _remove_files(self) -> None:
        shutil.rmtree(self.shm, ignore_errors=True)
        shutil.rmtree(self.state_dir, ignore_errors=True)
        for suffix in (".snapshot", ".promoted"):
            self.state_dir.with_name(self.state_dir.name + suffix).unlink(missing_ok=True)

    def _close(self) -> None:
        self._join_promotion()  # (its read transaction must end before the store closes)
        if self.pool is not None:
            self.pool.stop()
        if self.kv is not None:
            self.kv.close()
        self._remove_files()


def split_rows(table: pa.Table, keys, n_buckets: int, owner: np.ndarray):
    """Rows per owning instance (of ``owner``, per bucket), sorted by (bucket, key), with their
    group starts and buckets; and the rows per bucket (the step's figures). Rows that carry
    their bucket (:data:`BUCKET`, on several hosts) are placed by it."""
    if BUCKET in table.column_names:
        b = table.column(BUCKET).to_numpy().astype(np.int64)
        table = table.drop_columns([BUCKET])
        if len(b) and (b.min() < 0 or b.max() >= n_buckets):
            raise BadRequest(f"a row's bucket is outside 0..{n_buckets - 1}")
    else:
        b = siphash_buckets(table, keys, n_buckets)
    bucket_rows = np.bincount(b, minlength=n_buckets)
    table = table.append_column("__b", pa.array(b))
    order = pc.sort_indices(table, sort_keys=[("__b", "ascending")] +
                            [(k, "ascending") for k in keys], null_placement="at_end")
    table = table.take(order)
    b = table.column("__b").to_numpy()
    table = table.drop_columns(["__b"])
    new = np.ones(table.num_rows, dtype=bool)
    if table.num_rows > 1:
        diff = b[1:] != b[:-1]
        for k in keys:
            col = table.column(k)
            a, c = col.slice(1), col.slice(0, table.num_rows - 1)
            ne = pc.fill_null(pc.not_equal(a, c), True)
            both_null = pc.and_(pc.is_null(a), pc.is_null(c))
            diff |= pc.and_(ne, pc.invert(both_null)).to_numpy(zero_copy_only=False)
        new[1:] = diff
    starts = np.flatnonzero(new)
    row_owner = owner[b]
    g_owner = row_owner[starts]
    sizes = np.diff(np.append(starts, table.num_rows))
    parts = {}
    for i in np.unique(g_owner):
        gi = g_owner == i
        sub = table if gi.all() else table.filter(pa.array(row_owner == i))
        sz = sizes[gi]
        sub_starts = np.concatenate([[0], np.cumsum(sz)[:-1]]).astype(np.int64)
        parts[int(i)] = (sub, sub_starts, b[starts[gi]].astype(np.int64))
    return parts, bucket_rows
