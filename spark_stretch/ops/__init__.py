"""Built-in O+ operators (aggregations, joins, examples from the STRETCH papers)."""
from .aggregate import aggregate, aggregate_many, count, longest, max_, mean, min_, sum_
from .wordcount import paircount, wordcount

__all__ = ["aggregate", "aggregate_many", "count", "sum_", "min_", "max_", "mean", "longest", "wordcount", "paircount"]
from ..engine.operator import Operator
from ..engine.store import JoinOperator
from .examples import passthrough, value_barrier_partials, value_barrier_totals
from .join import band_join, hedge_join, join

__all__ += ["Operator", "JoinOperator", "passthrough", "value_barrier_partials", "value_barrier_totals", "band_join", "hedge_join", "join"]
