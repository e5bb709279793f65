"""Elastic policies: a batch's figures in, a reconfiguration (or none) out.

A :class:`Policy` is asked once per micro-batch, after the batch's output is written, with the
batch's :class:`BatchMetrics`; a :class:`Decision` it returns is applied before the next batch's
step, as an epoch switch (no state moved), and recorded in ``q.metrics()["reconfigurations"]``
with its ``cause``. :class:`ElasticPolicy` is STRETCH's controller (stretch-tpds §8.4: scale out
above 90% utilization, in below 45%, to the parallelism that brings the mean utilization to
70%) with Elasticutor's rebalancing (theta = 1.2: buckets move from the busiest instance to the
least loaded one until the busiest carries at most theta times the mean).

The interface is per host engine: a decision changes the parallelism and the owner map of the
instances of one host. A decision for queries on several hosts (key groups moved between hosts,
through the same ``decide``) would add a field to :class:`Decision`; it is not built.

Examples
--------
>>> from spark_stretch.driver.policy import BatchMetrics, ElasticPolicy
>>> p = ElasticPolicy(max_parallelism=4)
>>> busy = BatchMetrics(batch=7, parallelism=1, max_parallelism=4, utilization=[1.2],
...                     tuples=5000)
>>> p.decide(busy)
Decision(cause='scale_out', parallelism=2, owner_map=None)
>>> p.decide(BatchMetrics(batch=8, parallelism=2, max_parallelism=4, utilization=[0.2, 0.2],
...                       tuples=5000, batches_since_switch=3))
Decision(cause='scale_in', parallelism=1, owner_map=None)
>>> ElasticPolicy(scale_in_below=0.8, target=0.7)
Traceback (most recent call last):
...
ValueError: ElasticPolicy: scale_in_below=0.8 must be below target=0.7 (and target below scale_out_above=0.9)
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import numpy as np

__all__ = ["BatchMetrics", "Decision", "Policy", "ElasticPolicy", "CAUSES", "rebalanced",
           "as_policy"]

#: The causes of a reconfiguration: the user's ``reconfigure``, or a policy's decision.
CAUSES = ("manual", "scale_out", "scale_in", "rebalance")


@dataclass
class BatchMetrics:
    """One micro-batch's figures, as a policy sees them (and as ``q.metrics()["per_batch"]``
    keeps them, without ``bucket_load`` and ``owner_map``).

    Rates are per second; times in milliseconds; ``utilization``, ``busy_ms`` and ``load`` are
    per active instance (``instances``). An instance's utilization is its busy time in the
    batch's step over the time the batch had: the trigger interval of a processing-time trigger,
    else the wall time since the previous step ended (it exceeds 1 when the engine falls
    behind). ``demand`` is the mean utilization the batch's *input* takes at the instances'
    cost per processed tuple (their busy time per tuple in the last few steps at this
    parallelism, times the input rows, over the batch's time; None until known): in
    append mode the watermark releases a batch's rows to the instances one batch later, so the
    input is what the next step processes, and ``demand`` sees a rate step one batch before
    ``utilization`` does. ``imbalance`` is the busiest instance's load over the mean (keys
    processed, the drop-in: rows). ``batches_since_switch``: batches stepped since the last
    epoch switch, this one included (None: none yet). ``live_windows`` (the drop-in: keys in
    state), ``rows_updated``, ``rows_removed`` and ``late_rows`` are the state operator's rows
    after the step, written and removed by it, and the input rows it dropped as late.
    """

    batch: int
    parallelism: int
    max_parallelism: int
    utilization: List[float] = field(default_factory=list)
    instances: List[int] = field(default_factory=list)
    busy_ms: List[float] = field(default_factory=list)
    load: Optional[List[int]] = None
    imbalance: Optional[float] = None
    demand: Optional[float] = None
    input_rows: int = 0
    input_rate: Optional[float] = None
    processed_rate: Optional[float] = None
    latency_p50_ms: Optional[float] = None
    latency_p99_ms: Optional[float] = None
    step_ms: float = 0.0
    budget_ms: float = 0.0
    tuples: int = 0
    epoch: int = 0
    live_windows: int = 0
    state_bytes: int = 0
    rows_updated: int = 0
    rows_removed: int = 0
    late_rows: int = 0
    time_ms: int = 0
    batches_since_switch: Optional[int] = None
    switched: Optional[str] = None
    switch_ms: Optional[float] = None
    bucket_load: Optional[np.ndarray] = field(default=None, repr=False)
    owner_map: Optional[np.ndarray] = field(default=None, repr=False)

    @property
    def mean_utilization(self) -> float:
        return float(np.mean(self.utilization)) if self.utilization else 0.0

    @property
    def max_utilization(self) -> float:
        return float(np.max(self.utilization)) if self.utilization else 0.0

    def row(self) -> dict:
        """The batch's row of ``q.metrics()["per_batch"]`` (plain values, no bucket arrays)."""
        out = {k: v for k, v in self.__dict__.items() if k not in ("bucket_load", "owner_map")}
        out.update(utilization_mean=self.mean_utilization, utilization_max=self.max_utilization)
        return out


@dataclass(frozen=True)
class Decision:
    """A reconfiguration: a new ``parallelism`` (1..max_parallelism) and/or ``owner_map`` (the
    owner instance of each bucket, every one active), and why (``cause``: ``"scale_out"``,
    ``"scale_in"`` or ``"rebalance"``)."""

    cause: str
    parallelism: Optional[int] = None
    owner_map: Optional[Sequence[int]] = None

    def __post_init__(self):
        if self.cause not in CAUSES[1:]:
            raise ValueError(f"Decision: cause={self.cause!r}; use one of {CAUSES[1:]}")
        if self.parallelism is None and self.owner_map is None:
            raise ValueError("Decision: give parallelism= or owner_map=")


class Policy(ABC):
    """A policy of an elastic query: ``decide`` gets each batch's :class:`BatchMetrics` (on the
    driver, between two batches) and returns a :class:`Decision` or None.

    Examples
    --------
    >>> class EveryTenth(Policy):
    ...     def decide(self, m):
    ...         if m.batch % 10 == 9 and m.parallelism < m.max_parallelism:
    ...             return Decision("scale_out", parallelism=m.parallelism + 1)
    >>> EveryTenth().decide(BatchMetrics(batch=9, parallelism=1, max_parallelism=2))
    Decision(cause='scale_out', parallelism=2, owner_map=None)
    """

    @abstractmethod
    def decide(self, metrics: BatchMetrics) -> Optional[Decision]:
        """The reconfiguration after this batch, or None."""

    def bind(self, max_parallelism: int) -> "Policy":
        """Check the policy against a query of ``max_parallelism`` instances (before it
        starts); the policy to run."""
        return self


def _unit(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
        raise ValueError(f"ElasticPolicy: {name}={v!r} must be a positive number")
    return float(v)


def _count(name: str, v, least: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < least:
        raise ValueError(f"ElasticPolicy: {name}={v!r} must be an integer >= {least}")
    return int(v)


class ElasticPolicy(Policy):
    """STRETCH's threshold controller with Elasticutor's rebalancing.

    Parameters
    ----------
    scale_out_above : float
        Scale out when the utilization of the active instances is above this (0.9): their
        :attr:`BatchMetrics.demand`, the mean utilization the batch's input takes (the work
        the next step has), or without it their mean utilization.
    scale_in_below : float
        Scale in when it is below this (0.45).
    target : float
        The utilization a scaling aims at (0.7): the new parallelism is
        ``ceil(parallelism * utilization / target)``, at least one more (out) or fewer (in).
    min_parallelism, max_parallelism : int
        The range of parallelisms (1 and the query's ``max_parallelism``).
    cooldown_batches : int
        Batches after an epoch switch (of any cause, the user's too) with no decision (2).
    rebalance_above : float or None
        Rebalance when the busiest instance's load is above this many times the mean (1.2);
        None: never. Only ownership moves (no state).

    Examples
    --------
    >>> ElasticPolicy(min_parallelism=3, max_parallelism=2)
    Traceback (most recent call last):
    ...
    ValueError: ElasticPolicy: max_parallelism=2 is below min_parallelism=3
    >>> ElasticPolicy(cooldown_batches=-1)
    Traceback (most recent call last):
    ...
    ValueError: ElasticPolicy: cooldown_batches=-1 must be an integer >= 0
    """

    def __init__(self, scale_out_above: float = 0.9, scale_in_below: float = 0.45,
                 target: float = 0.7, min_parallelism: int = 1,
                 max_parallelism: Optional[int] = None, cooldown_batches: int = 2,
                 rebalance_above: Optional[float] = 1.2):
        self.scale_out_above = _unit("scale_out_above", scale_out_above)
        self.scale_in_below = _unit("scale_in_below", scale_in_below)
        self.target = _unit("target", target)
        if not self.scale_in_below < self.target < self.scale_out_above:
            raise ValueError(
                f"ElasticPolicy: scale_in_below={scale_in_below} must be below target={target} "
                f"(and target below scale_out_above={scale_out_above})")
        self.min_parallelism = _count("min_parallelism", min_parallelism, 1)
        self.max_parallelism = (None if max_parallelism is None else
                                _count("max_parallelism", max_parallelism, 1))
        if self.max_parallelism is not None and self.max_parallelism < self.min_parallelism:
            raise ValueError(f"ElasticPolicy: max_parallelism={max_parallelism} is below "
                             f"min_parallelism={min_parallelism}")
        self.cooldown_batches = _count("cooldown_batches", cooldown_batches, 0)
        if rebalance_above is not None and (_unit("rebalance_above", rebalance_above) <= 1):
            raise ValueError(f"ElasticPolicy: rebalance_above={rebalance_above} must be above 1 "
                             "(the busiest instance's load over the mean), or None")
        self.rebalance_above = rebalance_above

    def __repr__(self) -> str:
        return (f"ElasticPolicy(scale_out_above={self.scale_out_above}, "
                f"scale_in_below={self.scale_in_below}, target={self.target}, "
                f"min_parallelism={self.min_parallelism}, "
                f"max_parallelism={self.max_parallelism}, "
                f"cooldown_batches={self.cooldown_batches}, "
                f"rebalance_above={self.rebalance_above})")

    def bind(self, max_parallelism: int) -> "ElasticPolicy":
        """This policy for a query of ``max_parallelism`` instances (its own max, if given, is
        at most that): a ValueError naming the argument otherwise."""
        if self.max_parallelism is not None and self.max_parallelism > max_parallelism:
            raise ValueError(f"ElasticPolicy: max_parallelism={self.max_parallelism} is above "
                             f"the query's max_parallelism={max_parallelism} (the instances "
                             "it creates)")
        if self.min_parallelism > max_parallelism:
            raise ValueError(f"ElasticPolicy: min_parallelism={self.min_parallelism} is above "
                             f"the query's max_parallelism={max_parallelism}")
        return self

    def decide(self, m: BatchMetrics) -> Optional[Decision]:
        since = m.batches_since_switch
        if since is not None and since <= self.cooldown_batches:
            return None
        if not m.utilization or (m.demand is None and not m.tuples):
            return None  # (nothing measured: the step processed no tuple)
        top = min(m.max_parallelism, self.max_parallelism or m.max_parallelism)
        cur = m.parallelism
        u = m.demand if m.demand is not None else m.mean_utilization
        want = math.ceil(cur * u / self.target - 1e-9)
        if u > self.scale_out_above and cur < top:
            return Decision("scale_out", parallelism=min(top, max(cur + 1, want)))
        if u < self.scale_in_below and cur > self.min_parallelism:
            return Decision("scale_in",
                            parallelism=max(self.min_parallelism, min(cur - 1, max(1, want))))
        if (self.rebalance_above is not None and m.imbalance is not None and cur > 1
                and m.imbalance > self.rebalance_above and m.bucket_load is not None
                and m.owner_map is not None):
            om = rebalanced(m.bucket_load, m.owner_map, m.instances, self.rebalance_above)
            if om is not None:
                return Decision("rebalance", owner_map=om.tolist())
        return None


def rebalanced(bucket_load, owner_map, instances, theta: float) -> Optional[np.ndarray]:
    """A new owner map: buckets moved one at a time from the busiest instance to the least
    loaded one, each time the bucket that lowers the busier of the two the most (Elasticutor's
    heuristic), until the busiest instance carries at most ``theta`` times the mean or no move
    helps. None if nothing moved.

    Examples
    --------
    >>> rebalanced([5, 1, 1, 1], [0, 0, 1, 1], [0, 1], 1.2).tolist()
    [0, 1, 1, 1]
    """
    w = np.asarray(bucket_load, np.float64)
    om = np.array(owner_map, np.int64)
    inst = np.asarray(sorted(instances), np.int64)
    if len(inst) < 2 or w.sum() <= 0:
        return None
    loads = {int(j): float(w[om == j].sum()) for j in inst}
    mean = sum(loads.values()) / len(inst)
    moved = False
    for _ in range(len(w)):
        h = max(loads, key=loads.get)
        lo = min(loads, key=loads.get)
        gap = loads[h] - loads[lo]
        if loads[h] <= theta * mean or gap <= 0:
            break
        cand = np.flatnonzero((om == h) & (w > 0) & (w < gap))
        if not len(cand):
            break
        b = int(cand[np.argmin(np.abs(w[cand] - gap / 2))])
        om[b] = lo
        loads[h] -= w[b]
        loads[lo] += w[b]
        moved = True
    return om if moved else None


def as_policy(elastic, max_parallelism: int) -> Optional[Policy]:
    """What ``elastic=`` means for a query of ``max_parallelism`` instances: None/False (no
    controller), True (``ElasticPolicy()``), or a :class:`Policy`; checked now."""
    if elastic is None or elastic is False:
        return None
    if elastic is True:
        return ElasticPolicy().bind(max_parallelism)
    if isinstance(elastic, Policy):
        return elastic.bind(max_parallelism)
    raise TypeError(f"elastic={elastic!r}: use True, an ElasticPolicy(...) or a "
                    "spark_stretch.Policy subclass")
