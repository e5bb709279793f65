"""What users call, in the driver process: the calls, the query kinds they return, the query handle.

- :func:`~.aggregate.stretch_aggregate` (``df.stretchAggregate``): built-in windowed
  aggregations (:mod:`.aggregate`, arguments checked in :mod:`.specs`, the native equivalent in
  :mod:`.native`) or the engine's own operators and joins (:mod:`.operators`);
- :func:`~.grouped.stretch_apply_in_pandas_with_state`
  (``df.groupBy(...).stretchApplyInPandasWithState``, alias ``df.groupBy(...).stretchAggregate``):
  the ``applyInPandasWithState`` drop-in (:mod:`.grouped`);
- ``.writeStream`` (:mod:`.writer`) starts a :class:`~.query.StretchQuery`;
- ``elastic=`` takes an :class:`ElasticPolicy` (or a :class:`Policy` of the user's: a batch's
  :class:`BatchMetrics` in, a :class:`Decision` out; :mod:`spark_stretch.driver.policy`);
- :func:`~.native_spelling.stretch` (``df.groupBy(...).stretchAgg``): a native aggregation as
  written for Spark, on the engine inside Spark's plan, a streaming DataFrame back
  (:mod:`.native_spelling`), and :func:`~.native_spelling.control` for its running query.

:func:`install` attaches these methods to pyspark's ``DataFrame`` and ``GroupedData``, once.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql.group import GroupedData

from ..driver.policy import BatchMetrics, Decision, ElasticPolicy, Policy
from .aggregate import StretchAggregation, stretch_aggregate
from .grouped import StretchGroupedAggregation, stretch_apply_in_pandas_with_state
from .native_spelling import FallbackWarning, StretchControl, control, stretch, stretch_agg
from .operators import StretchOperatorAggregation
from .query import StretchQuery
from .specs import pairs

__all__ = ["BatchMetrics", "Decision", "ElasticPolicy", "Policy", "FallbackWarning",
           "StretchAggregation", "StretchControl", "StretchGroupedAggregation",
           "StretchOperatorAggregation", "StretchQuery", "control", "install", "pairs", "stretch",
           "stretch_aggregate", "stretch_apply_in_pandas_with_state"]


def install() -> None:
    """Attach ``DataFrame.stretchAggregate``, ``GroupedData.stretchApplyInPandasWithState`` (the
    ``applyInPandasWithState`` drop-in, with ``GroupedData.stretchAggregate`` as its alias: the
    same function) and ``GroupedData.stretchAgg``, once; ``import spark_stretch`` calls it."""
    if getattr(DataFrame, "_stretch_installed", False):
        return

    def stretchAggregate(self, keys=None, window=None, agg="count", **kwargs):
        return stretch_aggregate(self, keys, window, agg, **kwargs)

    stretchAggregate.__doc__ = stretch_aggregate.__doc__
    DataFrame.stretchAggregate = stretchAggregate

    def stretchApplyInPandasWithState(self, func, outputStructType, stateStructType, outputMode,
                                      timeoutConf, **kwargs):
        return stretch_apply_in_pandas_with_state(self, func, outputStructType, stateStructType,
                                                  outputMode, timeoutConf, **kwargs)

    stretchApplyInPandasWithState.__doc__ = stretch_apply_in_pandas_with_state.__doc__
    GroupedData.stretchApplyInPandasWithState = stretchApplyInPandasWithState
    # The name the drop-in had first, kept for the code that calls it: the same function.
    GroupedData.stretchAggregate = stretchApplyInPandasWithState
    GroupedData.stretchAgg = stretch_agg
    DataFrame._stretch_installed = True
