"""What a query kind tells the driver's machinery: the contract between the API and the driver.

A *query kind* is what the user's call returns (:mod:`spark_stretch.api`: built-in
aggregations, an engine operator, the ``applyInPandasWithState`` drop-in); the driver runs any
of them the same way (:mod:`.run`), asking only what is declared here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import StructType

from ..protocol.specs import QuerySpec
from .policy import Policy

__all__ = ["QueryKind"]


class QueryKind(ABC):
    """A stretch query before it starts: its input, its output, and its engine spec."""

    #: The engine runtime has submit/result and an input log: micro-batches are pipelined.
    pipelined: bool = True
    #: The elastic policy deciding reconfigurations after each batch (``elastic=``), or None.
    elastic: Optional[Policy] = None

    #: The query's state operator in Spark's progress (``stateOperators[].operatorName``).
    operator_name = "stretchAggregate"

    def __init__(self, df: DataFrame):
        self._df = df

    @property
    def session(self) -> SparkSession:
        return self._df.sparkSession

    @property
    @abstractmethod
    def schema(self) -> StructType:
        """The output schema."""

    @property
    def max_parallelism(self) -> int:
        """Instances created; ``reconfigure`` moves between 1 and this many."""
        return self.engine_spec().max_parallelism

    @abstractmethod
    def engine_spec(self) -> QuerySpec:
        """The spec the host engine opens (the driver adds checkpointing and resume point)."""

    def with_settings(self, spec: QuerySpec, settings) -> QuerySpec:
        """``spec`` with what the session's settings (a :class:`~.settings.QuerySettings`,
        read when the query starts) add for this kind."""
        return spec

    @abstractmethod
    def input_df(self) -> DataFrame:
        """The streaming DataFrame whose micro-batches go to the engine."""

    def output_mode(self, mode: str) -> str:
        """The output mode ``writeStream.outputMode(mode)`` sets (a ValueError if unsupported)."""
        if mode.lower() != "append":
            raise ValueError(f"outputMode '{mode}' is not supported by stretchAggregate: a "
                             "window is emitted once, when the watermark passes its end ('append')")
        return "append"

    def check_start(self, mode: str) -> None:
        """Checks at ``start()`` (the output mode against the plan, ...)."""

    def batch_time(self, query, batch_id: int, info: Optional[dict] = None) -> Optional[int]:
        """Batch ``batch_id``'s processing time (ms) for the engine, or None (it needs none).
        ``query``: the query's :class:`~.recovery.Recovery` (its ``layout``, ``settings`` and
        ``last_done``); ``info``: what Spark gave the batch's state operator, if anything
        (``batch_ts_ms``: Spark's own time for it)."""
        return None

    def flush_time(self, query, at_ms: Optional[int] = None) -> Optional[int]:
        """The processing time (ms) of a no-data batch after the last batch, run at ``at_ms``
        (the start of the trigger it stands for; None: now), or None (it needs none)."""
        return None

    def keep_flush_time(self, query, batch: int, seq: int, ts_ms: Optional[int]) -> None:
        """Keep the time of the no-data batch ``seq`` after ``batch`` before its rows reach
        the sink (a restart may have to run it again: :meth:`kept_flush_time`)."""

    def kept_flush_time(self, query, batch: int, seq: int) -> Optional[int]:
        """The time kept for the no-data batch ``seq`` after ``batch``, or None."""
        return None
