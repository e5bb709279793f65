"""One stretch query inside the host engine process: Arrow in, engine, Arrow out.

Runs in :mod:`spark_stretch.spark.hostd` (no Spark in this process). Spark's timeline for a
window aggregation is reproduced exactly (``IncrementalExecution``): batch N filters late rows with
the *previous* batch's watermark W_{N-1} and evicts windows with the current one, W_N, which was
computed after batch N-1 as ``max(W_{N-1}, max event time (ms) - delay)``. Per micro-batch N:

1. ``ingest``: the committed input of batch N arrives as one Arrow table (the shim's two-phase
   write publishes exactly the committed task attempts, in partition order).
2. ``step``: keys are interned to exact int64 ids (vectorised: Python touches each distinct new
   string once, never a row); the batch enters the ESG under W_{N-1} (a row whose every window
   ended by then is late: dropped and counted; a row with some windows still open updates only
   those); the ESG advances to W_N and the instances emit every window with ``end <= W_N``.
3. The results are offered as an Arrow table on ``<query>:out:<N>`` for the executors to read.

``flush`` plays Spark's no-data batch: when the query goes idle (or an ``availableNow`` run ends)
and the next watermark is ahead, the windows it closes are emitted (``<query>:flush:<N>``).

A replay of the last batch (Spark re-running it after a failure) re-offers the same output without
touching the engine; Delta's ``txnVersion`` then makes the sink write a no-op.
"""

from __future__ import annotations

import base64
import json
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..engine import Interner, ListColumn, engine_class
from . import faults
from .checkpointed import CheckpointedRuntime, read_arrow
from ..ops.aggregate import aggregate

__all__ = ["QueryRuntime"]

_TS = pa.timestamp("us", tz="UTC")


class QueryRuntime(CheckpointedRuntime):
    """The engine-side state of one query (``spec`` is ``asdict(AggregationSpec)``)."""

    def __init__(self, qid: str, spec: dict, receiver):
        self.qid = qid
        self.spec = spec
        self.receiver = receiver
        self.interner = Interner()
        self.lock = threading.Lock()
        self.counters = {"input_rows": 0, "late_rows": 0, "output_rows": 0, "batches": 0}
        ops = self._operators()
        # Spark's watermark starts at 0 ms; the engine works in microseconds. watermark_ms is
        # W_N (eviction, and the late rule of the next batch); next_watermark_ms is W_{N+1}.
        self.watermark_ms = 0
        self.next_watermark_ms = 0
        # Per input stream (one withWatermark each): the largest event time seen so far, in ms.
        self.stream_max_ms: list = [None] * len(self._delays())
        self._offered: Optional[str] = None
        self._dict_cache: Optional[pa.Array] = None  # interned values, id order
        self.pending = {}
        self.last_batch = -1
        self.state_dir = Path(spec["state_dir"]) if spec.get("state_dir") else None
        self._hold_checkpoint()
        self._saver: Optional[threading.Thread] = None
        self._chain: Optional[dict] = None  # the last checkpoint: {"parent", "deltas", "strings"}
        self._save_error: Optional[BaseException] = None
        self.save_stats: dict = {}
        self.last_reply: Optional[dict] = None
        # Continue after Spark's last committed batch (resume_batch): from the latest checkpoint
        # at or before it, then the batches after that checkpoint again, from the input log
        # (``replay``, stepped by the driver, which rewrites their outputs idempotently).
        resume = spec.get("resume_batch")
        try:
            start = self._latest_checkpoint(resume) if resume is not None else None
            if start is not None:
                self.engines = self._load(start, ops)
                # the checkpoint's own output too, if it kept one: the sink may not have it yet
                first = start if self.last_reply is not None else start + 1
            else:
                self.engines = [
                    engine_class(op)(op, m=spec["parallelism"], n=spec["max_parallelism"],
                                     n_buckets=spec["buckets"], lateness=self._lateness(op))
                    for op in ops]
                for eng in self.engines:  # source s feeds stream s
                    for s in range(eng.op.I):
                        eng.esg_in.add_sources([s], stream=s, ordered=False, watermark=0)
                first = 0
        except BaseException:
            self._release_checkpoint()
            raise
        self.checkpoint = start
        self.replay = [] if resume is None else list(range(first, resume + 1))
        self._stepper: Optional[ThreadPoolExecutor] = None  # submit(): steps off the request
        self._inflight: dict = {}

        self.switches = []

    def describe(self) -> dict:
        return {"query": self.qid, "parallelism": self.spec["parallelism"],
                "max_parallelism": self.spec["max_parallelism"], "replay": self.replay,
                "checkpoint": self.checkpoint}

    def warm_up(self) -> None:
        """Load what the first batch would load, in the background while Spark starts the query:
        the numba kernels of the step and of checkpoints (from numba's cache; half a second in
        all) and deltalake, by running a throwaway copy of the query on two made-up rows of its
        input schema. Best effort: anything it cannot make up, it skips."""
        try:
            schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(self.spec["input_schema"])))
            rows = pa.table({f.name: _sample(f.type) for f in schema}, schema=schema)
            rt = type(self)(f"{self.qid}:warm-up", dict(
                self.spec, state_dir=None, resume_batch=None, parallelism=1, max_parallelism=1,
                buckets=64, warm_up=True), _Nowhere())
            try:
                rt.ingest("in:0", "warm-up", rows)
                rt.step(0)
                rt.flush()
                for eng in rt.engines:
                    eng.snapshot(delta=False)
                    eng.snapshot(delta=True)
            finally:
                rt.close()
            import deltalake  # noqa: F401  (the engine's own Delta appends)
            import pandas  # noqa: F401  (deltalake's first write imports it)
        except Exception:
            pass

    # -- pipelined micro-batches -----------------------------------------------------------------
    def submit(self, batch: int) -> dict:
        """Log the input of ``batch`` (after which Spark may commit it) and step it in the
        background; :meth:`result` waits for the step's reply."""
        self.log_input(batch)
        if self._stepper is None:
            self._stepper = ThreadPoolExecutor(1, thread_name_prefix=f"stretch-step-{self.qid}")
        self._inflight[batch] = self._stepper.submit(self.step, batch)
        return {"batch": batch}

    def result(self, batch: int) -> dict:
        """The reply of the submitted step of ``batch`` (its error, raised)."""
        fut = self._inflight.pop(batch, None)
        if fut is None:
            raise RuntimeError(f"batch {batch} of query {self.qid} was not submitted")
        return fut.result()

    # -- data --------------------------------------------------------------------------------------
    def step(self, batch: int) -> dict:
        with self.lock:
            self._join_saver()  # the previous checkpoint reads the engines: let it finish
            if batch in self.pending:
                table = self.pending.pop(batch)
            elif batch > self.last_batch and batch in self.replay:
                table = self._logged_input(batch)  # after a restart: the batch again, from the log
            else:
                table = None  # a batch with no rows (or a replay, answered below)
            if batch <= self.last_batch:
                if batch == self.last_batch and self.last_reply is not None:
                    return dict(self.last_reply, replayed=True)
                raise RuntimeError(
                    f"batch {batch} replayed after batch {self.last_batch}: the engine state of "
                    "that batch is gone (restart the query from its checkpoint)")
            t0 = time.perf_counter()
            lead = self.engines[0]
            late_before = lead.esg_in.late_dropped
            if table is not None and table.num_rows:
                for s, cols in enumerate(self._stream_columns(table)):
                    if cols is None or not len(cols["ts"]):
                        continue
                    for eng in self.engines:  # late rule: the ESG still holds W_{N-1}
                        eng.esg_in.add(cols, s)
                    top = int(cols["ts"].max()) // 1000
                    seen = self.stream_max_ms[s]
                    self.stream_max_ms[s] = top if seen is None else max(seen, top)
                self.counters["input_rows"] += table.num_rows
            if not self.spec.get("warm_up"):  # a test's fault is for the query itself
                faults.inject("step", batch)
            out = self._advance(self.next_watermark_ms)  # evict with W_N
            self.next_watermark_ms = self._next_watermark()  # W_{N+1}, used from the next batch
            late = lead.esg_in.late_dropped - late_before
            self.counters["late_rows"] += late
            self.counters["batches"] += 1
            self.last_batch = batch
            if self._checkpoint_due(batch):
                self._save(batch, out=out)
            elif self.state_dir is not None:  # its state: the last checkpoint + logged inputs
                self._join_saver()
                self.save_stats = {"batch": batch, "kind": "log", "checkpoint": self._chain["parent"]}
            self.last_reply = self._offer(f"{self.qid}:out:{batch}", out, {
                "watermark_ms": self.watermark_ms, "late_rows": late,
                "engine_ms": (time.perf_counter() - t0) * 1e3})
            return self.last_reply

    def flush(self) -> dict:
        """Spark's no-data batch: emit the windows the next watermark closes, if it is ahead."""
        with self.lock:
            self._join_saver()
            if self.next_watermark_ms <= self.watermark_ms:
                return {"rows": 0, "batch": self.last_batch}
            out = self._advance(self.next_watermark_ms)
            reply = self._offer(f"{self.qid}:flush:{self.last_batch}", out,
                                {"watermark_ms": self.watermark_ms})
            # changed: the watermark moved (the next batch's late rule), with or without rows
            return dict(reply, batch=self.last_batch, changed=True)

    def flushed(self) -> dict:
        """The sink holds the last flush: keep the state after it as the state of the last batch."""
        with self.lock:
            self._save(self.last_batch, full=True)  # replaces the batch's checkpoint: no delta
            self._join_saver()
            return {"batch": self.last_batch}

    # -- engine state per batch (restart from a checkpoint) ----------------------------------------
    def _checkpoint_due(self, batch: int) -> bool:
        """Whether the state after ``batch`` is checkpointed: the first time, then every
        ``checkpoint_interval`` batches (``spark.stretch.checkpoint.interval``). In between,
        the input log is the delta: the logged inputs after a checkpoint are kept until the next
        one, and a restart steps them again (as Spark's state store replays its delta files on
        its last snapshot). A checkpoint of a large state costs more than the inputs that
        changed it (word count: 17 MB a batch, most of it the batch's own tuples waiting in the
        ESG, against 10 MB of logged input)."""
        chain = self._chain
        return chain is None or batch - chain["parent"] >= self.spec.get("checkpoint_interval", 1)

    def _save(self, batch: int, full: bool = False, out: Optional[pa.Table] = None) -> None:
        """Checkpoint every engine and the bridge's own variables as the state after ``batch``.

        Incremental where that pays: a *delta* holds only the buckets changed since the previous
        checkpoint (its ``parent``); a *full* one is written first, every ``min_deltas`` batches
        (Spark's ``stateStore.minDeltasForSnapshot``), and whenever most buckets changed anyway.
        A background thread takes the snapshot and writes it while the batch's output is
        written; the next step, flush or reconfiguration waits for it (and :meth:`wait_saved`).
        ``out``, the batch's output, is kept with it: a restart from this checkpoint offers it
        again, as a pipelined query's sink may not have it yet. See docs/architecture.md,
        "Checkpoint format".
        """
        if self.state_dir is None:
            return
        self._join_saver()  # one write at a time, in batch order
        chain = self._chain
        dirty = float(np.mean([eng._dirty().mean() for eng in self.engines]))
        delta = not full and chain is not None and chain["parent"] < batch \
            and chain["deltas"] + 1 < self.spec.get("min_deltas", 10) and dirty <= 0.5
        buckets = int(sum(eng._dirty().sum() for eng in self.engines)) if delta else \
            self.spec["buckets"] * len(self.engines)
        strings = self.interner.strings()
        since = chain["strings"] if delta else 0  # the interner only grows: deltas append
        meta = {"format": 1, "kind": "delta" if delta else "full",
                "parent": chain["parent"] if delta else None, "strings_from": since,
                "watermark_ms": self.watermark_ms, "next_watermark_ms": self.next_watermark_ms,
                "stream_max_ms": self.stream_max_ms, "last_batch": batch,
                "counters": dict(self.counters), "parallelism": self.spec["parallelism"]}
        self._chain = {"parent": batch, "deltas": chain["deltas"] + 1 if delta else 0,
                       "strings": len(strings)}
        stats = {"batch": batch, "kind": meta["kind"], "buckets": buckets}
        self._saver = threading.Thread(
            target=self._write_state, args=(batch, delta, strings[since:], meta, stats, out),
            name=f"stretch-save-{batch}", daemon=True)
        self._saver.start()

    def _write_state(self, batch: int, delta: bool, strings: list, meta: dict,
                     stats: dict, out: Optional[pa.Table]) -> None:
        try:
            t0 = time.perf_counter()
            blobs = {f"engine{i}.snap": eng.snapshot(delta=delta)
                     for i, eng in enumerate(self.engines)}
            blobs["interner.pkl"] = pickle.dumps(strings, protocol=5)
            if out is not None:
                sink = pa.BufferOutputStream()
                with pa.ipc.new_file(sink, out.schema) as w:
                    w.write_table(out)
                blobs["output.arrow"] = sink.getvalue().to_pybytes()
            blobs["bridge.json"] = json.dumps(meta).encode()  # last: marks a whole directory
            t1 = time.perf_counter()
            self._write_dir(batch, blobs)
            self.save_stats = dict(stats, bytes=sum(len(b) for b in blobs.values()),
                                   snapshot_ms=(t1 - t0) * 1e3,
                                   write_ms=(time.perf_counter() - t1) * 1e3)
        except BaseException as e:  # reported by wait_saved, on the driver's thread
            self._save_error = e

    def _load(self, batch: int, ops) -> list:
        if self.state_dir is None:
            raise RuntimeError(f"no state directory to resume batch {batch} from")
        chain = self._chain_of(batch)
        dirs = [self.state_dir / str(b) for b in chain]
        meta = json.loads((dirs[-1] / "bridge.json").read_text())
        self.watermark_ms, self.next_watermark_ms = meta["watermark_ms"], meta["next_watermark_ms"]
        self.last_batch = meta["last_batch"]
        self.stream_max_ms = meta.get("stream_max_ms", [meta.get("max_event_ms")])
        self.counters.update(meta["counters"])
        self.spec["parallelism"] = meta["parallelism"]
        strings = []
        for d in dirs:
            part = json.loads((d / "bridge.json").read_text())
            if part.get("strings_from", 0) != len(strings):
                raise RuntimeError(f"engine checkpoint {d} does not continue {dirs[0]} (interner)")
            strings += pickle.loads((d / "interner.pkl").read_bytes())
        self.interner = Interner(strings)
        self._chain = {"parent": batch, "deltas": len(chain) - 1, "strings": len(strings)}
        if (dirs[-1] / "output.arrow").exists():  # offered again, as after the batch's step
            out = read_arrow(dirs[-1] / "output.arrow")
            stream = f"{self.qid}:out:{batch}"
            self.receiver.offer(stream, out)
            self._offered = stream
            self.last_reply = {"rows": out.num_rows, "stream": stream,
                               "metrics": {"watermark_ms": self.watermark_ms}}
        return [engine_class(op).restore(
                    op, (dirs[0] / f"engine{i}.snap").read_bytes(),
                    deltas=[(d / f"engine{i}.snap").read_bytes() for d in dirs[1:]])
                for i, op in enumerate(ops)]

    # -- what the query kind decides (the custom-operator runtime overrides these) ----------------
    def _operators(self) -> list:
        """The engine operators, all fed the same tuples under the same owner map and watermark:
        one per aggregation, so their outputs come out in the same (ts, key, window) order and
        zip. (A fused multi-aggregate kernel would update all in one pass; see
        docs/architecture.md.)"""
        return _make_operators(self.spec)

    def _lateness(self, op) -> str:
        return "window"  # Spark's rule for window aggregations

    def _delays(self) -> list:
        """The watermark delay (ms) of each input stream."""
        return [self.spec["delay_ms"]]

    def _stream_columns(self, table: pa.Table) -> list:
        """The batch's rows as engine columns, one dict (or None: no rows) per input stream."""
        return [self._columns(table)]

    def _next_watermark(self) -> int:
        """Spark's global watermark after this batch (``WatermarkTracker``): each stream's is
        its largest event time minus its delay (0 before it has seen data), the global one the
        min of them (``spark.sql.streaming.multipleWatermarkPolicy=max``: the max), never moving
        back."""
        per = [0 if top is None else top - delay
               for top, delay in zip(self.stream_max_ms, self._delays())]
        pick = max if self.spec.get("watermark_policy", "min") == "max" else min
        return max(self.watermark_ms, self.next_watermark_ms, pick(per))

    def _advance(self, watermark_ms: int) -> pa.Table:
        self.watermark_ms = watermark_ms
        for eng in self.engines:
            eng.esg_in.advance_watermark(watermark_ms * 1000)
            eng.drain()
        return self._output()

    def _validate(self, table: pa.Table, batch: int) -> None:
        s = self.spec
        ts = table.column(s["ts_column"])
        if ts.null_count:
            raise ValueError(f"event-time column '{s['ts_column']}' has {ts.null_count} nulls in "
                             f"batch {batch}")
        key = table.column(s["key_column"])
        # a null list is no key (as explode); a null element of one would be a null key
        nulls = key.null_count if s["key_kind"] == "scalar" else pc.list_flatten(key).null_count
        if nulls:
            col = s["key_column"]
            raise ValueError(
                f"keys column '{col}' has {nulls} null keys in batch {batch}; "
                "stretchAggregate does not group nulls (Spark would make a null group): filter "
                f"them first, e.g. df.where(F.col('{col}').isNotNull())")
        for c in s["value_types"]:
            if table.column(c).null_count:
                raise ValueError(f"agg column '{c}' has {table.column(c).null_count} nulls in "
                                 f"batch {batch}; stretchAggregate needs non-null values (fill or "
                                 "filter them)")

    def _columns(self, table: pa.Table) -> dict:
        """The engine's columns of a batch (checked by :meth:`_validate` when it arrived)."""
        s = self.spec
        cols = {"ts": pc.cast(table.column(s["ts_column"]), pa.int64()).to_numpy()}
        key = table.column(s["key_column"]).combine_chunks()
        if s["key_kind"] == "scalar":
            cols["key"] = self._ids(key)
        else:
            offsets, values = list_parts(key)
            cols["key"] = ListColumn(offsets, self._ids(values, force_intern=s["key_kind"] == "pairs"))
        for c, vt in s["value_types"].items():
            cols[c] = pc.cast(table.column(c), pa.int64() if vt == "long" else pa.float64()).to_numpy()
        return cols

    def _ids(self, arr: pa.Array, force_intern: bool = False) -> np.ndarray:
        """Exact int64 ids: strings interned (each distinct string once per batch), longs as is."""
        if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type) or force_intern:
            return self.interner.intern(arr)
        return pc.cast(arr, pa.int64()).to_numpy(zero_copy_only=False)

    def _output(self) -> pa.Table:
        s = self.spec
        outs = [eng.esg_out.get_batch("driver")[0] for eng in self.engines]
        out = outs[0]
        for other in outs[1:]:  # same tuples, same windows: the rows must line up one to one
            if not (np.array_equal(other["key"], out["key"])
                    and np.array_equal(other["window_start"], out["window_start"])):
                raise RuntimeError("aggregation outputs out of step (engine bug)")
        window = window_array(out["window_start"], s["window_us"])
        keys = np.asarray(out["key"], np.int64)
        key = self._decode_keys(keys)
        arrays, names = [window, key], ["window", "key"]
        for (fn, col), name, o in zip(s["aggs"], s["output_names"], outs):
            v = np.asarray(o[fn])
            if fn == "count" or (fn in ("sum", "min", "max") and s["value_types"][col] == "long"):
                arrays.append(pa.array(v.astype(np.int64)))
            else:
                arrays.append(pa.array(v.astype(np.float64)))
            names.append(name)
        return pa.Table.from_arrays(arrays, names=names)

    def _decode_keys(self, keys: np.ndarray) -> pa.Array:
        s = self.spec
        strings = s["key_type"] == "string"
        if s["key_kind"] == "pairs":
            a, b = keys >> 32, keys & 0xFFFFFFFF
            fa, fb = (self._strings(a), self._strings(b)) if strings else \
                (self._longs(a), self._longs(b))
            return pa.StructArray.from_arrays([fa, fb], names=["_1", "_2"])
        return self._strings(keys) if strings else pa.array(keys, pa.int64())

    def _strings(self, ids: np.ndarray) -> pa.Array:
        return self._dictionary(pa.string()).take(pa.array(ids))

    def _longs(self, ids: np.ndarray) -> pa.Array:
        return self._dictionary(pa.int64()).take(pa.array(ids))

    def _dictionary(self, typ) -> pa.Array:
        """The interned values as one Arrow array (id i at position i), grown by the new ones only,
        so decoding output keys is an Arrow ``take``, not a Python loop over rows."""
        known = self._dict_cache
        n = len(self.interner)
        if known is None or len(known) < n:
            new = pa.array(self.interner.strings()[0 if known is None else len(known):n], typ)
            known = new if known is None else pa.concat_arrays([known, new])
            self._dict_cache = known
        return known

    # -- control -----------------------------------------------------------------------------------
    def reconfigure(self, parallelism: Optional[int], owner_map) -> dict:
        with self.lock:  # between two micro-batches: the engine is idle here
            self._join_saver()
            t0 = time.perf_counter()
            m = parallelism or self.spec["parallelism"]
            om = None if owner_map is None else np.asarray(owner_map, np.int64)
            for i, eng in enumerate(self.engines):
                epoch = eng.reconfigure(m=parallelism, owner_map=om)
                eng.drain()
                if i == 0:  # a failure half way: some operators switched, some not
                    faults.inject("reconfigure", self.last_batch)
            ms = (time.perf_counter() - t0) * 1e3
            self.spec["parallelism"] = m
            rec = {"epoch": int(epoch), "parallelism": m, "switch_ms": ms,
                   "after_batch": self.last_batch,
                   "live_windows": int(self.engines[0].live_windows())}
            self.switches.append(rec)
            if self.last_batch >= 0:
                # The input log does not hold reconfigurations: a restart must find this one in
                # a checkpoint (written in the background; the next step waits for it).
                self._save(self.last_batch, full=True)
            return rec

    def metrics(self) -> dict:
        with self.lock:
            return {**self.counters, "parallelism": self.spec["parallelism"],
                    "watermark_ms": self.watermark_ms, "switches": list(self.switches),
                    "live_windows": int(self.engines[0].live_windows()),
                    "checkpoint": dict(self.save_stats),
                    "engine": {k: v for k, v in self.engines[0].metrics().items()
                               if isinstance(v, (int, float, str))}}

    def close(self) -> None:
        if self._stepper is not None:  # a step in flight finishes first
            self._stepper.shutdown(wait=True, cancel_futures=True)
        with self.lock:
            try:
                self._join_saver()
            except RuntimeError:
                pass  # the query is ending; its driver already saw (or will not need) the error
            if self._offered is not None:
                self.receiver.offer(self._offered, None)
            for eng in self.engines:
                eng.close()
            self._release_checkpoint()


def list_parts(arr: pa.Array):
    """A list array's offsets (from 0, int64) and flat values; a null list has no elements (as
    ``explode``)."""
    arr = pc.fill_null(arr, pa.scalar([], arr.type))
    return pc.subtract(arr.offsets, arr.offsets[0]).to_numpy().astype(np.int64), arr.flatten()


def window_array(start, window_us: int) -> pa.StructArray:
    """Spark's ``window`` column (``start``, ``end`` timestamps) of windows starting at ``start`` (us)."""
    start = np.asarray(start, np.int64)
    return pa.StructArray.from_arrays(
        [pa.array(start).cast(_TS), pa.array(start + window_us).cast(_TS)], names=["start", "end"])


class _Nowhere:
    """The receiver of a warm-up's throwaway query: its outputs go nowhere."""

    def offer(self, stream, data) -> None:
        pass


def _sample(t: pa.DataType) -> pa.Array:
    """Two made-up values of type ``t`` (no nulls) for :meth:`QueryRuntime.warm_up`."""
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        a, b = _sample(t.value_type).to_pylist()
        return pa.array([[a, b], [b]], t)
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return pa.array(["a", "b"], t)
    if pa.types.is_integer(t) or pa.types.is_timestamp(t):
        return pa.array([0, 1], t)  # (a stream tag: one row of each stream)
    if pa.types.is_floating(t):
        return pa.array([0.5, 1.5], t)
    raise TypeError(f"no sample values of {t}")


def _make_operators(spec: dict):
    """One built-in engine operator per aggregation of the spec."""
    kw = dict(WS=spec["window_us"], WA=spec["slide_us"])
    if spec["key_kind"] == "scalar":
        kw["key"] = "key"
    else:
        kw["keys"] = "key"
        if spec["key_kind"] == "pairs":
            kw["pairs"], kw["B"] = True, spec["distance"]
    ops = []
    for fn, col in spec["aggs"]:
        vt = "i" if col is not None and spec["value_types"][col] == "long" else "f"
        ops.append(aggregate(fn, value=col, value_type=vt, **kw))
    return ops
