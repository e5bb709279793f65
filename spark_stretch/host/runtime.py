"""What every query runtime in the host engine shares, whatever it computes.

A runtime is one open query (:mod:`.daemon` keeps one per query id). Subclasses:
:class:`~spark_stretch.host.aggregate.AggregateRuntime` (built-in aggregations, and through
:class:`~spark_stretch.host.operator.OperatorRuntime` the engine's own operators) and
:class:`~spark_stretch.host.grouped.GroupedRuntime` (the ``applyInPandasWithState`` drop-in).
Here, once for all of them:

- **input**: a batch's committed rows (:meth:`Runtime.ingest`, from the receiver) or its Parquet
  files (:meth:`~.file_batch.FileInput.ingest_files`), checked (:meth:`Runtime._validate`)
  when they arrive so that bad rows fail the batch's own Spark job;
- **micro-batches**: :meth:`Runtime.step` with its replay guard (the last batch again gives the
  same rows; an older one is an error), and the pipelined :meth:`Runtime.submit` /
  :meth:`Runtime.result` with the input log;
- **output**: offered to the executors on ``<query>:out:<N>`` (:meth:`Runtime._offer`);
- **state**: the checkpoint store (full or delta, written in the background), the state after a
  flush (:meth:`Runtime.flushed`), :meth:`Runtime.wait_saved`, and :meth:`Runtime.close`.

A subclass says what a batch does (:meth:`Runtime._step`, :meth:`Runtime.flush`), what its
checkpoint holds (:meth:`Runtime._save`, :meth:`Runtime._load`), and how it rescales.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Dict, List, Optional, Union

import pyarrow as pa

from ..protocol import messages as M
from ..protocol.errors import StateError
from ..protocol.layout import input_log_of
from ..protocol.specs import QuerySpec
from . import allocator, faults, load
from .checkpoints import CheckpointStore
from .file_batch import FileBatch, FileInput
from .input_log import InputLog, InputLogWriter, LoggedFiles, read_again

__all__ = ["Runtime", "ms_since"]


class Runtime(FileInput, ABC):
    """One open query. ``receiver`` offers outputs to the executors of this host."""

    META: str = ""  # the checkpoint meta file (protocol.layout)

    def __init__(self, qid: str, spec: QuerySpec, receiver):
        self.qid = qid
        self.spec = spec
        self.receiver = receiver
        self.lock = threading.Lock()
        self.parallelism = spec.parallelism
        self.counters: Dict[str, int] = {"input_rows": 0, "late_rows": 0, "output_rows": 0,
                                         "batches": 0}
        # Spark's watermark starts at 0 ms. watermark_ms is W_N (eviction, and the late rule of
        # the next batch); next_watermark_ms is W_{N+1}.
        self.watermark_ms = 0
        self.next_watermark_ms = 0
        self.pending: Dict[int, Union[pa.Table, FileBatch]] = {}
        self.last_batch = -1
        self.last_reply: Optional[M.StepResult] = None
        self.switches: List[dict] = []
        self.replay: List[int] = []  # the batches the driver steps again after a restart
        self.checkpoint: Optional[int] = None  # the batch of the state it continued from
        self._last_out: Optional[pa.Table] = None
        self._offered: Optional[str] = None
        self._stepper: Optional[ThreadPoolExecutor] = None  # submit(): steps off the request
        self._inflight: Dict[int, Future] = {}
        state_dir = spec.checkpoint.state_dir
        self.log = InputLog(input_log_of(state_dir)) if state_dir else None
        self.logging = InputLogWriter(self.log, qid)
        self.store = CheckpointStore(spec.checkpoint, self.META,
                                     on_saved=self.logging.drop_through if self.log else None)
        # Set by an engine whose driver died: the lock is dropped when the process exits, not at
        # close(), so nothing it still does (a Delta append of a request in flight) can overlap a
        # restarted engine of the same query.
        self.keep_checkpoint_lock = False
        self.store.hold_lock()
        self._clock = load.StepClock()  # (a step's figures: the time since the last one)

    # -- what a runtime is -------------------------------------------------------------------
    @abstractmethod
    def describe(self) -> M.Opened:
        """The reply to ``open``."""

    @abstractmethod
    def _step(self, batch: int, table: Optional[pa.Table], batch_ts_ms: Optional[int]
              ) -> M.StepResult:
        """Step ``batch`` (``table``: its input, None if it had no rows), under the lock."""

    @abstractmethod
    def flush(self) -> M.FlushResult:
        """Spark's no-data batch after the last one (a query beside Spark's plan, whose
        driver plays it)."""

    @abstractmethod
    def reconfigure(self, parallelism: Optional[int], owner_map, persist: bool = True
                    ) -> M.Reconfigured:
        """Switch epoch between two batches (no state moved); ``persist``: checkpoint the state
        after it, so a restart from the checkpoint starts in the new epoch (an elastic
        controller's switch need not: a restart applies it again, or decides anew)."""

    @abstractmethod
    def metrics(self) -> dict:
        """The runtime's figures."""

    @abstractmethod
    def _save(self, batch: int, full: bool = False, out: Optional[pa.Table] = None) -> None:
        """Checkpoint the state after ``batch`` (through ``self.store``)."""

    def _logged(self, batch: int):
        """``(input, driver's extra)`` of ``batch`` from the input log (or its files)."""
        got, extra = self.log.read(batch, extra=True)
        return self._arrived(read_again(batch, got)) if isinstance(got, LoggedFiles) \
            else got, extra

    def fold_event_times(self, stream_max_ms: list) -> None:
        """Take every host's largest event times (ms, per input stream) in, before a step or
        flush of a query on several hosts (the runtimes that have a watermark)."""

    def take_watermark(self, watermark_ms: int) -> None:
        """Take Spark's own watermark for the next step as W_N, in place of the one this
        runtime computed from its input (the runtimes that have a watermark)."""

    def _arrived(self, table: pa.Table) -> pa.Table:
        """A batch's input as the query keeps (and logs) it, from the rows that arrived."""
        return table

    def _validate(self, table: pa.Table, batch: int) -> None:
        """Raise InputRejected (naming the column) if the engine cannot take ``table``'s rows."""

    def _check_usable(self) -> None:
        """Raise StateError if an earlier failure left the state unusable."""

    def _step_figures(self, t0: float, since_ms: Optional[float]) -> dict:
        """The figures of the step started at ``t0`` (:mod:`.load`): elastic control, metrics."""
        return load.engine_figures(self, t0, since_ms)

    def _close(self) -> None:
        """Release what the subclass holds (under the lock, once)."""

    def cancel(self, batch: int) -> None:
        """Give up the step of ``batch`` if it is running (Spark is stopping the query), without
        the lock the step holds. A runtime whose steps are short lets it end (this one)."""

    def abandon(self) -> None:
        """The engine is exiting without its driver while a step still runs (:meth:`close`
        did not finish in time): stop the runtime's processes and remove its files on this
        host now, without the lock, since nobody else would (a query that is never restarted
        never cleans a dead engine's files)."""

    # -- restart -------------------------------------------------------------------------------
    def _resume_from(self, resume: Optional[int]) -> Optional[int]:
        """The checkpoint to continue after Spark's batch ``resume`` from: the latest at or before
        it (None: from the start), kept as ``self.checkpoint``."""
        start = self.store.latest(resume) if resume is not None and self.store.enabled else None
        self.checkpoint = start
        return start

    def _set_replay(self, resume: Optional[int], first: int) -> None:
        """The batches the driver steps again after the restart, ``first`` to ``resume``: the
        logged inputs, with the checkpoint's own batch first if it kept its output (the sink
        may not have it yet)."""
        self.replay = [] if resume is None else list(range(first, resume + 1))

    def _restore_common(self, meta: dict) -> None:
        self.watermark_ms, self.next_watermark_ms = meta["watermark_ms"], meta["next_watermark_ms"]
        self.last_batch = meta["last_batch"]
        self.counters.update(meta["counters"])
        self.parallelism = int(meta["parallelism"])

    def _common_meta(self, batch: int) -> dict:
        return {"last_batch": batch, "watermark_ms": self.watermark_ms,
                "next_watermark_ms": self.next_watermark_ms, "counters": dict(self.counters),
                "parallelism": self.parallelism}

    # -- input ---------------------------------------------------------------------------------
    def ingest(self, rest: str, job: str, table: pa.Table) -> None:
        """The committed input of a batch (stream ``in:<N>``), kept until its step.

        Not under ``lock``: a pipelined query ingests batch N+1 while batch N is stepped. Rows
        the engine cannot take fail here (:meth:`_validate`), so they fail the batch's own
        Spark job and the query names the batch and column.
        """
        kind, _, batch = rest.partition(":")
        if kind != "in":
            raise ValueError(f"unexpected stream '{rest}' for query {self.qid}")
        table = self._arrived(table)
        self._validate(table, int(batch))
        # One save() per batch; a re-run of the batch replaces what an earlier run delivered.
        # (A dict store is atomic: the step thread only pops other batches.)
        self.pending[int(batch)] = table
        self.logging.forget(int(batch))
        allocator.give_back()  # (what reading and preparing it freed)

    # -- micro-batches -------------------------------------------------------------------------
    def step(self, batch: int, batch_ts_ms: Optional[int] = None,
             stream_max_ms: Optional[list] = None,
             watermark_ms: Optional[int] = None,
             watermarks: Optional[list] = None) -> M.StepResult:
        """Step ``batch``: its pending input, or after a restart its logged one. The last batch
        again (Spark re-running it after a failure) gives the same rows without touching the
        state; an older one is an error. ``stream_max_ms``: every host's largest event times
        up to the batch before (a query on several hosts); ``watermark_ms``: Spark's own
        eviction watermark for the batch (an aggregation in Spark's plan, by :meth:`submit`:
        :meth:`take_watermark`); ``watermarks``: Spark's own ``[W_{N-1}, W_N]`` (the drop-in in
        Spark's plan: late events and eviction), taken in place of the engine's."""
        with self.lock:
            self.store.join()  # the previous checkpoint reads the state: let it finish
            table = self.pending.pop(batch, None)
            self.logging.forget(batch)  # (stepped without submit(): not logged)
            if batch <= self.last_batch:
                if batch == self.last_batch and self.last_reply is not None:
                    # the same rows again (a flush may have replaced the offer meanwhile)
                    self._publish(self.last_reply.stream, self._last_out)
                    return replace(self.last_reply, replayed=True)
                raise StateError(
                    f"batch {batch} replayed after batch {self.last_batch}: the engine state of "
                    "that batch is gone (restart the query from its checkpoint)")
            if table is None and batch in self.replay and self.log is not None:
                # after a restart: the batch again, from the log (with what the driver decided)
                table, extra = self._logged(batch)
                stream_max_ms = stream_max_ms or extra.get("stream_max_ms")
                watermark_ms = extra.get("watermark_ms", watermark_ms)
            self.logging.check()
            self._check_usable()
            if stream_max_ms:
                self.fold_event_times(stream_max_ms)
            if watermark_ms is not None:
                self.take_watermark(watermark_ms)
            if watermarks:
                self.watermark_ms, self.next_watermark_ms = (int(w) for w in watermarks)
            t0 = time.perf_counter()
            reply = self._step(batch, table, batch_ts_ms)
            allocator.give_back()
            figures = self._step_figures(t0, self._clock.lap())
            figures["input_rows"] = input_rows(table)
            # (the query's state operator in Spark's progress: state rows, changes, late rows)
            figures.update(getattr(self, "state_changes", None) or {},
                           late_rows=int(reply.metrics.get("late_rows", 0)))
            self.last_reply = replace(reply, metrics={**reply.metrics, "elastic": figures})
            return self.last_reply

    def submit(self, batch: int, stream_max_ms: Optional[list] = None,
               watermark_ms: Optional[int] = None, await_result: bool = False
               ) -> M.Submitted:
        """Log the input of ``batch`` (after which Spark may commit it) and step it in the
        background; :meth:`result` waits for the step's reply (and, ``await_result``, for
        the log written meanwhile: :class:`~.input_log.InputLogWriter`)."""
        if self.log is not None:
            extra = {**({"stream_max_ms": stream_max_ms} if stream_max_ms else {}),
                     **({"watermark_ms": watermark_ms} if watermark_ms is not None else {})}
            self.logging.write(batch, self.pending.get(batch), extra or None, await_result)
        if self._stepper is None:
            self._stepper = ThreadPoolExecutor(1, thread_name_prefix=f"stretch-step-{self.qid}")
        self._inflight[batch] = self._stepper.submit(self.step, batch, None, stream_max_ms,
                                                     watermark_ms)
        return M.Submitted(batch)

    def result(self, batch: int) -> M.StepResult:
        """The reply of the submitted step of ``batch`` (its error, raised), logged."""
        fut = self._inflight.pop(batch, None)
        if fut is None:
            raise StateError(f"batch {batch} of query {self.qid} was not submitted")
        try:
            return fut.result()
        finally:
            self.logging.wait(batch)

    def _publish(self, stream: str, out: pa.Table) -> None:
        """Offer ``out`` on ``stream``, withdrawing the previous output (kept until now: a
        retried read task, or a replayed batch, reads the same rows)."""
        if self._offered is not None and self._offered != stream:
            self.receiver.offer(self._offered, None)
        self.receiver.offer(stream, out)
        self._offered = stream
        self._last_out = out

    def _offer(self, stream: str, out: pa.Table, metrics: dict) -> M.StepResult:
        self._publish(stream, out)
        self.counters["output_rows"] += out.num_rows
        return M.StepResult(rows=out.num_rows, stream=stream, metrics=metrics)

    # -- state ---------------------------------------------------------------------------------
    def _checkpoint_due(self, batch: int) -> bool:
        """Whether the state after ``batch`` is checkpointed: the first time, then every
        ``checkpoint.interval`` batches (``spark.stretch.checkpoint.interval``). In between,
        the input log is the delta: the logged inputs after a checkpoint are kept until the next
        one, and a restart steps them again (as Spark's state store replays its delta files on
        its last snapshot)."""
        chain = self.store.chain
        return chain is None or batch - chain["parent"] >= self.spec.checkpoint.interval

    def flushed(self) -> M.Submitted:
        """The sink holds the last flush: keep the state after it as the state of the last batch
        (a full checkpoint, replacing the batch's own)."""
        with self.lock:
            self._save(self.last_batch, full=True)
            self.store.join()
            return M.Submitted(self.last_batch)

    def wait_saved(self) -> M.SaveStats:
        """Block until the last checkpoint is on disk (before Spark may commit its batch)."""
        with self.lock:
            self.store.join()
            faults.inject("saved", self.last_batch)
            return M.SaveStats(**self.store.stats)

    def close(self) -> None:
        """Finish a step in flight, wait for the checkpoint being written, withdraw the output,
        release what the runtime holds and the checkpoint lock."""
        if self._stepper is not None:
            self._stepper.shutdown(wait=True, cancel_futures=True)
        self.logging.close()
        with self.lock:
            try:
                self.store.join()
            except StateError:
                pass  # the query is ending; its driver already saw (or will not need) the error
            if self._offered is not None:
                self.receiver.offer(self._offered, None)
                self._offered = None
            try:
                self._close()
            finally:
                if not self.keep_checkpoint_lock:
                    self.store.release_lock()


def input_rows(table) -> int:
    """The rows of a step's input: one table, a table per stream (``(table, stream)``), none."""
    if isinstance(table, list):
        return sum(t.num_rows for t, _ in table if t is not None)
    return 0 if table is None else table.num_rows


def ms_since(t0: float) -> float:
    """Milliseconds since ``t0`` (``time.perf_counter()``)."""
    return (time.perf_counter() - t0) * 1e3
