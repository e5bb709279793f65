"""One ``stretchAggregate`` query inside the host engine process: Arrow in, VSN engine, Arrow out.

Spark's timeline for a window aggregation is reproduced exactly (``IncrementalExecution``): batch N
filters late rows with the *previous* batch's watermark W_{N-1} and evicts windows with the
current one, W_N, which was computed after batch N-1 as ``max(W_{N-1}, max event time (ms) -
delay)``. Per micro-batch N:

1. ``ingest``: the committed input of batch N arrives as one Arrow table (the shim's two-phase
   write publishes exactly the committed task attempts, in partition order), or its files.
2. ``step``: keys are interned to exact int64 ids; the batch enters the ESG under W_{N-1} (a row
   whose every window ended by then is late: dropped and counted; a row with some windows still
   open updates only those); the ESG advances to W_N and the instances emit every window with
   ``end <= W_N``.
3. The results are offered as an Arrow table on ``<query>:out:<N>`` for the executors to read,
   or appended to Delta from here (:mod:`.delta`).

``flush`` plays Spark's no-data batch: when the query goes idle (or an ``availableNow`` run ends)
and the next watermark is ahead, the windows it closes are emitted (``<query>:flush:<N>``).

The late rule is Spark's per window (``Engine(lateness="window")``: a row with ``ts <= W`` still
updates its windows that are open), and the kernel never reopens an emitted window. Keys are
interned to dense int64 ids by a jitted table over the Arrow array's UTF-8 buffers
(:mod:`spark_stretch.engine.strings`: only a string never seen becomes a Python string) and
decoded with an Arrow ``take``; a word pair packs two 32-bit word ids in one int64. Every
aggregation of the query runs in one engine operator (:mod:`.aggregations`, docs/inplan.md).
On ``open`` a thread runs a throwaway copy of the query on two made-up rows of its input schema
(:meth:`AggregateRuntime.warm_up`), so numba's cached kernels and deltalake load while Spark
starts the query, not in the first batches.
"""

from __future__ import annotations

import json
import pickle
import time
from typing import List, Optional

import numpy as np
import pyarrow as pa

from ..engine import Interner, engine_class
from ..engine.snapshot import map_file
from ..engine.spill import Spill, default_budget
from ..protocol import messages as M
from ..protocol.errors import StateError
from ..protocol.layout import AGGREGATE_META, state_root
from . import allocator, faults, load
from .aggregations import (add_sources, builtin_operators, check_checkpoint, engine_columns,
                           output_table, output_in_blocks, per_aggregation, rank_strings,
                           reject_nulls, slice_rows, state_output, check_keys, key_encoding,
                           whole_batches)
from .checkpoints import arrow_bytes, read_arrow
from .file_batch import pieces
from .columns import KeyCodec, prepare, sample
from .runtime import Runtime, ms_since
from .reshard import Resharding
from .share import EventTimes, KeyShare, group_loads, tops_of

__all__ = ["AggregateRuntime"]


def _warm_up(runtime, qid: str, spec) -> None:
    """:meth:`AggregateRuntime.warm_up`: a throwaway ``runtime`` of ``spec`` steps two rows."""
    from dataclasses import replace

    from ..protocol.specs import Checkpointing

    try:
        schema = M.schema_from_wire(spec.input_schema)
        rows = pa.table({f.name: sample(f.type) for f in schema}, schema=schema)
        rt = runtime(f"{qid}:warm-up", replace(
            spec, checkpoint=Checkpointing(), resume_batch=None, parallelism=1,
            max_parallelism=1, buckets=64, warm_up=True), _Nowhere())
        try:
            rt.ingest("in:0", "warm-up", rows)
            rt.step(0)
            rt.flush()
            for eng in rt.engines:
                eng.snapshot(delta=False)
                eng.snapshot(delta=True)
        finally:
            rt.close()
        import deltalake  # noqa: F401  (the engine's own Delta appends; no pandas: allocator)
    except Exception:
        pass


class AggregateRuntime(EventTimes, Resharding, Runtime):
    """The engine side of one query of built-in aggregations (``spec``: an
    :class:`~spark_stretch.protocol.specs.AggregateSpec`); :class:`~.operator.OperatorRuntime`
    runs an engine operator through the same steps."""

    META = AGGREGATE_META

    def __init__(self, qid: str, spec, receiver):
        super().__init__(qid, spec, receiver)
        self.codec = KeyCodec()
        self._evicted = 0  # (the windows the last step closed unsaid: update mode)
        self.sources: list = []  # (after key groups changed hosts: every host's input log)
        self.share = None if spec.share is None else KeyShare(spec.share, spec.key_kind,
                                                              spec.key_column, spec.ts_column)
        # Per input stream (one withWatermark each): the largest event time seen so far, in ms.
        self.stream_max_ms: list = [None] * len(self._delays())
        ops = self._operators()
        # Continue after Spark's last committed batch: from the latest checkpoint at or before it,
        # then the later batches from the input log (``replay``: outputs rewritten idempotently).
        resume = spec.resume_batch
        try:
            start = self._resume_from(resume)
            if start is not None:
                self.engines = self._load(start, ops)
                # the checkpoint's own output too, if it kept one: the sink may not have it yet
                first = start if self.last_reply is not None else start + 1
            elif self.share is not None and resume is not None and self.share.mine.any():
                # (new here, given groups: their state after the move, from the others' checkpoints)
                self.engines = self._resharded(resume, ops)
                first = resume + 1
            else:
                self.engines = [
                    engine_class(op)(op, m=spec.parallelism, n=spec.max_parallelism,
                                     n_buckets=spec.buckets, lateness=self._lateness(op),
                                     **self._spill())
                    for op in ops]
                add_sources(self.engines, spec)
                # (a host new to the query, owning no group yet: nothing of the past is its)
                fresh = self.share is not None and not self.share.mine.any()
                first = resume + 1 if fresh and resume is not None else 0
        except BaseException:
            self.store.release_lock()
            raise
        whole_batches(self.engines, spec)
        self._set_replay(resume, first)

    def describe(self) -> M.Opened:
        return M.Opened(query=self.qid, parallelism=self.parallelism,
                        max_parallelism=self.spec.max_parallelism, replay=self.replay,
                        checkpoint=self.checkpoint, stream_max_ms=list(self.stream_max_ms))

    def warm_up(self) -> None:
        """Load what the first batch would load (numba's kernels, deltalake; half a second) while
        Spark starts the query: a throwaway copy of the query on two made-up rows. Best effort."""
        _warm_up(type(self), self.qid, self.spec)

    # -- data --------------------------------------------------------------------------------------
    def _step(self, batch: int, table: Optional[pa.Table], batch_ts_ms=None) -> M.StepResult:
        t0 = time.perf_counter()
        lead = self.engines[0]
        late_before = lead.esg_in.late_dropped
        live_before = lead.live_windows()
        # (on several hosts: this host's share, kept as it arrived, or after key groups changed
        # hosts each source host's logged share of it, with what this host keeps of it)
        parts = table if isinstance(table, list) else [(table, self.share)]
        self.group_load = group_loads(parts, self.share)  # (several hosts: for moves)
        rows = slice_rows(self.spec, self.engines)  # (0: the batch at once)
        for table, share in parts:
            if table is None or not table.num_rows:
                continue
            self.counters["input_rows"] += table.num_rows
            tops = tops_of(table)  # (every row's event time counts: one watermark)
            for piece in pieces(table, rows):  # (a FileBatch: read again a slice at a time)
                self._add(piece, share, tops is None)
                if rows:  # (applied now: its columns let go, and the heap's pages with them)
                    for eng in self.engines:
                        eng.release_all(0)
                    allocator.give_back()
            for s, top in enumerate(tops or ()):
                self._saw(s, top)
        if not self.spec.warm_up:  # a test's fault is for the query itself
            faults.inject("step", batch)
        out = self._emit(batch)
        self.next_watermark_ms = self._next_watermark()  # W_{N+1}, used from the next batch
        late = lead.esg_in.late_dropped - late_before
        self.state_changes = load.window_changes(self, batch, live_before, out)
        self.counters["late_rows"] += late
        self.counters["batches"] += 1
        self.last_batch = batch
        if self._checkpoint_due(batch):
            self._save(batch, out=out)
        elif self.store.enabled:  # its state: the last checkpoint + logged inputs
            self.store.logged(batch)
        return self._offer(f"{self.qid}:out:{batch}", out, {
            "watermark_ms": self.watermark_ms, "late_rows": late,
            "engine_ms": ms_since(t0), "stream_max_ms": list(self.stream_max_ms)})

    def _add(self, table: pa.Table, share, saw: bool) -> None:
        for s, cols in enumerate(self._stream_columns(table, share)):
            if cols is None or not len(cols["ts"]):
                continue
            for eng in self.engines:  # late rule: the ESG still holds W_{N-1}
                eng.esg_in.add(cols, s)
            if saw:
                self._saw(s, int(cols["ts"].max()) // 1000)

    def _emit(self, batch: int) -> pa.Table:
        """The batch's output rows, as Spark's output mode has them: in append mode the
        windows W_N closes; in update mode every window the batch changed, then the windows
        W_N closes are evicted unsaid; in complete mode every window, none ever evicted."""
        mode = getattr(self.spec, "output_mode", "append")
        rank_strings(self.spec, self.codec, self.engines)
        if mode == "append":
            for eng in filter(lambda e: e.applies_whole_batches, self.engines):
                eng.release_all(0)  # (then the watermark fires what it closes)
            return self._advance(self.next_watermark_ms)
        stamp = batch + 1  # (> 0: an unstamped window has 0)
        for eng in self.engines:
            eng.release_all(stamp)
        rows = per_aggregation(self.spec, [eng.state_rows(stamp if mode == "update" else None,
                                                          words=True) for eng in self.engines])
        out = output_table(self.spec, self.codec, [state_output(self.spec, rec, acc, *a[:2])
                           for (rec, acc), a in zip(rows, self.spec.aggs)])
        if mode == "update" or self.spec.session_end:  # (late sessions: dropped in every mode)
            self._advance(self.next_watermark_ms, read=False)
        else:  # (reported as Spark's; the engine's watermark stays where it started)
            self.watermark_ms = self.next_watermark_ms
        return out

    def flush(self) -> M.FlushResult:
        """Spark's no-data batch: emit the windows the next watermark closes, if it is ahead."""
        with self.lock:
            self.store.join()
            if self.next_watermark_ms <= self.watermark_ms:
                return M.FlushResult(rows=0, batch=self.last_batch)
            rank_strings(self.spec, self.codec, self.engines)
            out = self._advance(self.next_watermark_ms)
            r = self._offer(f"{self.qid}:flush:{self.last_batch}", out,
                            {"watermark_ms": self.watermark_ms})
            # changed: the watermark moved (the next batch's late rule), with or without rows
            return M.FlushResult(rows=r.rows, batch=self.last_batch, stream=r.stream,
                                 changed=True, metrics=r.metrics)

    # -- checkpoints -------------------------------------------------------------------------------
    def _save(self, batch: int, full: bool = False, out: Optional[pa.Table] = None) -> None:
        """Checkpoint every engine and this runtime's own variables as the state after ``batch``:
        a *delta* (the buckets changed since the previous checkpoint) where that pays
        (:meth:`CheckpointStore.delta_due`), else *full*. ``out``, the batch's output, is kept
        with it: a restart from this checkpoint offers it again, as a pipelined query's sink may
        not have it yet. Its files: docs/recovery.md."""
        if not self.store.enabled:
            return
        self.store.join()  # one write at a time, in batch order
        dirty = float(np.mean([eng._dirty().mean() for eng in self.engines]))
        delta = self.store.delta_due(batch, dirty, full)
        buckets = int(sum(eng._dirty().sum() for eng in self.engines)) if delta else \
            self.spec.buckets * len(self.engines)
        strings = self.codec.interner.strings()
        since = self.store.chain["strings"] if delta else 0  # the interner only grows: append
        meta = {**self._common_meta(batch), "strings_from": since,
                "host_map": None if self.share is None else self.spec.share.host_map,
                "stream_max_ms": self.stream_max_ms,
                "output_mode": getattr(self.spec, "output_mode", "append"),
                "keys": key_encoding(self.spec)}

        def files():  # (in the store's writer thread; the next step waits for it)
            # (lazy: the windows copied as the store writes each blob, now, in this thread,
            # while the next step waits: never a whole copy of the state in memory)
            blobs = {f"engine{i}.snap": eng.snapshot(delta=delta, lazy=True)
                     for i, eng in enumerate(self.engines)}
            blobs["interner.pkl"] = pickle.dumps(strings[since:], protocol=5)
            if out is not None:
                blobs["output.arrow"] = arrow_bytes(out)
            return blobs

        self.store.save(batch, delta, meta, files, {"buckets": buckets}, strings=len(strings))

    def _load(self, batch: int, ops) -> list:
        share = self.spec.share
        if share is not None and share.groups_changed(self.store.read_meta(batch).get("host_map")):
            return self._resharded(batch, ops)
        chain = self.store.chain_of(batch)
        dirs = [self.store.dir / str(b) for b in chain]
        meta = self.store.read_meta(batch)
        check_checkpoint(getattr(self.spec, "output_mode", "append"), meta, batch,
                         len(list(dirs[0].glob("engine*.snap"))), len(ops))
        check_keys(self.spec, meta, batch)
        self._restore_common(meta)
        self.stream_max_ms = meta.get("stream_max_ms", [meta.get("max_event_ms")])
        strings = []
        for d in dirs:
            part = json.loads((d / self.META).read_text())
            if part.get("strings_from", 0) != len(strings):
                raise StateError(f"engine checkpoint {d} does not continue {dirs[0]} (interner)")
            strings += pickle.loads((d / "interner.pkl").read_bytes())
        self.codec = KeyCodec(Interner(strings))
        self.store.chain = {"parent": batch, "deltas": len(chain) - 1, "strings": len(strings)}
        if (dirs[-1] / "output.arrow").exists():  # offered again, as after the batch's step
            out = read_arrow(dirs[-1] / "output.arrow")
            stream = f"{self.qid}:out:{batch}"
            self._publish(stream, out)
            self.last_reply = M.StepResult(rows=out.num_rows, stream=stream,
                                           metrics={"watermark_ms": self.watermark_ms})
        return [engine_class(op).restore(
                    op, map_file(dirs[0] / f"engine{i}.snap"),
                    deltas=[map_file(d / f"engine{i}.snap") for d in dirs[1:]], **self._spill())
                for i, op in enumerate(ops)]

    def _spill(self) -> dict:
        """The engine's memory budget for its state (``spark.stretch.state.memory``; unset:
        half this host's memory), past which its tables go to files on local disk."""
        return {"spill": Spill(self.spec.state_memory or default_budget(), state_root())}

    # -- what the query kind decides (the operator runtime overrides these) ----------------------
    def _operators(self) -> list:
        """The engine operators, all fed the same tuples under the same owner map and watermark:
        one for all the aggregations (``aggregate_many``: a tuple finds its window once)."""
        return builtin_operators(self.spec)

    def _lateness(self, op) -> str:
        return "window"  # Spark's rule for window aggregations

    def _delays(self) -> List[int]:
        """The watermark delay (ms) of each input stream."""
        return [self.spec.delay_ms]

    def _stream_columns(self, table: pa.Table, share=None) -> list:
        """The batch's rows as engine columns, one dict (or None: no rows) per input stream
        (pair keys flagged by ``share``, this host's share of them)."""
        return [engine_columns(self.spec, self.codec, share, table)]

    def _advance(self, watermark_ms: int, read: bool = True) -> Optional[pa.Table]:
        self.watermark_ms = watermark_ms
        for eng in self.engines:
            eng.esg_in.advance_watermark(watermark_ms * 1000)
            eng.drain()
            if not read:  # (update mode: the closed windows were emitted when they changed)
                self._evicted = len(eng.esg_out.get_batch("driver")[0]["ts"])
        return self._output() if read else None

    def _arrived(self, table: pa.Table) -> pa.Table:
        # (the engine's input from the scan's columns if the shim left it; this host's share)
        table = table if self.spec.prepare is None else prepare(table, self.spec.prepare)
        return table if self.share is None else self.share.kept(table)

    def _validate(self, table: pa.Table, batch: int) -> None:
        reject_nulls(self.spec, table, batch)

    def _file_slices(self) -> int:
        # (one host: a share's kept table carries its loads and tops, made whole)
        return slice_rows(self.spec, self.engines) if self.share is None else 0

    def _output(self) -> pa.Table:
        out = output_in_blocks(self.spec, self.codec, self.engines)
        return out if out is not None else output_table(self.spec, self.codec, per_aggregation(
            self.spec, [eng.esg_out.get_batch("driver")[0] for eng in self.engines]))

    # -- control -----------------------------------------------------------------------------------
    def reconfigure(self, parallelism: Optional[int], owner_map, persist=True) -> M.Reconfigured:
        with self.lock:  # between two micro-batches: the engine is idle here
            self.store.join()
            t0 = time.perf_counter()
            m = parallelism or self.parallelism
            om = None if owner_map is None else np.asarray(owner_map, np.int64)
            for i, eng in enumerate(self.engines):
                epoch = eng.reconfigure(m=parallelism, owner_map=om)
                eng.drain()
                if i == 0:  # a failure half way: some operators switched, some not
                    faults.inject("reconfigure", self.last_batch)
            self.parallelism = m
            rec = M.Reconfigured(epoch=int(epoch), parallelism=m, switch_ms=ms_since(t0),
                                 after_batch=self.last_batch,
                                 live_windows=int(self.engines[0].live_windows()))
            self.switches.append(rec.to_dict())
            if persist and self.last_batch >= 0:
                # The input log does not hold reconfigurations: a restart must find this one in
                # a checkpoint (background; the next step waits for it). Not a controller's.
                self._save(self.last_batch, full=True)
            return rec

    def metrics(self) -> dict:
        with self.lock:
            return {**self.counters, "parallelism": self.parallelism,
                    "watermark_ms": self.watermark_ms, "switches": list(self.switches),
                    "live_windows": int(self.engines[0].live_windows()),
                    "checkpoint": dict(self.store.stats),
                    "engine": {k: v for k, v in self.engines[0].metrics().items()
                               if isinstance(v, (int, float, str))}}

    def _close(self) -> None:
        for eng in self.engines:
            eng.close()


class _Nowhere:
    """The receiver of a warm-up's throwaway query: its outputs go nowhere."""

    def offer(self, stream, data) -> None:
        pass
