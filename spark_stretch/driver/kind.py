"""What a query kind tells the driver's machinery: the contract between the API and the driver.

A *query kind* is what ``stretchAggregate`` returns (:mod:`spark_stretch.api`: built-in
aggregations, an engine operator); the driver runs any of them the same way (:mod:`.run`),
asking only what is declared here. (The ``applyInPandasWithState`` drop-in and ``stretch(df)``
are DataFrames whose operator is inside Spark's plan: :mod:`.inplan`.)
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

    @abstractmethod
    def input_df(self) -> DataFrame:
        """The streaming DataFrame whose micro-batches go to the engine."""

    def output_mode(self, mode: str) -> str:
        """The output mode ``writeStream.outputMode(mode)`` sets (a ValueError if unsupported)."""
        if mode.lower() != "append":
            raise ValueError(f"outputMode '{mode}' is not supported by stretchAggregate: a "
                             "window is emitted once, when the watermark passes its end ('append')")
        return "append"
