"""The DataFrame ``stretch(df)`` returns: Spark's own, with the engine's Delta append when it is
written straight to a Delta path.

Everything a user does with it is Spark's (``select``, ``filter``, joins, any sink): those go
through Spark's plan, where the shim's ``StretchExec`` runs the aggregation on the engine and
Spark's sink writes its rows. Written *unchanged* to a Delta path in append mode
(``.writeStream.format("delta").start(path)``, with at most a checkpoint location, a trigger and
a query name), the query gets the shim's ``StretchDeltaSink`` in place of Delta's: the engine
appends each batch's rows to the table itself, one Delta commit with the batch's ``txn``, while
Spark commits the batch and plans the next (as ``stretchAggregate`` does), and the rows never
travel through Spark. ``spark.stretch.delta.directWrite=false`` turns that off.
"""

from __future__ import annotations

from typing import List, Optional, Union

from pyspark.sql.classic.dataframe import DataFrame as ClassicDataFrame
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.streaming.readwriter import DataStreamWriter

from ..driver import jvm
from ..driver.cluster import acquire_engine
from ..driver.inplan import DISTINCT_UPDATE, fall_back, handler_for, open_at_start, run_of
from ..driver.settings import read_settings

__all__ = ["StretchFrame"]

_DELTA_SINK = "org.apache.spark.sql.stretch.StretchDeltaSinkProvider"
_PLAIN_OPTIONS = {"checkpointlocation", "path"}


class StretchFrame(ClassicDataFrame):
    """A streaming DataFrame whose aggregation runs on the engine (``stretch(df)``); a
    ``pyspark.sql.DataFrame`` in every respect, see the module doc."""

    def _stretch_init(self, spec, agg_id: str) -> "StretchFrame":
        self._stretch_spec = spec
        self._stretch_id = agg_id
        return self

    @property
    def writeStream(self) -> DataStreamWriter:
        return _Writer(self, getattr(self, "_stretch_spec", None),
                       getattr(self, "_stretch_id", None))


class _Writer(DataStreamWriter):
    """Spark's ``DataStreamWriter``, noting what it is given: a plain Delta path in append mode
    starts with the shim's Delta sink (the engine appends)."""

    def __init__(self, df: StretchFrame, spec, agg_id: Optional[str]):
        super().__init__(df)
        self._spec = spec
        self._agg_id = agg_id
        self._finishable = spec is not None and spec.finish is not None
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
        direct = (self._finishable and self._fmt == "delta" and self._plain and target is not None
                  and self._mode in (None, "append")
                  and settings.direct_write)
        if direct:
            super().format(_DELTA_SINK)
        # The engine process starts (about a second of imports) while Spark starts the query,
        # not after: the run opened at the start takes it over.
        early = (acquire_engine(self._spark, settings) if self._spec is not None
                 and len(jvm.ShimPlans(self._spark).frame_marker_ids(self._df)) == 1 else None)
        try:
            q = super().start(path)
            if self._spec is not None:  # the engine opens beside Spark's start
                open_at_start(self._spark, self._agg_id, q, self._mode or "append",
                              {"path": target, "schema": self._df.schema.json()} if direct
                              else None)
        finally:
            if early is not None:
                early.release()
        if not direct:
            return q
        q = jvm.requery(q, _EngineWrites)
        q._stretch_id = self._agg_id
        return q


class _EngineWrites(StreamingQuery):
    """Spark's ``StreamingQuery`` of an aggregation the engine appends to Delta itself: Spark
    commits a batch while the engine writes it, so waiting for the query (its end, or all
    available input) also waits for the engine's last append, and raises its error."""

    def awaitTermination(self, timeout: Optional[int] = None) -> Optional[bool]:  # noqa: N802
        done = super().awaitTermination(timeout)
        if done is None or done:
            self._settle()
        return done

    def processAllAvailable(self) -> None:  # noqa: N802
        super().processAllAvailable()
        self._settle()

    def stop(self) -> None:
        super().stop()
        self._settle()

    def _settle(self) -> None:
        run = run_of(str(self.runId), self._stretch_id)
        if run is not None:
            run.settle()
