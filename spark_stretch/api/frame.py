"""The DataFrame a stretch operator inside Spark's plan gives (``stretch(df)``, the
``applyInPandasWithState`` drop-in): Spark's own, with the engine's Delta append when it is
written straight to a Delta path, and its query with the stretch handle's methods.

Everything a user does with it is Spark's (``select``, ``filter``, joins, any sink): those go
through Spark's plan, where the shim's ``StretchExec`` runs the operator on the engine and
Spark's sink writes its rows. Written *unchanged* to a Delta path
(``.writeStream.format("delta").start(path)``, with at most a checkpoint location, a trigger
and a query name; in append mode, and for the drop-in also in update mode), the query gets the
shim's ``StretchDeltaSink`` in place of Delta's: the engine appends each batch's rows to the
table itself, one Delta commit with the batch's ``txn``, and the rows never travel through
Spark. ``spark.stretch.delta.directWrite=false`` turns that off.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Union

from pyspark.sql.classic.dataframe import DataFrame as ClassicDataFrame
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.streaming.readwriter import DataStreamWriter

from ..driver import jvm
from ..driver.cluster import acquire_engine
from ..driver.elastic import per_batch_frame
from ..driver.inplan import DISTINCT_UPDATE, fall_back, handler_for, open_at_start, run_of
from ..driver.settings import read_settings

__all__ = ["StretchControl", "StretchFrame", "StretchStreamingQuery"]

_DELTA_SINK = "org.apache.spark.sql.stretch.StretchDeltaSinkProvider"
_PLAIN_OPTIONS = {"checkpointlocation", "path"}


class StretchFrame(ClassicDataFrame):
    """A streaming DataFrame with a stretch operator in its plan (``stretch(df)``, the drop-in);
    a ``pyspark.sql.DataFrame`` in every respect, see the module doc."""

    def _stretch_init(self, spec, agg_id: str, direct_modes: Sequence[str] = ()):
        """``direct_modes``: the output modes in which the engine may append the rows to a
        Delta path itself."""
        self._stretch_spec = spec
        self._stretch_id = agg_id
        self._stretch_direct = tuple(direct_modes)
        return self

    @property
    def writeStream(self) -> DataStreamWriter:
        return _Writer(self, getattr(self, "_stretch_spec", None),
                       getattr(self, "_stretch_id", None), getattr(self, "_stretch_direct", ()))


class _Writer(DataStreamWriter):
    """Spark's ``DataStreamWriter``, noting what it is given: a plain Delta path in one of
    the frame's direct modes starts with the shim's Delta sink (the engine appends)."""

    def __init__(self, df: StretchFrame, spec, agg_id: Optional[str], direct_modes):
        super().__init__(df)
        self._spec = spec
        self._agg_id = agg_id
        self._direct_modes = direct_modes
        self._fmt: Optional[str] = None
        self._mode: Optional[str] = None
        self._path: Optional[str] = None
        self._plain = True   # no writer option the engine's append would ignore

    def format(self, source: str) -> "DataStreamWriter":
        self._fmt = source.lower()
        return super().format(source)

    def outputMode(self, outputMode: str) -> "DataStreamWriter":  # noqa: N802
        self._mode = outputMode.lower()
        return super().outputMode(outputMode)

    def option(self, key: str, value) -> "DataStreamWriter":
        self._note(key, value)
        return super().option(key, value)

    def options(self, **options) -> "DataStreamWriter":
        for k, v in options.items():
            self._note(k, v)
        return super().options(**options)

    def _note(self, key: str, value) -> None:
        if key.lower() == "path":
            self._path = str(value)
        elif key.lower() not in _PLAIN_OPTIONS:
            self._plain = False

    def partitionBy(self, *cols) -> "DataStreamWriter":  # noqa: N802
        self._plain = False
        return super().partitionBy(*cols)

    def clusterBy(self, *cols) -> "DataStreamWriter":  # noqa: N802
        self._plain = False
        return super().clusterBy(*cols)

    def foreach(self, f) -> "DataStreamWriter":
        self._plain = False
        return super().foreach(f)

    def foreachBatch(self, func) -> "DataStreamWriter":  # noqa: N802
        self._plain = False
        return super().foreachBatch(func)

    def start(self, path: Optional[str] = None, format: Optional[str] = None,
              outputMode: Optional[str] = None,
              partitionBy: Optional[Union[str, List[str]]] = None,
              queryName: Optional[str] = None, **options) -> StreamingQuery:
        self.options(**options)
        if outputMode is not None:
            self.outputMode(outputMode)
        if partitionBy is not None:
            self.partitionBy(partitionBy)
        if format is not None:
            self.format(format)
        if queryName is not None:
            self.queryName(queryName)
        if self._spec is not None and (self._mode or "append") == "update":
            try:
                handler_for(self._spark).check_mode(self._agg_id, "update")
            except ValueError:  # (native Spark runs no distinct aggregate: its own error)
                fall_back(self._spark, DISTINCT_UPDATE, stacklevel=2)
                jvm.ShimPlans(self._spark).check_native(self._agg_id, "update")
                raise
        settings = read_settings(self._spark.conf)
        target = path or self._path
        direct = (self._fmt == "delta" and self._plain and target is not None
                  and (self._mode or "append") in self._direct_modes and settings.direct_write)
        if direct:
            super().format(_DELTA_SINK)
        return self._started(lambda: super(_Writer, self).start(path),
                             {"path": target, "schema": self._df.schema.json()} if direct
                             else None)

    def toTable(self, tableName: str, format: Optional[str] = None,  # noqa: N802
                outputMode: Optional[str] = None,
                partitionBy: Optional[Union[str, List[str]]] = None,
                queryName: Optional[str] = None, **options) -> StreamingQuery:
        return self._started(lambda: super(_Writer, self).toTable(
            tableName, format, outputMode, partitionBy, queryName, **options), None)

    def _started(self, start: Callable[[], StreamingQuery],
                 delta: Optional[dict]) -> StreamingQuery:
        """Spark's query, started by ``start()``, the engine opening beside it; with the
        stretch methods."""
        if self._spec is None:
            return start()
        # (the frame's plan is the query's: Spark's own plan of a started query may not be
        # made yet, and is made on the query's thread)
        ids = jvm.ShimPlans(self._spark).frame_marker_ids(self._df)
        # The engine process starts (about a second of imports) while Spark starts the query,
        # not after: the run opened at the start takes it over.
        early = (acquire_engine(self._spark, read_settings(self._spark.conf))
                 if len(ids) == 1 else None)
        try:
            q = start()
            open_at_start(self._spark, self._agg_id, q, self._mode or "append", delta,
                          several=len(ids) > 1)
        finally:
            if early is not None:
                early.release()
        q = jvm.requery(q, _EngineWrites if delta else StretchStreamingQuery)
        q._stretch_ids = ids
        return q


class StretchControl:
    """The stretch side of a running ``StreamingQuery``: rescale it, read its figures.

    A query with several stretch aggregations (a union of two, one over another's windows) runs
    each as its own engine query: :attr:`aggregations` has a handle for each, in the plan's
    order (the outer of two chained first); on the query's handle ``reconfigure`` changes every
    one of them, and ``metrics`` has each one's figures under ``"aggregations"``.
    """

    def __init__(self, query: StreamingQuery, agg_ids: List[str]):
        self._query = query
        self._ids = agg_ids

    @property
    def aggregations(self) -> List["StretchControl"]:
        """A handle for each stretch aggregation of the query, in the plan's order."""
        return [StretchControl(self._query, [a]) for a in self._ids]

    def _runs(self) -> list:
        runs = [run_of(str(self._query.runId), a, wait=60.0) for a in self._ids]
        if any(r is None for r in runs):
            raise RuntimeError("the query has run no micro-batch on the engine yet")
        return runs

    def reconfigure(self, parallelism: Optional[int] = None, owner_map=None,
                    key_groups=None, host: Optional[str] = None) -> dict:
        """Change the parallelism and/or owner map between two micro-batches (no state moves;
        on several hosts, of ``host``'s instances or every host's), or, for a query on several
        hosts, how many key groups each host owns (``key_groups``: ``{host: count}``; the
        state of the moved groups moves), as :meth:`spark_stretch.StretchQuery.reconfigure`;
        of every stretch aggregation of the query (``{"parallelism": ..., "aggregations":
        [each one's record]}`` for several)."""
        recs = [r.reconfigure(parallelism, owner_map, key_groups, host) for r in self._runs()]
        if len(recs) == 1:
            return recs[0]
        return {"parallelism": parallelism, "aggregations": recs}

    def metrics(self) -> dict:
        """The engine's figures for this run (batches, rows, reconfigurations, per-batch
        figures, ...), as :meth:`spark_stretch.StretchQuery.metrics` (for several stretch
        aggregations: ``{"aggregations": [each one's figures]}``)."""
        figures = [r.figures() for r in self._runs()]
        return figures[0] if len(figures) == 1 else {"aggregations": figures}

    def metrics_frame(self):
        """``metrics()["per_batch"]`` as a pandas DataFrame, one row per batch (for several
        stretch aggregations, one per batch and aggregation, its index in ``aggregation``)."""
        import pandas as pd

        frames = [per_batch_frame(r.figures()) for r in self._runs()]
        if len(frames) == 1:
            return frames[0]
        return pd.concat([f.assign(aggregation=i) for i, f in enumerate(frames)],
                         ignore_index=True)


class StretchStreamingQuery(StreamingQuery):
    """Spark's own ``StreamingQuery`` of a query with a stretch operator in its plan, with the
    methods of its stretch handle (:func:`spark_stretch.control`) too: ``reconfigure``,
    ``metrics``, ``metrics_frame``. Its end (``stop``, or ``awaitTermination`` returning once
    the query is over) also releases the query's engine, as Spark's end of the query does a
    moment later.

    Examples
    --------
    >>> q = sessions.writeStream.format("memory").queryName("s").outputMode("update").start()  # doctest: +SKIP
    >>> q.reconfigure(parallelism=2)["parallelism"]          # doctest: +SKIP
    2
    """

    _stretch_ids: List[str] = []

    def _control(self) -> StretchControl:
        return StretchControl(self, self._stretch_ids)

    def reconfigure(self, parallelism: Optional[int] = None, owner_map=None,
                    key_groups=None, host: Optional[str] = None) -> dict:
        """As :meth:`StretchControl.reconfigure`."""
        return self._control().reconfigure(parallelism, owner_map, key_groups, host)

    def metrics(self) -> dict:
        """As :meth:`StretchControl.metrics`."""
        return self._control().metrics()

    def metrics_frame(self):
        """As :meth:`StretchControl.metrics_frame`."""
        return self._control().metrics_frame()

    @property
    def stretch_id(self) -> Optional[str]:
        """The query's id on its host engine (kept in its checkpoint; of the first stretch
        operator of the plan, when it has several)."""
        run = run_of(str(self.runId), self._stretch_ids[0], wait=60.0) \
            if self._stretch_ids else None
        return None if run is None else run.qid

    def awaitTermination(self, timeout: Optional[int] = None) -> Optional[bool]:  # noqa: N802
        done = super().awaitTermination(timeout)
        if done is None or done:
            self._ended()
        return done

    def processAllAvailable(self) -> None:  # noqa: N802
        super().processAllAvailable()
        self._settle()

    def stop(self) -> None:
        super().stop()
        self._ended()

    def _runs(self) -> list:
        runs = [run_of(str(self.runId), a) for a in self._stretch_ids]
        return [r for r in runs if r is not None]

    def _settle(self) -> None:
        for run in self._runs():
            run.settle()

    def _ended(self) -> None:
        error = None
        for run in self._runs():
            try:
                run.settle()
            except BaseException as e:  # (every run released; the first error raised)
                error = error or e
            finally:
                run.release()
        if error is not None:
            raise error


class _EngineWrites(StretchStreamingQuery):
    """The query of a stretch operator whose rows the engine appends to Delta itself: Spark
    commits a batch of ``stretch(df)`` while the engine writes it, so waiting for the query
    (its end, or all available input) also waits for the engine's last append, and raises its
    error."""
