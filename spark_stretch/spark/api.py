"""``df.stretchAggregate(...)``: windowed, multi-key aggregation on the host's VSN engine.

Each micro-batch runs with no Exchange: the batch's partitions are written to this host's engine
(``format("stretch")``), the engine updates the keys each instance owns and emits the windows the
watermark closed, and the results are appended to the sink (Delta: idempotently, with
``txnAppId``/``txnVersion``; by the engine itself for a path-based Delta table, otherwise read
back on the same host and written by Spark).

Micro-batches are pipelined: once batch N's input is in the engine's input log, Spark may commit
N and go on to batch N+1, while the engine steps N and its output is written. The next batch
waits for that after its own ingest (and a flush, ``reconfigure``, ``processAllAvailable``,
``stop`` or the end of an ``availableNow`` run waits for it too), so at most one batch is in
flight, and a restart redoes the logged batches after the engine's last checkpoint.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Dict, Optional

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery

from .host import EngineDiedError, HostEngine
from .native import native_equivalent
from .spec import AggregationSpec, build_spec

__all__ = ["StretchAggregation", "StretchStreamWriter", "StretchQuery", "stretch_aggregate"]

_IDEMPOTENT = {"delta"}
_FILE_FORMATS = {"parquet", "json", "csv", "orc"}
_ROWS_PER_SPLIT = 50_000  # below this an output batch is read (and written) by one task


def stretch_aggregate(df: DataFrame, keys=None, window=None, agg="count", *, others=None,
                      parallelism: int = 1, max_parallelism: int = 4,
                      buckets: int = 4096) -> "StretchAggregation":
    """Windowed aggregation per key on the host's shared-state (VSN) engine.

    The rows are those of the native ``groupBy(window(ts, size, slide), key).agg(...)`` (after
    ``explode`` for array keys) in append mode, with the input's watermark.

    Parameters
    ----------
    keys : str, Column or :func:`spark_stretch.pairs`
        A scalar key column (string or integer), an array column (every element is a key of the
        row: multi-key), or an engine key function such as ``pairs("words", distance=3)``.
    window : str or (str, str)
        Window size, or ``(size, slide)``, as for ``pyspark.sql.functions.window``.
    agg : str, list, dict or engine operator
        ``"count"``, a list like ``["count", "sum(x)", "max(x)", "mean(x)"]``, or ``{"x": "sum"}``.
        Columns are named as Spark names them: ``count``, ``sum(x)``, ``avg(x)``, ... Or one of
        the engine's operators: a join (:func:`spark_stretch.ops.band_join`,
        :func:`spark_stretch.ops.join` with a numba predicate) or an O+ operator with numba
        ``f_MK``/``f_U``/``f_O``/``f_S`` (:class:`spark_stretch.ops.Operator`, e.g.
        :func:`spark_stretch.ops.passthrough`); see :mod:`spark_stretch.spark.custom` for the
        result's columns. Its keys come from its ``f_MK`` (no ``keys=``); ``window=`` sets its
        window, else its ``WS``/``WA`` are in microseconds.
    others : DataFrame, optional
        The second input stream (stream 1) of an operator with ``I = 2`` (joins, pass-through),
        with its own ``withWatermark``. Both streams run in one query; the watermark is Spark's
        global one (the min of the two, or per ``spark.sql.streaming.multipleWatermarkPolicy``).
    parallelism : int
        Instances updating state at the start (m).
    max_parallelism : int
        Instances created (n); ``reconfigure`` moves between 1 and n without a restart.
    buckets : int
        State buckets (B); ownership moves between instances bucket by bucket.

    Returns
    -------
    StretchAggregation
        Use ``.writeStream`` like a DataFrame's.

    Examples
    --------
    >>> import spark_stretch
    >>> from pyspark.sql import functions as F
    >>> counts = (spark.readStream.format("delta").load(src)          # doctest: +SKIP
    ...           .withWatermark("ts", "10 seconds")
    ...           .stretchAggregate(keys=F.col("words"), window=("120 seconds", "60 seconds"),
    ...                             agg="count", parallelism=1, max_parallelism=4))
    >>> q = counts.writeStream.format("delta").option("checkpointLocation", ckpt).start(out)  # doctest: +SKIP
    >>> q.reconfigure(parallelism=2)   # online: no restart, no shuffle, no state moved  # doctest: +SKIP

    Notes
    -----
    Errors in the arguments (unknown column or aggregation, wrong key type, no watermark) are
    raised here, before any query starts. Delta accepts names like ``sum(x)`` only with column
    mapping (as for the native query): set
    ``spark.databricks.delta.properties.defaults.columnMapping.mode=name`` for new tables. A null key is an error at run time (Spark would make a
    null group); filter nulls first.
    """
    from .custom import StretchOperatorAggregation, build_operator_spec, is_engine_operator

    if is_engine_operator(agg):
        spec = build_operator_spec(df, others, agg, window, keys, parallelism, max_parallelism,
                                   buckets)
        return StretchOperatorAggregation(df, others, spec)
    if others is not None:
        raise ValueError("others= is the second input stream of an engine operator with I = 2 "
                         "(agg=spark_stretch.ops.band_join(...), passthrough(...)); built-in "
                         "aggregations read one stream")
    spec = build_spec(df, keys, window, agg, parallelism, max_parallelism, buckets)
    return StretchAggregation(df, spec)


class StretchAggregation:
    """The result of ``stretchAggregate``: write it with ``.writeStream``.

    A *query kind* for :class:`StretchQuery`, which asks of it: ``schema``, ``max_parallelism``,
    ``_engine_spec()`` (the engine's ``open`` spec; its ``kind`` picks the engine runtime),
    ``_input_df()`` (the streaming DataFrame each micro-batch writes to the engine), ``_output_mode(mode)``, ``_check_start(mode)``, and the extra arguments
    of the engine's ``step``/``flush`` (``_step_args``, ``_flush_args``). The other kinds are
    :class:`spark_stretch.spark.custom.StretchOperatorAggregation` (an engine operator) and
    :class:`spark_stretch.spark.grouped.StretchGroupedAggregation`.
    """

    kind = "aggregate"
    pipelined = True  # the engine runtime has submit/result and an input log (see the module doc)

    def __init__(self, df: DataFrame, spec: AggregationSpec):
        self._df = df
        self.spec = spec

    @property
    def schema(self):
        """Output schema: ``window``, ``key`` and one column per aggregation."""
        return self.spec.output_schema()

    @property
    def isStreaming(self) -> bool:
        return True

    def native(self) -> DataFrame:
        """The equivalent native Spark query (same rows in append mode), e.g. for comparison."""
        return native_equivalent(self._df, self.spec)

    @property
    def writeStream(self) -> "StretchStreamWriter":
        return StretchStreamWriter(self)

    @property
    def max_parallelism(self) -> int:
        return self.spec.max_parallelism

    def _engine_spec(self) -> dict:
        return {**asdict(self.spec), "kind": "aggregate", "output_names": self.spec.output_names()}

    def _input_df(self) -> DataFrame:
        """What each micro-batch hands to the engine: the columns it reads, nothing else."""
        spec = self.spec
        return self._df.select(spec.ts_column, spec.key_column, *spec.value_columns)

    def _output_mode(self, mode: str) -> str:
        if mode.lower() != "append":
            raise ValueError(f"outputMode '{mode}' is not supported by stretchAggregate: a "
                             "window is emitted once, when the watermark passes its end ('append')")
        return "append"

    def _check_start(self, mode: str) -> None:
        pass

    def _step_args(self, query, batch_id: int) -> dict:
        return {}

    def _flush_args(self, query, replay: bool = False) -> dict:
        return {}


class StretchStreamWriter:
    """Mirrors :class:`pyspark.sql.streaming.DataStreamWriter` for a stretch query kind."""

    def __init__(self, agg):
        self._agg = agg
        self._format = "delta"
        self._options: Dict[str, str] = {}
        self._mode = "append"
        self._trigger: Optional[dict] = None
        self._name: Optional[str] = None

    def format(self, source: str) -> "StretchStreamWriter":
        self._format = source.lower()
        return self

    def option(self, key: str, value) -> "StretchStreamWriter":
        self._options[key] = str(value)
        return self

    def options(self, **options) -> "StretchStreamWriter":
        for k, v in options.items():
            self.option(k, v)
        return self

    def outputMode(self, outputMode: str) -> "StretchStreamWriter":
        self._mode = self._agg._output_mode(outputMode)
        return self

    def trigger(self, **kwargs) -> "StretchStreamWriter":
        self._trigger = kwargs
        return self

    def queryName(self, queryName: str) -> "StretchStreamWriter":
        self._name = queryName
        return self

    def toTable(self, tableName: str, **options) -> "StretchQuery":
        return self.options(**options)._start(path=None, table=tableName)

    def start(self, path: Optional[str] = None, format: Optional[str] = None, **options) -> "StretchQuery":
        if format:
            self.format(format)
        return self.options(**options)._start(path=path or self._options.pop("path", None), table=None)

    def _start(self, path: Optional[str], table: Optional[str]) -> "StretchQuery":
        fmt = self._format
        if fmt not in _IDEMPOTENT | _FILE_FORMATS | {"console", "noop"}:
            raise ValueError(f"format '{fmt}' is not supported as a stretchAggregate sink; use "
                             "delta (exactly once), parquet/json/csv/orc, console or noop")
        if path is None and table is None and fmt not in ("console", "noop"):
            raise ValueError(f"start() needs a path (or use toTable) for format '{fmt}'")
        self._agg._check_start(self._mode)
        return StretchQuery._start(self._agg, fmt, dict(self._options), path, table,
                                   self._trigger, self._name)


class StretchQuery:
    """A running stretch query: a :class:`StreamingQuery` plus ``reconfigure`` and ``metrics``.

    Everything of ``StreamingQuery`` (``id``, ``status``, ``lastProgress``, ``awaitTermination``,
    ``stop``, ...) is available on it.
    """

    _stopped = False
    _engine_metrics: Optional[dict] = None

    def __init__(self, agg, fmt, options, path, table, checkpoint, own_checkpoint, meta,
                 resume=None):
        self._agg = agg
        self._format = fmt
        self._sink_options = {k: v for k, v in options.items() if k != "checkpointLocation"}
        self._path, self._table = path, table
        self._checkpoint, self._own_checkpoint = checkpoint, own_checkpoint
        self.stretch_id = meta["stretch_id"]
        self._app_id = meta["app_id"]
        self._spark: SparkSession = agg._df.sparkSession
        self._niceness = _engine_niceness(self._spark)
        self._engine = HostEngine.acquire(niceness=self._niceness)
        self._lock = threading.Lock()
        self._metrics = {"batches": 0, "output_rows": 0, "plans": [], "reconfigurations": []}
        self._released = False
        self._query: Optional[StreamingQuery] = None
        self._started = threading.Event()    # set once writer.start() returned (or failed)
        self._step_lock = threading.Lock()   # one micro-batch or flush at a time
        self._done = threading.Event()       # set once the final flush (if any) and release ran
        self._finish_error: Optional[BaseException] = None
        self._last_step = time.monotonic()
        self._one_shot = False               # availableNow / once: flush when the run ends
        # the last batch the engine holds: its state on disk, or (pipelined) its input logged
        self._last_done = resume
        self._aligned = False  # the engine's resume point checked against Spark's (_realign)
        self._pipelined = bool(getattr(agg, "pipelined", False))
        self._inflight: Optional[threading.Thread] = None  # finishing the last submitted batch
        self._inflight_batch: Optional[int] = None
        self._inflight_error: Optional[BaseException] = None
        self._table_ready: Optional[threading.Thread] = None  # creating the Delta table
        self._opening: Optional[threading.Thread] = None
        self._open_error: Optional[BaseException] = None
        self._check_one_host()
        conf = self._spark.conf
        policy = conf.get("spark.stretch.onEngineFailure", "restart").lower()
        if policy not in ("restart", "fail"):
            self._release()
            raise ValueError(f"spark.stretch.onEngineFailure='{policy}': must be 'restart' "
                             "(restart the engine from the last checkpoint and retry the batch) "
                             "or 'fail' (fail the query)")
        self._on_failure = policy
        direct = self._bool_conf("spark.stretch.delta.directWrite", "true",
                                 "the engine appends to a path-based Delta sink itself",
                                 "Spark writes every batch")
        # Writer options (mergeSchema, partitionBy, ...) are Spark's to apply: Spark writes then.
        self._direct = (direct and fmt == "delta" and bool(path) and not table
                        and not set(self._sink_options) - {"path"})
        self._columnar = self._bool_conf(
            "spark.stretch.ingest.columnar", "true",
            "a batch read by a columnar scan goes to the engine as its columns",
            "always as the rows foreachBatch hands over")
        # The engine reads a plain Parquet scan's files itself (Parquet, plain Delta; pipelined
        # kinds: the drop-in's rows keep the order Spark hands them over in, which its functions
        # may see).
        self._read_files = self._bool_conf(
            "spark.stretch.ingest.files", "true",
            "the engine reads a batch's Parquet files itself when Spark would only read them",
            "Spark reads them") and self._columnar and self._pipelined
        self._max_restarts = self._int_conf("spark.stretch.maxEngineRestarts", 3, 0,
                                            "engine restarts in a row before the query fails")
        self._restarts: list = []
        self._reconfig_log: list = []  # successful reconfigure() calls, re-applied after a restart
        self._spec = {
            **agg._engine_spec(),
            "state_dir": str(Path(checkpoint) / "stretch" / "state"),
            # Checkpoint cadence and retention follow Spark's own state store settings.
            "min_deltas": int(conf.get("spark.sql.streaming.stateStore.minDeltasForSnapshot", "10")),
            "min_batches_to_retain": int(conf.get("spark.sql.streaming.minBatchesToRetain", "100")),
            "checkpoint_interval": self._int_conf("spark.stretch.checkpoint.interval", 10, 1,
                                                  "batches between two engine checkpoints"),
            "fsync": self._bool_conf("spark.stretch.checkpoint.fsync", "false",
                                     "fsync each engine checkpoint (survives a power cut)",
                                     "write and rename it, as Spark writes its own checkpoint")}
        schema = _arrow_schema(agg._input_df().schema) if self._pipelined else None
        if schema is not None:  # the engine warms up on made-up rows of it (QueryRuntime.warm_up)
            self._spec["input_schema"] = schema
        self._read_files = self._read_files and schema is not None
        # Opened while Spark starts the query (the engine process is still importing numba):
        # the first batch, or anything else that needs the engine, waits for it (_opened).
        self._opening = threading.Thread(target=self._open_in_background, args=(resume,),
                                         name="stretch-open", daemon=True)
        self._opening.start()

    def _int_conf(self, key: str, default: int, least: int, what: str) -> int:
        try:
            return _int_setting(self._spark, key, default, least, None, what)
        except ValueError:
            self._release()
            raise

    def _bool_conf(self, key: str, default: str, if_true: str, if_false: str) -> bool:
        value = self._spark.conf.get(key, default).lower()
        if value not in ("true", "false"):
            self._release()
            raise ValueError(f"{key}='{value}': must be 'true' ({if_true}) or 'false' ({if_false})")
        return value == "true"

    # -- start -------------------------------------------------------------------------------------
    @classmethod
    def _start(cls, agg, fmt, options, path, table, trigger, name) -> "StretchQuery":
        own = "checkpointLocation" not in options
        checkpoint = options.get("checkpointLocation") or tempfile.mkdtemp(prefix="stretch-ckpt-")
        resume = _last_committed(checkpoint)  # Spark resumes after its last committed batch
        meta = cls._meta(checkpoint)
        query = cls(agg, fmt, options, path, table, checkpoint, own, meta, resume)
        writer = (agg._input_df().writeStream.foreachBatch(query._step)
                  .option("checkpointLocation", checkpoint))
        if trigger:
            writer = writer.trigger(**trigger)
        if name:
            writer = writer.queryName(name)
        query._one_shot = bool(trigger) and any(trigger.get(k) for k in ("availableNow", "once"))
        if query._direct and not (Path(path) / "_delta_log").is_dir():
            # Spark makes the empty table (with the session's Delta defaults) while the first
            # batches run; the engine's first append waits for it (_emit).
            query._table_ready = threading.Thread(target=query._create_table_quietly,
                                                  name="stretch-create-table", daemon=True)
            query._table_ready.start()
        try:
            query._query = writer.start()
        except Exception:
            query._release()
            raise
        finally:
            query._started.set()
        threading.Thread(target=query._watch, name="stretch-query-watch", daemon=True).start()
        return query

    @staticmethod
    def _meta(checkpoint: str) -> dict:
        """Ids kept in the checkpoint, so a restart is the same query to the engine and to Delta."""
        d = Path(checkpoint) / "stretch"
        d.mkdir(parents=True, exist_ok=True)
        f = d / "query.json"
        if f.exists():
            return json.loads(f.read_text())
        meta = {"stretch_id": uuid.uuid4().hex, "app_id": f"stretch-{uuid.uuid4().hex}"}
        tmp = f.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, f)
        return meta

    def _check_one_host(self) -> None:
        status = self._spark.sparkContext._jsc.sc().getExecutorMemoryStatus()
        it = status.keysIterator()
        hosts = set()
        while it.hasNext():
            hosts.add(it.next().rsplit(":", 1)[0])
        others = hosts - {self._engine.host, "localhost", "127.0.0.1"}
        if others:
            self._release()
            raise NotImplementedError(
                f"executors on hosts {sorted(others)}: this version runs one host engine, on the "
                "driver's host (local, local-cluster or a one-host cluster)")

    def _open(self, resume: Optional[int]) -> Optional[int]:
        """Open the query on the engine, continuing after batch ``resume``.

        A pipelined kind continues from its latest checkpoint at or before ``resume`` and the
        engine names the batches to redo (``replay``): the checkpoint's own output, which the
        sink may lack, then the logged inputs after it. Each is stepped and written here, with
        its own batch id, so the sink takes each once. Returns the batch of the state the
        engine continued from (None: from the start).
        """
        reply = self._engine.request({"op": "open", "query": self.stretch_id,
                                      "spec": dict(self._spec, resume_batch=resume)})
        for b in reply.get("replay", []):
            step = self._engine.request({"op": "step", "query": self.stretch_id, "batch": b})
            if int(step["rows"]):
                self._emit(step["stream"], int(step["rows"]), b)
        start = reply["checkpoint"] if "checkpoint" in reply else resume
        if resume is not None and self._sink_holds_flush(resume):
            # The last flush reached the table but not the saved state: replay it, unwritten.
            self._engine.request({"op": "flush", "query": self.stretch_id,
                                  "args": self._agg._flush_args(self, replay=True)})
            self._engine.request({"op": "flushed", "query": self.stretch_id})
        return start

    def _reopen(self) -> Optional[int]:
        """Open the query on the (new or emptied) engine to hold what it held after batch
        ``_last_done``, with the reconfigurations made since its checkpoint applied again (they
        are not in it). Returns the batch of the checkpoint it continued from."""
        start = self._open(self._last_done)
        for r in self._reconfig_log:
            if start is None or r["after_batch"] >= start:
                self._engine.request({"op": "reconfigure", "query": self.stretch_id,
                                      "parallelism": r["parallelism"],
                                      "owner_map": r["owner_map"]})
        return start

    def _realign(self, committed: Optional[int]) -> None:
        """Make the engine continue after ``committed``, the batch Spark's commit log ends at
        as the run's first batch (or its end) shows it, if that is not the batch it was opened
        after.

        The engine is opened while Spark starts the query, after the commit log read when the
        query started. A driver that died a moment ago may leave its JVM running long enough to
        commit one more batch after that read (its input is in the input log, or its state on
        disk): Spark then continues after it, and so must the engine, or that batch would be
        missing from the state. Called once, under the step lock, before anything is ingested.
        """
        if self._aligned:
            return
        self._aligned = True
        if committed == self._last_done:
            return
        if self._last_done is not None and (committed is None or committed < self._last_done):
            raise RuntimeError(
                f"Spark continues after batch {committed} but the commit log under "
                f"{self._checkpoint} named batch {self._last_done} when the query started: was "
                "the checkpoint changed by another query meanwhile?")
        self._opened()
        self._engine.request({"op": "close", "query": self.stretch_id})
        was, self._last_done = self._last_done, committed
        start = self._reopen()
        with self._lock:
            self._metrics["realigned"] = {"opened_after": was, "continued_after": committed,
                                          "checkpoint": start}

    def _open_in_background(self, resume: Optional[int]) -> None:
        try:
            self._open(resume)
        except BaseException as e:  # raised by _opened, on the thread that needs the engine
            self._open_error = e

    def _opened(self) -> None:
        """Wait until the query is open on the engine; raise (once) what opening it raised."""
        t = self._opening
        if t is not None:
            t.join()
        e, self._open_error = self._open_error, None
        if e is not None:
            raise e

    def _discard_inflight(self) -> None:
        """Forget the batch in flight (its engine died; the restart redoes it from the log)."""
        t, self._inflight = self._inflight, None
        if t is not None:
            t.join(timeout=60)
        self._inflight_error = None

    def _engine_failed(self) -> bool:
        try:  # a killed engine is reaped at once; give a crashing one a moment to exit
            self._engine.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _with_engine(self, what: str, fn, opened: bool = True):
        """Run ``fn``; if the host engine died meanwhile, restart it to hold what it held after
        the last batch done (see :meth:`_open`) and run ``fn`` again
        (``spark.stretch.onEngineFailure=restart``, at most ``spark.stretch.maxEngineRestarts``
        times in a row), or fail naming the cause. ``opened=False``: ``fn`` waits for the
        query's open itself (a micro-batch ingests meanwhile)."""
        attempt = 0
        while True:
            try:
                if opened:
                    self._opened()
                return fn()
            except Exception as e:
                if not self._engine_failed():
                    raise
                dead = self._engine
                if getattr(e, "stretch_batch", None) is not None:  # the batch in flight died
                    what = f"batch {e.stretch_batch}"
                elif self._inflight is not None:  # maybe while stepping that one
                    what += f" (batch {self._inflight_batch} in flight)"
                cause = (f"the stretch host engine (pid {dead.pid}) died (exit status "
                         f"{dead.proc.returncode}) during {what}")
                _remove_shm(self.stretch_id)  # what its instances left in /dev/shm
                if self._on_failure == "fail" or attempt >= self._max_restarts:
                    hint = ("; set spark.stretch.onEngineFailure=restart to restart it from the "
                            "checkpoint" if self._on_failure == "fail" else
                            f" after {attempt} restarts (spark.stretch.maxEngineRestarts)")
                    raise EngineDiedError(cause + hint) from e
                attempt += 1
                t0 = time.perf_counter()
                self._discard_inflight()  # its batch is redone from the input log
                dead.release()
                fresh = HostEngine.acquire(niceness=self._niceness)
                with self._lock:  # the query may have ended meanwhile: then nobody would release it
                    if self._released:
                        fresh.release()
                        raise EngineDiedError(cause + "; the query ended before the restart") from e
                    self._engine = fresh
                start = self._reopen()
                with self._lock:
                    self._restarts.append({"cause": cause, "resumed_from": start,
                                           "restart_s": time.perf_counter() - t0})
                    self._metrics["engine_restarts"] = list(self._restarts)

    # -- one micro-batch ---------------------------------------------------------------------------
    def _step(self, batch_df: DataFrame, batch_id: int) -> None:
        with self._step_lock:
            # After a restart the engine continues from what it held after the previous batch
            # (its state, or its logged input: on disk before Spark committed that batch) and
            # this batch runs again whole.
            self._realign(batch_id - 1 if batch_id > 0 else None)
            fn = self._submit_locked if self._pipelined else self._step_locked
            self._with_engine(f"batch {batch_id}", lambda: fn(batch_df, batch_id), opened=False)
            self._last_done = batch_id
            self._last_step = time.monotonic()

    def _ingest(self, batch_df: DataFrame, batch_id: int):
        """The Spark job that writes the batch's partitions to the engine (no Exchange).

        When the batch's plan is a columnar scan (Parquet, Delta) under only column pruning and
        the watermark: a scan reading plain Parquet files (a Parquet source, or a Delta source
        without column mapping or deletion vectors) has its files read by the engine itself (no
        Spark job: Spark would only read them and hand the rows over; the scan's row count and the
        watermark's event-time statistics are recorded as if the rows had flowed;
        ``spark.stretch.ingest.files=false`` turns it off), or the scan's columnar batches go to
        the engine as columns (``StretchIngest`` in the shim; ``spark.stretch.ingest.columnar=false``
        turns both off). Else the rows ``foreachBatch`` hands over, through
        ``format("stretch")``. Returns what ran (a physical plan, or the DataFrame written), for
        the plans kept in :meth:`metrics`.
        """
        eng, qid = self._engine, self.stretch_id
        stream = f"{qid}:in:{batch_id}"
        try:
            # The engine takes rows once it listens, maybe before the query is open on it (the
            # first batch runs while the engine imports numba); its commit waits for the open.
            eng.wait_ready()
            plan = self._batch_plan(batch_id) if self._columnar else None
            if plan is not None and self._read_files and self._read_batch_files(plan, batch_id):
                return self._count_ingest("files", plan)
            if plan is not None and self._jvm_ingest().ingest(plan, eng.endpoint, stream) >= 0:
                return self._count_ingest("columnar", plan)
            batch_df.write.format("stretch").mode("append") \
                .option("endpoints", eng.endpoint).option("stream", stream).save()
            return self._count_ingest("rows", batch_df)
        except Exception as e:
            if not eng.alive():  # say what really happened, not just "socket refused"
                raise EngineDiedError(
                    f"the stretch host engine (pid {eng.pid}) died (exit status "
                    f"{eng.proc.returncode}) before batch {batch_id} could be ingested") from e
            raise

    def _read_batch_files(self, plan, batch_id: int) -> bool:
        """Have the engine read the batch's Parquet files; False if Spark must read them (then
        for the rest of the run, with the reason in ``metrics()["files_off"]``)."""
        jvm = self._jvm_ingest()
        files = jvm.parquetFiles(plan)
        if files is None:
            return False
        watermarks = list(jvm.watermarkColumns(plan))
        self._opened()  # (the engine reads them into the query's pending input)
        reply = self._engine.request({
            "op": "ingest_files", "query": self.stretch_id, "batch": batch_id,
            "files": list(files), "columns": list(jvm.columnNames(plan)),
            "schema": self._spec["input_schema"], "watermarks": watermarks})
        if "unsupported" in reply:
            self._read_files = False
            with self._lock:
                self._metrics["files_off"] = reply["unsupported"]
            return False
        jvm.recordRead(plan, int(reply["rows"]))
        for i, (top, low, avg, n) in enumerate(reply["event_times"]):
            jvm.recordEventTimes(plan, i, int(top), int(low), float(avg), int(n))
        return True

    def _count_ingest(self, path: str, ran):
        with self._lock:
            paths = self._metrics.setdefault("ingest", {})
            paths[path] = paths.get(path, 0) + 1
        return ran

    def _ingest_then_opened(self, batch_df: DataFrame, batch_id: int):
        """:meth:`_ingest`, then wait for the query's open; an error of the open comes first."""
        try:
            ran = self._ingest(batch_df, batch_id)
        except Exception:
            self._opened()  # (the engine refused the rows because the open failed: say why)
            raise
        self._opened()
        return ran

    def _batch_plan(self, batch_id: int):
        """The executed plan of micro-batch ``batch_id`` (Spark's ``IncrementalExecution`` of
        it, which ``foreachBatch`` wraps as rows), or None."""
        self._started.wait()  # foreachBatch may run before start() has returned the query
        if self._query is None:
            return None
        ex = self._query._jsq.streamingQuery().lastExecution()
        if ex is None or ex.currentBatchId() != batch_id:
            return None
        return ex.executedPlan()

    def _jvm_ingest(self):
        return self._spark.sparkContext._jvm.org.apache.spark.sql.stretch.StretchIngest

    def _submit_locked(self, batch_df: DataFrame, batch_id: int) -> None:
        """A pipelined micro-batch: ingest it, wait for the previous one (stepped and written
        meanwhile), log it and start its step, and let Spark commit it."""
        t0 = time.perf_counter()
        ran = self._ingest_then_opened(batch_df, batch_id)
        t1 = time.perf_counter()
        self._drain()
        t2 = time.perf_counter()
        self._engine.request({"op": "submit", "query": self.stretch_id, "batch": batch_id})
        t3 = time.perf_counter()
        times = {"batch": batch_id, "ingest_s": t1 - t0, "previous_s": t2 - t1,
                 "submit_s": t3 - t2}
        self._inflight_batch = batch_id
        self._inflight = threading.Thread(target=self._finish,
                                          args=(self._engine, ran, batch_id, times),
                                          name=f"stretch-finish-{batch_id}", daemon=True)
        self._inflight.start()

    def _finish(self, eng, ran, batch_id: int, times: dict) -> None:
        """Wait for the engine's step of a submitted batch and write its output (a thread)."""
        try:
            t0 = time.perf_counter()
            reply = eng.request({"op": "result", "query": self.stretch_id, "batch": batch_id})
            t1 = time.perf_counter()
            rows = int(reply["rows"])
            out = self._emit(reply["stream"], rows, batch_id) if rows else None
            t2 = time.perf_counter()
            # written meanwhile; waited for here only for its figures (and a write error)
            saved = eng.request({"op": "saved", "query": self.stretch_id})
            self._record(dict(times, engine_s=t1 - t0, output_s=t2 - t1,
                              checkpoint_wait_s=time.perf_counter() - t2, checkpoint=saved,
                              rows_out=rows, **reply.get("metrics", {})), rows, [ran, out])
        except BaseException as e:  # raised by _drain, on the thread of the next batch
            e.stretch_batch = batch_id
            self._inflight_error = e

    def _drain(self) -> None:
        """Wait for the batch in flight, if any, to be stepped and written; raise its error."""
        t, self._inflight = self._inflight, None
        if t is None:
            return
        t.join()
        e, self._inflight_error = self._inflight_error, None
        if e is not None:
            raise e

    def _record(self, times: dict, rows: int, jobs: list) -> None:
        """Count a finished batch; keep its figures, and the physical plans of its Spark jobs
        (``jobs``: DataFrames, physical plans or None) for the first few batches (tests assert
        no Exchange)."""
        plans = [] if len(self._metrics["plans"]) >= 6 else [
            (j._jdf.queryExecution().executedPlan() if isinstance(j, DataFrame) else j).toString()
            for j in jobs if j is not None]
        with self._lock:
            m = self._metrics
            m["batches"] += 1
            m["output_rows"] += rows
            m["last_batch"] = times
            m.setdefault("batch_times", []).append(times)
            del m["batch_times"][:-100]  # the last 100 batches
            m["plans"].extend(plans[:6 - len(m["plans"])])

    def _step_locked(self, batch_df: DataFrame, batch_id: int) -> None:
        eng, qid = self._engine, self.stretch_id
        t0 = time.perf_counter()
        ran = self._ingest_then_opened(batch_df, batch_id)
        t1 = time.perf_counter()
        reply = eng.request({"op": "step", "query": qid, "batch": batch_id,
                             "args": self._agg._step_args(self, batch_id)})
        t2 = time.perf_counter()
        rows = int(reply["rows"])
        out = self._emit(reply["stream"], rows, batch_id) if rows else None
        t3 = time.perf_counter()
        # The engine wrote its state after this batch while Spark wrote the output; it must be on
        # disk before Spark commits the batch (a restart resumes from it).
        saved = eng.request({"op": "saved", "query": qid})
        t4 = time.perf_counter()
        self._record({"batch": batch_id, "ingest_s": t1 - t0, "engine_s": t2 - t1,
                      "output_s": t3 - t2, "checkpoint_wait_s": t4 - t3, "checkpoint": saved,
                      "rows_out": rows, **reply.get("metrics", {})}, rows, [ran, out])

    def _flush(self, final: bool = False) -> int:
        """Spark's no-data batch: emit and write the windows the next watermark closes.

        Written under its own Delta app id (``<app>-idle``, version = the last batch id), so a
        repeated flush after a restart is a no-op in the table like a replayed batch. ``final``:
        the flush that ends a one-shot run.
        """
        with self._step_lock:
            self._realign(_last_committed(self._checkpoint))  # (no batch ran in this run)
            return self._with_engine("a flush", lambda: self._flush_locked(final))

    def _flush_locked(self, final: bool = False) -> int:
        self._drain()  # the last batch first
        reply = self._engine.request({"op": "flush", "query": self.stretch_id,
                                      "args": self._agg._flush_args(self)})
        rows = int(reply["rows"])
        if rows:
            self._emit(reply["stream"], rows, int(reply["batch"]), app_suffix="-idle")
        if rows or reply.get("changed"):
            # Only now is the state after the flush the state of that batch. The run's last
            # flush need not wait for that checkpoint when it wrote rows to a Delta path: the
            # table's txn action tells a restart to redo it, unwritten (_open, _sink_holds_flush).
            if not (final and rows and self._format in _IDEMPOTENT and self._path):
                self._engine.request({"op": "flushed", "query": self.stretch_id})
            with self._lock:
                self._metrics["output_rows"] += rows
                self._metrics["flushes"] = self._metrics.get("flushes", 0) + 1
        return rows

    def _sink_holds_flush(self, batch: int) -> bool:
        """Whether the Delta table has the flush written after ``batch`` (its ``txn`` action):
        the app's last version is ``batch`` itself (a later one is the flush after a later
        batch, which the state after ``batch`` has not had)."""
        if self._format not in _IDEMPOTENT or not self._path:
            return False
        app = self._app_id + "-idle"
        try:  # the table's snapshot: its checkpoints too, where old commit files may be gone
            from deltalake import DeltaTable
            from deltalake.exceptions import TableNotFoundError

            try:
                done = DeltaTable(self._path).transaction_version(app)
            except TableNotFoundError:
                return False
            return done is not None and int(done) == batch
        except Exception:  # (a store deltalake cannot open: read the commit files)
            pass
        for f in sorted((Path(self._path) / "_delta_log").glob("*.json"), reverse=True):
            for line in f.read_text().splitlines():
                txn = json.loads(line).get("txn")
                if txn and txn.get("appId") == app:
                    return int(txn["version"]) == batch
        return False

    def _emit(self, stream: str, rows: int, batch_id: int,
              app_suffix: str = "") -> Optional[DataFrame]:
        """Write the ``rows`` the engine offers on ``stream`` to the sink as batch ``batch_id``.

        A path-based Delta sink is appended to by the engine itself (``delta_direct``: one Delta
        commit from the process that holds the rows, with the same ``txn`` action Spark's writer
        adds) unless ``spark.stretch.delta.directWrite=false``; otherwise, and whenever deltalake
        cannot write the table, the executors read the rows back and Spark writes them. Returns
        the DataFrame Spark wrote, or None.
        """
        if self._table_ready is not None:
            self._table_ready.join()
        if self._direct:
            req = {"op": "write_delta", "query": self.stretch_id, "stream": stream,
                   "path": self._path, "app_id": self._app_id + app_suffix, "version": batch_id}
            reply = self._engine.request(req)
            if not reply.get("permanent", True):  # no table yet: Spark makes it, empty, then
                self._create_table()               # the engine appends (not Spark's slow path)
                reply = self._engine.request(req)
            with self._lock:
                m = self._metrics
                if "unsupported" not in reply:
                    m["direct_writes"] = m.get("direct_writes", 0) + 1
                    return None
                if reply["permanent"]:
                    self._direct = False
                    m["direct_write_off"] = reply["unsupported"]
        out = self._read_output(stream, rows)
        self._write_sink(out, batch_id, app_suffix)
        return out

    def _create_table_quietly(self) -> None:
        try:
            self._create_table()
        except Exception:
            pass  # the first append then finds no table and makes it itself, raising the error

    def _create_table(self) -> None:
        """Create the sink's Delta table, empty, with the output schema, as Spark's writer would
        for the first batch: by the engine (``delta_direct.create``: no Spark job, which costs
        about a core-second at the start of every query) unless the session sets defaults for
        new tables (``spark.databricks.delta.properties.defaults.*``: properties, protocol,
        features) or the schema has types deltalake makes differently; then by Spark."""
        if not any(k.startswith(_DELTA_TABLE_DEFAULTS) for k in self._spark.conf.getAll):
            schema = _arrow_schema(self._agg.schema)
            if schema is not None:
                reply = self._engine.request({"op": "create_delta", "path": self._path,
                                              "schema": schema})
                if "unsupported" not in reply:
                    return
        empty = self._spark.createDataFrame(self._spark.sparkContext.emptyRDD(), self._agg.schema)
        empty.write.format("delta").mode("append").save(self._path)

    def _read_output(self, stream: str, rows: int) -> DataFrame:
        """The rows the engine offers on ``stream``, read by the executors of its host.

        Large outputs are read in up to ``defaultParallelism`` slices, so the sink is written by
        every core of the host, not by one task.
        """
        splits = max(1, min(self._spark.sparkContext.defaultParallelism, rows // _ROWS_PER_SPLIT))
        return (self._spark.read.format("stretch").schema(self._agg.schema)
                .option("endpoints", self._engine.endpoint).option("stream", stream)
                .option("splits", splits).load())

    def _write_sink(self, out: DataFrame, batch_id: int, app_suffix: str = "") -> None:
        fmt = self._format
        if fmt == "console":
            out.show(truncate=False)
            return
        w = out.write.format(fmt).mode("append").options(**self._sink_options)
        if fmt in _IDEMPOTENT:  # a replayed batch is a no-op in the table
            w = w.option("txnAppId", self._app_id + app_suffix).option("txnVersion", batch_id)
        if self._table:
            w.saveAsTable(self._table)
        elif fmt == "noop":
            w.save()
        else:
            w.save(self._path)

    # -- control -----------------------------------------------------------------------------------
    def reconfigure(self, parallelism: Optional[int] = None, owner_map=None) -> dict:
        """Change the number of instances and/or the bucket-to-instance owner map, online.

        No restart, no shuffle, no state copied: the engine switches epoch between two
        micro-batches. Returns what happened, including the switch time in ms (also in
        :meth:`metrics`).

        Parameters
        ----------
        parallelism : int, optional
            New number of active instances, 1 to ``max_parallelism``.
        owner_map : sequence of int, optional
            Owner instance for each of the ``buckets`` buckets (a rebalance).
        """
        top = self._agg.max_parallelism
        if parallelism is not None and not (1 <= parallelism <= top):
            raise ValueError(f"parallelism={parallelism}: must be between 1 and "
                             f"max_parallelism={top}")
        if parallelism is None and owner_map is None:
            raise ValueError("reconfigure() needs parallelism= or owner_map=")
        t0 = time.perf_counter()
        req = {"op": "reconfigure", "query": self.stretch_id, "parallelism": parallelism,
               "owner_map": None if owner_map is None else [int(x) for x in owner_map]}
        with self._step_lock:  # between two micro-batches, none in flight
            self._settle_locked()
            reply = self._engine.request(req)
        reply["request_ms"] = (time.perf_counter() - t0) * 1e3
        with self._lock:
            self._metrics["reconfigurations"].append(reply)
            self._reconfig_log.append({"parallelism": parallelism, "owner_map": req["owner_map"],
                                       "after_batch": reply["after_batch"]})
        return reply

    def metrics(self) -> dict:
        """Engine and per-batch figures: parallelism, epoch, switch times, late rows, timings."""
        with self._lock:
            out = {k: (list(v) if isinstance(v, list) else v) for k, v in self._metrics.items()}
        if not self._released and self._engine.alive():
            try:
                self._opened()
                self._engine_metrics = self._engine.request(
                    {"op": "metrics", "query": self.stretch_id})
            except Exception as e:  # metrics must not throw on a dying query
                out["engine_error"] = str(e)
        if self._engine_metrics is not None:  # the last figures, also after the query ended
            out["engine"] = self._engine_metrics
        return out

    # -- lifecycle ---------------------------------------------------------------------------------
    def _watch(self) -> None:
        """Flush when idle (continuous triggers) or at the end of a one-shot run; when the run
        ends, finish the batch in flight and release.

        Native Spark runs a no-data batch when the watermark moved and no data is waiting; its
        evictions are what ``_flush`` writes. ``stop()`` runs no final batch, in Spark or here,
        but a batch Spark committed is finished (its output written) before the query ends.
        """
        try:
            while self._query.isActive:
                try:
                    self._query.awaitTermination(0.2)  # returns at once when the run ends
                except Exception:
                    break  # the query failed: awaitTermination reports it to the user
                if self._one_shot or self._metrics["batches"] == 0 or not self._query.isActive:
                    continue
                st = self._query.status
                if (not st["isTriggerActive"] and not st["isDataAvailable"]
                        and time.monotonic() - self._last_step > 0.5 and self._query.isActive):
                    try:
                        self._flush()
                    except Exception as e:  # surfaced by awaitTermination / metrics
                        self._finish_error = e
            if self._pipelined:
                try:
                    self._settle()
                except Exception as e:
                    self._finish_error = e
            if (self._one_shot and self._finish_error is None and self._query.exception() is None
                    and not self._stopped):
                try:
                    self._flush(final=True)
                except Exception as e:
                    self._finish_error = e
        finally:
            self._release()
            self._done.set()

    def _settle(self) -> None:
        """Wait until the batch in flight, if any, is stepped and written (restarting a dead
        engine as a micro-batch would)."""
        with self._step_lock:
            self._settle_locked()

    def _settle_locked(self) -> None:
        self._with_engine("the last batch", self._drain)

    def _release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        for t in (self._opening, self._inflight, self._table_ready):  # normally done by now
            if t is not None:
                t.join(timeout=60)
        try:
            if self._engine.alive():
                self._engine_metrics = self._engine.request(
                    {"op": "metrics", "query": self.stretch_id}, timeout=30)
                self._engine.request({"op": "close", "query": self.stretch_id}, timeout=30)
        except Exception:
            pass
        self._engine.release()
        _remove_shm(self.stretch_id)
        if self._own_checkpoint:
            shutil.rmtree(self._checkpoint, ignore_errors=True)

    def stop(self) -> None:
        """Stop the query and release the host engine (stopped with the last query using it)."""
        self._stopped = True
        try:
            if self._query is not None:
                self._query.stop()
        finally:
            self._done.wait(60)
            self._release()

    def awaitTermination(self, timeout: Optional[int] = None):
        """As ``StreamingQuery.awaitTermination``; when the run ends, also waits for its last flush."""
        result = self._query.awaitTermination(timeout)
        if not self._query.isActive:
            self._done.wait()
            if self._finish_error is not None:
                raise RuntimeError(f"stretch query {self.stretch_id}: writing the final windows "
                                   f"failed: {self._finish_error}") from self._finish_error
        return result

    def processAllAvailable(self) -> None:
        """As ``StreamingQuery.processAllAvailable``; also waits until the last batch's output is
        written (micro-batches are pipelined)."""
        self._query.processAllAvailable()
        if self._pipelined:
            self._settle()

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._query, name)

    def __repr__(self) -> str:
        return f"StretchQuery(id={self._query.id if self._query else None}, format={self._format})"


# Session settings that shape a new Delta table (Delta's DeltaConfigs and protocol defaults).
_DELTA_TABLE_DEFAULTS = ("spark.databricks.delta.properties.defaults.",
                         "spark.databricks.delta.protocol.")


def _int_setting(spark, key: str, default: int, least: int, most: Optional[int],
                 what: str) -> int:
    """The integer session setting ``key``; a ValueError naming it if it is not one in
    ``[least, most]`` (``most`` None: no upper bound)."""
    value = spark.conf.get(key, str(default))
    try:
        n = int(value)
    except ValueError:
        n = least - 1
    if n < least or (most is not None and n > most):
        bounds = f">= {least}" if most is None else f"from {least} to {most}"
        raise ValueError(f"{key}='{value}': must be an integer {bounds} ({what})")
    return n


def _engine_niceness(spark) -> int:
    """``spark.stretch.engine.niceness``: the host engine's nice value (default 5, 0 to 19).

    The engine's work is off Spark's critical path (batch N is stepped while Spark commits N and
    ingests N+1), so on a host whose cores Spark also needs, it yields to Spark's threads (see
    BENCHMARKS.md, session 7). The engine is shared by the queries of a host: the first
    query's setting starts it."""
    return _int_setting(spark, "spark.stretch.engine.niceness", 5, 0, 19,
                        "0: the engine's threads compete with Spark's as equals; 19: they run "
                        "only when Spark leaves a core idle")


def _last_committed(checkpoint) -> Optional[int]:
    """The last batch in the query's commit log (``<checkpoint>/commits/<N>``), or None."""
    commits = Path(checkpoint) / "commits"
    done = [int(p.name) for p in commits.iterdir() if p.name.isdigit()] if commits.is_dir() else []
    return max(done) if done else None


def _arrow_schema(schema) -> Optional[str]:
    """``schema`` as a serialized Arrow schema (base64), or None if Arrow has no such type."""
    from pyspark.sql.pandas.types import to_arrow_schema

    try:
        return base64.b64encode(
            to_arrow_schema(schema, timezone="UTC").serialize().to_pybytes()).decode()
    except Exception:
        return None


def _remove_shm(stretch_id: str) -> None:
    """Remove the query's state directories in shared memory (``/dev/shm/stretch-<id>-<pid>-*``)
    left by an engine that died; a live engine removes its own when the query closes."""
    from .grouped_runtime import shm_root

    for d in Path(shm_root()).glob(f"stretch-{stretch_id}-*"):
        shutil.rmtree(d, ignore_errors=True)


def _install() -> None:
    """Attach ``stretchAggregate`` to DataFrame and GroupedData (once, on import of spark_stretch)."""
    if getattr(DataFrame, "_stretch_installed", False):
        return

    def stretchAggregate(self, keys=None, window=None, agg="count", **kwargs):
        return stretch_aggregate(self, keys, window, agg, **kwargs)

    stretchAggregate.__doc__ = stretch_aggregate.__doc__
    DataFrame.stretchAggregate = stretchAggregate

    from .grouped import _install_grouped

    _install_grouped()  # groupBy(...).stretchAggregate(func, ...): the applyInPandasWithState drop-in
    DataFrame._stretch_installed = True
