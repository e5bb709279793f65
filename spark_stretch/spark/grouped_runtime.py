"""``groupBy(k).stretchAggregate(func, ...)`` inside the host engine: the applyInPandasWithState
drop-in's runtime (no Spark import here; pyspark's pure-Python state and Arrow/pandas conversion
modules are used so that the user function sees exactly what it sees under native Spark).

Layout (one :class:`GroupedRuntime` per query, in :mod:`spark_stretch.spark.hostd`)::

    hostd (GroupedRuntime)                         instance processes (n = max_parallelism)
    ──────────────────────                         ───────────────────────────────────────
    batch N (Arrow) ─ late filter (event time) ─┐
      key hash -> bucket (B), sort, split by    │  in-<N>-<i>.arrow (tmpfs)   ┌──────────────┐
      owner map bucket -> instance  ────────────┼───────────────────────────▶ │ instance i:  │
                                                │                             │ func per key,│
    output = concat(out-<N>-<i>.arrow) ◀────────┼──── out-<N>-<i>.arrow ───── │ then timeouts│
    checkpoint: changed bucket files ◀──────────┘                             └──────┬───────┘
                                                    /dev/shm/stretch-<q>-<pid>/b<bucket>.pkl

- **State** lives in one file per bucket on tmpfs (``/dev/shm``): a pickled dict
  ``key tuple -> (state value in Spark's internal form or None, timeout timestamp ms)``. Every
  instance can read every bucket; an instance caches the buckets it owns and writes back the ones
  it changed at the end of each batch. A rescale or rebalance only swaps the owner map between two
  batches: nothing is restarted, shuffled or copied; a new owner reads a bucket from shared memory
  the first time it needs it.
- **Instances** are processes (Python functions hold the GIL), started once with the query
  (``max_parallelism`` of them; ``parallelism`` are given buckets), the function shipped with
  pyspark's cloudpickle. They die with the engine (``PR_SET_PDEATHSIG``) and also exit when its
  socket closes.
- **Semantics** are those of ``FlatMapGroupsInPandasWithStateExec`` (Spark 4.2): see
  :class:`_Instance` and docs/architecture.md.
- **Checkpoint** per batch under ``<checkpoint>/stretch/state/<N>/``: ``grouped.json`` plus the
  bucket files, all of them (full) or those changed since the parent checkpoint (delta).
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait as conn_wait
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import faults
from .checkpointed import CheckpointedRuntime
from .host import _die_with_parent, spawn_child

__all__ = ["GroupedRuntime", "UserFunctionError", "InstanceDiedError"]

NO_TIMESTAMP = -1
_META = "grouped.json"


class UserFunctionError(RuntimeError):
    """The user's function (or the conversion of what it returned) raised in an instance."""


class InstanceDiedError(RuntimeError):
    """An instance process died while it ran a batch."""


def shm_root() -> str:
    """Where bucket files live: tmpfs (``/dev/shm``) when there is one."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
        else tempfile.gettempdir()


def _bucket_file(d: Path, b: int) -> Path:
    return d / f"b{b:05d}.pkl"


# ---------------------------------------------------------------------------------------------
# host engine side
# ---------------------------------------------------------------------------------------------
class GroupedRuntime(CheckpointedRuntime):
    """The engine-side state of one grouped query (``spec`` from ``GroupedSpec.engine_spec``)."""

    META = _META

    def __init__(self, qid: str, spec: dict, receiver):
        self.qid = qid
        self.spec = spec
        self.receiver = receiver
        self.lock = threading.Lock()
        self.B = int(spec["buckets"])
        self.n = int(spec["max_parallelism"])
        self.m = int(spec["parallelism"])
        self.owner = np.arange(self.B, dtype=np.int64) % self.m
        self._prev_owner = self.owner.copy()
        self.epoch = 0
        self.counters = {"input_rows": 0, "late_rows": 0, "output_rows": 0, "batches": 0,
                         "calls": 0, "timeout_calls": 0}
        self.watermark_ms = 0          # W_N: eviction watermark of the last batch (late rule next)
        self.next_watermark_ms = 0     # W_{N+1}
        self.max_event_ms: Optional[int] = None
        self.last_batch = -1
        self.last_reply: Optional[dict] = None
        self.pending: Dict[int, pa.Table] = {}
        self.switches: List[dict] = []
        self.state_keys = 0
        self._flushed_batch = -2       # processing-time flush: at most one per batch
        self._broken: Optional[str] = None
        self._offered: Optional[str] = None
        self._seq = 0
        self.state_dir = Path(spec["state_dir"]) if spec.get("state_dir") else None
        self._hold_checkpoint()
        self._saver: Optional[threading.Thread] = None
        self._save_error: Optional[BaseException] = None
        self._chain: Optional[dict] = None
        self.save_stats: dict = {}
        self.last_metrics: dict = {}
        self._flush_dirty: set = set()
        self._last_out: Optional[pa.Table] = None
        self.shm = Path(tempfile.mkdtemp(prefix=f"stretch-{qid}-{os.getpid()}-", dir=shm_root()))
        self.instances: List[_InstanceHandle] = []
        try:
            resume = spec.get("resume_batch")
            if resume is not None:
                self._load(int(resume))
            self._start_instances()
        except BaseException:
            self.close()
            raise

    # -- instances ---------------------------------------------------------------------------
    def _start_instances(self) -> None:
        init = {"spec": {k: v for k, v in self.spec.items() if k != "func"},
                "func": base64.b64decode(self.spec["func"]), "shm": str(self.shm)}
        self.instances = [_InstanceHandle(i, self.shm) for i in range(self.n)]
        for inst in self.instances:
            inst.send(dict(init, op="init", index=inst.index))
        for inst in self.instances:
            inst.recv(timeout=300, what="start-up")

    def describe(self) -> dict:
        return {"query": self.qid, "parallelism": self.m, "max_parallelism": self.n,
                "kind": "grouped", "instance_pids": [i.pid for i in self.instances]}

    # -- data --------------------------------------------------------------------------------
    def step(self, batch: int, batch_ts_ms: Optional[int] = None) -> dict:
        with self.lock:
            table = self.pending.pop(batch, None)
            if batch <= self.last_batch:
                if batch == self.last_batch and self.last_reply is not None:
                    # the same rows again (a flush may have replaced the offer meanwhile)
                    self.receiver.offer(self.last_reply["stream"], self._last_out)
                    self._offered = self.last_reply["stream"]
                    return dict(self.last_reply, replayed=True)
                raise RuntimeError(
                    f"batch {batch} replayed after batch {self.last_batch}: the state of that "
                    "batch is gone (restart the query from its checkpoint)")
            self._check_usable()
            t0 = time.perf_counter()
            s = self.spec
            ts_ms = int(batch_ts_ms if batch_ts_ms is not None else time.time() * 1000)
            evict_wm = self.next_watermark_ms                     # W_N
            late = 0
            top = None
            if table is not None and table.num_rows:
                self.counters["input_rows"] += table.num_rows
                if s.get("ts_column"):
                    ts = table.column(s["ts_column"])
                    if ts.null_count < len(ts):
                        top = int(pc.max(pc.cast(ts, pa.int64())).as_py()) // 1000
                    if s["timeout_conf"] == "EventTimeTimeout":
                        # FlatMapGroupsWithStateExecBase: with an event-time timeout, rows at or
                        # before the late-events watermark (the previous batch's) are dropped.
                        keep = pc.fill_null(
                            pc.greater(pc.cast(ts, pa.int64()), self.watermark_ms * 1000), False)
                        before = table.num_rows
                        table = table.filter(keep)
                        late = before - table.num_rows
            faults.inject("step", batch)
            out, info = self._run(batch, table, ts_ms, evict_wm)
            self.watermark_ms = evict_wm
            if top is not None:
                self.max_event_ms = top if self.max_event_ms is None else max(self.max_event_ms, top)
            if self.max_event_ms is not None:  # W_{N+1}, used from the next batch
                self.next_watermark_ms = max(self.watermark_ms,
                                             self.max_event_ms - int(s.get("delay_ms") or 0))
            self.counters["late_rows"] += late
            self.counters["batches"] += 1
            self.last_batch = batch
            self._save(batch, info["dirty"])
            self._last_out = out
            self.last_reply = self._offer(f"{self.qid}:out:{batch}", out, {
                "watermark_ms": self.watermark_ms, "late_rows": late, "batch_ts_ms": ts_ms,
                "engine_ms": (time.perf_counter() - t0) * 1e3, **info["metrics"]})
            return self.last_reply

    def flush(self, batch_ts_ms: Optional[int] = None) -> dict:
        """Spark's no-data batch: call the keys whose timeout passed (next watermark, or now)."""
        with self.lock:
            self._check_usable()
            s = self.spec
            conf = s["timeout_conf"]
            if conf == "EventTimeTimeout":
                if self.next_watermark_ms <= self.watermark_ms:
                    return {"rows": 0, "batch": self.last_batch, "changed": False}
                evict_wm, ts_ms = self.next_watermark_ms, batch_ts_ms
            elif conf == "ProcessingTimeTimeout":
                if self._flushed_batch >= self.last_batch or self.last_batch < 0:
                    return {"rows": 0, "batch": self.last_batch, "changed": False}
                evict_wm, ts_ms = self.next_watermark_ms, batch_ts_ms
            else:
                return {"rows": 0, "batch": self.last_batch, "changed": False}
            ts_ms = int(ts_ms if ts_ms is not None else time.time() * 1000)
            out, info = self._run(self.last_batch, None, ts_ms, evict_wm, flush=True)
            self.watermark_ms = evict_wm
            self._flushed_batch = self.last_batch
            self._flush_dirty = set(info["dirty"])
            reply = self._offer(f"{self.qid}:flush:{self.last_batch}", out,
                                {"watermark_ms": self.watermark_ms, "batch_ts_ms": ts_ms,
                                 **info["metrics"]})
            return dict(reply, batch=self.last_batch, changed=True)

    def flushed(self) -> dict:
        """The sink holds the last flush: keep the state after it as the state of the last batch."""
        with self.lock:
            self._save(self.last_batch, getattr(self, "_flush_dirty", set()), full=True)
            self._join_saver()
            return {"batch": self.last_batch}

    def _check_usable(self) -> None:
        if self._broken:
            raise RuntimeError(f"this query's state is unusable after an earlier failure "
                               f"({self._broken}); restart the query from its checkpoint")

    def _run(self, batch: int, table: Optional[pa.Table], ts_ms: int, evict_wm: int,
             flush: bool = False):
        """One step on the instances: the keys with data, then the timed-out keys."""
        self._join_saver()  # the previous checkpoint read its bucket files already; be sure
        t0 = time.perf_counter()
        self._seq += 1
        parts = self._split(table) if table is not None and table.num_rows else {}
        t_split = time.perf_counter()
        active = sorted(set(int(x) for x in np.unique(self.owner)))
        msgs = {}
        for i in active:
            owned = np.flatnonzero(self.owner == i)
            reload = owned[self._prev_owner[owned] != i]
            msg = {"op": "batch", "batch": batch, "seq": self._seq, "flush": flush,
                   "owned": owned, "reload": reload, "batch_ts_ms": ts_ms,
                   "watermark_ms": evict_wm, "input": None}
            if i in parts:
                path = self.shm / f"in-{self._seq}-{i}.arrow"
                sub, starts, gb = parts[i]
                with pa.OSFile(str(path), "wb") as f:
                    with pa.ipc.new_file(f, sub.schema) as w:
                        w.write_table(sub)
                msg.update(input=str(path), starts=starts, group_buckets=gb)
            msgs[i] = msg
        for i, msg in msgs.items():
            self.instances[i].send(msg)
        replies = self._collect(msgs, batch)
        self._prev_owner = self.owner.copy()
        t_run = time.perf_counter()
        tables, dirty = [], set()
        calls = timeouts = keys = 0
        per = []
        for i in sorted(replies):
            r = replies[i]
            dirty.update(int(b) for b in r["dirty"])
            calls += r["calls"]
            timeouts += r["timeout_calls"]
            keys += r["state_keys"]
            per.append({"instance": i, "pid": self.instances[i].pid, **r["times"],
                        "calls": r["calls"], "timeout_calls": r["timeout_calls"],
                        "bucket_loads": r["bucket_loads"]})
            if r["out"]:
                src = pa.memory_map(r["out"])  # zero-copy; the mapping outlives the unlink
                tables.append(pa.ipc.open_file(src).read_all())
                os.unlink(r["out"])
            if msgs[i]["input"]:
                try:
                    os.unlink(msgs[i]["input"])
                except FileNotFoundError:
                    pass
        # instances not active keep no state of their own: owned buckets are all counted above
        self.state_keys = keys
        out = pa.concat_tables(tables) if tables else self._empty_output()
        self.counters["calls"] += calls
        self.counters["timeout_calls"] += timeouts
        m = {"calls": calls, "timeout_calls": timeouts, "state_keys": keys,
             "changed_buckets": len(dirty), "split_ms": (t_split - t0) * 1e3,
             "instances_ms": (t_run - t_split) * 1e3, "instances": per}
        self.last_metrics = m
        return out, {"dirty": dirty, "metrics": m}

    def _collect(self, msgs: dict, batch: int) -> dict:
        """Wait for every instance's reply; a death or an error fails the step (never hangs)."""
        waiting = {self.instances[i].conn: i for i in msgs}
        replies = {}
        while waiting:
            ready = conn_wait(list(waiting), timeout=5.0)
            for conn in ready:
                i = waiting.pop(conn)
                inst = self.instances[i]
                try:
                    r = inst.conn.recv()
                except (EOFError, OSError):
                    self._broken = inst.death(f"batch {batch}")
                    raise InstanceDiedError(self._broken) from None
                if not r.get("ok"):
                    self._broken = f"the user function failed in batch {batch}"
                    raise UserFunctionError(
                        f"applyInPandasWithState function failed in batch {batch} (stretch "
                        f"instance {i}, pid {inst.pid}):\n{r['error']}")
                replies[i] = r
            for conn, i in list(waiting.items()):  # a killed instance may not close at once
                if self.instances[i].proc.poll() is not None:
                    self._broken = self.instances[i].death(f"batch {batch}")
                    raise InstanceDiedError(self._broken)
        return replies

    def _split(self, table: pa.Table) -> dict:
        """Rows per owning instance, sorted by (bucket, key), with their group starts."""
        keys = self.spec["key_columns"]
        b = _buckets(table, keys, self.B)
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
        row_owner = self.owner[b]
        g_owner = row_owner[starts]
        sizes = np.diff(np.append(starts, table.num_rows))
        parts = {}
        for i in np.unique(g_owner):
            gi = g_owner == i
            sub = table if gi.all() else table.filter(pa.array(row_owner == i))
            sz = sizes[gi]
            sub_starts = np.concatenate([[0], np.cumsum(sz)[:-1]]).astype(np.int64)
            parts[int(i)] = (sub, sub_starts, b[starts[gi]].astype(np.int64))
        return parts

    def _empty_output(self) -> pa.Table:
        return pa.table({})  # no rows: the driver reads nothing

    # -- checkpoints -------------------------------------------------------------------------
    def _save(self, batch: int, dirty: set, full: bool = False) -> None:
        if self.state_dir is None:
            return
        self._join_saver()
        t0 = time.perf_counter()
        chain = self._chain
        delta = (not full and chain is not None and chain["parent"] < batch
                 and chain["deltas"] + 1 < self.spec.get("min_deltas", 10)
                 and len(dirty) <= self.B // 2)
        blobs = {}
        for b in (sorted(dirty) if delta else range(self.B)):
            f = _bucket_file(self.shm, b)
            if f.exists():
                blobs[f.name] = f.read_bytes()
            elif delta:
                blobs[f.name] = pickle.dumps({}, protocol=5)
        meta = {"format": 1, "kind": "delta" if delta else "full",
                "parent": chain["parent"] if delta else None, "last_batch": batch,
                "watermark_ms": self.watermark_ms, "next_watermark_ms": self.next_watermark_ms,
                "max_event_ms": self.max_event_ms, "counters": dict(self.counters),
                "parallelism": self.m, "owner_map": [int(x) for x in self.owner],
                "epoch": self.epoch, "buckets": self.B, "flushed_batch": self._flushed_batch,
                "state_keys": self.state_keys}
        self._chain = {"parent": batch, "deltas": chain["deltas"] + 1 if delta else 0}
        stats = {"batch": batch, "kind": meta["kind"], "buckets": len(blobs),
                 "bytes": sum(len(v) for v in blobs.values()),
                 "snapshot_ms": (time.perf_counter() - t0) * 1e3}
        blobs[_META] = json.dumps(meta).encode()  # last: its presence marks a whole directory
        self._saver = threading.Thread(target=self._write_state, args=(batch, blobs, stats),
                                       name=f"stretch-grouped-save-{batch}", daemon=True)
        self._saver.start()

    def _write_state(self, batch: int, blobs: dict, stats: dict) -> None:
        try:
            t0 = time.perf_counter()
            self._write_dir(batch, blobs)
            self.save_stats = dict(stats, write_ms=(time.perf_counter() - t0) * 1e3)
        except BaseException as e:
            self._save_error = e

    def _load(self, batch: int) -> None:
        if self.state_dir is None:
            raise RuntimeError(f"no state directory to resume batch {batch} from")
        chain = self._chain_of(batch)
        for b in chain:  # full, then deltas in order: later bucket files replace earlier ones
            d = self.state_dir / str(b)
            for f in d.iterdir():
                if f.name.startswith("b") and f.name.endswith(".pkl"):
                    shutil.copyfile(f, self.shm / f.name)
        meta = json.loads((self.state_dir / str(batch) / _META).read_text())
        if int(meta["buckets"]) != self.B:
            raise RuntimeError(f"the checkpoint has {meta['buckets']} buckets, the query "
                               f"{self.B}: keep buckets= the same across restarts")
        self.watermark_ms, self.next_watermark_ms = meta["watermark_ms"], meta["next_watermark_ms"]
        self.max_event_ms, self.last_batch = meta["max_event_ms"], meta["last_batch"]
        self._flushed_batch = meta.get("flushed_batch", -2)
        self.counters.update(meta["counters"])
        self.m = int(meta["parallelism"])
        self.spec["parallelism"] = self.m
        self.owner = np.asarray(meta["owner_map"], dtype=np.int64)
        if self.owner.max() >= self.n:
            self.owner = np.arange(self.B, dtype=np.int64) % min(self.m, self.n)
        self._prev_owner = self.owner.copy()
        self.epoch = int(meta.get("epoch", 0))
        self.state_keys = int(meta.get("state_keys", 0))
        self._chain = {"parent": batch, "deltas": len(chain) - 1}

    # -- control -----------------------------------------------------------------------------
    def reconfigure(self, parallelism: Optional[int], owner_map) -> dict:
        """Epoch switch between two batches: only the owner map changes (no state is moved)."""
        with self.lock:
            self._check_usable()
            t0 = time.perf_counter()
            if owner_map is not None:
                om = np.asarray(owner_map, dtype=np.int64)
                if om.shape != (self.B,) or om.min() < 0 or om.max() >= self.n:
                    raise ValueError(f"owner_map must list an instance in [0, {self.n}) for each "
                                     f"of the {self.B} buckets")
                m = int(parallelism or (int(om.max()) + 1))
            else:
                m = int(parallelism or self.m)
                om = np.arange(self.B, dtype=np.int64) % m
            moved = int((om != self.owner).sum())
            self.owner = om
            self.m = m
            self.spec["parallelism"] = m
            self.epoch += 1
            faults.inject("reconfigure", self.last_batch)
            ms = (time.perf_counter() - t0) * 1e3
            rec = {"epoch": self.epoch, "parallelism": m, "switch_ms": ms,
                   "after_batch": self.last_batch, "moved_buckets": moved,
                   "state_keys": self.state_keys, "state_copied_bytes": 0}
            self.switches.append(rec)
            return rec

    def metrics(self) -> dict:
        with self.lock:
            return {**self.counters, "parallelism": self.m, "max_parallelism": self.n,
                    "epoch": self.epoch, "watermark_ms": self.watermark_ms,
                    "switches": list(self.switches), "state_keys": self.state_keys,
                    "checkpoint": dict(self.save_stats), "last_step": dict(self.last_metrics),
                    "instance_pids": [i.pid for i in self.instances], "shm_dir": str(self.shm)}

    def close(self) -> None:
        with self.lock:
            try:
                self._join_saver()
            except RuntimeError:
                pass
            if self._offered is not None:
                self.receiver.offer(self._offered, None)
                self._offered = None
            for inst in self.instances:
                inst.stop()
            self.instances = []
            shutil.rmtree(self.shm, ignore_errors=True)
            self._release_checkpoint()


def _buckets(table: pa.Table, keys: List[str], B: int) -> np.ndarray:
    """Stable bucket of each row's key: pandas' SipHash of the key columns (fixed hash key, so
    the same in every process and run), modulo B."""
    import pandas as pd

    cols = {}
    for k in keys:
        col = table.column(k)
        t = col.type
        if pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_time(t) \
                or pa.types.is_duration(t):
            col = pc.cast(col, pa.int64())
        elif pa.types.is_decimal(t):
            col = pc.cast(col, pa.string())
        s = col.to_pandas()
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            s = s.astype(object)
        cols[k] = s
    h = pd.util.hash_pandas_object(pd.DataFrame(cols), index=False).to_numpy()
    return (h % np.uint64(B)).astype(np.int64)


class _InstanceHandle:
    """The engine's end of one instance process."""

    def __init__(self, index: int, shm: Path):
        self.index = index
        ours, theirs = socket.socketpair()
        self.log = shm / f"instance-{index}.log"
        env = dict(os.environ)
        env.pop("PYSPARK_GATEWAY_PORT", None)
        env.pop("SPARK_STRETCH_HOSTD", None)  # user functions may use the whole spark_stretch API
        with open(self.log, "wb") as log:
            self.proc = spawn_child(
                [sys.executable, "-m", "spark_stretch.spark.grouped_runtime", "--instance",
                 str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, env=env)
        theirs.close()
        self.conn = Connection(ours.detach())

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, msg: dict) -> None:
        try:
            self.conn.send(msg)
        except (OSError, EOFError):
            raise InstanceDiedError(self.death("a request")) from None

    def recv(self, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise InstanceDiedError(self.death(what))
        try:
            r = self.conn.recv()
        except (EOFError, OSError):
            raise InstanceDiedError(self.death(what)) from None
        if not r.get("ok"):
            raise RuntimeError(f"stretch instance {self.index} failed during {what}:\n{r['error']}")
        return r

    def death(self, what: str) -> str:
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
        code = self.proc.returncode
        how = "is still running but closed its channel" if code is None else (
            f"was killed by signal {-code}" if code < 0 else f"exited with status {code}")
        tail = ""
        try:
            tail = self.log.read_text(errors="replace")[-3000:].strip()
        except OSError:
            pass
        return (f"stretch instance {self.index} (pid {self.pid}) {how} during {what}"
                + (f"; its output:\n{tail}" if tail else ""))

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                try:
                    self.conn.send({"op": "exit"})
                except (OSError, EOFError):
                    pass
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        finally:
            try:
                self.conn.close()
            except OSError:
                pass


# ---------------------------------------------------------------------------------------------
# instance process side
# ---------------------------------------------------------------------------------------------
class _Instance:
    """Runs the user's function for the keys of the buckets this instance owns.

    Per batch, as ``FlatMapGroupsInPandasWithStateExec`` does per partition:

    1. every key with data, once, in key order: ``func(key, iter([pdf, ...]), state)``, the data
       converted with pyspark's own Arrow-to-pandas code (session time zone, same dtypes), in
       chunks of ``spark.sql.execution.arrow.maxRecordsPerBatch`` rows;
    2. then every key of the owned buckets whose timeout timestamp is set and earlier than the
       threshold (the batch timestamp for ``ProcessingTimeTimeout``, the batch's event-time
       watermark for ``EventTimeTimeout``), keys that had data included, with
       ``hasTimedOut=True`` and ``[empty pdf]`` as the data.

    The state object is pyspark's ``GroupState``, built as the JVM builds it for Python
    (``GroupStateImpl.createForStreaming``): the stored value, the batch timestamp, the eviction
    watermark, and *no* timeout (``timeoutTimestamp=-1``; the stored timeout is not carried in).
    After the call Spark's rules decide what is stored: removed and no timeout set -> the key is
    deleted; else the value (or none) and the new timeout are written if the state was updated,
    removed or a timeout was set. A key whose function touched nothing keeps its old value *and
    old timeout* (so a timed-out key that neither sets a timeout nor removes its state times out
    again in the next batch, as in Spark).
    """

    def __init__(self, init: dict):
        from pyspark import cloudpickle
        from pyspark.sql.types import StructType, _parse_datatype_json_string

        s = init["spec"]
        self.spec = s
        self.index = init["index"]
        self.shm = Path(init["shm"])
        self.func = cloudpickle.loads(init["func"])
        self.out_schema = _parse_datatype_json_string(s["out_schema"])
        self.state_schema: StructType = _parse_datatype_json_string(s["state_schema"])
        self.state_needs_conversion = any(f.dataType.needConversion()
                                          for f in self.state_schema.fields)
        rc = s["runner_conf"]
        self.tz = rc.get("timezone")
        self.safecheck = rc.get("safecheck", False)
        self.assign_cols_by_name = rc.get("assign_cols_by_name", True)
        self.prefer_int_ext_dtype = rc.get("prefer_int_ext_dtype", False)
        self.int_to_decimal = rc.get("int_to_decimal_coercion_enabled", False)
        mr = int(rc.get("arrow_max_records_per_batch", 10000))
        self.max_records = mr if mr > 0 else 2 ** 31 - 1
        self.columns = list(s["columns"])
        self.key_columns = list(s["key_columns"])
        self.timeout_conf = s["timeout_conf"]
        self.watermark_present = bool(s.get("watermark_present"))
        self.cache: Dict[int, dict] = {}
        self.min_ts: Dict[int, int] = {}

    # -- state buckets -----------------------------------------------------------------------
    def _bucket(self, b: int) -> dict:
        d = self.cache.get(b)
        if d is None:
            f = _bucket_file(self.shm, b)
            d = pickle.loads(f.read_bytes()) if f.exists() else {}
            self.cache[b] = d
            self.loads += 1
            self.min_ts[b] = min((v[1] for v in d.values() if v[1] != NO_TIMESTAMP),
                                 default=NO_TIMESTAMP)
        return d

    def _write_bucket(self, b: int) -> None:
        d = self.cache[b]
        with open(_bucket_file(self.shm, b), "wb") as f:
            f.write(pickle.dumps(d, protocol=5))
        self.min_ts[b] = min((v[1] for v in d.values() if v[1] != NO_TIMESTAMP),
                             default=NO_TIMESTAMP)

    # -- one batch ---------------------------------------------------------------------------
    def batch(self, msg: dict) -> dict:
        import pandas as pd

        t0 = time.perf_counter()
        owned = set(int(b) for b in msg["owned"])
        for b in list(self.cache):
            if b not in owned:
                del self.cache[b]
                self.min_ts.pop(b, None)
        for b in msg["reload"]:
            self.cache.pop(int(b), None)
            self.min_ts.pop(int(b), None)
        self.loads = 0
        self.dirty = set()
        self.ts_ms = int(msg["batch_ts_ms"])
        self.wm_ms = int(msg["watermark_ms"])
        calls = tcalls = 0
        batches: List[pa.RecordBatch] = []
        if msg["input"]:
            table = pa.ipc.open_file(pa.memory_map(msg["input"])).read_all()
            pdf = self._to_pandas(table)
            starts = np.asarray(msg["starts"], dtype=np.int64)
            ends = np.append(starts[1:], len(pdf))
            gb = msg["group_buckets"]
            kidx = [self.columns.index(k) for k in self.key_columns]
            kvals = [pdf.iloc[:, j]._values for j in kidx]
            out = _Output(self)
            for g in range(len(starts)):
                a, z = int(starts[g]), int(ends[g])
                key = tuple(v[a] for v in kvals)
                values = self._chunks(pdf, a, z)
                self._call(key, values, int(gb[g]), False, out)
                calls += 1
            batches += out.finish()
        t1 = time.perf_counter()
        if self.timeout_conf != "NoTimeout":
            threshold = self.ts_ms if self.timeout_conf == "ProcessingTimeTimeout" else self.wm_ms
            empty = None
            out = _Output(self)
            for b in sorted(owned):
                d = self._bucket(b)
                mt = self.min_ts.get(b, NO_TIMESTAMP)
                if b not in self.dirty and (mt == NO_TIMESTAMP or mt >= threshold):
                    continue
                due = [k for k, v in d.items() if v[1] != NO_TIMESTAMP and v[1] < threshold]
                for key in due:
                    if empty is None:
                        empty = pd.DataFrame(columns=self.columns)
                    # as pyspark's wrapper: a list with one empty DataFrame of the data columns
                    self._call(key, [empty], b, True, out)
                    tcalls += 1
            batches += out.finish()
        t2 = time.perf_counter()
        for b in self.dirty:
            self._write_bucket(b)
        out_path = None
        rows = sum(x.num_rows for x in batches)
        if batches:
            out_path = str(self.shm / f"out-{msg['seq']}-{self.index}.arrow")
            with pa.OSFile(out_path, "wb") as f:
                with pa.ipc.new_file(f, batches[0].schema) as w:
                    for rb in batches:
                        w.write_batch(rb)
        t3 = time.perf_counter()
        return {"ok": True, "out": out_path, "rows": rows, "dirty": sorted(self.dirty),
                "calls": calls, "timeout_calls": tcalls, "bucket_loads": self.loads,
                "state_keys": sum(len(self._bucket(b)) for b in owned),
                "times": {"data_ms": (t1 - t0) * 1e3, "timeouts_ms": (t2 - t1) * 1e3,
                          "write_ms": (t3 - t2) * 1e3}}

    def _to_pandas(self, table: pa.Table):
        import pandas as pd
        from pyspark.sql.conversion import ArrowBatchTransformer

        series = ArrowBatchTransformer.to_pandas(
            table, timezone=self.tz, schema=None, struct_in_pandas="dict", ndarray_as_list=False,
            prefer_int_ext_dtype=self.prefer_int_ext_dtype, df_for_struct=False)
        pdf = pd.concat(series, axis=1)
        # Native converts each group's rows on their own: an integer column with nulls elsewhere
        # in the batch must not turn float for a group without nulls. Keep such tables per group.
        self._per_group = None
        for i, f in enumerate(table.schema):
            t = f.type
            if (pa.types.is_integer(t) or pa.types.is_boolean(t)) and table.column(i).null_count:
                self._per_group = table
                break
        return pdf

    def _chunks(self, pdf, a: int, z: int):
        """The group's rows as pandas DataFrames of at most maxRecordsPerBatch rows."""
        import pandas as pd

        out = []
        for lo in range(a, z, self.max_records):
            hi = min(z, lo + self.max_records)
            if self._per_group is not None:
                out.append(self._to_pandas_exact(self._per_group.slice(lo, hi - lo)))
            else:
                part = pdf.iloc[lo:hi]
                part.index = pd.RangeIndex(hi - lo)
                out.append(part)
        return iter(out)

    def _to_pandas_exact(self, table: pa.Table):
        import pandas as pd
        from pyspark.sql.conversion import ArrowBatchTransformer

        return pd.concat(ArrowBatchTransformer.to_pandas(
            table, timezone=self.tz, schema=None, struct_in_pandas="dict", ndarray_as_list=False,
            prefer_int_ext_dtype=self.prefer_int_ext_dtype, df_for_struct=False), axis=1)

    def _call(self, key: tuple, values, b: int, timed_out: bool, out: "_Output") -> None:
        """One call of the function, as pyspark's ``wrap_grouped_map_pandas_udf_with_state``,
        then Spark's rules for what is stored."""
        import pandas as pd
        from pyspark.errors import PySparkRuntimeError, PySparkTypeError
        from pyspark.sql.streaming.state import GroupState

        d = self._bucket(b)
        old = d.get(key)
        value = None
        if old is not None and old[0] is not None:
            value = self.state_schema.fromInternal(old[0])
        state = GroupState(
            optionalValue=value, batchProcessingTimeMs=self.ts_ms,
            eventTimeWatermarkMs=self.wm_ms, timeoutConf=self.timeout_conf,
            hasTimedOut=timed_out, watermarkPresent=self.watermark_present,
            defined=value is not None, updated=False, removed=False,
            timeoutTimestamp=NO_TIMESTAMP, keyAsUnsafe=b"", valueSchema=self.state_schema)
        result_iter = self.func(key, values, state)
        if isinstance(result_iter, pd.DataFrame):
            raise PySparkTypeError(
                errorClass="UDF_RETURN_TYPE",
                messageParameters={"expected": "iterable of pandas.DataFrame",
                                   "actual": type(result_iter).__name__})
        try:
            iter(result_iter)
        except TypeError:
            raise PySparkTypeError(
                errorClass="UDF_RETURN_TYPE",
                messageParameters={"expected": "iterable", "actual": type(result_iter).__name__})
        n_out = len(self.out_schema)
        for result in result_iter:
            if not isinstance(result, pd.DataFrame):
                raise PySparkTypeError(
                    errorClass="UDF_RETURN_TYPE",
                    messageParameters={"expected": "iterator of pandas.DataFrame",
                                       "actual": "iterator of {}".format(type(result).__name__)})
            if not (len(result.columns) == n_out or (len(result.columns) == 0 and result.empty)):
                raise PySparkRuntimeError(
                    errorClass="RESULT_COLUMN_SCHEMA_MISMATCH",
                    messageParameters={"expected": str(n_out),
                                       "actual": str(len(result.columns))})
            out.add(result)
        out.state_done()
        # FlatMapGroupsInPandasWithStateExec.process / onIteratorCompletion
        timeout = state._timeout_timestamp
        if state._removed and timeout == NO_TIMESTAMP:
            if key in d:
                del d[key]
                self.dirty.add(b)
        elif state._updated or state._removed or timeout != state.oldTimeoutTimestamp:
            stored = None
            if state.exists:
                v = state._value
                if len(v) != len(self.state_schema.fields):
                    raise PySparkRuntimeError(
                        f"state value {tuple(v)!r} has {len(v)} fields, the state schema "
                        f"{self.state_schema.simpleString()} has {len(self.state_schema.fields)}")
                stored = tuple(self.state_schema.toInternal(v)) if self.state_needs_conversion \
                    else tuple(v)
            d[key] = (stored, int(timeout))
            self.dirty.add(b)


class _Output:
    """What ``ApplyInPandasWithStateSerializer.dump_stream`` does with the returned DataFrames:
    non-empty ones are concatenated (padded with null rows up to the number of states, as there)
    and converted to Arrow with pyspark's conversion, in batches of ~maxRecordsPerBatch rows."""

    def __init__(self, inst: _Instance):
        self.inst = inst
        self.pdfs = []
        self.rows = 0
        self.states = 0
        self.batches: List[pa.RecordBatch] = []

    def add(self, pdf) -> None:
        if len(pdf) > 0:
            self.rows += len(pdf)
            self.pdfs.append(pdf)
            if self.rows > self.inst.max_records:
                self._convert()

    def state_done(self) -> None:
        self.states += 1

    def _convert(self) -> None:
        import pandas as pd
        from pyspark.sql.conversion import PandasToArrowConversion

        inst = self.inst
        if self.rows:
            schema = inst.out_schema
            total = max(1, max(self.rows, self.states))
            # always appended, also with 0 rows: it changes the dtypes concat gives (e.g. a
            # pandas 3 "str" column becomes object), as in native Spark
            pdfs = list(self.pdfs) + [pd.DataFrame(dict.fromkeys(schema.names),
                                                   index=list(range(total - self.rows)))]
            merged = pd.concat(pdfs, ignore_index=True)
            rb = PandasToArrowConversion.convert(
                merged, schema, timezone=inst.tz, safecheck=inst.safecheck, arrow_cast=True,
                assign_cols_by_name=inst.assign_cols_by_name,
                int_to_decimal_coercion_enabled=inst.int_to_decimal)
            self.batches.append(rb.slice(0, self.rows))
        self.pdfs, self.rows, self.states = [], 0, 0

    def finish(self) -> List[pa.RecordBatch]:
        self._convert()
        return self.batches


def _instance_main(fd: int, parent: int) -> int:
    _die_with_parent()
    if os.getppid() != parent:
        return 0
    import faulthandler

    faulthandler.enable()
    conn = Connection(fd)
    inst = None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return 0  # the engine is gone
        op = msg.get("op")
        if op == "exit":
            return 0
        try:
            if op == "init":
                import pandas  # noqa: F401  (imported before the first batch, not during it)
                import pyspark.sql.conversion  # noqa: F401
                from pyspark.sql.streaming.state import GroupState  # noqa: F401

                inst = _Instance(msg)
                reply = {"ok": True, "pid": os.getpid()}
            elif op == "batch":
                reply = inst.batch(msg)
            else:
                raise ValueError(f"unknown instance op {op!r}")
        except BaseException:
            reply = {"ok": False, "error": traceback.format_exc()}
            if inst is not None:  # a half-run batch: nothing cached may be trusted again
                inst.cache.clear()
                inst.min_ts.clear()
        try:
            conn.send(reply)
        except (OSError, EOFError):
            return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--instance":
        sys.exit(_instance_main(int(sys.argv[2]), int(sys.argv[3])))
    print("usage: python -m spark_stretch.spark.grouped_runtime --instance FD PARENT_PID",
          file=sys.stderr)
    sys.exit(2)
