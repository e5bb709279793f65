"""A query's micro-batches on the driver: ingest, step on the engine, write the output.

Each micro-batch runs with no Exchange: the batch's input goes to the host engine
(:mod:`.ingest`), the engine updates the keys each instance owns and emits the windows the
watermark closed, and the results go to the sink (:mod:`.sink`).

Micro-batches of a pipelined kind overlap: ``foreachBatch`` N ingests N, waits for batch N-1
(stepped and written meanwhile), has the engine log N's input (after which Spark may commit N)
and step it in the background, and returns; a finisher thread writes N's output. At most one
batch is in flight: a flush, ``reconfigure``, ``processAllAvailable``, ``stop`` and the end of an
``availableNow`` run wait for it. A kind that is not pipelined (the drop-in, inside Spark's
plan: :mod:`.planrun`) steps, writes and checkpoints each batch before it returns.

An elastic query's policy decides after each batch (:mod:`.elastic`); its decision is applied
before the next batch's step, with nothing in flight, as :meth:`Pipeline.reconfigure` applies
the user's. A decision moving key groups between hosts is applied before the next batch's
input reaches the hosts (which keep, and route to, the keys of their groups): that batch waits
for the one in flight before its ingest, not after.

A ``foreachBatch`` query gets no no-data batch from Spark; the pipeline plays one (a *flush*)
where a stateful query would run it: after a trigger of Spark's query found no data
(:func:`.jvm.trigger_state` tells), or before the next batch's rows. A query inside Spark's
plan gets Spark's own.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Callable, Optional, Tuple

from pyspark.sql import DataFrame

from ..protocol import messages as M
from . import jvm, recovery
from .ingest import Ingest
from .metrics import QueryMetrics
from .elastic import ElasticRun
from .recovery import Recovery
from .sink import QuerySink

__all__ = ["Pipeline"]


class _Decisions:
    """The elastic policy's decisions, applied by a :class:`Pipeline` between two batches."""

    def _apply_decision(self) -> None:
        """The policy's decisions after the last batch, applied now (nothing in flight)."""
        for d in self.elastic.pending() if self.elastic is not None else ():
            if self._gone(d.host):
                continue
            # (checked as a user's would be: 1 <= parallelism <= max)
            msg = recovery.reconfiguration(self._qid, d.parallelism, d.owner_map,
                                           self._kind.max_parallelism, d.host)
            self._switch(replace(msg, persist=False), d.cause)

    def _gone(self, host: Optional[str]) -> bool:
        """Whether ``host``, named by a decision, was one of the query's hosts in the figures
        it was taken on and is no longer (lost since): the decision is dropped."""
        latest = self.elastic.latest
        known = {h.host for h in latest.hosts or ()} if latest is not None else set()
        return host in known and host not in getattr(self._rec.engine, "hosts", ())

    def _move_groups(self, trigger) -> None:
        """Before a batch's input reaches the hosts: the policy's decision moving key groups,
        if one waits (decided after a batch before the one in flight, which is waited for
        first), applied after the no-data batch that comes before this batch."""
        if self.elastic is None or not self.elastic.move_pending():
            return
        self._drain()
        self._play_before(trigger)
        for d in self.elastic.pending(moves=True):
            if not any(self._gone(h) for h in d.key_groups.values()):
                self.elastic.switched(self._rec.move_groups(moves=d.key_groups, cause=d.cause))

    def _switch(self, msg: M.Reconfigure, cause: str) -> dict:
        recovery.check_host(self._rec.engine, msg.host)
        t0 = time.perf_counter()
        reply = self._rec.engine.call(msg)
        rec = self._rec.reconfigured(msg, reply, t0, cause)
        if self.elastic is not None:
            self.elastic.switched(rec)
        return rec


class Pipeline(_Decisions):
    """The micro-batches of one query (``kind.pipelined``: overlapped, see the module doc)."""

    def __init__(self, qid: str, kind, rec: Recovery, ingest: Ingest, sink: QuerySink,
                 metrics: QueryMetrics, trigger: Callable[[], Optional[Tuple]],
                 elastic: Optional[ElasticRun] = None):
        self._qid = qid
        self.elastic = elastic  # per-batch figures and the policy's decisions
        self._kind = kind
        self._rec = rec
        self._ingest = ingest
        self._sink = sink
        self._metrics = metrics
        self.pipelined = kind.pipelined
        self._step_lock = threading.Lock()   # one micro-batch or flush at a time
        self._inflight: Optional[threading.Thread] = None  # finishing the last submitted batch
        self._inflight_batch: Optional[int] = None
        self._inflight_error: Optional[BaseException] = None
        self._trigger = trigger  # Spark's latest trigger (jvm.trigger_state), or None
        self._batch_trigger: Optional[int] = None  # start (ms) of the last batch's trigger
        self._idle_done = False  # the no-data batch since the last batch was played
        rec.in_flight = lambda: self._inflight_batch if self._inflight is not None else None
        rec.discard_in_flight = self._discard

    # -- one micro-batch (Spark's foreachBatch) -------------------------------------------------
    def run_batch(self, batch_df: DataFrame, batch_id: int, info: Optional[dict] = None) -> None:
        """The ``foreachBatch`` function (``info``: what Spark gave the batch's state operator,
        inside Spark's plan: ``batch_ts_ms``, ``late_watermark_ms``, ``watermark_ms``)."""
        with self._step_lock:
            trigger = self._started(batch_id)
            fn = self._submit if self.pipelined else self._step
            self._rec.with_engine(f"batch {batch_id}",
                                  lambda: fn(batch_df, batch_id, trigger, info), opened=False)
            self._rec.last_done = batch_id
            ok = trigger is not None and trigger[0] == batch_id
            self._batch_trigger = trigger[1] if ok else None
            self._idle_done = False

    def run_now(self, batch_df: DataFrame, batch_id: int,
                info: Optional[dict] = None) -> M.StepResult:
        """A micro-batch whose output is read as soon as this returns (the in-plan exec's,
        which Spark's sink then writes): ingested and stepped (and, not pipelined,
        checkpointed); the step's reply."""
        with self._step_lock:
            self._started(batch_id)
            fn = self._now if self.pipelined else self._step
            reply = self._rec.with_engine(f"batch {batch_id}",
                                          lambda: fn(batch_df, batch_id, None, info),
                                          opened=False)
            self._rec.last_done = batch_id
            return reply

    def _started(self, batch_id: int):
        """A batch begins: its figures' start, the engine where Spark continues; its trigger."""
        if self.elastic is not None:
            self.elastic.started(batch_id)
        # After a restart the engine continues from what it held after the previous batch
        # (its state, or its logged input: on disk before Spark committed that batch) and
        # this batch runs again whole.
        self._rec.realign(batch_id - 1 if batch_id > 0 else None)
        return self._trigger()  # this batch's

    def _now(self, batch_df: DataFrame, batch_id: int, trigger, info) -> M.StepResult:
        """A pipelined kind's batch, stepped at once (its input logged first)."""
        t0 = time.perf_counter()
        self._move_groups(trigger)
        ran = self._ingest(batch_df, batch_id, bool((info or {}).get("empty")))
        self._apply_decision()
        eng = self._rec.engine
        eng.call(M.Submit(query=self._qid, batch=batch_id,
                          watermark_ms=(info or {}).get("watermark_ms"), await_result=True))
        reply = eng.call(M.Result(query=self._qid, batch=batch_id))
        self._record({"batch": batch_id, "written_at": time.time(),
                      "step_s": time.perf_counter() - t0, "rows_out": reply.rows,
                      **reply.metrics}, reply.rows, [ran])
        return reply

    def _submit(self, batch_df: DataFrame, batch_id: int, trigger, info=None) -> None:
        """A pipelined micro-batch: ingest it, wait for the previous one (stepped and written
        meanwhile), log it and start its step, and let Spark commit it."""
        t0 = time.perf_counter()
        self._move_groups(trigger)
        ran = self._ingest(batch_df, batch_id, bool((info or {}).get("empty")))
        t1 = time.perf_counter()
        self._drain()
        self._play_before(trigger)
        self._apply_decision()
        t2 = time.perf_counter()
        eng = self._rec.engine
        eng.call(M.Submit(query=self._qid, batch=batch_id,
                          watermark_ms=(info or {}).get("watermark_ms")))
        times = {"batch": batch_id, "ingest_s": t1 - t0, "previous_s": t2 - t1,
                 "submit_s": time.perf_counter() - t2}
        self._inflight_batch = batch_id
        self._inflight = threading.Thread(target=self._finish, args=(eng, ran, batch_id, times),
                                          name=f"stretch-finish-{batch_id}", daemon=True)
        self._inflight.start()

    def _finish(self, eng, ran, batch_id: int, times: dict) -> None:
        """Wait for the engine's step of a submitted batch and write its output (a thread)."""
        try:
            t0 = time.perf_counter()
            reply = eng.call(M.Result(query=self._qid, batch=batch_id))
            t1 = time.perf_counter()
            out = (self._sink.emit(reply.stream, reply.rows, batch_id) if reply.rows
                   else self._sink.emit_empty(batch_id))
            t2, written = time.perf_counter(), time.time()
            # written meanwhile; waited for here only for its figures (and a write error)
            saved = eng.call(M.Saved(query=self._qid))
            self._record(dict(times, written_at=written, engine_s=t1 - t0, output_s=t2 - t1,
                              checkpoint_wait_s=time.perf_counter() - t2,
                              checkpoint=saved.to_dict(), rows_out=reply.rows, **reply.metrics),
                         reply.rows, [ran, out])
        except BaseException as e:  # raised by _drain, on the thread of the next batch
            e.stretch_batch = batch_id
            self._inflight_error = e

    def _drain(self) -> None:
        """Wait for the batch in flight, if any, to be stepped and written; raise its error."""
        t = self._inflight
        if t is None:
            return
        t.join()
        self._inflight = None  # (only now: join() on another thread waits for it meanwhile)
        e, self._inflight_error = self._inflight_error, None
        if e is not None:
            raise e

    def _discard(self) -> None:
        """Forget the batch in flight (its engine died; the restart redoes it from the log)."""
        t, self._inflight = self._inflight, None
        if t is not None:
            t.join(timeout=60)
        self._inflight_error = None

    def _step(self, batch_df: DataFrame, batch_id: int, trigger,
              info: Optional[dict] = None) -> M.StepResult:
        """A micro-batch of a kind that is not pipelined: ingest, step, write, checkpoint; the
        step's reply. Spark's watermarks of the batch (``info``), when given, are the
        engine's."""
        t0 = time.perf_counter()
        self._move_groups(trigger)
        ran = self._ingest(batch_df, batch_id, bool((info or {}).get("empty")))
        t1 = time.perf_counter()
        self._play_before(trigger)
        self._apply_decision()
        eng = self._rec.engine
        info = info or {}
        marks = [info[k] for k in ("late_watermark_ms", "watermark_ms") if k in info]
        reply = eng.call(M.Step(query=self._qid, batch=batch_id,
                                batch_ts_ms=self._kind.batch_time(self._rec, batch_id, info),
                                watermarks=marks if len(marks) == 2 else None))
        t2 = time.perf_counter()
        out = (self._sink.emit(reply.stream, reply.rows, batch_id) if reply.rows
               else self._sink.emit_empty(batch_id))
        t3, written = time.perf_counter(), time.time()
        # The engine wrote its state after this batch while Spark wrote the output; it must be on
        # disk before Spark commits the batch (a restart resumes from it).
        saved = eng.call(M.Saved(query=self._qid))
        self._record({"batch": batch_id, "written_at": written, "ingest_s": t1 - t0,
                      "engine_s": t2 - t1,
                      "output_s": t3 - t2, "checkpoint_wait_s": time.perf_counter() - t3,
                      "checkpoint": saved.to_dict(), "rows_out": reply.rows, **reply.metrics},
                     reply.rows, [ran, out])
        return reply

    def _record(self, times: dict, rows: int, jobs: list) -> None:
        """Count a finished batch; keep the physical plans of its Spark jobs (``jobs``:
        DataFrames, physical plans or None) for the first few batches; its figures to the
        elastic run (which may decide a reconfiguration)."""
        figures, written = times.pop("elastic", None), times.pop("written_at", None)
        if times.get("instance_retries"):
            self._metrics.add("instance_retries", times["instance_retries"])
        plans = [jvm.plan_string(j) for j in jobs if j is not None] \
            if self._metrics.wants_plans() else []
        self._metrics.record_batch(times, rows, plans)
        if self.elastic is not None and figures is not None:
            self.elastic.batch_done(times["batch"], figures, written)

    # -- Spark's no-data batch -----------------------------------------------------------------
    def flush(self, final: bool = False) -> int:
        """Spark's no-data batch: emit and write what the next watermark closes; the rows
        written. ``final``: the flush that ends a one-shot run."""
        with self._step_lock:
            # (no batch ran in this run)
            self._rec.realign(recovery.last_committed(self._rec.layout.checkpoint))
            return self._rec.with_engine("a flush", lambda: self._flush(final)).rows

    def play_idle(self, settle_s: float = 0.0) -> int:
        """Play the no-data batch of the last trigger of Spark's query that found no data after
        the last batch, if not played yet (a stateful query runs one there); the rows written.
        Nothing before the run's first batch (nor does Spark after a restart).

        ``settle_s``: a trigger is known to have found no data (``processAllAvailable``
        returned) but may not be over yet; wait up to that long for it to end."""
        if self._batch_trigger is None or self._idle_done:
            return 0
        state = self._trigger()
        deadline = time.monotonic() + settle_s
        while (state is not None and not state[3] and state[0] == self._rec.last_done + 1
               and time.monotonic() < deadline):
            time.sleep(0.005)  # Spark marks the trigger over just after it signals no data
            state = self._trigger()
        with self._step_lock:  # (a batch may have run meanwhile: then it played it)
            at = self._idle_trigger(state)
            if at is None:
                return 0
            return self._rec.with_engine("a flush", lambda: self._play(at))

    def _play_before(self, trigger) -> None:
        """In batch N: the no-data batch a trigger without data between N-1 and N asks for,
        before N's rows (as Spark would have run it), unless played already."""
        at = self._idle_trigger(trigger)
        if at is not None:
            self._play(at)

    def _idle_trigger(self, state) -> Optional[int]:
        """The start (ms) of the last trigger that found no data after the last batch (Spark's
        latest trigger ``state``), if its no-data batch is still to play."""
        last = self._rec.last_done
        if state is None or self._batch_trigger is None or self._idle_done or last is None:
            return None
        batch, start, before, idle = state
        if batch != last + 1:
            return None
        at = start if idle else before
        return None if at == self._batch_trigger else at

    def _play(self, at: int) -> int:
        """The no-data batch of the trigger that began at ``at`` (once per gap between
        batches: a later one would find nothing the watermark has not closed)."""
        self._idle_done = True
        return self._flush(False).rows

    def _flush(self, final: bool) -> M.FlushResult:
        """The no-data batch after the last batch.

        Its rows are written under their own Delta app id, so a flush repeated after a restart
        is a no-op in the table like a replayed batch: ``<app>-idle`` with the last batch id as
        the version (:meth:`.sink.Sink.emit_flush`).
        """
        self._drain()  # the last batch first
        eng = self._rec.engine
        reply = eng.call(M.Flush(query=self._qid))
        if reply.rows:
            self._sink.emit_flush(reply.stream, reply.rows, reply.batch)
        if reply.rows or reply.changed:
            # Only now is the state after the flush the state of that batch. The run's last
            # flush need not wait for that checkpoint when it wrote rows to a Delta path: the
            # table's txn action tells a restart to redo it, unwritten (Recovery, holds_flush).
            if not (final and reply.rows and self._sink.idempotent_path):
                eng.call(M.Flushed(query=self._qid))
            self._metrics.add("output_rows", reply.rows)
            self._metrics.add("flushes")
        return reply

    # -- between two micro-batches ---------------------------------------------------------------
    def settle(self) -> None:
        """Wait until the batch in flight, if any, is stepped and written (restarting a dead
        engine as a micro-batch would)."""
        with self._step_lock:
            self._rec.with_engine("the last batch", self._drain)

    def wait(self) -> None:
        """Wait until the batch in flight, if any, is written; raise its error (no engine
        restart: the query has ended, or its next batch redoes it)."""
        with self._step_lock:
            self._drain()

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the batch in flight (if any) to finish, raising nothing."""
        t = self._inflight
        if t is not None:
            t.join(timeout)

    def between(self, fn):
        """Run ``fn()`` between two micro-batches, none in flight (its result; a record of a
        reconfiguration, which the elastic figures take in)."""
        with self._step_lock:
            self._rec.with_engine("the last batch", self._drain)
            rec = fn()
            if self.elastic is not None:
                self.elastic.switched(rec)
            return rec

    def reconfigure(self, msg: M.Reconfigure) -> dict:
        """Switch the engine's epoch between two micro-batches, none in flight (the user's:
        cause ``"manual"``)."""
        with self._step_lock:
            self._rec.with_engine("the last batch", self._drain)
            return self._switch(msg, "manual")
